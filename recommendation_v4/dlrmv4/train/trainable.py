"""What a run's settings can do on its store, checked before anything is allocated.

Refused, each in one line (``check_trainable``): no train samples, a global batch larger than every
train window (each window's last partial batch is dropped, so no step would run), or an eval schedule
whose first eval comes after the last sample the run can train on (no eval could reach the target;
``--max-steps`` is the user's own limit and is left out).

Warned, each in one line (``recipe_warnings``): a warm-up longer than the data, a target above the
holdout's best possible AUC (the store's recorded ceiling, ``data/holdout_quality.py``), or an eval
interval below one global batch (an eval after every step, as tests may want). The run goes on (a
submitter may mean it), but nobody waits an hour to learn it."""

from __future__ import annotations

from typing import Any

import numpy as np

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.store import Store
from dlrmv4.data.windows import split_windows
from dlrmv4.errors import UserError
from dlrmv4.train.schedule import EvalSchedule


def trainable_samples(window_samples: np.ndarray, global_batch: int) -> int:
    """Samples the run steps over: every train window's whole global batches."""
    return int((window_samples // global_batch).sum()) * global_batch


def check_trainable(cfg: BenchmarkConfig, store: Store) -> None:
    windows, _ = split_windows(store)
    per_window = np.diff(np.asarray(store.window_offsets))[windows]
    train_samples, gbs = int(per_window.sum()), cfg.loader.batch_size
    if train_samples == 0:
        raise UserError(
            f"the store at {store.path} has no anchors in its {len(windows)} train window(s): nothing to train on "
            "(use more data, more --num-train-days or a smaller --min-history)"
        )
    steps_over = trainable_samples(per_window, gbs)
    if steps_over == 0:
        raise UserError(
            f"the global batch ({gbs:,} samples) is larger than every train window (the largest holds "
            f"{int(per_window.max()):,}): no step would run, since a window's last partial batch is dropped; "
            "lower --batch-size"
        )
    if cfg.train.eval_mode != "holdout":
        return
    first = EvalSchedule(train_samples, gbs, cfg.train.eval_every_data_pct).first
    if first > steps_over:
        raise UserError(
            f"the first eval comes at {first:,} samples but the run trains on at most {steps_over:,} (global batch "
            f"{gbs:,}): no eval could reach the target; lower --eval-every-data-pct or --batch-size"
        )


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
    schedule = EvalSchedule(train_samples, gbs, tr.eval_every_data_pct)
    if tr.eval_mode == "holdout" and schedule.every_step:
        warnings.append(
            f"warning: eval every step: --eval-every-data-pct {tr.eval_every_data_pct:g} gives an interval of "
            f"{tr.eval_every_data_pct * train_samples:.3g} samples, below one global batch of {gbs:,} samples "
            f"(evals from sample {schedule.first:,} on)"
        )
    return warnings
