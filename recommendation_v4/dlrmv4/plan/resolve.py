"""The memory plan's choices written into the config the run goes on with."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrmv4.config import BenchmarkConfig
from dlrmv4.model.embeddings.tables import TABLE_NAMES
from dlrmv4.model.embeddings.torchrec_backend.sharding import (
    PLACEMENTS,
    SHARDING_TYPES,
    format_table_options,
    parse_table_options,
)
from dlrmv4.plan.costs import GIB
from dlrmv4.plan.memory_plan import MemoryPlan


def resolved_config(plan: MemoryPlan, cfg: BenchmarkConfig) -> BenchmarkConfig:
    """``cfg`` with the plan's choices filled in (chunks, recompute; for TorchRec the sharding,
    placement and the tables' HBM cap where the config left them open)."""
    if not plan.fits:
        raise ValueError("resolved_config() of a memory plan that does not fit")
    model = dataclasses.replace(cfg.model, recompute=plan.recompute) if cfg.model.recompute == "auto" else cfg.model
    train = dataclasses.replace(cfg.train, chunks=plan.chunks) if cfg.train.chunks == 0 else cfg.train
    emb = cfg.embeddings
    if plan.backend == "torchrec":
        changes: dict[str, Any] = {}
        if plan.sharding and len(parse_table_options(emb.sharding_types, "sharding_types", SHARDING_TYPES)) < len(
            TABLE_NAMES
        ):
            changes["sharding_types"] = format_table_options(plan.sharding)
        if plan.placement and len(parse_table_options(emb.placement, "placement", tuple(PLACEMENTS))) < len(
            TABLE_NAMES
        ):
            changes["placement"] = format_table_options(plan.placement)
        if plan.hbm_cap is not None and emb.hbm_cap_gib == 0:
            changes["hbm_cap_gib"] = plan.hbm_cap / GIB
        emb = dataclasses.replace(emb, **changes)
    return dataclasses.replace(cfg, model=model, train=train, embeddings=emb)
