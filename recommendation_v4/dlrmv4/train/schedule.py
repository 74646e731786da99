"""When to evaluate: the reference's eval grid (docs/training.md), generalised to any dataset and batch size.

The MLPerf checker (``closed_dlrmv4.yaml`` of training 6.1.0) requires every eval's
``samples_count`` to be a multiple of ``eval_interval`` and the first one to equal
``first_eval_samples``; both are computed here with the checker's own formulas.

Generalisation to datasets other than Yambda-5B. The reference skips early evals up to
``floor((4480·GBS + 135,331,840) / 3)`` samples, a linear fit through the reference sweep's
earliest convergence (about 2.5 % of the 2,290,835,423-sample epoch at GBS 8192). For another
dataset the whole threshold is scaled by ``train_samples / 2,290,835,423``, so that at a given
GBS the same fraction of an epoch is skipped. Scaling only the constant term would not do that:
the ``4480·GBS`` term alone is ~1,493 steps, more than a whole epoch of a small synthetic set.
The threshold is computed in integers, so at the reference epoch it is bit-for-bit the
checker's value, and the first eval is at least one interval in (never at sample 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from dlrmv4.reference_counts import REFERENCE_TRAIN_SAMPLES

# floor((FIRST_EVAL_PER_GBS * GBS + FIRST_EVAL_CONSTANT) / FIRST_EVAL_DIVISOR): the reference fit.
FIRST_EVAL_PER_GBS = 4480
FIRST_EVAL_CONSTANT = 135_331_840
FIRST_EVAL_DIVISOR = 3


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def eval_interval(train_samples: int, global_batch_size: int, eval_every_data_pct: float = 0.001) -> int:
    """Samples between evals: ``max(1, ceil(pct · train_samples / GBS)) · GBS``.

    The float expression is the checker's (and the reference's ``data_pct_to_global_steps``),
    kept as is so that rounding agrees with it exactly.
    """
    _check_positive("train_samples", train_samples)
    _check_positive("global_batch_size", global_batch_size)
    if not 0.0 < eval_every_data_pct <= 1.0:
        raise ValueError(f"eval_every_data_pct must be in (0, 1], got {eval_every_data_pct}")
    return max(1, int(math.ceil(eval_every_data_pct * train_samples / global_batch_size))) * global_batch_size


def skip_threshold(global_batch_size: int, train_samples: int = REFERENCE_TRAIN_SAMPLES) -> int:
    """Samples before which no eval is run (before snapping to the eval grid); see the module doc."""
    _check_positive("train_samples", train_samples)
    _check_positive("global_batch_size", global_batch_size)
    numerator = (FIRST_EVAL_PER_GBS * global_batch_size + FIRST_EVAL_CONSTANT) * train_samples
    return numerator // (FIRST_EVAL_DIVISOR * REFERENCE_TRAIN_SAMPLES)


def first_eval_samples(global_batch_size: int, interval: int, train_samples: int = REFERENCE_TRAIN_SAMPLES) -> int:
    """The first grid point at or after the skip threshold (at least one interval)."""
    _check_positive("eval interval", interval)
    threshold = skip_threshold(global_batch_size, train_samples)
    return max(1, -(-threshold // interval)) * interval


@dataclass(frozen=True)
class EvalSchedule:
    """The eval grid of one run. ``samples_seen`` counts every sample trained on, all ranks."""

    train_samples: int
    global_batch_size: int
    eval_every_data_pct: float = 0.001

    @property
    def interval(self) -> int:
        return eval_interval(self.train_samples, self.global_batch_size, self.eval_every_data_pct)

    @property
    def first(self) -> int:
        return first_eval_samples(self.global_batch_size, self.interval, self.train_samples)

    @property
    def every_step(self) -> bool:
        """Whether ``eval_every_data_pct`` of the train samples is less than one global batch: the
        interval is then its floor, one global batch, and an eval follows every step from the first."""
        return self.eval_every_data_pct * self.train_samples < self.global_batch_size

    def should_eval(self, samples_seen: int) -> bool:
        """True on grid points from the first eval on.

        The loop advances ``samples_seen`` by whole global batches and the interval is a
        multiple of GBS, so every grid point is hit exactly; nothing is crossed between steps.
        """
        return samples_seen >= self.first and samples_seen % self.interval == 0

    def points(self, max_samples: int | None = None) -> Iterator[int]:
        """Eval sample counts up to ``max_samples`` (default: one epoch), in order."""
        limit = self.train_samples if max_samples is None else max_samples
        return iter(range(self.first, limit + 1, self.interval))
