"""Eval grid: the reference numbers, the MLPerf checker's own formulas, the small-data rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from dlrmv4.config_loading import load_config
from dlrmv4.reference_counts import REFERENCE_TRAIN_SAMPLES
from dlrmv4.train.schedule import (
    EvalSchedule,
    eval_interval,
    first_eval_samples,
    skip_threshold,
)
from dlrmv4.train.trainable import recipe_warnings

# GBS -> (eval interval, first eval, first eval in blocks); blocks 25/31/41 are quoted in the checker.
REFERENCE = {
    8_192: (2_293_760, 57_344_000, 25),
    16_384: (2_293_760, 71_106_560, 31),
    32_768: (2_293_760, 94_044_160, 41),
}


def _checker_state(global_batch_size: int) -> dict:
    """Run the BEGIN code and the global_batch_size POST of closed_dlrmv4.yaml (training 6.1.0).

    That POST sets s['eval_interval_samples'] = max(1, ceil(0.001·train_samples/GBS))·GBS and
    s['first_eval_samples'] = ceil(floor((4480·GBS + 135331840)/3) / interval)·interval; the
    eval_accuracy rule then checks samples_count % interval == 0 and the first == first_eval_samples.
    """
    checker = pytest.importorskip("mlperf_logging.compliance_checker")
    rules = yaml.safe_load((Path(checker.__file__).parent / "training_6.1.0" / "closed_dlrmv4.yaml").read_text())
    begin = next(r["BEGIN"]["CODE"] for r in rules if "BEGIN" in r)
    post = next(r["KEY"]["POST"] for r in rules if r.get("KEY", {}).get("NAME") == "global_batch_size")
    scope = {"s": {}, "math": math}
    exec(begin, scope)  # noqa: S102 - the checker's own rule code, shipped in the package
    scope["v"] = {"value": global_batch_size}
    exec(post, scope)  # noqa: S102
    return scope["s"]


@pytest.mark.parametrize("gbs", sorted(REFERENCE))
def test_reference_numbers(gbs):
    interval, first, blocks = REFERENCE[gbs]
    assert eval_interval(REFERENCE_TRAIN_SAMPLES, gbs) == interval
    assert first_eval_samples(gbs, interval) == first
    assert first == blocks * interval
    schedule = EvalSchedule(REFERENCE_TRAIN_SAMPLES, gbs)
    assert (schedule.interval, schedule.first) == (interval, first)


@pytest.mark.parametrize("gbs", [1, 1_000, 4_096, 8_192, 12_288, 16_384, 32_768, 65_536, 1_000_003])
def test_matches_the_shipped_compliance_rule(gbs):
    state = _checker_state(gbs)
    assert state["train_samples"] == REFERENCE_TRAIN_SAMPLES
    schedule = EvalSchedule(REFERENCE_TRAIN_SAMPLES, gbs)
    assert schedule.interval == state["eval_interval_samples"]
    assert schedule.first == state["first_eval_samples"]
    first, second = list(schedule.points())[:2]
    assert first == state["first_eval_samples"]
    assert second % state["eval_interval_samples"] == 0


def test_should_eval_and_points_agree():
    schedule = EvalSchedule(train_samples=100_000, global_batch_size=256)
    seen = [n for n in range(0, 100_001, 256) if schedule.should_eval(n)]
    assert seen == list(schedule.points())
    assert seen[0] == schedule.first and all(b - a == schedule.interval for a, b in zip(seen, seen[1:]))
    assert list(schedule.points(max_samples=3 * 100_000))[-1] <= 300_000


def test_small_dataset_skips_the_same_fraction_of_an_epoch():
    gbs = 8_192
    reference_fraction = skip_threshold(gbs) / REFERENCE_TRAIN_SAMPLES
    for train_samples in (50_000_000, 500_000_000, 10_000_000_000):
        assert skip_threshold(gbs, train_samples) / train_samples == pytest.approx(reference_fraction, rel=1e-6)
    # A tiny synthetic set: the first eval lands early in the epoch, on the grid, never at 0.
    schedule = EvalSchedule(train_samples=20_000, global_batch_size=64)
    assert 0 < schedule.first < 20_000 * 0.05 and schedule.first % schedule.interval == 0
    assert EvalSchedule(train_samples=10, global_batch_size=64).first == 64


def test_interval_is_a_whole_number_of_batches():
    assert eval_interval(1_000, 64) == 64  # max(1, ...) keeps at least one batch
    assert eval_interval(10_000_000, 1_000, eval_every_data_pct=0.01) == 100_000


@pytest.mark.parametrize("args", [(0, 8), (100, 0), (100, 8, 0.0), (100, 8, 1.5)])
def test_bad_arguments(args):
    with pytest.raises(ValueError):
        eval_interval(*args)


@pytest.mark.parametrize("mode", ["holdout", "next_window"])
def test_an_interval_below_one_global_batch_is_said_in_one_line(mode):
    """--eval-every-data-pct 1e-9 is a legitimate setting (tests use it), so it is not refused: the
    interval takes its floor of one global batch, an eval after every step, and the run's start says
    so once (holdout evals only: next_window evals come at window ends whatever the setting)."""
    train_samples = 135_239
    overrides = {("train", "eval_every_data_pct"): 1e-9, ("train", "eval_mode"): mode}
    cfg = load_config("synthetic-tiny", None, overrides)
    schedule = EvalSchedule(train_samples, 128, 1e-9)
    assert schedule.every_step and schedule.interval == 128
    said = [w for w in recipe_warnings(cfg, {}, train_samples) if "every step" in w]
    if mode == "next_window":
        assert said == []
        return
    assert said == [
        "warning: eval every step: --eval-every-data-pct 1e-09 gives an interval of 0.000135 samples, "
        f"below one global batch of 128 samples (evals from sample {schedule.first:,} on)"
    ]
    # One global batch exactly, or more: the interval the setting asks for, nothing said.
    for pct in (128 / train_samples, 0.125):
        cfg = load_config("synthetic-tiny", None, {("train", "eval_every_data_pct"): pct})
        assert not EvalSchedule(train_samples, 128, pct).every_step
        assert recipe_warnings(cfg, {}, train_samples) == []
