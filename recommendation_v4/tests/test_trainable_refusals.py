"""Runs that cannot train stop before anything is allocated, in one line (the CLI, on the embedded
default's store)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dlrmv4.config_loading import load_config
from dlrmv4.data import synthetic
from dlrmv4.data.preprocess import preprocess
from dlrmv4.train.trainable import trainable_samples


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    cfg = load_config("synthetic-tiny")
    root = tmp_path_factory.mktemp("tiny")
    raw = synthetic.generate(root / "raw", "tiny", cfg.dataset.synthetic_seed, progress=False)
    preprocess(raw, root / "data" / "processed" / "synthetic-tiny", cfg.dataset, cfg.preprocess, progress=False)
    return root / "data"


def _train(data_path, tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dlrmv4", "train", "--data-path", str(data_path), "--run-dir", str(tmp_path / "run"),
         "--no-progress", "--max-steps", "1", *flags],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--batch-size", "200000"],
            "the global batch (200,000 samples) is larger than every train window (the largest holds 18,053): no "
            "step would run",
        ),
        (["--eval-every-data-pct", "1.0"], "the first eval comes at 135,296 samples but the run trains on at most"),
    ],
)
def test_a_run_that_cannot_train_is_refused_in_one_line(data_path, tmp_path, flags, line):
    """The issue's case (a global batch larger than every window trained nothing and exited 0) and a
    first eval past the data: exit 1, one line, no run directory written."""
    proc = _train(data_path, tmp_path, *flags)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and line in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_steps_a_run_takes_drop_each_windows_last_partial_batch():
    assert trainable_samples(np.array([100, 250, 70]), 100) == 300
    assert trainable_samples(np.array([99, 99]), 100) == 0
