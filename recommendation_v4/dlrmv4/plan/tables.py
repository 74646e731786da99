"""Where the tables go and what each takes on the fullest rank: TorchRec's planner laid out for the
target world size (as the run's planner will), or a replica of every table (plain backend).
"""

from __future__ import annotations

import math

import torch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.errors import UserError
from dlrmv4.model.dtypes import DTYPES
from dlrmv4.model.embeddings.torchrec_backend.sharding import PLACEMENTS, plan_shards, target_plan
from dlrmv4.plan.costs import CACHE_LOAD_FACTOR
from dlrmv4.plan.memory_plan import TableUse, Target

PLANNER_UNLIMITED = 1 << 60


def planner_plan(cfg: BenchmarkConfig, target: Target, rows, sharding, placement, hbm_cap: int | None):
    out = DTYPES[cfg.model.sequence_dtype] if target.device_kind == "cuda" else torch.float32
    return target_plan(
        rows,
        cfg.model.embedding_dim,
        sharding,
        placement,
        world_size=target.world_size,
        local_world_size=target.gpus_per_node,
        compute_device=target.device_kind,
        hbm_cap_bytes=hbm_cap if target.device_kind == "cuda" else None,
        ddr_cap_bytes=PLANNER_UNLIMITED,
        output_dtype=out,
    )


def table_layout(
    cfg: BenchmarkConfig, target: Target, backend: str, rows: dict[str, int], sharding, placement
) -> tuple[TableUse, ...]:
    """Per table, the fullest rank's device and host bytes (fp32 rows + row-wise Adagrad state)."""
    dim = cfg.model.embedding_dim
    if backend == "plain":
        return tuple(TableUse(n, r, "replicated", r * dim * 4 + r * 4, 0) for n, r in rows.items())
    plan = planner_plan(cfg, target, rows, sharding, placement, PLANNER_UNLIMITED)
    if plan is None:
        raise UserError(
            f"TorchRec's planner found no layout for these tables on {target.world_size:,} rank(s) "
            "(embeddings.sharding_types)"
        )
    kernels = {v: k for k, v in PLACEMENTS.items()}
    device: dict[int, dict[str, int]] = {}
    host: dict[int, dict[str, int]] = {}
    for shard in plan_shards(plan):
        where = kernels.get(shard.kernel, "hbm") if target.device_kind == "cuda" else "memory"
        on_device = {"uvm": 0, "uvm_caching": math.ceil(CACHE_LOAD_FACTOR * shard.rows) * shard.cols * 4}
        dev = on_device.get(where, shard.bytes)
        device.setdefault(shard.rank, {}).setdefault(shard.table, 0)
        device[shard.rank][shard.table] += dev
        host.setdefault(shard.rank, {}).setdefault(shard.table, 0)
        host[shard.rank][shard.table] += shard.bytes if where in ("uvm", "uvm_caching") else 0
    fullest = max(range(target.world_size), key=lambda r: (sum(device.get(r, {}).values()), -r))
    host_rank = max(range(target.world_size), key=lambda r: (sum(host.get(r, {}).values()), -r))
    return tuple(
        TableUse(
            n,
            rows[n],
            placement[n] if placement else "memory",
            device.get(fullest, {}).get(n, 0),
            host.get(host_rank, {}).get(n, 0),
        )
        for n in rows
    )
