"""The quality bounds of a store's holdout window, recorded in its meta.json under ``quality``:

  ceiling_auc    the best possible AUC (synthetic data: the generator's true probabilities;
                 holdout_ceiling.py), with ``ceiling`` saying what it is or why there is none
  baseline_auc   the AUC of a logistic regression on seven simple counts, fitted on the train
                 windows (baseline.py)

A preset's target AUC sits below the ceiling by a margin, to be reachable (``train`` warns when it
is not); the baseline says how much of the signal a few counts already find.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dlrmv4.config import PreprocessConfig
from dlrmv4.data.baseline import FEATURES, holdout_baseline
from dlrmv4.data.holdout_ceiling import ceiling_unavailable, holdout_ceiling
from dlrmv4.data.store import Store
from dlrmv4.data.yambda_schema import ACTION_LISTEN_PLUS


def _rounded(value: float | None) -> float | None:
    """Four decimals: a machine whose numpy rounds its logarithms otherwise still writes the same meta.json
    (the published checksums cover it)."""
    return None if value is None else round(value, 4)


def holdout_quality(
    store: Store, cfg: PreprocessConfig, events: Path | None, truth: Path | None, workers: int = 0
) -> dict[str, Any]:
    """The ``quality`` section of meta.json; ``truth`` is the generator's probability file (None: real data)."""
    holdout = np.asarray(store.window_anchors(store.num_windows - 1)) if store.num_windows else np.zeros(0, np.int64)
    labels = np.asarray(store.train.action[holdout]) == ACTION_LISTEN_PLUS
    quality: dict[str, Any] = {
        "eval_samples": len(holdout),
        "eval_positive_share": _rounded(float(labels.mean())) if len(holdout) else None,
    }
    if not len(holdout) or labels.all() or not labels.any():
        quality.update(ceiling_auc=None, ceiling="the holdout has one class only", baseline_auc=None)
        return quality
    reason: str | None
    if truth is None or events is None:
        reason = "real data: no generator's truth"
    elif not truth.exists():
        reason = f"no {truth.name} beside the events (delete the raw files to generate them again with it)"
    else:
        reason = ceiling_unavailable(cfg)
    if reason is None and events is not None and truth is not None:
        quality["ceiling_auc"] = _rounded(holdout_ceiling(store, events, truth, cfg))
        quality["ceiling"] = "the generator's true listen_plus probabilities"
    else:
        quality["ceiling_auc"], quality["ceiling"] = None, reason
    baseline = holdout_baseline(store, workers)
    quality["baseline_auc"] = _rounded(baseline.auc)
    quality["baseline"] = (
        f"logistic regression on {len(FEATURES)} counts of the anchor and the user's recent listens, fitted on "
        f"{baseline.fitted_on:,} train-window anchors"
    )
    return quality


def describe_quality(meta: dict[str, Any]) -> str:
    """One line on a store's holdout bounds, from its meta.json (stores made before they were recorded: say so)."""
    quality = meta.get("quality")
    if not quality:
        return "holdout quality bounds not recorded (a store made before they were: preprocess again to add them)"

    def shown(auc: float | None) -> str:
        return "n/a" if auc is None else f"{auc:.4f}"

    ceiling = f"ceiling AUC {shown(quality['ceiling_auc'])} ({quality['ceiling']})"
    baseline = f"baseline AUC {shown(quality['baseline_auc'])}"
    if quality.get("baseline"):
        baseline += f" ({quality['baseline']})"
    return f"holdout of {quality['eval_samples']:,} anchors: {ceiling}; {baseline}"
