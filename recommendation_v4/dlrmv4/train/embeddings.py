"""The sparse embedding tables: one interface, two backends (TorchRec/FBGEMM and plain PyTorch).

Tables: "item", "artist", "album" (shared by the history and the candidate) and the 8 contextual
tables in ``hashing.CONTEXTUAL_FEATURES`` order. Both backends train them with FBGEMM's
EXACT_ROWWISE_ADAGRAD (weight decay 0), whose update for one row that the batch touched is

    g      = sum of the row's gradients over every occurrence in the batch   (duplicates summed)
    state += sum_d(g_d**2) / D                                               (one fp32 per row)
    w     -= lr / (sqrt(state) + eps) * g

(fbgemm_gpu/codegen/genscript/optimizers.py: rowwise_adagrad(), split_weight_update_cpu and
split_precomputation). TorchRec fuses it into the backward; the plain backend applies it in
``sparse_step``. Initial weights come from seeded generators, chunk by chunk, so both backends (and
any row sharding) start from the same numbers. Checkpoints hold full fp32 tables and states in one
format, so a run can resume on either backend.

Ids are not range-checked in the hot path (that would need a device-to-host sync every step);
``check_ids`` does it with a clear message, for debug runs and tests.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, table_rows
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings import SequenceEmbeddings

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


def _assemble(out: dict[str, torch.Tensor]) -> SequenceEmbeddings:
    """SequenceEmbeddings from per-feature [n, E] lookups."""
    return SequenceEmbeddings(
        history_item=out["history_item_id"], history_artist=out["history_artist_id"],
        history_album=out["history_album_id"], candidate_item=out["candidate_item_id"],
        candidate_artist=out["candidate_artist_id"], candidate_album=out["candidate_album_id"],
        contextual=torch.stack([out[name] for name in CONTEXTUAL_FEATURES], dim=1))


class SparseEmbeddings(nn.Module, abc.ABC):
    """The interface both backends implement (see the module docstring). Its parameters belong to the
    sparse optimizer: keep them out of the dense Adam and of gradient clipping."""

    backend: str

    def __init__(self, specs: list[TableSpec], dim: int, lr: float, eps: float) -> None:
        super().__init__()
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
        """The learning rate of the next update (the warm-up changes it every step)."""

    @abc.abstractmethod
    def state_for_checkpoint(self) -> dict:
        """``{'tables': {name: {'weight': [rows, E], 'momentum': [rows]}}}``: fp32 host copies, one
        format for both backends."""

    @abc.abstractmethod
    def load_from_checkpoint(self, state: dict) -> None:
        """Restore weights and Adagrad state exactly, from either backend's checkpoint."""

    def _check_state(self, state: dict) -> None:
        for spec in self.specs:
            table = state["tables"].get(spec.name)
            if table is None or tuple(table["weight"].shape) != (spec.rows, self.dim) \
                    or tuple(table["momentum"].shape) != (spec.rows,):
                raise UserError(f"checkpoint embedding table {spec.name!r} does not match "
                                f"{spec.rows} rows x {self.dim}: was it saved with another config?")


class PlainEmbeddings(SparseEmbeddings):
    """fp32 nn.Parameter tables with sparse gradients; row-wise Adagrad in ``sparse_step``."""

    backend = "plain"

    def __init__(self, specs: list[TableSpec], dim: int, lr: float, eps: float, std: float, seed: int,
                 device: torch.device) -> None:
        super().__init__(specs, dim, lr, eps)
        self.weights = nn.ParameterDict({
            s.name: nn.Parameter(init_rows(i, s.rows, 0, s.rows, dim, std, seed, device)) for i, s in enumerate(specs)})
        for s in specs:
            self.register_buffer(f"momentum_{s.name}", torch.zeros(s.rows, dtype=torch.float32, device=device))
        # A tensor, not a float: lr / tensor would become reciprocal-then-multiply, not FBGEMM's division.
        self.register_buffer("lr_tensor", torch.tensor(lr, dtype=torch.float32, device=device))

    def forward(self, batch: TorchJaggedBatch) -> SequenceEmbeddings:
        ids = _feature_ids(batch)
        out = {}
        for spec in self.specs:
            features = _table_features(spec.name)
            # One lookup per table: history and candidate ids go through the same call.
            rows = F.embedding(torch.cat([ids[f] for f in features]), self.weights[spec.name], sparse=True)
            out.update(zip(features, rows.split([ids[f].numel() for f in features])))
        return _assemble(out)

    @torch.no_grad()
    def sparse_step(self) -> None:
        for spec in self.specs:
            weight = self.weights[spec.name]
            if weight.grad is not None:
                self._update(weight, getattr(self, f"momentum_{spec.name}"), weight.grad)
                weight.grad = None

    def _update(self, weight: torch.Tensor, momentum: torch.Tensor, grad: torch.Tensor) -> None:
        ids, values = grad._indices()[0], grad._values()
        if ids.numel() == 0:
            return
        # Coalesce with static shapes (no host sync): segment s of the sorted ids sums into slot s;
        # slots past the last segment keep id 0, a zero gradient and a zero multiplier (with eps 0,
        # an untouched row 0 would otherwise give 0 * inf = NaN), so they change nothing.
        sorted_ids, order = torch.sort(ids, stable=True)
        new = torch.ones_like(sorted_ids, dtype=torch.bool)
        new[1:] = sorted_ids[1:] != sorted_ids[:-1]
        segment = torch.cumsum(new, 0) - 1
        rows = torch.zeros_like(sorted_ids).scatter_(0, segment, sorted_ids)
        g = torch.zeros_like(values).index_add_(0, segment, values[order])
        momentum.index_add_(0, rows, (g * g).sum(1) / self.dim)
        multiplier = self.lr_tensor / (torch.sqrt(momentum[rows]) + self.eps)
        multiplier = torch.where(torch.arange(len(rows), device=rows.device) <= segment[-1], multiplier, 0.0)
        weight.index_add_(0, rows, -(g * multiplier[:, None]))

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        self.lr_tensor.fill_(lr)

    def state_for_checkpoint(self) -> dict:
        return {"tables": {s.name: {"weight": self.weights[s.name].detach().to("cpu", copy=True),
                                    "momentum": getattr(self, f"momentum_{s.name}").to("cpu", copy=True)}
                           for s in self.specs}}

    @torch.no_grad()
    def load_from_checkpoint(self, state: dict) -> None:
        self._check_state(state)
        for s in self.specs:
            self.weights[s.name].copy_(state["tables"][s.name]["weight"])
            getattr(self, f"momentum_{s.name}").copy_(state["tables"][s.name]["momentum"])


