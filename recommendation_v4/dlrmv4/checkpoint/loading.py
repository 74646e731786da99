"""Reading checkpoints back: the small state alone, one checkpoint, and a checkpoint with the chain
of deltas it continues."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path
from typing import Any, Callable

from dlrmv4.checkpoint.chain import checkpoint_chain
from dlrmv4.checkpoint.dcp_io import dcp_load
from dlrmv4.checkpoint.layout import PICKLE_FILE, POSITION_FILE
from dlrmv4.checkpoint.state import CheckpointPosition, split_state
from dlrmv4.checkpoint.table_deltas import apply_delta
from dlrmv4.checkpoint.tables import SparseEmbeddings
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.files import read_errors_in_one_line


def load_small_state(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's small non-tensor state (``state.pkl``) alone: cheap, read before the tensors."""
    with open(Path(path) / PICKLE_FILE, "rb") as fh:
        return pickle.load(fh)


def load_checkpoint(
    path: str | os.PathLike, state_template: dict[str, Any], cluster: Cluster | None = None
) -> tuple[CheckpointPosition, dict[str, Any]]:
    """Load a checkpoint written by ``save_checkpoint``.

    Stateful entries of ``state_template`` (modules, ``ModelAndOptimizers``) are restored in place
    through DCP and returned as the same objects (resharded to this cluster); the other entries are
    returned as saved (the template's values for them are ignored), with ``rank_states`` the list
    of every saving rank's own state. Call ``resume_point`` first to pick a sound one.
    """
    path = Path(path)
    tensor_state, _ = split_state(state_template)
    with read_errors_in_one_line(path):
        saved = json.loads((path / POSITION_FILE).read_text())
        # Checkpoints written before two unused counters were dropped still hold them.
        position = CheckpointPosition(**{f.name: saved[f.name] for f in dataclasses.fields(CheckpointPosition)})
        small_state = load_small_state(path)
        if tensor_state:
            dcp_load(tensor_state, path, cluster)
    return position, {**small_state, **tensor_state}


def load_chain(
    path: str | os.PathLike,
    dense: dict[str, Any],
    tables: dict[str, Any],
    embeddings: SparseEmbeddings,
    cluster: Cluster,
    log: Callable[[str], None],
) -> tuple[CheckpointPosition, dict[str, Any], int]:
    """Load the checkpoint at ``path`` as ``load_checkpoint`` does, with the chain it continues: the
    ``tables`` entry from the whole checkpoint at the chain's start, each delta after it applied to
    ``embeddings`` (one line each on ``log``), then ``dense`` and the rest from ``path`` itself.
    Returns the position, the state and the number of deltas applied. Check the chain first
    (``resume_point``)."""
    whole, *deltas = checkpoint_chain(path)
    # Behind deltas the whole checkpoint gives the tables alone: the dense state is the newest's.
    position, state = load_checkpoint(whole, tables if deltas else {**dense, **tables}, cluster)
    for delta in deltas:
        rows = apply_delta(delta, embeddings, cluster)
        log(f"applied {delta.name}: {rows:,} changed rows of the tables since {whole.name}")
        whole = delta
    if deltas:  # the dense state, the position and the rest are the newest checkpoint's own
        position, state = load_checkpoint(path, dense, cluster)
    return position, state, len(deltas)
