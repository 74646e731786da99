"""The sparse embedding tables: one interface, two backends (TorchRec/FBGEMM and plain PyTorch).

Tables: "item", "artist", "album" (shared by the history and the candidate) and the 8 contextual
tables in ``hashing.CONTEXTUAL_FEATURES`` order. Both backends train them with FBGEMM's
EXACT_ROWWISE_ADAGRAD (weight decay 0), whose update for one row that the batch touched is

    g      = sum of the row's gradients over every occurrence in the batch   (duplicates summed)
    state += sum_d(g_d**2) / D                                               (one fp32 per row)
    w     -= lr / (sqrt(state) + eps) * g

(fbgemm_gpu/codegen/genscript/optimizers.py: rowwise_adagrad(), split_weight_update_cpu and
split_precomputation). TorchRec fuses it into the backward; the plain backend's backward leaves
each lookup's gradient rows pending and ``sparse_step`` applies it from them in place
(``ops/rowwise_adagrad.py``: one Triton pass on GPUs, the PyTorch reference elsewhere). Initial
weights come from seeded generators, chunk by chunk, so both backends (and any row sharding) start
from the same numbers. Checkpoints go through ``checkpoint_state`` (a
``torch.distributed.checkpoint`` entry: ``tables.<name>.weight`` / ``.momentum``, sharded tensors
where TorchRec shards them), so a run resumes on either backend and on any number of ranks.

Several processes: TorchRec shards the tables by its planner's plan (``train/sharding.py``); the
plain backend keeps a replica of every table on each rank (data parallel) and exchanges the
gradients before the update (a dense all-reduce for tables smaller than the batch's gradient
rows, an all-gather of (id, row) pairs for the others, then an update that sums each row's
gradients in a fixed order), so every replica applies the same update to the same bits.

Ids are not range-checked in the hot path (that would need a device-to-host sync every step);
``check_ids`` does it with a clear message, for debug runs and tests.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torch.distributed.checkpoint.stateful import Stateful

from dlrmv4.config import BenchmarkConfig, EmbeddingConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, table_rows
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.hstu import DTYPES
from dlrmv4.ops.rowwise_adagrad import rowwise_adagrad_
from dlrmv4.train.distributed import Cluster
from dlrmv4.train.sharding import plan_sharding, qcomm_registry

SHARED_TABLES = ("item", "artist", "album")
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
    shared = {"item": emb.item_rows or num_items, "artist": emb.artist_rows or num_artists,
              "album": emb.album_rows or num_albums}
    specs = [TableSpec(name, int(rows)) for name, rows in shared.items()]
    specs += [TableSpec(name, rows) for name, rows in zip(CONTEXTUAL_FEATURES, table_rows(cfg.sampler))]
    for spec in specs:
        if spec.rows <= 0:
            raise UserError(f"embedding table {spec.name!r} has {spec.rows} rows: set "
                            f"embeddings.{spec.name}_rows or use a store with at least one item")
    return specs


def init_rows(table_index: int, table_rows: int, row_begin: int, row_end: int, dim: int, std: float,
              seed: int, device: torch.device) -> torch.Tensor:
    """Rows [row_begin, row_end) of a table's N(0, std) init, the same whatever the slicing (drawn on
    ``device``: CPU and CUDA generators give different numbers for one seed)."""
    out = torch.empty(row_end - row_begin, dim, dtype=torch.float32, device=device)
    for chunk in range(row_begin // INIT_CHUNK_ROWS, -(-row_end // INIT_CHUNK_ROWS)):
        c0, c1 = chunk * INIT_CHUNK_ROWS, min((chunk + 1) * INIT_CHUNK_ROWS, table_rows)
        chunk_seed = int(np.random.SeedSequence([seed, table_index, chunk]).generate_state(1, np.uint64)[0] >> 1)
        gen = torch.Generator(device=device).manual_seed(chunk_seed)
        # Always the whole chunk: a prefix of normal_(n) is not normal_(k), so shards must agree.
        values = torch.empty(c1 - c0, dim, dtype=torch.float32, device=device).normal_(0.0, std, generator=gen)
        lo, hi = max(c0, row_begin), min(c1, row_end)
        out[lo - row_begin:hi - row_begin] = values[lo - c0:hi - c0]
    return out


def _feature_ids(batch: TorchJaggedBatch) -> dict[str, torch.Tensor]:
    """Every id feature of a batch: history/candidate per shared table, one column per contextual table."""
    ids = {}
    for name in SHARED_TABLES:
        ids[f"history_{name}_id"] = getattr(batch, f"history_{name}_id")
        ids[f"candidate_{name}_id"] = getattr(batch, f"candidate_{name}_id")
    for c, name in enumerate(CONTEXTUAL_FEATURES):
        ids[name] = batch.contextual_ids[:, c]
    return ids


def _table_features(name: str) -> tuple[str, ...]:
    return (f"history_{name}_id", f"candidate_{name}_id") if name in SHARED_TABLES else (name,)


def _assemble(sequence: dict[str, torch.Tensor], candidate: list[torch.Tensor]) -> SequenceEmbeddings:
    """SequenceEmbeddings from per-table sequence rows ([T + B, E] for the shared tables, [B, E]
    for the contextual ones) and the candidate's fp32 (item, artist, album) rows."""
    return SequenceEmbeddings(item=sequence["item"], artist=sequence["artist"], album=sequence["album"],
                              contextual=torch.stack([sequence[name] for name in CONTEXTUAL_FEATURES], dim=1),
                              candidate=torch.cat(candidate, -1))


