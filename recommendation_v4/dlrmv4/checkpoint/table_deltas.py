"""Delta checkpoints: the table rows that changed since the checkpoint before, in place of whole tables.

A window touches a small share of the tables' rows, and only the rows it touches change. The rows
that changed since the last checkpoint are found at the save, for either backend and row- or
table-wise sharding, with nothing done per step: each row (its weight and its Adagrad momentum, as
bits) has a 64-bit fingerprint, the sum of its 32-bit words times fixed odd multipliers, and a row
changed when its fingerprint differs from a snapshot taken at that checkpoint. A change to one
word always changes the fingerprint (an odd multiplier times a nonzero difference below 2^33 is
never 0 modulo 2^64); changes to several words of a row cancel out with probability 2^-64. The
momentum alone would not do: once a row's momentum is large, a small update's squared gradient is
absorbed in its float32 sum while the weight still moves.

``ChangedRows`` keeps the snapshot (8 bytes a row, in host memory) and hands out the changed rows;
``TableRowsDelta`` is the checkpoint entry that holds them, one piece per writing rank;
``apply_delta`` writes a delta's rows into the live tables on any number of ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dlrmv4.checkpoint.dcp_io import dcp_load
from dlrmv4.checkpoint.state import HostCopy
from dlrmv4.checkpoint.tables import SparseEmbeddings
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.files import read_errors_in_one_line

ENTRY = "sparse_delta"  # the checkpoint entry (``<ENTRY>.rows.<table>.rank<r>.<part>`` in DCP's keys)
PARTS = ("ids", "weight", "momentum")

# (first row, weight rows [n, E], momentum [n]) of a table held on this rank
Piece = tuple[int, torch.Tensor, torch.Tensor]
# ((table, first row), weight rows, momentum): a piece as fingerprinted
Block = tuple[tuple[str, int], torch.Tensor, torch.Tensor]


def _pieces(name: str, parts: dict[str, Any], dim: int) -> list[Piece]:
    """The row blocks of one table that this rank holds (none where a table-wise plan put it elsewhere)."""
    weight, momentum = parts["weight"], parts["momentum"]
    if weight is None or momentum is None:
        return []
    if not hasattr(weight, "local_shards"):
        return [(0, weight, momentum)]
    moments = {int(s.metadata.shard_offsets[0]): s.tensor for s in momentum.local_shards()}
    pieces = []
    for shard in weight.local_shards():
        (row0, col0), (_, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
        if col0 != 0 or cols != dim:
            raise ValueError(f"table {name!r} is split by columns: a delta needs whole rows")
        pieces.append((int(row0), shard.tensor, moments[int(row0)]))
    return pieces


def split_by_columns(embeddings: SparseEmbeddings) -> list[str]:
    """The tables whose rows are split over ranks by columns (column-wise sharding): no delta can hold them."""
    split = []
    for name, parts in embeddings.live_tables().items():
        weight = parts["weight"]
        shards = weight.metadata().shards_metadata if hasattr(weight, "metadata") else []
        if any(shard.shard_offsets[1] != 0 or shard.shard_sizes[1] != embeddings.dim for shard in shards):
            split.append(name)
    return split


def _writes_its_pieces(parts: dict[str, Any], cluster: Cluster) -> bool:
    """Whether this rank writes the rows it holds: a table whole on every rank is written by rank 0 alone."""
    return hasattr(parts["weight"], "local_shards") or cluster.is_main


# The int64 words fingerprinted at once (with their int32 view, 384 MiB of transient device memory
# between steps whatever the row width; a fixed row count took 2.7 GB at E = 512).
_FINGERPRINT_CHUNK_BYTES = 256 << 20


# The changed rows gathered on the device at once, before their copy to host memory.
_GATHER_CHUNK_BYTES = 256 << 20


def _multipliers(words: int, device: torch.device) -> torch.Tensor:
    """Fixed odd 64-bit multipliers, one per 32-bit word of a row (the same on every rank and every run)."""
    generator = torch.Generator().manual_seed(0x5EED_DE17A)
    draws = torch.randint(-(2**62), 2**62, (words,), generator=generator, dtype=torch.int64)
    return (draws | 1).to(device)


@torch.no_grad()
def _fingerprints(weight: torch.Tensor, momentum: torch.Tensor) -> torch.Tensor:
    """One int64 per row over the bits of its weight and momentum (host copy; int64 arithmetic wraps)."""
    if weight.dtype != torch.float32 or momentum.dtype != torch.float32:
        raise UserError(f"delta checkpoints need fp32 tables and momentum, got {weight.dtype} / {momentum.dtype}")
    multipliers = _multipliers(weight.shape[1] + 1, weight.device)
    chunk_rows = max(1, _FINGERPRINT_CHUNK_BYTES // (8 * multipliers.numel()))
    # Pinned, each chunk's copy queued behind its kernels and one wait at the end: a wait and a
    # pageable copy per chunk cost up to 8x the kernels on a host that answers slowly.
    out = torch.empty(weight.shape[0], dtype=torch.int64, pin_memory=weight.is_cuda)
    for begin in range(0, weight.shape[0], chunk_rows):
        end = min(begin + chunk_rows, weight.shape[0])
        words = torch.cat([weight[begin:end], momentum[begin:end, None]], 1).contiguous().view(torch.int32)
        out[begin:end].copy_(words.to(torch.int64).mul_(multipliers).sum(1), non_blocking=True)
    if weight.is_cuda:  # (the current stream: the training's, or the writer's copy stream in its thread)
        torch.cuda.current_stream(weight.device).synchronize()
    return out


class ChangedRows:
    """The rows of this rank's tables that changed since ``reset`` or the last ``take``."""

    def __init__(self) -> None:
        self._fingerprints: dict[tuple[str, int], torch.Tensor] | None = None

    @property
    def ready(self) -> bool:
        """Whether a snapshot exists (taken at a whole checkpoint or a resume): a delta has a base."""
        return self._fingerprints is not None

    @staticmethod
    def blocks(embeddings: SparseEmbeddings) -> list[Block]:
        """The row blocks this rank fingerprints: ((table, first row), weight rows, momentum)."""
        return [
            ((name, row0), weight, momentum)
            for name, parts in embeddings.live_tables().items()
            if _writes_its_pieces(parts, embeddings.cluster)
            for row0, weight, momentum in _pieces(name, parts, embeddings.dim)
        ]

    def reset(self, embeddings: SparseEmbeddings) -> None:
        """Snapshot the rows as they are now: the state the next delta is written against."""
        self.reset_to(self.blocks(embeddings))

    @torch.no_grad()
    def reset_to(self, blocks: list[Block]) -> None:
        """Snapshot the rows of ``blocks`` (``blocks``' tensors, or copies of them taken at a checkpoint)."""
        self._fingerprints = {key: _fingerprints(weight, momentum) for key, weight, momentum in blocks}

    @torch.no_grad()
    def take(self, embeddings: SparseEmbeddings) -> dict[str, dict[str, torch.Tensor]]:
        """``{table: {'ids': [n] global rows, 'weight': [n, E], 'momentum': [n]}}`` (host copies) of the rows
        this rank writes that changed since the snapshot, which moves to now. Tables with none are left out."""
        if self._fingerprints is None:
            raise RuntimeError("a delta needs a snapshot: reset() at the whole checkpoint or resume it follows")
        changed: dict[str, dict[str, torch.Tensor]] = {}
        for name, parts in embeddings.live_tables().items():
            if not _writes_its_pieces(parts, embeddings.cluster):
                continue
            found = []
            for row0, weight, momentum in _pieces(name, parts, embeddings.dim):
                now = _fingerprints(weight, momentum)
                local = torch.nonzero(now != self._fingerprints[(name, row0)]).flatten()
                self._fingerprints[(name, row0)] = now
                found.append((row0, weight, momentum, local))
            count = sum(local.numel() for *_, local in found)
            if not count:
                continue
            # Copied straight into the host rows the delta keeps (no list of pieces joined afterwards:
            # that was a second host copy of every row, into memory touched for the first time).
            rows = {
                "ids": torch.cat([local + row0 for row0, _, _, local in found]),
                "weight": torch.empty((count, embeddings.dim), dtype=torch.float32),
                "momentum": torch.empty(count, dtype=torch.float32),
            }
            at = 0
            for _, weight, momentum, local in found:
                # A bounded device copy at a time: after skipped saves a delta may hold most rows (and
                # a gather from host-mapped tables lands in device memory too).
                rows_at_once = max(1, _GATHER_CHUNK_BYTES // (weight.shape[1] * weight.element_size()))
                for chunk in local.to(weight.device).split(rows_at_once):
                    rows["weight"][at : at + chunk.numel()].copy_(weight.detach()[chunk])
                    rows["momentum"][at : at + chunk.numel()].copy_(momentum.detach()[chunk])
                    at += chunk.numel()
            changed[name] = rows
        return changed


class TableRowsDelta(HostCopy):
    """This rank's changed rows as a checkpoint entry (host copies, written as they are; never loaded into:
    ``apply_delta`` reads a delta back). Their sizes change from one delta to the next, so they must not
    go through a staging copy that is reused from save to save (the asynchronous writer's on a GPU)."""

    def __init__(self, rows: dict[str, dict[str, torch.Tensor]], rank: int) -> None:
        self.rows, self.rank = rows, rank

    def state_dict(self) -> dict[str, Any]:
        return {"rows": {name: {f"rank{self.rank}": parts} for name, parts in self.rows.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError("a delta is applied with apply_delta, not loaded into")


def delta_bytes(rows: dict[str, dict[str, torch.Tensor]]) -> int:
    return sum(t.numel() * t.element_size() for parts in rows.values() for t in parts.values())


@torch.no_grad()
def apply_delta(path: Path, embeddings: SparseEmbeddings, cluster: Cluster) -> int:
    """Write the rows of the delta checkpoint at ``path`` into the live tables (each rank the rows it holds,
    whatever the number of ranks that wrote it); returns the rows the delta holds. Every writer's row ids
    are read, then the rows of the writers whose ids fall in this rank's blocks only: a rank reads its own
    share of a delta, not the whole of it, on any number of ranks."""
    rows: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    with read_errors_in_one_line(path):
        metadata = FileSystemReader(str(path)).read_metadata()
    prefix = f"{ENTRY}.rows."
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        assert isinstance(entry, TensorStorageMetadata)
        table, writer, part = key[len(prefix) :].rsplit(".", 2)
        empty = torch.empty(entry.size, dtype=entry.properties.dtype)
        rows.setdefault(table, {}).setdefault(writer, {})[part] = empty
    live = embeddings.live_tables()
    unknown = sorted(set(rows) - set(live))
    if unknown:
        raise UserError(f"the delta checkpoint {path} holds rows of tables this model does not have: {unknown}")
    split = sorted(set(rows) & set(split_by_columns(embeddings)))
    if split:
        raise UserError(
            f"cannot resume from {path}, a delta checkpoint: this run splits {', '.join(split)} by columns "
            "(column_wise sharding) and a delta holds whole rows; resume with those tables row_wise or "
            "table_wise (every checkpoint of a run that splits a table by columns is whole)"
        )
    if not rows:
        return 0
    pieces = {table: _pieces(table, live[table], embeddings.dim) for table in rows}
    with read_errors_in_one_line(path):
        ids = {table: {writer: {"ids": parts["ids"]} for writer, parts in by.items()} for table, by in rows.items()}
        dcp_load({ENTRY: {"rows": ids}}, path, cluster)
        wanted = {
            table: {
                writer: {part: parts[part] for part in PARTS if part != "ids"}
                for writer, parts in by.items()
                if any(_inside(parts["ids"], row0, weight.shape[0]).any() for row0, weight, _ in pieces[table])
            }
            for table, by in rows.items()
        }
        if cluster.world_size > 1 or any(wanted.values()):  # a collective: every rank loads, if only nothing
            dcp_load({ENTRY: {"rows": wanted}}, path, cluster)
    for table, by_writer in wanted.items():
        for writer, parts in by_writer.items():
            writer_ids = rows[table][writer]["ids"]
            for row0, weight, momentum in pieces[table]:
                inside = _inside(writer_ids, row0, weight.shape[0])
                local = (writer_ids[inside] - row0).to(weight.device)
                weight[local] = parts["weight"][inside].to(weight.device, weight.dtype)
                momentum[local] = parts["momentum"][inside].to(momentum.device, momentum.dtype)
    return sum(parts["ids"].numel() for by in rows.values() for parts in by.values())


def _inside(ids: torch.Tensor, row0: int, rows: int) -> torch.Tensor:
    return (ids >= row0) & (ids < row0 + rows)
