"""How TorchRec lays the tables over the ranks: the config's overrides, the planner, the plan.

``embeddings.sharding_types`` and ``embeddings.placement`` are ``table=value`` lists (``*`` for
every table); a table without an override leaves the choice to TorchRec's
``EmbeddingShardingPlanner``, which also respects the per-rank memory cap
(``embeddings.hbm_cap_gib``: the device memory the tables may fill, so no further share is
reserved; without it the planner keeps ``DENSE_RESERVATION`` of the device free). The memory plan
(``plan/``) fills all three in for a run, so the run's planner lays the tables out
exactly as the plan counted them. The planner runs on every rank and agrees on one plan
(``collective_plan``); ``describe_plan`` is what rank 0 prints at the start. ``target_plan`` runs the
same planner for a target that is not this machine (no process group, nothing allocated).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from dlrmv4.config import EmbeddingConfig
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings.tables import TABLE_NAMES, table_features
from dlrmv4.model.embeddings.torchrec_backend.compat import codec_settings, plain_cast_dtype
from dlrmv4.model.embeddings.wire import cast_then_clamp

# data_parallel is not offered: TorchRec 1.8's dense (data-parallel) lookup for sequence tables
# (EmbeddingCollection) returns pooled rows; the plain backend is the data-parallel path.
SHARDING_TYPES = ("row_wise", "column_wise", "table_wise")
# Where a table lives -> TorchRec compute kernel (fused: FBGEMM's row-wise Adagrad in the backward).
PLACEMENTS = {"hbm": "fused", "uvm": "fused_uvm", "uvm_caching": "fused_uvm_caching"}
# Share of each rank's memory the planner keeps free of tables when no cap is configured.
DENSE_RESERVATION = 0.25
# The reference's sharding (docs/model.md); the memory plan assumes it for tables the config leaves open.
DEFAULT_SHARDING = "row_wise"


def parse_table_options(text: str, field: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """``'item=row_wise,*=table_wise'`` -> {table: value} for every table named or covered by ``*``."""
    out: dict[str, str] = {}
    default: str | None = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not name or not value:
            raise UserError(f"config field embeddings.{field}: {item!r} is not 'table=value'")
        if value not in allowed:
            raise UserError(
                f"config field embeddings.{field}: {value!r} for {name!r} is not one of {', '.join(allowed)}"
            )
        if name == "*":
            default = value
        elif name in TABLE_NAMES:
            out[name] = value
        else:
            raise UserError(
                f"config field embeddings.{field}: unknown table {name!r}; tables: {', '.join(TABLE_NAMES)}"
            )
    if default is not None:
        out = {name: out.get(name, default) for name in TABLE_NAMES}
    return out


def check_sharding_options(cfg: EmbeddingConfig) -> None:
    parse_table_options(cfg.sharding_types, "sharding_types", SHARDING_TYPES)
    parse_table_options(cfg.placement, "placement", tuple(PLACEMENTS))


def constraints(cfg: EmbeddingConfig) -> dict[str, Any]:
    from torchrec.distributed.planner import ParameterConstraints

    # A table the config does not name is row-wise in HBM (the reference's layout); the memory plan
    # names the tables it moves to host memory. Left to itself TorchRec's planner may pick column-wise
    # shards, whose row-wise Adagrad state is per shard (another update), or a UVM cache.
    sharding = table_options(cfg.sharding_types, "sharding_types", SHARDING_TYPES, DEFAULT_SHARDING)
    placement = table_options(cfg.placement, "placement", tuple(PLACEMENTS), "hbm")
    return {
        name: ParameterConstraints(sharding_types=[sharding[name]], compute_kernels=[PLACEMENTS[placement[name]]])
        for name in TABLE_NAMES
    }


def plan_sharding(
    module: torch.nn.Module, sharders: list, cfg: EmbeddingConfig, cluster: Cluster, device: torch.device
):
    """The ShardingPlan every rank agrees on (the planner runs on each and rank 0's plan wins), its
    shards placed on the GPUs the ranks run on. A collective."""
    import torch.distributed as dist

    world_size, local_world_size = cluster.world_size, cluster.local_world_size
    kind = "cuda" if device.type == "cuda" else "cpu"
    hbm = int(cfg.hbm_cap_gib * 1024**3) if cfg.hbm_cap_gib > 0 else None
    if hbm is None and kind == "cuda":
        hbm = torch.cuda.get_device_properties(device).total_memory
    # A configured cap is the tables' own budget (the memory plan counted the rest); otherwise the
    # dense model, activations and optimizer state share the device with the tables.
    reserve = 0.0 if cfg.hbm_cap_gib > 0 else DENSE_RESERVATION
    planner = _planner(
        constraints(cfg), world_size, local_world_size, kind, hbm, _host_memory_per_rank(local_world_size), reserve
    )
    try:
        plan = planner.collective_plan(module, sharders, dist.GroupMember.WORLD)
    except Exception as exc:  # the planner's own errors are long multi-line reports
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"TorchRec found no sharding plan for these tables on {world_size} rank(s) "
            f"(embeddings.sharding_types / placement / hbm_cap_gib): {first[:300]}"
        ) from exc
    if kind == "cuda":
        own = device.index if device.index is not None else torch.cuda.current_device()
        indices = [index for (index,) in cluster.all_gather_ints([own])]
        if any(index != rank % local_world_size for rank, index in enumerate(indices)):
            placed_on_the_ranks_devices(plan, indices)
    return plan


def placed_on_the_ranks_devices(plan, device_indices: list[int]):
    """``plan`` with every shard placed on its rank's own GPU index (``device_indices`` by rank).
    TorchRec places rank r on GPU r % local_world_size, which is not where a task bound to one GPU
    runs (srun --gpus-per-task=1: each sees its GPU as cuda:0). The plan is changed in place."""
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

    for module_plan in plan.plan.values():
        for parameter in module_plan.values():
            spec = parameter.sharding_spec
            if not isinstance(spec, EnumerableShardingSpec):
                continue  # data-parallel tables: no shards
            placed = []
            for shard in spec.shards:
                rank = shard.placement.rank() if shard.placement is not None else None
                if rank is None:
                    raise ValueError(f"a shard of the plan has no rank: {shard}")
                placement = f"rank:{rank}/cuda:{device_indices[rank]}"
                placed.append(ShardMetadata(shard.shard_offsets, shard.shard_sizes, placement))
            spec.shards = placed
    return plan


def _planner(
    table_constraints: dict[str, Any],
    world_size: int,
    local_world_size: int,
    compute_device: str,
    hbm_cap_bytes: int | None,
    ddr_cap_bytes: int | None,
    reserve: float,
):
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    topology = TopologyFactory.create_topology(
        TrainerConfig(
            world_size=world_size,
            local_world_size=local_world_size,
            hbm_cap_bytes=hbm_cap_bytes,
            ddr_cap_bytes=ddr_cap_bytes,
        ),
        kernel_config=KernelConfig(compute_device=compute_device),
    )
    return EmbeddingShardingPlanner(
        topology=topology, constraints=table_constraints, storage_reservation=FixedPercentageStorageReservation(reserve)
    )


def _host_memory_per_rank(local_world_size: int) -> int:
    """This node's RAM per local rank, never below TorchRec's own default (the memory plan checks
    host memory itself: the planner's host cap must not refuse what the plan accepted)."""
    from torchrec.distributed.planner.constants import DDR_CAP

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return max(DDR_CAP, total // max(local_world_size, 1))


def table_options(text: str, field: str, allowed: tuple[str, ...], default: str) -> dict[str, str]:
    """Every table's value: the configured one, else ``default``."""
    named = parse_table_options(text, field, allowed)
    return {name: named.get(name, default) for name in TABLE_NAMES}


def format_table_options(values: dict[str, str]) -> str:
    """{table: value} for every table -> the shortest ``'*=common,table=other,...'`` string."""
    counts: dict[str, int] = {}
    for value in values.values():
        counts[value] = counts.get(value, 0) + 1
    common = max(counts, key=lambda v: (counts[v], -list(values.values()).index(v)))
    return ",".join([f"*={common}"] + [f"{name}={values[name]}" for name in TABLE_NAMES if values[name] != common])


def planning_sharder(output_dtype: torch.dtype):
    """A sharder with the run's fused parameters (``tables.py``), for ``target_plan``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    output = {torch.bfloat16: SparseType.BF16, torch.float16: SparseType.FP16, torch.float32: SparseType.FP32}
    return EmbeddingCollectionSharder(
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": 0.0,
            "eps": 1e-8,
            "weight_decay": 0.0,
            "output_dtype": output[output_dtype],
            "uvm_host_mapped": True,
        }
    )


def target_plan(
    table_rows: dict[str, int],
    dim: int,
    sharding: dict[str, str],
    placement: dict[str, str] | None,
    *,
    world_size: int,
    local_world_size: int,
    compute_device: str,
    hbm_cap_bytes: int | None,
    ddr_cap_bytes: int | None,
    output_dtype: torch.dtype = torch.float32,
):
    """TorchRec's ShardingPlan for ``world_size`` ranks of ``compute_device`` ("cuda" or "cpu"),
    without a process group: the tables are built on "meta". ``sharding`` and ``placement`` give
    every table's sharding type and placement (``placement`` None: the planner picks the kernel).
    None when the planner finds no plan (the tables do not fit its caps); no extra reservation."""
    from torchrec import EmbeddingCollection
    from torchrec import EmbeddingConfig as TableConfig
    from torchrec.distributed.planner import ParameterConstraints
    from torchrec.distributed.planner.types import PlannerError

    tables = [
        TableConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=list(table_features(name)))
        for name, rows in table_rows.items()
    ]
    kernels = {name: [PLACEMENTS[placement[name]]] if placement else list(PLACEMENTS.values()) for name in table_rows}
    table_constraints = {
        name: ParameterConstraints(sharding_types=[sharding[name]], compute_kernels=kernels[name])
        for name in table_rows
    }
    planner = _planner(
        table_constraints, world_size, local_world_size, compute_device, hbm_cap_bytes, ddr_cap_bytes, 0.0
    )
    with _quiet_torchrec():
        try:
            return planner.plan(
                EmbeddingCollection(tables=tables, device=torch.device("meta")), [planning_sharder(output_dtype)]
            )
        except PlannerError:
            return None


@contextlib.contextmanager
def _quiet_torchrec():
    """The planner logs its statistics and warnings: a plan made for another machine prints its own."""
    logger = logging.getLogger("torchrec")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass(frozen=True)
class ShardBytes:
    """One table's bytes on one rank: fp32 rows + row-wise Adagrad state (one fp32 per row)."""

    table: str
    rank: int
    rows: int
    cols: int
    kernel: str

    @property
    def bytes(self) -> int:
        return self.rows * self.cols * 4 + self.rows * 4


def plan_shards(plan) -> list[ShardBytes]:
    """Every shard of a ShardingPlan with its rank (a shard's rows and columns, its kernel)."""
    out = []
    for module_plan in plan.plan.values():
        for table, ps in module_plan.items():
            for shard in ps.sharding_spec.shards if ps.sharding_spec else []:
                rank = shard.placement.rank() if shard.placement is not None else 0
                out.append(
                    ShardBytes(table, rank, int(shard.shard_sizes[0]), int(shard.shard_sizes[1]), ps.compute_kernel)
                )
    return out


def plan_rows(plan) -> list[dict[str, Any]]:
    """One row per table: sharding type, compute kernel, ranks, shard sizes."""
    rows = []
    for module_plan in plan.plan.values():
        for table, ps in sorted(module_plan.items(), key=lambda kv: TABLE_NAMES.index(kv[0])):
            shards = [tuple(s.shard_sizes) for s in ps.sharding_spec.shards] if ps.sharding_spec else []
            rows.append(
                {
                    "table": table,
                    "sharding_type": ps.sharding_type,
                    "compute_kernel": ps.compute_kernel,
                    "ranks": list(ps.ranks or []),
                    "shards": shards,
                }
            )
    return rows


def describe_plan(plan) -> str:
    lines = ["sharding plan (table: type, kernel, ranks, shard sizes):"]
    for row in plan_rows(plan):
        shards = ", ".join("x".join(map(str, s)) for s in row["shards"]) or "replicated"
        lines.append(
            f"  {row['table']}: {row['sharding_type']}, {row['compute_kernel']}, ranks "
            f"{row['ranks'] or 'all'}, {shards}"
        )
    return "\n".join(lines)


def _cast_then_clamp_codec_class():
    from fbgemm_gpu.quantize_comm import QuantizedCommCodec

    class CastThenClampCodec(QuantizedCommCodec):
        """FBGEMM's fp16/bf16 all-to-all codec with a low-memory encoder (``cast_then_clamp``) and a
        decoder that returns the rows' own dtype (``rows_dtype``: the lookup's output dtype)."""

        def __init__(self, comm_precision, is_fwd: bool, rows_dtype: torch.dtype) -> None:
            super().__init__(comm_precision, is_fwd=is_fwd)
            self.rows_dtype = rows_dtype

        def encode(self, input_tensor: torch.Tensor, ctx=None) -> torch.Tensor:
            cast = plain_cast_dtype(self)
            if cast is None:
                return super().encode(input_tensor, ctx)
            return cast_then_clamp(input_tensor, cast)

        def decode(self, input_tensor: torch.Tensor, ctx=None) -> torch.Tensor:
            # FBGEMM decodes to fp32. Where the lookup returns bf16 rows (GPUs), the fp32 copy would
            # double the received rows and the backward's permuted gradients, and the autograd
            # engine casts the gradient to bf16 before the lookup's backward anyway: decoding
            # straight to the rows' dtype gives the same numbers.
            if plain_cast_dtype(self) is None:
                return super().decode(input_tensor, ctx)
            return input_tensor.to(self.rows_dtype)

    return CastThenClampCodec


def qcomm_registry(cfg: EmbeddingConfig, rows_dtype: torch.dtype = torch.float32):
    """Codecs for the quantized all-to-all (None: the rows' own dtype): TorchRec's registry for the
    precision, each of its codecs swapped for ours (the low-memory encoder; decoding to
    ``rows_dtype``, the lookup's output dtype). The precision is kept on gloo too (TorchRec's
    registry would turn bf16 into fp16 for a CPU device; gloo moves bf16 fine)."""
    if cfg.qcomm == "none":
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    precision = {"fp16": CommType.FP16, "bf16": CommType.BF16}[cfg.qcomm]
    registry = get_qcomm_codecs_registry(QCommsConfig(forward_precision=precision, backward_precision=precision))
    codec_class = _cast_then_clamp_codec_class()
    for codecs in registry.values():
        for direction in ("forward", "backward"):
            stock = getattr(codecs, direction)
            setattr(codecs, direction, codec_class(*codec_settings(stock), rows_dtype))
    return registry