class SparseEmbeddings(nn.Module, abc.ABC):
    """The interface both backends implement (see the module docstring). Its parameters belong to the
    sparse optimizer: keep them out of the dense Adam and of gradient clipping."""

    backend: str

    def __init__(self, specs: list[TableSpec], dim: int, lr: float, eps: float, cluster: Cluster) -> None:
        super().__init__()
        self.cluster = cluster
        if [s.name for s in specs] != list(TABLE_NAMES):
            raise ValueError(f"table specs must name {TABLE_NAMES}, got {[s.name for s in specs]}")
        self.specs = list(specs)
        self.dim = dim
        self.eps = eps
        self.lr = lr

    def check_ids(self, batch: TorchJaggedBatch) -> None:
        """Raise ValueError naming the feature when an id is outside its table (syncs: debug only)."""
        features = _feature_ids(batch)
        for spec in self.specs:
            for feature in _table_features(spec.name):
                ids = features[feature]
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= spec.rows):
                    raise ValueError(f"{feature}: ids span [{int(ids.min())}, {int(ids.max())}], "
                                     f"table {spec.name!r} has {spec.rows} rows")

    @abc.abstractmethod
    def forward(self, batch: TorchJaggedBatch) -> SequenceEmbeddings:
        """One lookup of every id feature; history and candidate share the item/artist/album tables."""

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

    def checkpoint_state(self) -> "TableState":
        """The tables as one ``torch.distributed.checkpoint`` entry (saved and loaded in place)."""
        return TableState(self)

    def state_for_checkpoint(self) -> dict:
        """``{'tables': {name: {'weight': [rows, E], 'momentum': [rows]}}}``: full fp32 host copies, one
        format for both backends. With sharded tables it is a collective: every rank must call it;
        rank 0 gets the tables, the others an empty dict."""
        tables: dict[str, dict[str, torch.Tensor]] = {}
        rows = {s.name: s.rows for s in self.specs}
        for name, parts in self.live_tables().items():
            shapes = {"weight": (rows[name], self.dim), "momentum": (rows[name],)}
            full = {part: _full_on_rank0(t, shapes[part], self.cluster) for part, t in parts.items()}
            if self.cluster.is_main:
                tables[name] = full
        return {"tables": tables} if self.cluster.is_main else {}

    @torch.no_grad()
    def load_from_checkpoint(self, state: dict) -> None:
        """Restore weights and Adagrad state exactly from full tables (``state_for_checkpoint``)."""
        self._check_state(state)
        for name, parts in self.live_tables().items():
            for part, live in parts.items():
                full = state["tables"][name][part]
                if live is None:
                    continue
                if hasattr(live, "local_shards"):
                    for shard in live.local_shards():
                        index = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                                       shard.metadata.shard_sizes))
                        shard.tensor.copy_(full[index])
                else:
                    live.copy_(full)

    def _check_state(self, state: dict) -> None:
        for spec in self.specs:
            table = state["tables"].get(spec.name)
            if table is None or tuple(table["weight"].shape) != (spec.rows, self.dim) \
                    or tuple(table["momentum"].shape) != (spec.rows,):
                raise UserError(f"checkpoint embedding table {spec.name!r} does not match "
                                f"{spec.rows} rows x {self.dim}: was it saved with another config?")


