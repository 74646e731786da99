"""The tables in checkpoints, one format for both backends, so a run resumes on either backend and
on any number of ranks.

``TableState`` is a ``torch.distributed.checkpoint`` entry (``tables.<name>.weight`` /
``.momentum``, sharded tensors where TorchRec shards them). ``gather_full_tables`` and
``load_full_tables`` move full fp32 host copies of every table (and its Adagrad state) in and out.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import torch
from torch.distributed.checkpoint.stateful import Stateful

from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError


class _Spec(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def rows(self) -> int: ...


class SparseEmbeddings(Protocol):
    """What this module reads of a backend's tables (``tables.SparseEmbeddings``, which imports this
    module, has all of it): the layout, the cluster and the live storage."""

    cluster: Cluster
    dim: int

    @property
    def specs(self) -> Sequence[_Spec]: ...

    def live_tables(self) -> dict[str, dict[str, Any]]: ...


class TableState(Stateful):
    """A backend's tables as a DCP entry: ``state_dict`` hands out the live tensors and DCP writes into
    them in place on load (resharding as needed); ``load_state_dict`` copies what DCP handed back as
    a new tensor instead."""

    def __init__(self, embeddings: SparseEmbeddings) -> None:
        self.embeddings = embeddings

    def state_dict(self) -> dict[str, Any]:
        return {
            "tables": {
                name: {part: t for part, t in parts.items() if t is not None}
                for name, parts in self.embeddings.live_tables().items()
            }
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, parts in self.embeddings.live_tables().items():
            for part, live in parts.items():
                if live is None or hasattr(live, "local_shards"):
                    continue  # nothing here, or loaded in place shard by shard
                loaded = state_dict["tables"][name][part]
                if loaded is not live:
                    live.copy_(loaded)


def gather_full_tables(embeddings: SparseEmbeddings) -> dict:
    """``{'tables': {name: {'weight': [rows, E], 'momentum': [rows]}}}`` on rank 0, an empty dict on
    the others (a collective with sharded tables: every rank must call it)."""
    cluster = embeddings.cluster
    tables: dict[str, dict[str, torch.Tensor | None]] = {}
    rows = {s.name: s.rows for s in embeddings.specs}
    for name, parts in embeddings.live_tables().items():
        shapes = {"weight": (rows[name], embeddings.dim), "momentum": (rows[name],)}
        full = {part: _full_on_rank0(t, shapes[part], cluster) for part, t in parts.items()}
        if cluster.is_main:
            tables[name] = full
    return {"tables": tables} if cluster.is_main else {}


@torch.no_grad()
def load_full_tables(embeddings: SparseEmbeddings, state: dict) -> None:
    """Copy full tables (``gather_full_tables``) into the live storage, each rank its own shards."""
    _check_shapes(embeddings, state)
    for name, parts in embeddings.live_tables().items():
        for part, live in parts.items():
            full = state["tables"][name][part]
            if live is None:
                continue
            if hasattr(live, "local_shards"):
                for shard in live.local_shards():
                    index = tuple(
                        slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
                    )
                    shard.tensor.copy_(full[index])
            else:
                live.copy_(full)


def _check_shapes(embeddings: SparseEmbeddings, state: dict) -> None:
    for spec in embeddings.specs:
        table = state["tables"].get(spec.name)
        if (
            table is None
            or tuple(table["weight"].shape) != (spec.rows, embeddings.dim)
            or tuple(table["momentum"].shape) != (spec.rows,)
        ):
            raise UserError(
                f"checkpoint embedding table {spec.name!r} does not match "
                f"{spec.rows} rows x {embeddings.dim}: was it saved with another config?"
            )


def _full_on_rank0(tensor, shape: tuple[int, ...], cluster: Cluster) -> torch.Tensor | None:
    """A host copy of a whole table (or state) on rank 0, from a plain or a sharded tensor (None on
    a rank that holds no part of it)."""
    if tensor is not None and not hasattr(tensor, "local_shards"):
        return tensor.detach().to("cpu", copy=True) if cluster.is_main else None
    shards = tensor.local_shards() if tensor is not None else []
    pieces = [(tuple(s.metadata.shard_offsets), s.tensor.detach().to("cpu", copy=True)) for s in shards]
    gathered = cluster.gather(pieces)
    if not cluster.is_main:
        return None
    assert gathered is not None  # rank 0 receives every rank's pieces
    full = torch.zeros(shape, dtype=torch.float32)
    for rank_pieces in gathered:
        for offsets, piece in rank_pieces:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    return full
