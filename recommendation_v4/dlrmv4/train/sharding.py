"""How TorchRec lays the tables over the ranks: the config's overrides, the planner, the plan.

``embeddings.sharding_types`` and ``embeddings.placement`` are ``table=value`` lists (``*`` for
every table); a table without an override leaves the choice to TorchRec's
``EmbeddingShardingPlanner``, which also respects the per-rank memory cap
(``embeddings.hbm_cap_gib``). The planner runs on every rank and agrees on one plan
(``collective_plan``); ``describe_plan`` is what rank 0 prints at the start.
"""

from __future__ import annotations

from typing import Any

import torch

from dlrmv4.config import EmbeddingConfig
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.errors import UserError

TABLE_NAMES = ("item", "artist", "album") + CONTEXTUAL_FEATURES
# data_parallel is not offered: TorchRec 1.8's dense (data-parallel) lookup for sequence tables
# (EmbeddingCollection) returns pooled rows; the plain backend is the data-parallel path.
SHARDING_TYPES = ("row_wise", "column_wise", "table_wise")
# Where a table lives -> TorchRec compute kernel (fused: FBGEMM's row-wise Adagrad in the backward).
PLACEMENTS = {"hbm": "fused", "uvm": "fused_uvm", "uvm_caching": "fused_uvm_caching"}
# Share of each rank's memory the planner keeps free of tables.
DENSE_RESERVATION = 0.25


def parse_table_options(text: str, field: str, allowed: tuple[str, ...]) -> dict[str, str]:
    """``'item=row_wise,*=table_wise'`` -> {table: value} for every table named or covered by ``*``."""
    out: dict[str, str] = {}
    default: str | None = None
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = (s.strip() for s in item.partition("="))
        if not sep or not name or not value:
            raise UserError(f"config field embeddings.{field}: {item!r} is not 'table=value'")
        if value not in allowed:
            raise UserError(f"config field embeddings.{field}: {value!r} for {name!r} is not one of "
                            f"{', '.join(allowed)}")
        if name == "*":
            default = value
        elif name in TABLE_NAMES:
            out[name] = value
        else:
            raise UserError(f"config field embeddings.{field}: unknown table {name!r}; tables: "
                            f"{', '.join(TABLE_NAMES)}")
    if default is not None:
        out = {name: out.get(name, default) for name in TABLE_NAMES}
    return out


def check_sharding_options(cfg: EmbeddingConfig) -> None:
    parse_table_options(cfg.sharding_types, "sharding_types", SHARDING_TYPES)
    parse_table_options(cfg.placement, "placement", tuple(PLACEMENTS))


def constraints(cfg: EmbeddingConfig) -> dict[str, Any]:
    from torchrec.distributed.planner import ParameterConstraints

    sharding = parse_table_options(cfg.sharding_types, "sharding_types", SHARDING_TYPES)
    placement = parse_table_options(cfg.placement, "placement", tuple(PLACEMENTS))
    out = {}
    for name in TABLE_NAMES:
        kinds = [sharding[name]] if name in sharding else list(SHARDING_TYPES)
        kernels = [PLACEMENTS[placement[name]]] if name in placement else list(PLACEMENTS.values())
        out[name] = ParameterConstraints(sharding_types=kinds, compute_kernels=kernels)
    return out


def plan_sharding(module: torch.nn.Module, sharders: list, cfg: EmbeddingConfig, world_size: int,
                  local_world_size: int, device: torch.device):
    """The ShardingPlan every rank agrees on (the planner runs on each and rank 0's plan wins)."""
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    kind = "cuda" if device.type == "cuda" else "cpu"
    hbm = int(cfg.hbm_cap_gib * 1024**3) if cfg.hbm_cap_gib > 0 else None
    if hbm is None and kind == "cuda":
        hbm = torch.cuda.get_device_properties(device).total_memory
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_world_size, hbm_cap_bytes=hbm),
        kernel_config=KernelConfig(compute_device=kind))
    # The dense model, activations and optimizer state share the device with the tables.
    reservation = FixedPercentageStorageReservation(DENSE_RESERVATION)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints(cfg),
                                       storage_reservation=reservation)
    try:
        return planner.collective_plan(module, sharders, dist.GroupMember.WORLD)
    except Exception as exc:  # the planner's own errors are long multi-line reports
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"TorchRec found no sharding plan for these tables on {world_size} rank(s) "
                        f"(embeddings.sharding_types / placement / hbm_cap_gib): {first[:300]}") from exc


def plan_rows(plan) -> list[dict[str, Any]]:
    """One row per table: sharding type, compute kernel, ranks, shard sizes."""
    rows = []
    for module_plan in plan.plan.values():
        for table, ps in sorted(module_plan.items(), key=lambda kv: TABLE_NAMES.index(kv[0])):
            shards = [tuple(s.shard_sizes) for s in ps.sharding_spec.shards] if ps.sharding_spec else []
            rows.append({"table": table, "sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
                         "ranks": list(ps.ranks or []), "shards": shards})
    return rows


def describe_plan(plan) -> str:
    lines = ["sharding plan (table: type, kernel, ranks, shard sizes):"]
    for row in plan_rows(plan):
        shards = ", ".join("x".join(map(str, s)) for s in row["shards"]) or "replicated"
        lines.append(f"  {row['table']}: {row['sharding_type']}, {row['compute_kernel']}, ranks "
                     f"{row['ranks'] or 'all'}, {shards}")
    return "\n".join(lines)


def qcomm_registry(cfg: EmbeddingConfig):
    """Codecs for quantized all-to-all (None: fp32)."""
    if cfg.qcomm == "none":
        return None
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    precision = {"fp16": CommType.FP16, "bf16": CommType.BF16}[cfg.qcomm]
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=precision, backward_precision=precision))