class TableState(Stateful):
    """A backend's tables as a DCP entry: ``state_dict`` hands out the live tensors and DCP writes into
    them in place on load (resharding as needed); ``load_state_dict`` copies what DCP handed back as
    a new tensor instead."""

    def __init__(self, embeddings: SparseEmbeddings) -> None:
        self.embeddings = embeddings

    def state_dict(self) -> dict[str, Any]:
        return {"tables": {name: {part: t for part, t in parts.items() if t is not None}
                           for name, parts in self.embeddings.live_tables().items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for name, parts in self.embeddings.live_tables().items():
            for part, live in parts.items():
                if live is None or hasattr(live, "local_shards"):
                    continue  # nothing here, or loaded in place shard by shard
                loaded = state_dict["tables"][name][part]
                if loaded is not live:
                    live.copy_(loaded)


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
    full = torch.zeros(shape, dtype=torch.float32)
    for rank_pieces in gathered:
        for offsets, piece in rank_pieces:
            full[tuple(slice(o, o + n) for o, n in zip(offsets, piece.shape))] = piece
    return full


def rowwise_adagrad_dense_(weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor, lr: torch.Tensor,
                           eps: float) -> None:
    """The same update from a dense [rows, E] gradient (duplicates already summed): a row with an
    all-zero gradient changes neither its state nor its weight, as in FBGEMM."""
    touched = (grad != 0).any(1)
    momentum.add_((grad * grad).sum(1) / weight.shape[1])
    multiplier = torch.where(touched, lr / (torch.sqrt(momentum) + eps), 0.0)
    weight.sub_(grad * multiplier[:, None])


class _TableLookup(torch.autograd.Function):
    """One table's rows for the sequence (in the sequence dtype) and for the item tower (fp32). The
    backward builds no ``weight.grad``: it hands the (ids, gradient rows) pairs to the table's list
    of pending gradients, which ``sparse_step`` updates from in place (as FBGEMM's fused backward
    does, without copying the rows into a sparse tensor)."""

    @staticmethod
    def forward(ctx, weight, sequence_ids, candidate_ids, dtype, pending):
        ctx.save_for_backward(sequence_ids, candidate_ids)
        ctx.pending = pending
        return F.embedding(sequence_ids, weight).to(dtype), F.embedding(candidate_ids, weight)

    @staticmethod
    def backward(ctx, sequence_grad, candidate_grad):
        sequence_ids, candidate_ids = ctx.saved_tensors
        ctx.pending.append((sequence_ids, sequence_grad))
        if candidate_ids.numel():
            ctx.pending.append((candidate_ids, candidate_grad))
        return None, None, None, None, None


class PlainEmbeddings(SparseEmbeddings):
    """fp32 nn.Parameter tables; the backward leaves each lookup's gradient rows pending and
    ``sparse_step`` applies row-wise Adagrad from them. On several ranks every rank holds every
    table (data parallel) and the gradients are all-gathered."""

    backend = "plain"

    def __init__(self, specs: list[TableSpec], dim: int, lr: float, eps: float, std: float, seed: int,
                 device: torch.device, cluster: Cluster, kernels: str = "auto",
                 sequence_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(specs, dim, lr, eps, cluster)
        self.kernels = kernels  # the update's implementation (ops/rowwise_adagrad.py)
        # The sequence rows come in the sequence model's dtype: its first layers would cast them anyway.
        self.sequence_dtype = sequence_dtype
        self.weights = nn.ParameterDict({
            s.name: nn.Parameter(init_rows(i, s.rows, 0, s.rows, dim, std, seed, device)) for i, s in enumerate(specs)})
        for s in specs:
            self.register_buffer(f"momentum_{s.name}", torch.zeros(s.rows, dtype=torch.float32, device=device))
        # A tensor, not a float: lr / tensor would become reciprocal-then-multiply, not FBGEMM's division.
        self.register_buffer("lr_tensor", torch.tensor(lr, dtype=torch.float32, device=device))
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {s.name: [] for s in specs}

    def forward(self, batch: TorchJaggedBatch) -> SequenceEmbeddings:
        ids = _feature_ids(batch)
        no_ids = torch.zeros(0, dtype=torch.int64, device=self.lr_tensor.device)
        sequence, candidate = {}, []
        for spec in self.specs:
            features = [ids[f] for f in _table_features(spec.name)]
            # History and candidate ids in one lookup: its rows are SequenceEmbeddings' layout.
            rows, candidate_rows = _TableLookup.apply(
                self.weights[spec.name], torch.cat(features) if len(features) > 1 else features[0],
                features[1] if len(features) > 1 else no_ids, self.sequence_dtype, self.pending[spec.name])
            sequence[spec.name] = rows
            if len(features) > 1:
                candidate.append(candidate_rows)
        return _assemble(sequence, candidate)

    @torch.no_grad()
    def sparse_step(self) -> None:
        grads = {}
        for name, pieces in self.pending.items():
            if pieces:
                grads[name] = (torch.cat([i for i, _ in pieces]), [g for _, g in pieces])
                pieces.clear()
        for name, grad in self._exchange(grads).items():
            momentum = getattr(self, f"momentum_{name}")
            if isinstance(grad, torch.Tensor):
                rowwise_adagrad_dense_(self.weights[name], momentum, grad, self.lr_tensor, self.eps)
            else:
                rowwise_adagrad_(self.weights[name], momentum, *grad, self.lr_tensor, self.eps, self.kernels)

    def _exchange(self, grads: dict[str, tuple[torch.Tensor, list[torch.Tensor]]]) -> dict[str, Any]:
        """Every rank's gradient of every table; values / world size, as each rank's loss is the mean
        over its own slice. Row counts are host-side shapes (one small gloo message between ranks).
        A table with fewer rows than the gradient rows of all ranks goes dense: the rows summed into
        [rows, E] (then one all-reduce, identical sums on every rank); the others as (id, row) pairs,
        all-gathered in rank order. One rank keeps its own (ids, gradient pieces): the update reads
        them in place."""
        world = self.cluster.world_size
        if world == 1:
            return grads
        device = self.lr_tensor.device
        local = {s.name: (grads[s.name][0], torch.cat([g.float() for g in grads[s.name][1]])) if s.name in grads
                 else (torch.zeros(0, dtype=torch.int64, device=device),
                       torch.zeros(0, self.dim, dtype=torch.float32, device=device))
                 for s in self.specs}
        counts = self.cluster.all_gather_ints([local[s.name][0].numel() for s in self.specs])
        out: dict[str, Any] = {}
        gathered = []
        for k, spec in enumerate(self.specs):
            ids, values = local[spec.name]
            if spec.rows < sum(rank_counts[k] for rank_counts in counts):
                dense = torch.zeros(spec.rows, self.dim, dtype=torch.float32, device=device)
                dense.index_add_(0, ids, values / world if world > 1 else values)
                out[spec.name] = self.cluster.all_reduce_(dense)
            else:
                gathered.append(k)
        if gathered:
            totals = [sum(rank_counts[k] for k in gathered) for rank_counts in counts]
            ids = self.cluster.all_gather_rows(torch.cat([local[self.specs[k].name][0] for k in gathered]), totals)
            values = self.cluster.all_gather_rows(
                torch.cat([local[self.specs[k].name][1] for k in gathered]) / world, totals)
            # Rank-major, table-minor pieces -> per table, in rank order.
            sizes = [rank_counts[k] for rank_counts in counts for k in gathered]
            id_parts, value_parts = ids.split(sizes), values.split(sizes)
            t = len(gathered)
            for j, k in enumerate(gathered):
                out[self.specs[k].name] = (torch.cat(id_parts[j::t]), torch.cat(value_parts[j::t]))
        return out

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        self.lr_tensor.fill_(lr)

    def live_tables(self) -> dict[str, dict[str, Any]]:
        return {s.name: {"weight": self.weights[s.name].data, "momentum": getattr(self, f"momentum_{s.name}")}
                for s in self.specs}


class TorchRecEmbeddings(SparseEmbeddings):
    """An EmbeddingCollection in DistributedModelParallel, sharded by TorchRec's planner (row-, column-
    or table-wise); FBGEMM's row-wise Adagrad fused in the backward. Rows come out in the sequence
    dtype (the history rows feed the bf16 sequence model; the item tower takes the candidates'
    rows up to fp32), which halves the lookup's output and gradient against fp32; the row-wise
    lookup's unbucketize step has a gather for its backward (``torchrec_permute.py``). Tables placed in
    host memory (``uvm``, ``uvm_caching``) are allocated as pinned host memory mapped into the
    device (``uvm_host_mapped``), never as CUDA managed memory."""

    backend = "torchrec"

    def __init__(self, specs: list[TableSpec], dim: int, lr: float, eps: float, std: float, seed: int,
                 device: torch.device, cluster: Cluster, cfg: EmbeddingConfig,
                 sequence_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(specs, dim, lr, eps, cluster)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from torchrec import EmbeddingCollection, EmbeddingConfig as TableConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        from dlrmv4.train import torchrec_permute

        torchrec_permute.install()
        if not dist.is_initialized():
            raise UserError("the torchrec embedding backend needs torch.distributed initialised "
                            "(gloo on the CPU, NCCL on GPUs); or set embeddings.embedding_backend=plain")
        tables = [TableConfig(name=s.name, embedding_dim=dim, num_embeddings=s.rows,
                              feature_names=list(_table_features(s.name))) for s in specs]
        # FBGEMM's CPU kernels write fp32 only: there the rows are cast after the lookup (same numbers).
        self.sequence_dtype = sequence_dtype
        output_dtype = sequence_dtype if device.type == "cuda" else torch.float32
        output = {torch.bfloat16: SparseType.BF16, torch.float16: SparseType.FP16, torch.float32: SparseType.FP32}
        sharder = EmbeddingCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": eps,
            "weight_decay": 0.0, "output_dtype": output[output_dtype], "uvm_host_mapped": True},
            qcomm_codecs_registry=qcomm_registry(cfg))
        # Built on "meta": DMP allocates only this rank's shards.
        collection = EmbeddingCollection(tables=tables, device=torch.device("meta"))
        self.plan = plan_sharding(collection, [sharder], cfg, cluster.world_size, cluster.local_world_size, device)
        self.dmp = DistributedModelParallel(collection, device=device, sharders=[sharder], plan=self.plan)
        self.keys = [f for s in specs for f in _table_features(s.name)]
        with torch.no_grad():
            for i, s in enumerate(specs):
                for shard in self._weight(s.name).local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    rows = init_rows(i, s.rows, r0, r0 + nr, dim, std, seed, shard.tensor.device)
                    shard.tensor.copy_(rows[:, c0:c0 + nc])

    def _weight(self, name: str):
        return self.dmp.state_dict()[f"embeddings.{name}.weight"]

    def _momentum(self, name: str):
        """The table's Adagrad state, or None on a rank that holds none of it (table-wise plans)."""
        state = self.dmp.fused_optimizer.state_dict()["state"].get(f"embeddings.{name}.weight")
        return None if state is None else state[f"{name}.momentum1"]

    def forward(self, batch: TorchJaggedBatch) -> SequenceEmbeddings:
        from torchrec import KeyedJaggedTensor

        ids = _feature_ids(batch)
        b, t = batch.num_samples, batch.total_tokens
        ones = torch.ones(b, dtype=torch.int32, device=batch.history_lengths.device)
        lengths = [batch.history_lengths.to(torch.int32) if k.startswith("history_") else ones for k in self.keys]
        # Host-side sizes per key spare TorchRec a device-to-host sync.
        per_key = [t if k.startswith("history_") else b for k in self.keys]
        kjt = KeyedJaggedTensor(keys=self.keys, values=torch.cat([ids[k] for k in self.keys]),
                                lengths=torch.cat(lengths), stride=b, length_per_key=per_key)
        out = {k: jt.values().to(self.sequence_dtype) for k, jt in self.dmp(kjt).items()}
        return _assemble({s.name: torch.cat([out[f] for f in _table_features(s.name)]) for s in self.specs},
                         [out[f"candidate_{name}_id"] for name in SHARED_TABLES])

    def sparse_step(self) -> None:
        """Nothing to do: FBGEMM applied the update inside the backward."""

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        for group in self.dmp.fused_optimizer.param_groups:
            group["lr"] = lr
        # The fused optimizer's step() only pushes param_groups' lr into the FBGEMM modules.
        self.dmp.fused_optimizer.step()

    def live_tables(self) -> dict[str, dict[str, Any]]:
        return {s.name: {"weight": self._weight(s.name), "momentum": self._momentum(s.name)} for s in self.specs}


def torchrec_works(device: torch.device) -> bool:
    """True when TorchRec imports and FBGEMM's fused row-wise Adagrad kernel runs on ``device``."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
        import torchrec  # noqa: F401

        on_gpu = device.type == "cuda"
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(4, 4, EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST,
              ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU)],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, device=device)
        tbe(torch.tensor([1, 2], device=device), torch.tensor([0, 1, 2], device=device)).sum().backward()
        return True
    except Exception:  # noqa: BLE001 - any failure to import or run means "use the plain backend"
        return False


def resolve_backend(cfg: BenchmarkConfig, device: torch.device) -> str:
    """``auto``: torchrec where its kernels run on ``device`` and a process group exists, else plain."""
    choice = cfg.embeddings.embedding_backend
    if choice != "auto":
        return choice
    return "torchrec" if dist.is_initialized() and torchrec_works(device) else "plain"


def make_embeddings(specs: list[TableSpec], cfg: BenchmarkConfig, device: torch.device | str,
                    seed: int, cluster: Cluster | None = None) -> SparseEmbeddings:
    device = torch.device(device)
    cluster = cluster or Cluster(0, 1, 0, 1, device)
    args = (specs, cfg.model.embedding_dim, cfg.train.learning_rate, cfg.train.adagrad_eps,
            cfg.embeddings.embedding_init_std, seed, device, cluster)
    if resolve_backend(cfg, device) == "torchrec":
        return TorchRecEmbeddings(*args, cfg.embeddings, sequence_dtype=DTYPES[cfg.model.sequence_dtype])
    if cfg.embeddings.sharding_types or cfg.embeddings.placement or cfg.embeddings.qcomm != "none":
        raise UserError("embeddings.sharding_types, placement and qcomm are TorchRec settings: the plain backend "
                        "keeps a replica of every table on each rank")
    return PlainEmbeddings(*args, kernels=cfg.model.kernels, sequence_dtype=DTYPES[cfg.model.sequence_dtype])
