"""Exact ROC AUC on host arrays (numpy): the data layer's yardstick for a holdout's quality bounds.

The trainer's own AUC (``train/metrics.py``) runs on the device; both are the Mann-Whitney U statistic
with ties counted half, and a test holds them equal.
"""

from __future__ import annotations

import numpy as np


def rank_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """AUC of ``scores`` against 0/1 ``labels``; None when one class is absent (the AUC is undefined)."""
    scores = np.asarray(scores, np.float64).ravel()
    positive = np.asarray(labels).ravel().astype(bool)
    if len(scores) != len(positive):
        raise ValueError(f"AUC got {len(scores)} scores and {len(positive)} labels")
    if not np.isfinite(scores).all():
        raise ValueError("AUC scores must be finite")
    num_pos = int(positive.sum())
    num_neg = len(positive) - num_pos
    if num_pos == 0 or num_neg == 0:
        return None
    order = np.argsort(scores, kind="stable")
    _, first, counts = np.unique(scores[order], return_index=True, return_counts=True)
    ranks = np.repeat(first + (counts + 1) / 2.0, counts)  # 1-based, ties share their mean rank
    rank_sum = ranks[positive[order]].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))
