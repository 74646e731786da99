"""The kernels' warm-up before RUN_START: its synthetic batches cover every length bucket and both token
alignments, and a run with it is the same run, bit for bit, as one without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_train import OVERRIDES, data_path  # noqa: F401 - the store every run here trains on

from dlrmv4.config_loading import load_config
from dlrmv4.train.warm_up import WarmUpBatch, history_lengths, length_buckets, warm_up_batches


def test_the_buckets_reach_the_longest_sequence():
    assert length_buckets(4096) == [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert length_buckets(2057) == [16, 32, 64, 128, 256, 512, 1024, 2048, 2057]
    assert length_buckets(10) == [10]


def test_each_bucket_gets_aligned_and_unaligned_steps_and_full_short_and_single_evals():
    shapes = warm_up_batches(48, 16)
    assert len(shapes) == 7 * 3
    for longest in (16, 32, 48):
        mine = [s for s in shapes if s.longest == longest]
        assert {(s.samples, s.aligned, s.training) for s in mine} == {
            (16, True, True),
            (16, False, True),
            (16, True, False),
            (16, False, False),
            (3, True, False),
            (3, False, False),
            (1, False, False),
        }


@pytest.mark.parametrize("samples", [1, 2, 5, 1024])
@pytest.mark.parametrize("longest", [16, 40, 4096])
def test_history_lengths_meet_the_shape(samples, longest):
    rng = np.random.default_rng(samples * longest)
    for aligned in (True, False):
        hist = history_lengths(WarmUpBatch(samples, longest, aligned, True), 9, rng)
        assert len(hist) == samples and hist[0] == longest - 9 and hist.min() >= 1 and hist.max() <= longest - 9
        low, high = longest - 9 + samples - 1, (longest - 9) * samples  # the totals the slice can have
        if samples > 1 and high // 16 * 16 >= low:  # some total of the slice is a multiple of 16
            assert (hist.sum() % 16 == 0) == aligned, (hist.sum(), aligned)


def _run(data_path: Path, run_dir: Path, warm_up: str, extra: dict) -> tuple[dict, list[tuple], list[str]]:
    from dlrmv4.train.run import run_training

    overrides = {
        **OVERRIDES,
        ("dataset", "data_path"): str(data_path),
        ("train", "run_dir"): str(run_dir),
        ("train", "max_steps"): 12,
        ("train", "warm_up"): warm_up,
        **extra,
    }
    lines: list[str] = []
    _, report = run_training(load_config(None, None, overrides), log=lines.append)
    events = []
    for line in (run_dir / "mlperf_log.txt").read_text().splitlines():
        record = json.loads(line[len(":::MLLOG ") :])
        events.append((record["key"], record["value"], record["metadata"].get("samples_count")))
    return json.loads(report.read_text()), events, lines


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {("train", "chunks"): 3},
        {("embeddings", "embedding_backend"): "torchrec", ("train", "chunks"): 2},
    ],
    ids=["plain", "plain-3-chunks", "torchrec-2-chunks"],
)
def test_a_run_with_the_warm_up_is_the_run_without_it(data_path, tmp_path, extra):
    """The same parameters (dense and every table's rows and Adagrad state) and the same MLPerf events
    apart from their times: the warm-up's batches, gradients and random draws leave no trace."""
    cold, cold_events, cold_lines = _run(data_path, tmp_path / "cold", "false", extra)
    warm, warm_events, warm_lines = _run(data_path, tmp_path / "warm", "true", extra)
    assert warm["parameters_sha256"] == cold["parameters_sha256"] is not None
    assert warm_events == cold_events
    assert [e["auc"] for e in warm["history"]["evals"]] == [e["auc"] for e in cold["history"]["evals"]]
    (said,) = [line for line in warm_lines if line.startswith("kernels compiled and tuned before RUN_START")]
    assert said.startswith("kernels compiled and tuned before RUN_START: 21 warm-up passes over 3 sequence-length")
    assert not any(line.startswith("kernels compiled and tuned") for line in cold_lines)
    # The PyTorch reference ops compile nothing: no count of Triton kernels either.
    assert not any(line.startswith("Triton kernels after RUN_START") for line in warm_lines + cold_lines)


def test_gluon_attention_on_the_reference_ops_is_one_line_before_run_start(data_path, tmp_path):
    """``--attention-kernels gluon`` where the run takes the PyTorch reference ops (this CPU): refused
    in one line before the timed run starts (the kernels are picked at the warm-up's place)."""
    from dlrmv4.errors import UserError

    with pytest.raises(
        UserError, match="^--attention-kernels gluon needs the Triton ops on a GPU; this run takes the pytorch ops$"
    ):
        _run(data_path, tmp_path / "run", "auto", {("model", "attention_kernels"): "gluon"})
    log = tmp_path / "run" / "mlperf_log.txt"
    assert not log.exists() or "run_start" not in log.read_text()
