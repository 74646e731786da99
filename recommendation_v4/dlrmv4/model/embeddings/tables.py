"""The sparse embedding tables: their names and sizes, their initial rows, and the interface both
backends implement (``SparseEmbeddings``).

Tables: "item", "artist", "album" (shared by the history and the candidate) and the 8 contextual
tables in ``hashing.CONTEXTUAL_FEATURES`` order. Initial weights come from seeded generators, chunk
by chunk, so both backends (and any row sharding) start from the same numbers.

Ids are not range-checked in the hot path (that would need a device-to-host sync every step);
``check_ids`` does it with a clear message, for debug runs and tests.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from dlrmv4.checkpoint.tables import TableState, gather_full_tables, load_full_tables
from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, table_rows
from dlrmv4.data.sparse_features import SHARED_IDS, feature_ids
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings.sequence import SequenceEmbeddings

# One table per shared id: the history and the candidate look up the same rows.
SHARED_TABLES = SHARED_IDS
TABLE_NAMES = SHARED_TABLES + CONTEXTUAL_FEATURES
# Rows per init chunk: each chunk has its own seed, so a shard can generate just its rows.
INIT_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int


def store_table_counts(store) -> tuple[int, int, int]:
    """(items, artist rows, album rows) of a Store: ids index the tables directly."""
    num_items = len(store.artist_id)
    if num_items == 0:
        return 0, 0, 0
    return num_items, int(store.artist_id.max()) + 1, int(store.album_id.max()) + 1


def table_specs(cfg: BenchmarkConfig, num_items: int, num_artists: int, num_albums: int) -> list[TableSpec]:
    """The 11 tables; a configured size of 0 takes the store's count."""
    emb = cfg.embeddings
    shared = {
        "item": emb.item_rows or num_items,
        "artist": emb.artist_rows or num_artists,
        "album": emb.album_rows or num_albums,
    }
    specs = [TableSpec(name, int(rows)) for name, rows in shared.items()]
    specs += [TableSpec(name, rows) for name, rows in zip(CONTEXTUAL_FEATURES, table_rows(cfg.sampler))]
    for spec in specs:
        if spec.rows <= 0:
            raise UserError(
                f"embedding table {spec.name!r} has {spec.rows} rows: set "
                f"embeddings.{spec.name}_rows or use a store with at least one item"
            )
    return specs


def init_bound(table_rows: int) -> float:
    """The half-width of a table's uniform init: sqrt(1 / rows), the reference's (TorchRec's default
    for an EmbeddingConfig, which FBGEMM draws its rows from; docs/model.md names the source)."""
    return math.sqrt(1.0 / table_rows)