class TorchRecEmbeddings(SparseEmbeddings):
    """An EmbeddingCollection in DistributedModelParallel, FBGEMM row-wise Adagrad fused in the backward."""

    backend = "torchrec"

    def __init__(self, specs: list[TableSpec], dim: int, lr: float, eps: float, std: float, seed: int,
                 device: torch.device) -> None:
        super().__init__(specs, dim, lr, eps)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingCollection, EmbeddingConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        if not dist.is_initialized():
            raise UserError("the torchrec embedding backend needs torch.distributed initialised "
                            "(gloo on the CPU, NCCL on GPUs); or set embeddings.embedding_backend=plain")
        tables = [EmbeddingConfig(name=s.name, embedding_dim=dim, num_embeddings=s.rows,
                                  feature_names=list(_table_features(s.name))) for s in specs]
        sharder = EmbeddingCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr, "eps": eps,
            "weight_decay": 0.0})
        # Built on "meta": DMP allocates only this rank's shards.
        collection = EmbeddingCollection(tables=tables, device=torch.device("meta"))
        self.dmp = DistributedModelParallel(collection, device=device, sharders=[sharder])
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
        return self.dmp.fused_optimizer.state_dict()["state"][f"embeddings.{name}.weight"][f"{name}.momentum1"]

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
        out = self.dmp(kjt)
        return _assemble({k: out[k].values() for k in self.keys})

    def sparse_step(self) -> None:
        """Nothing to do: FBGEMM applied the update inside the backward."""

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        for group in self.dmp.fused_optimizer.param_groups:
            group["lr"] = lr
        # The fused optimizer's step() only pushes param_groups' lr into the FBGEMM modules.
        self.dmp.fused_optimizer.step()

    def _full(self, sharded, name: str) -> torch.Tensor:
        shards = sharded.local_shards()
        if len(shards) != 1 or tuple(shards[0].tensor.shape) != tuple(sharded.size()):
            raise UserError(f"embedding table {name!r} is split over ranks: full-table checkpoints "
                            "need world size 1 (use torch.distributed.checkpoint for sharded runs)")
        return shards[0].tensor

    def state_for_checkpoint(self) -> dict:
        return {"tables": {s.name: {"weight": self._full(self._weight(s.name), s.name).detach().to("cpu", copy=True),
                                    "momentum": self._full(self._momentum(s.name), s.name).to("cpu", copy=True)}
                           for s in self.specs}}

    @torch.no_grad()
    def load_from_checkpoint(self, state: dict) -> None:
        self._check_state(state)
        for s in self.specs:
            # The state dicts' local shards are views of FBGEMM's own storage: copy in place.
            self._full(self._weight(s.name), s.name).copy_(state["tables"][s.name]["weight"])
            self._full(self._momentum(s.name), s.name).copy_(state["tables"][s.name]["momentum"])


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
                    seed: int) -> SparseEmbeddings:
    device = torch.device(device)
    cls = TorchRecEmbeddings if resolve_backend(cfg, device) == "torchrec" else PlainEmbeddings
    return cls(specs, cfg.model.embedding_dim, cfg.train.learning_rate, cfg.train.adagrad_eps,
               cfg.embeddings.embedding_init_std, seed, device)
