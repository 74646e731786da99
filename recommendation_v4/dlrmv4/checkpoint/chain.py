"""The chain of deltas: the checkpoint a delta continues, the checkpoints a resume from one loads,
whether they can still be trusted together, and which of them pruning keeps.

A delta checkpoint holds the dense state whole and only the table rows that changed since its parent
(``table_deltas``); its ``chain.json`` names the parent and the sha256 of the parent's marker. A
resume loads the whole checkpoint at the chain's start and applies every delta after it, so a
checkpoint is usable only with its whole chain.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from dlrmv4.checkpoint.layout import CHAIN_FILE, MARKER, marker_problem, sha256, step_dirs, write_synced


def write_link(tmp: Path, parent: Path) -> None:
    """``chain.json`` in ``tmp``: the delta being written there continues ``parent``."""
    chain = {"parent": parent.name, "parent_marker_sha256": sha256(parent / MARKER)}
    write_synced(tmp / CHAIN_FILE, json.dumps(chain, indent=1).encode())


def _parent(ckpt: Path) -> tuple[Path, str] | None:
    """The checkpoint a delta continues and the sha256 its marker must have; None for a whole checkpoint."""
    try:
        chain = json.loads((ckpt / CHAIN_FILE).read_text())
    except FileNotFoundError:
        return None
    return ckpt.parent / chain["parent"], chain["parent_marker_sha256"]


def _ancestry(ckpt: Path) -> list[Path]:
    """``ckpt`` and the checkpoints its chain goes back through, as far as they exist (newest first)."""
    chain = [ckpt]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        while (parent := _parent(chain[-1])) is not None and parent[0].is_dir() and parent[0] not in chain:
            chain.append(parent[0])
    return chain


def checkpoint_chain(ckpt: str | os.PathLike) -> list[Path]:
    """The checkpoints a resume from ``ckpt`` loads, oldest (the whole one) first. Check the chain with
    ``resume_point`` first."""
    return list(reversed(_ancestry(Path(ckpt))))


def chain_problem(ckpt: Path, verify_hashes: bool, checked: dict[Path, str | None]) -> str | None:
    """Why a resume from ``ckpt`` cannot be trusted: its own problem or one of the checkpoints its chain
    goes back through (gone, rewritten since, or damaged); None when the whole chain is sound.
    ``checked`` holds each checkpoint's own problem once found: the checkpoints of one chain share
    their ancestors, which are hashed once."""
    seen: set[Path] = set()
    while True:
        if ckpt not in checked:
            checked[ckpt] = marker_problem(ckpt, verify_hashes)
        problem = checked[ckpt]
        if problem is not None:
            return problem if not seen else f"the checkpoint it continues, {ckpt.name}: {problem}"
        seen.add(ckpt)
        try:
            parent = _parent(ckpt)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable {CHAIN_FILE} in {ckpt.name} ({type(exc).__name__})"
        if parent is None:
            return None
        path, marker_sha256 = parent
        if not (path / MARKER).is_file() or path in seen:
            return f"the checkpoint it continues, {path.name}, is gone"
        if sha256(path / MARKER) != marker_sha256:
            return f"the checkpoint it continues, {path.name}, was written again since"
        ckpt = path


def prune(root: Path, keep: int, just_written: Path) -> None:
    """Keep ``keep`` restore points, each on a chain of its own (a whole checkpoint and the deltas
    after it), and every checkpoint their chains go back through: the one just written, then the
    newest complete checkpoint of each older chain. Points on one chain would all be lost with its
    whole checkpoint; with every checkpoint whole these are the newest ``keep``."""
    complete = [p for p in step_dirs(root) if (p / MARKER).is_file()]
    ancestry = {p: _ancestry(p) for p in complete + [just_written]}
    kept, starts = [just_written], {ancestry[just_written][-1]}
    for ckpt in reversed(complete):
        if len(kept) == keep:
            break
        if ancestry[ckpt][-1] not in starts:
            kept.append(ckpt)
            starts.add(ancestry[ckpt][-1])
    needed = {p for ckpt in kept for p in ancestry[ckpt]}
    for p in complete:
        if p not in needed:
            # Out of the step-* names first: a kill inside the removal leaves a dead writer's temp
            # (removed at the next start), not a checkpoint without its marker.
            old = p.with_name(f".{p.name}.old-{os.getpid()}")
            with contextlib.suppress(OSError):
                os.rename(p, old)
                p = old
            shutil.rmtree(p, ignore_errors=True)