def init_rows(
    table_index: int,
    table_rows: int,
    row_begin: int,
    row_end: int,
    dim: int,
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    """Rows [row_begin, row_end) of a table's uniform(-b, b) init, b = ``init_bound(table_rows)``, the
    same whatever the slicing (drawn on ``device``: CPU and CUDA generators give different numbers
    for one seed)."""
    bound = init_bound(table_rows)
    out = torch.empty(row_end - row_begin, dim, dtype=torch.float32, device=device)
    for chunk in range(row_begin // INIT_CHUNK_ROWS, -(-row_end // INIT_CHUNK_ROWS)):
        c0, c1 = chunk * INIT_CHUNK_ROWS, min((chunk + 1) * INIT_CHUNK_ROWS, table_rows)
        chunk_seed = int(np.random.SeedSequence([seed, table_index, chunk]).generate_state(1, np.uint64)[0] >> 1)
        gen = torch.Generator(device=device).manual_seed(chunk_seed)
        # Always the whole chunk: every shard draws the same numbers for the rows it holds.
        values = torch.empty(c1 - c0, dim, dtype=torch.float32, device=device).uniform_(-bound, bound, generator=gen)
        lo, hi = max(c0, row_begin), min(c1, row_end)
        out[lo - row_begin : hi - row_begin] = values[lo - c0 : hi - c0]
    return out


def table_features(name: str) -> tuple[str, ...]:
    """The id features (``data/sparse_features.py`` names) that look up table ``name``."""
    return (f"history_{name}_id", f"candidate_{name}_id") if name in SHARED_TABLES else (name,)


def assemble_embeddings(
    sequence: dict[str, torch.Tensor], candidate: list[torch.Tensor], chunks: tuple[tuple[int, int], ...] = ()
) -> SequenceEmbeddings:
    """SequenceEmbeddings from per-table sequence rows ([T + B, E] for the shared tables, laid out by
    ``chunks``; [B, E] for the contextual ones) and the candidate's fp32 (item, artist, album) rows."""
    return SequenceEmbeddings(
        item=sequence["item"],
        artist=sequence["artist"],
        album=sequence["album"],
        contextual=torch.stack([sequence[name] for name in CONTEXTUAL_FEATURES], dim=1),
        candidate=torch.cat(candidate, -1),
        chunks=chunks if len(chunks) > 1 else (),
    )


@dataclass(frozen=True)
class TableSettings:
    """What either backend is built from (``backend.make_embeddings`` fills it from the config)."""

    specs: tuple[TableSpec, ...]
    dim: int  # the rows' width
    lr: float  # row-wise Adagrad's peak learning rate
    eps: float  # and its epsilon
    seed: int  # the initial rows are drawn from it (the same on both backends)
    device: torch.device
    cluster: Cluster
    sequence_dtype: torch.dtype = torch.float32  # the looked-up rows' dtype, the sequence model's
    kernels: str = "auto"  # the model's ops choice (``model.kernels``), for the embeddings' own ops


class SparseEmbeddings(nn.Module, abc.ABC):
    """The interface both backends implement (``plain_backend/``, ``torchrec_backend/``). Its parameters
    belong to the sparse optimizer: keep them out of the dense Adam and of gradient clipping."""

    backend: str

    def __init__(self, settings: TableSettings) -> None:
        super().__init__()
        specs = settings.specs
        self.cluster = settings.cluster
        if [s.name for s in specs] != list(TABLE_NAMES):
            raise ValueError(f"table specs must name {TABLE_NAMES}, got {[s.name for s in specs]}")
        self.specs = list(specs)
        self.dim = settings.dim
        self.eps = settings.eps
        self.lr = settings.lr
        # The sequence rows come in the sequence model's dtype: its first layers would cast them anyway.
        self.sequence_dtype = settings.sequence_dtype
        self.kernels = settings.kernels
        self.lookups_distributed_ahead = 0  # lookups whose ids ``distribute_ids`` had sent ahead
        self.ids_looked_up = 0  # ids the lookups asked for (TorchRec; fewer than the tokens' with dedup_ids)

    def check_ids(self, batch: TorchJaggedBatch) -> None:
        """Raise ValueError naming the feature when an id is outside its table (syncs: debug only)."""
        features = feature_ids(batch)
        for spec in self.specs:
            for feature in table_features(spec.name):
                ids = features[feature]
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.rows):
                    raise ValueError(
                        f"{feature}: ids span [{int(ids.min())}, {int(ids.max())}], "
                        f"table {spec.name!r} has {spec.rows} rows"
                    )

    @abc.abstractmethod
    def forward(self, batch: TorchJaggedBatch, chunks: tuple[tuple[int, int], ...] = ()) -> SequenceEmbeddings:
        """One lookup of every id feature; history and candidate share the item/artist/album tables.
        ``chunks``: the sample ranges the caller takes the rows by (``train/chunks.py``), which a
        backend may lay the shared tables' rows out by (``SequenceEmbeddings.chunks`` says whether it
        did)."""

    def warm_up_lookup(self, batch: TorchJaggedBatch, chunks: tuple[tuple[int, int], ...] = ()) -> SequenceEmbeddings:
        """``forward``'s embeddings of ``batch`` as leaves: a backward from the model stops at them, never
        reaching the tables or their optimizer state (the kernels' warm-up before RUN_START,
        ``train/warm_up.py``; a backend whose lookup has kernels of its own makes the leaves below them)."""
        with torch.no_grad():
            emb = self(batch, chunks)
        return dataclasses.replace(emb, **{n: getattr(emb, n).detach().requires_grad_() for n in emb.TENSORS})

    def warm_up_update(self, batch: TorchJaggedBatch) -> None:
        """Run the sparse update's own kernels once on scratch rows, for ``batch``'s ids (the warm-up;
        nothing where the update is fused into the lookup's backward)."""

    @property
    def holds_pinned_host_memory(self) -> bool:
        """Whether tables of this rank live in pinned host memory (TorchRec's uvm placements)."""
        return False

    def sharding_rows(self) -> list[dict[str, Any]] | None:
        """Where each table's shards live (one row per table, for the report); None: every table
        is whole on every rank."""
        return None

    def describe_sharding(self) -> str | None:
        """The sharding plan in words, for the run's log; None: every table is whole on every rank."""
        return None

    @property
    def dense_parallel(self) -> nn.Module | None:
        """The dense model as this backend made it data parallel; None: the backend does not own it
        (the plain backend: the trainer wraps it in DistributedDataParallel itself)."""
        return None

    def distribute_ids(self, batch: TorchJaggedBatch, after: torch.cuda.Event | None = None) -> None:
        """Start sending ``batch``'s ids to the ranks that hold their rows, for a ``forward`` of that
        batch later (the sparse-dist pipeline: the next batch's ids travel while this step computes).
        On a GPU, ``after`` marks the point of the current stream from which the batch is on the
        device (None: the current stream as it is now). Nothing to send ahead here: the plain
        backend's tables are whole on every rank."""

    def settle_ids(self) -> None:
        """Take the distribution ``distribute_ids`` started past the point where the host waits for
        the device (the exchange of the ids' counts), so the ids themselves travel before the lookup."""

    @abc.abstractmethod
    def sparse_step(self) -> None:
        """Row-wise Adagrad for the gradients of the backward(s) since the last call (no-op where fused)."""

    @abc.abstractmethod
    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of the next update (the warm-up changes it every step). Set it before the
        lookup: FBGEMM's CUDA kernels apply the rate that was set when the forward ran (seen with
        fbgemm-gpu 1.6 on an H200; its CPU kernels read it in the backward)."""

    @abc.abstractmethod
    def live_tables(self) -> dict[str, dict[str, Any]]:
        """``{name: {'weight': [rows, E], 'momentum': [rows]}}`` of the live storage: plain tensors or
        TorchRec ShardedTensors whose local shards are views of FBGEMM's own (loads write in place)."""

    def checkpoint_state(self) -> TableState:
        """The tables as one ``torch.distributed.checkpoint`` entry (saved and loaded in place)."""
        return TableState(self)

    def state_for_checkpoint(self) -> dict:
        """``{'tables': {name: {'weight': [rows, E], 'momentum': [rows]}}}``: full fp32 host copies, one
        format for both backends. With sharded tables it is a collective: every rank must call it;
        rank 0 gets the tables, the others an empty dict."""
        return gather_full_tables(self)

    def load_from_checkpoint(self, state: dict) -> None:
        """Restore weights and Adagrad state exactly from full tables (``state_for_checkpoint``)."""
        load_full_tables(self, state)
