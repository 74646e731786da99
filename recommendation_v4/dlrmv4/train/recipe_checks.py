"""Warnings about a recipe that cannot work on its store: a warm-up longer than the data, or a target
above the holdout's best possible AUC (the store's recorded ceiling, ``data/holdout_quality.py``).
Each is one line; the run goes on (a submitter may mean it), but nobody waits an hour to learn it."""

from __future__ import annotations

from typing import Any

from dlrmv4.config import BenchmarkConfig


def recipe_warnings(cfg: BenchmarkConfig, meta: dict[str, Any], train_samples: int) -> list[str]:
    tr, gbs = cfg.train, cfg.loader.batch_size
    warnings = []
    warmup_samples = tr.warmup_steps * gbs
    if warmup_samples > train_samples:
        warnings.append(
            f"warning: the warm-up ({tr.warmup_steps:,} steps = {warmup_samples:,} samples at global batch {gbs:,}) is "
            f"longer than one pass over the train windows ({train_samples:,} samples): the learning rate never "
            f"reaches its peak {tr.learning_rate:g} (set --warmup-steps, or use the preset's own recipe)"
        )
    ceiling = (meta.get("quality") or {}).get("ceiling_auc")
    if ceiling is not None and tr.target_auc > ceiling:
        warnings.append(
            f"warning: the target AUC {tr.target_auc:g} is above the holdout's best possible AUC {ceiling:.4f} "
            f"(the store's ceiling: {meta['quality']['ceiling']}): no run can reach it (set --target-auc)"
        )
    return warnings
