"""Each preset's recipe against its data: the warnings of a warm-up longer than the data or a target above
the holdout's ceiling, and every synthetic preset's own recipe passing them."""

from __future__ import annotations

import pytest

from dlrmv4.config_loading import load_config
from dlrmv4.train.trainable import recipe_warnings

# Train samples and holdout ceilings of the synthetic stores (python -m dlrmv4 prepare --preset <name>;
# docs/data.md tabulates them). synthetic-5b's have not been measured (its store needs a larger machine).
STORES = {
    "synthetic-tiny": (135_239, 0.8017),
    "synthetic-small": (702_485, 0.8072),
    "synthetic-medium": (2_087_774, 0.8108),
    "synthetic-50m": (20_165_522, 0.8026),
}


def _meta(ceiling: float | None) -> dict:
    return {"quality": {"ceiling_auc": ceiling, "ceiling": "the generator's true listen_plus probabilities"}}


def test_a_warm_up_longer_than_the_data_is_one_line():
    """The Yambda-5B recipe on synthetic-medium's data: 24,000 steps at GBS 512 are 5.9 passes."""
    cfg = load_config("synthetic-medium", None, {("train", "warmup_steps"): 24_000})
    (line,) = recipe_warnings(cfg, _meta(0.81), 2_087_774)
    assert "\n" not in line and line.startswith("warning: the warm-up (24,000 steps = 12,288,000 samples")
    assert "one pass over the train windows (2,087,774 samples)" in line


def test_a_target_above_the_ceiling_is_one_line():
    cfg = load_config("synthetic-medium", None, {("train", "target_auc"): 0.85})
    (line,) = recipe_warnings(cfg, _meta(0.8108), 2_087_774)
    assert "\n" not in line and "target AUC 0.85 is above the holdout's best possible AUC 0.8108" in line
    assert recipe_warnings(cfg, _meta(None), 2_087_774) == []  # real data: no ceiling, no warning
    assert recipe_warnings(cfg, {}, 2_087_774) == []  # a store made before the ceiling was recorded


@pytest.mark.parametrize("preset", [*STORES, "synthetic-1b", "synthetic-5b"])
def test_every_synthetic_preset_has_its_own_recipe(preset):
    """Not the Yambda-5B recipe (LR 1e-6, 24,000 warm-up steps): a warm-up inside the data, a target
    below the ceiling, an eval cadence of its own."""
    cfg = load_config(preset)
    yambda = load_config("yambda-5b").train
    tr = cfg.train
    assert (tr.learning_rate, tr.warmup_steps) != (yambda.learning_rate, yambda.warmup_steps)
    if preset in STORES:
        train_samples, ceiling = STORES[preset]
        assert recipe_warnings(cfg, _meta(ceiling), train_samples) == []
        assert tr.target_auc <= ceiling - 0.1  # the stated margin (docs/training.md)
