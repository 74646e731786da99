"""The TorchRec/FBGEMM backend: the tables in an EmbeddingCollection, sharded over the ranks by
TorchRec's planner (``sharding.py``), with FBGEMM's row-wise Adagrad fused into the backward.
DistributedModelParallel wraps the whole model: the EmbeddingCollection beside the dense model
(``ShardedModel``), which it makes data parallel (``DenseDataParallel``: DistributedDataParallel
around the dense model alone, so the chunked step can run it chunk by chunk and reduce its
gradients once).

A lookup is TorchRec's three stages: the input distribution (the ids to the ranks that hold their
rows: an all-to-all of the counts, which the host waits for, then one of the ids), the lookup
itself, and the output distribution (the rows back). ``distribute_ids`` runs the first stage of
the next batch while the current step (or eval batch) computes, as TorchRec's
``TrainPipelineSparseDist`` does; ``forward`` of that batch then starts at the lookup. The first
stage reads no table, so the numbers are those of the unpipelined lookup.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlrmv4.config import EmbeddingConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.sparse_features import SPARSE_KEYS, lookup_size, sequence_rows, sparse_features
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings.sequence import SequenceEmbeddings
from dlrmv4.model.embeddings.tables import (
    SHARED_TABLES,
    SparseEmbeddings,
    TableSettings,
    assemble_embeddings,
    init_rows,
    table_features,
)
from dlrmv4.model.embeddings.torchrec_backend.compat import push_learning_rate
from dlrmv4.model.embeddings.torchrec_backend.sharding import (
    PLACEMENTS,
    describe_plan,
    plan_rows,
    plan_sharding,
    qcomm_registry,
)


@dataclass(eq=False)
class _DistributedIds:
    """A batch's ids on their way to the ranks that hold their rows (TorchRec's input distribution),
    on the side stream ``stream`` on a GPU (None on the CPU)."""

    batch: TorchJaggedBatch
    context: Any  # the sharded module's context for this lookup
    awaitable: Any  # the counts' all-to-all, then (settled) the ids' all-to-all
    stream: torch.cuda.Stream | None
    settled: bool = False

    def on_stream(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def settle(self) -> None:
        if not self.settled:
            with self.on_stream():
                self.awaitable = self.awaitable.wait()  # the host waits for the counts, sends the ids
            self.settled = True

    def take(self):
        """The distributed ids, ready for the lookup on the current stream."""
        self.settle()
        with self.on_stream():
            ids = self.awaitable.wait()
        if self.stream is not None:  # made on the side stream, used on this one (TorchRec's own rule)
            current = torch.cuda.current_stream(self.stream.device)
            current.wait_stream(self.stream)
            ids.record_stream(current)
            self.context.record_stream(current)
        return ids


class ShardedModel(nn.Module):
    """What DistributedModelParallel wraps: the tables (sharded by it) and the dense model (made data
    parallel by it; None where only the tables are wanted, as in the lookup benchmarks)."""

    def __init__(self, tables: nn.Module, dense: nn.Module | None) -> None:
        super().__init__()
        self.tables = tables
        self.dense = dense


def _dense_data_parallel():
    from torchrec.distributed.model_parallel import DataParallelWrapper, get_unwrapped_module

    class DenseDataParallel(DataParallelWrapper):
        """DistributedDataParallel around the dense model alone, on several ranks (buffers are not
        synchronised: every rank builds the same ones; inputs are already on the device)."""

        def wrap(self, dmp, env, device) -> None:
            model = get_unwrapped_module(dmp)
            if env.world_size > 1 and model.dense is not None:
                model.dense = DistributedDataParallel(
                    model.dense, device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True
                )

    return DenseDataParallel()


class TorchRecEmbeddings(SparseEmbeddings):
    """An EmbeddingCollection in DistributedModelParallel, sharded by TorchRec's planner (row-, column-
    or table-wise); FBGEMM's row-wise Adagrad fused in the backward. Rows come out in the sequence
    dtype (the history rows feed the bf16 sequence model; the item tower takes the candidates'
    rows up to fp32), which halves the lookup's output and gradient against fp32; the row-wise
    lookup's unbucketize step has a gather for its backward (``permute.py``, installed by
    ``compat.install``). Tables placed in
    host memory (``uvm``, ``uvm_caching``) are allocated as pinned host memory mapped into the
    device (``uvm_host_mapped``), never as CUDA managed memory."""

    backend = "torchrec"
    dmp: Any  # DistributedModelParallel over the tables and the dense model, kept out of this module's tree

    def __init__(self, settings: TableSettings, cfg: EmbeddingConfig, dense: nn.Module | None = None) -> None:
        super().__init__(settings)
        specs, dim, lr, eps = settings.specs, settings.dim, settings.lr, settings.eps
        seed, device, cluster = settings.seed, settings.device, settings.cluster
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from torchrec import EmbeddingCollection
        from torchrec import EmbeddingConfig as TableConfig
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embedding import EmbeddingCollectionSharder

        if not dist.is_initialized():
            raise UserError(
                "the torchrec embedding backend needs torch.distributed initialised "
                "(gloo on the CPU, NCCL on GPUs); or set embeddings.embedding_backend=plain"
            )
        tables = [
            TableConfig(
                name=s.name, embedding_dim=dim, num_embeddings=s.rows, feature_names=list(table_features(s.name))
            )
            for s in specs
        ]
        # FBGEMM's CPU kernels write fp32 only: there the rows are cast after the lookup (same numbers).
        output_dtype = self.sequence_dtype if device.type == "cuda" else torch.float32
        output = {torch.bfloat16: SparseType.BF16, torch.float16: SparseType.FP16, torch.float32: SparseType.FP32}
        sharder = EmbeddingCollectionSharder(
            fused_params={
                "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                "learning_rate": lr,
                "eps": eps,
                "weight_decay": 0.0,
                "output_dtype": output[output_dtype],
                "uvm_host_mapped": True,
            },
            qcomm_codecs_registry=qcomm_registry(cfg, output_dtype),
        )
        # Built on "meta": DMP allocates only this rank's shards.
        model = ShardedModel(EmbeddingCollection(tables=tables, device=torch.device("meta")), dense)
        self.plan = plan_sharding(model, [sharder], cfg, cluster, device)
        dmp = DistributedModelParallel(
            model, device=device, sharders=[sharder], plan=self.plan, data_parallel_wrapper=_dense_data_parallel()
        )
        # The DMP is kept out of this module's tree (the dense model's parameters are the dense
        # optimizer's); the sharded tables are this module's one submodule.
        self.__dict__["dmp"] = dmp
        self.tables = self._model().tables
        if [f for s in specs for f in table_features(s.name)] != list(SPARSE_KEYS):
            raise ValueError("the tables' features are not the batch's SPARSE_KEYS")
        # Batches whose ids are on their way, oldest first: the next training step's, and an eval's
        # next batch while the eval runs between two steps.
        self._distributed: list[_DistributedIds] = []
        # The ids' distribution runs on a stream of its own, as in TorchRec's pipeline: the host's
        # waits in it then wait for that stream's few kernels, not for the step's compute. High
        # priority: its kernels take the next free SMs instead of queueing behind the step's.
        self._dist_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        weights = self._sharded().state_dict()  # (once for all the tables: each call builds every table's)
        with torch.no_grad():
            for i, s in enumerate(specs):
                for shard in weights[f"embeddings.{s.name}.weight"].local_shards():
                    (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    rows = init_rows(i, s.rows, r0, r0 + nr, dim, seed, shard.tensor.device)
                    shard.tensor.copy_(rows[:, c0 : c0 + nc])

    @property
    def holds_pinned_host_memory(self) -> bool:
        return any(
            row["compute_kernel"] != PLACEMENTS["hbm"] and self.cluster.rank in (row["ranks"] or [self.cluster.rank])
            for row in plan_rows(self.plan)
        )

    @property
    def dense_parallel(self) -> nn.Module | None:
        """The dense model as DistributedModelParallel made it data parallel (itself on one rank)."""
        return self._model().dense

    def sharding_rows(self) -> list[dict[str, Any]]:
        return plan_rows(self.plan)

    def describe_sharding(self) -> str:
        return describe_plan(self.plan)

    def _model(self) -> ShardedModel:
        from torchrec.distributed.model_parallel import get_unwrapped_module

        return get_unwrapped_module(self.dmp)

    def _sharded(self):
        """The sharded EmbeddingCollection (its lookup's stages, its tables and fused optimizer)."""
        return self.tables

    def distribute_ids(self, batch: TorchJaggedBatch, after: torch.cuda.Event | None = None) -> None:
        sharded = self._sharded()
        stream = self._dist_stream
        if stream is not None:  # the batch is on the device once the current stream reaches ``after``
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream())
            for tensor in batch.device_buffers():
                tensor.record_stream(stream)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            context = sharded.create_context()
            awaitable = sharded.input_dist(context, sparse_features(batch))
        self._distributed.append(_DistributedIds(batch, context, awaitable, stream))

    def settle_ids(self) -> None:
        for distributed in self._distributed:
            distributed.settle()

    def forward(self, batch: TorchJaggedBatch, chunks: tuple[tuple[int, int], ...] = ()) -> SequenceEmbeddings:
        self.ids_looked_up += lookup_size(batch)
        waiting = next((i for i, d in enumerate(self._distributed) if d.batch is batch), None)
        if waiting is not None:  # its ids are on their way
            distributed = self._distributed.pop(waiting)
            ids = distributed.take()
            self.lookups_distributed_ahead += 1
            looked_up = self._sharded().compute_and_output_dist(distributed.context, ids).wait()
        else:  # a batch of its own: those on their way (another loop's) wait for their lookups
            looked_up = self._sharded()(sparse_features(batch)).wait()
        return self._assemble(batch, {k: jt.values() for k, jt in looked_up.items()}, chunks)

    def warm_up_lookup(self, batch: TorchJaggedBatch, chunks: tuple[tuple[int, int], ...] = ()) -> SequenceEmbeddings:
        """The leaves are the looked-up rows, below the lookup's own kernels (the distinct ids' gather and
        its backward); the tables and FBGEMM's fused update are never reached."""
        with torch.no_grad():
            looked_up = self._sharded()(sparse_features(batch)).wait()
        return self._assemble(batch, {k: jt.values().detach().requires_grad_() for k, jt in looked_up.items()}, chunks)

    def _assemble(
        self, batch: TorchJaggedBatch, rows: dict[str, torch.Tensor], chunks: tuple[tuple[int, int], ...]
    ) -> SequenceEmbeddings:
        # The sequence rows in the sequence model's dtype, laid out by the chunks; the candidate's rows
        # also as they came (fp32 on the CPU, where the wire's rounding is all they carry) for the fp32
        # item tower.
        return assemble_embeddings(
            {s.name: sequence_rows(batch, rows, s.name, self.sequence_dtype, self.kernels, chunks) for s in self.specs},
            [rows[f"candidate_{name}_id"] for name in SHARED_TABLES],
            chunks,
        )

    def sparse_step(self) -> None:
        """Nothing to do: FBGEMM applied the update inside the backward."""

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        push_learning_rate(self.dmp.fused_optimizer, lr)

    def live_tables(self) -> dict[str, dict[str, Any]]:
        # The module's and its optimizer's state dicts once for all the tables (each builds every table's
        # sharded tensors).
        sharded = self._sharded()
        weights = sharded.state_dict()
        moments = sharded.fused_optimizer.state_dict()["state"]
        return {
            s.name: {"weight": weights[f"embeddings.{s.name}.weight"], "momentum": _momentum(moments, s.name)}
            for s in self.specs
        }


def _momentum(optimizer_state: dict[str, Any], name: str):
    """A table's Adagrad state in its fused optimizer's state, or None on a rank that holds none of it
    (table-wise plans)."""
    state = optimizer_state.get(f"embeddings.{name}.weight")
    return None if state is None else state[f"{name}.momentum1"]
