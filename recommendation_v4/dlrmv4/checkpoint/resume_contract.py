"""The resume contract: a checkpoint records the settings that shape the run, and a resume with
different ones stops with one line naming them (unless ``train.allow_changed_settings``).

Settings that may change between a run and its resume: where things live (data path, run
directory, log file), how the work is laid out or scheduled without changing what is computed
(workers, the rank shares, chunks, recompute, kernels, table sharding and placement, the memory
plan's inputs, the distributed backend and timeouts), when it pauses, checkpoints or profiles,
and this switch itself. Everything else (the seed, the data and samples, the model, the tables'
sizes and the all-to-all precision, the optimizers and the schedule, the MLPerf labels) is part
of the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrmv4.config import BenchmarkConfig

RESUMABLE_SECTIONS = ("distributed", "plan")
RESUMABLE_FIELDS = frozenset(
    {
        "dataset.data_path",
        "preprocess.workers",
        "loader.num_workers",
        "loader.prefetch_batches",
        "loader.rank_slicing",
        "model.recompute",
        "model.kernels",
        "embeddings.sharding_types",
        "embeddings.placement",
        "embeddings.hbm_cap_gib",
        "train.chunks",
        "train.sparse_pipeline",
        "train.warm_up",
        "train.max_steps",
        "train.run_dir",
        "train.checkpoint_every_steps",
        "train.checkpoint_every_seconds",
        "train.checkpoint_every_window",
        "train.final_checkpoint",
        "train.keep_last_checkpoints",
        "train.checkpoint_full_every",
        "train.tensorboard",
        "train.async_checkpoints",
        "train.profile_steps",
        "train.allow_changed_settings",
        "mlperf.log_file",
    }
)


def run_settings(cfg: BenchmarkConfig) -> dict[str, Any]:
    """The settings a resume must keep, as 'section.field' -> value."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(value):
            out[f.name] = value
            continue
        if f.name in RESUMABLE_SECTIONS:
            continue
        for sf in dataclasses.fields(value):
            name = f"{f.name}.{sf.name}"
            if name not in RESUMABLE_FIELDS:
                out[name] = getattr(value, sf.name)
    return out


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'name saved -> current' for every setting that differs (one only one side records included)."""

    def shown(settings: dict[str, Any], name: str) -> str:
        return repr(settings[name]) if name in settings else "(not recorded)"

    return [
        f"{name} {shown(saved, name)} -> {shown(current, name)}"
        for name in sorted(set(saved) | set(current))
        if name not in saved or name not in current or saved[name] != current[name]
    ]
