"""TensorBoard scalars of real training runs on the CPU (a small store, plain embeddings), read back
with TensorBoard's own reader: they agree with report.json; a run stopped past its newest
checkpoint and resumed continues the same curves with each step once and the uninterrupted run's
values; --restart starts them over and --tensorboard false writes none; without the tensorboard
package a run says so once and trains; two ranks write one file with the global batch's loss."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multi_process import OVERRIDES, launch_env, make_data, run_flags, train_report

from dlrmv4.cli import main as cli_main
from dlrmv4.config_loading import load_config
from dlrmv4.train.run import run_training
from dlrmv4.train.tensorboard_scalars import EVENT_FILES, TENSORBOARD_DIR

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

pytestmark = pytest.mark.slow  # whole training runs

# The first window of this store ends at step 32; evals come at steps 19 and 38.
STEPS = 40
CHECKPOINT_EVERY = 20
PAUSE = 38  # a stopped run's last step; without its checkpoint the resume is from step 20
TIMED = ("train/samples_per_s", "eval/seconds", "checkpoint/wait_seconds")  # clock readings: not repeatable


def _values(data_path: Path, run_dir: Path, **extra) -> dict:
    return {
        **OVERRIDES,
        "embeddings.embedding_backend": "plain",
        "train.checkpoint_every_steps": CHECKPOINT_EVERY,
        "dataset.data_path": str(data_path),
        "train.run_dir": str(run_dir),
        **extra,
    }


def _train(data_path: Path, run_dir: Path, **extra) -> list[str]:
    """One run in this process, with torch's deterministic algorithms (runs are compared bit for bit);
    returns its log lines."""
    lines: list[str] = []
    values = _values(data_path, run_dir, **extra)
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        run_training(cfg, log=lines.append)
    finally:
        torch.use_deterministic_algorithms(before)
    return lines


def _curves(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve as TensorBoard reads the run's folder: tag -> [(step, value)]."""
    reader = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def _steps(curve: list[tuple[int, float]]) -> list[int]:
    return [step for step, _ in curve]


def _points(curve: list[tuple[int, float]]) -> list[float]:
    return [value for _, value in curve]


def _event_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / TENSORBOARD_DIR).glob(EVENT_FILES))


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("tensorboard"))


@pytest.fixture(scope="module")
def uninterrupted(data_path, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    _train(data_path, run_dir, **{"train.max_steps": STEPS})
    return run_dir


def test_the_scalars_agree_with_the_report(uninterrupted):
    report = json.loads((uninterrupted / "report.json").read_text())
    history, train = report["history"], report["config"]["train"]
    batch = report["config"]["loader"]["batch_size"]
    curves = _curves(uninterrupted)
    assert "train/gpu_memory_gib" not in curves  # a CPU run
    assert len(_event_files(uninterrupted)) == 1

    steps = list(range(1, history["steps"] + 1))
    for tag in ("train/loss", "train/learning_rate_dense", "train/learning_rate_sparse"):
        assert _steps(curves[tag]) == steps, tag
    peak, warmup = train["learning_rate"], train["warmup_steps"]
    ramp = [peak * min(step - 1, warmup) / warmup for step in steps]  # step N trains at step index N - 1's rate
    assert _points(curves["train/learning_rate_dense"]) == pytest.approx(ramp)
    assert _points(curves["train/learning_rate_sparse"]) == pytest.approx(ramp)  # one rate for both here

    evals = history["evals"]
    assert len(evals) == 2
    for tag, key in (("eval/auc", "auc"), ("eval/seconds", "eval_seconds"), ("eval/samples_count", "samples_count")):
        assert _steps(curves[tag]) == [e["step"] for e in evals], tag
        assert _points(curves[tag]) == pytest.approx([e[key] for e in evals], rel=1e-6), tag  # float32 in the file

    ends = [samples // batch for _, samples, _ in history["window_losses"]]
    assert ends == [32]
    assert _steps(curves["train/window_mean_loss"]) == ends == _steps(curves["train/samples_per_s"])
    window_means = [loss for *_, loss in history["window_losses"]]
    assert _points(curves["train/window_mean_loss"]) == pytest.approx(window_means, rel=1e-6)
    assert _points(curves["train/samples_per_s"]) == pytest.approx([r for _, r in history["throughput"]], rel=1e-6)
    losses = _points(curves["train/loss"])
    for start, end, mean in zip([0, *ends], ends, window_means):  # each window's steps average to its mean
        assert sum(losses[start:end]) / (end - start) == pytest.approx(mean, rel=1e-5)

    waits = curves["checkpoint/wait_seconds"]
    assert _steps(waits) == [CHECKPOINT_EVERY, STEPS]
    # The report counts the waits of the timed run: the last checkpoint (after RUN_STOP) is left out.
    assert sum(_points(waits)[:-1]) == pytest.approx(history["checkpoint_seconds"], rel=1e-5)


def test_a_resumed_run_continues_the_same_curves(data_path, tmp_path, uninterrupted):
    """A run stopped at step 38 whose checkpoint there is lost and whose event file ends in a record
    cut short (what a kill during step 38's checkpoint leaves) resumes from step 20: its points past
    20 (an eval, a window's end, a checkpoint's wait) are gone from the files and made again, and the
    curves hold each step once, with the uninterrupted run's values."""
    run_dir = tmp_path / "run"
    _train(data_path, run_dir, **{"train.max_steps": PAUSE})
    shutil.rmtree(run_dir / "checkpoints" / f"step-{PAUSE:08d}")
    [events] = _event_files(run_dir)
    with open(events, "ab") as f:
        f.write(struct.pack("<Q", 64) + bytes(10))  # a record's header and the start of its data
    before = _curves(run_dir)
    assert _steps(before["train/loss"])[-1] == PAUSE
    assert 38 in _steps(before["eval/auc"]) and 32 in _steps(before["train/window_mean_loss"])
    assert _steps(before["checkpoint/wait_seconds"]) == [CHECKPOINT_EVERY, PAUSE]

    lines = _train(data_path, run_dir, **{"train.max_steps": STEPS})
    assert any(line.startswith(f"resumed from step-{CHECKPOINT_EVERY:08d}") for line in lines), lines
    assert len(_event_files(run_dir)) == 1 and not events.exists()  # the points up to step 20 moved to the new file
    got, want = _curves(run_dir), _curves(uninterrupted)
    assert sorted(got) == sorted(want)
    for tag in want:
        assert _steps(got[tag]) == _steps(want[tag]), tag  # increasing steps, each once
        if tag not in TIMED:
            assert _points(got[tag]) == _points(want[tag]), tag


def test_restart_starts_the_curves_over_and_the_flag_turns_them_off(data_path, tmp_path):
    run_dir = tmp_path / "run"
    flags = run_flags(data_path, run_dir, **{"embeddings.embedding_backend": "plain", "train.max_steps": 3})
    assert cli_main(["train", *flags]) == 0
    assert _steps(_curves(run_dir)["train/loss"]) == [1, 2, 3]
    short = [f for f in flags if not f.startswith("--max-steps=")] + ["--max-steps=2"]
    assert cli_main(["train", *short, "--restart"]) == 0
    assert _steps(_curves(run_dir)["train/loss"]) == [1, 2] and len(_event_files(run_dir)) == 1
    assert cli_main(["train", *short, "--restart", "--tensorboard", "false"]) == 0
    assert json.loads((run_dir / "report.json").read_text())["history"]["steps"] == 2
    assert not (run_dir / TENSORBOARD_DIR).exists()


# A run in a fresh interpreter in which the tensorboard package cannot be imported.
WITHOUT_TENSORBOARD = """
import json, sys
sys.modules["tensorboard"] = None  # what an environment without the package gives: ImportError
from dlrmv4.config_loading import load_config
from dlrmv4.train.run import run_training
values = {tuple(key.split(".")): value for key, value in json.loads(sys.argv[1]).items()}
run_training(load_config(None, None, values), log=lambda m: print(m, flush=True))
"""


def test_without_the_package_a_run_says_so_once_and_trains(data_path, tmp_path):
    run_dir = tmp_path / "run"
    values = _values(data_path, run_dir, **{"train.max_steps": 2})
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_TENSORBOARD, json.dumps(values)],
        capture_output=True,
        text=True,
        timeout=300,
        env=launch_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "tensorboard" in line.lower()]
    assert said == [
        "tensorboard is not installed: this run writes no TensorBoard scalars "
        "(pip install tensorboard, or --tensorboard false to turn them off)"
    ]
    assert json.loads((run_dir / "report.json").read_text())["history"]["steps"] == 2
    assert not (run_dir / TENSORBOARD_DIR).exists()


def test_two_ranks_write_one_file_with_the_global_batch_loss(data_path, tmp_path):
    """Rank 0 writes; each step's loss is the mean over the ranks' halves of the global batch, so the
    first window's steps average to the report's window loss (the mean over the ranks)."""
    run_dir = tmp_path / "run"
    report = train_report(2, data_path, run_dir, **{"embeddings.embedding_backend": "plain", "train.max_steps": 32})
    assert len(_event_files(run_dir)) == 1
    curves = _curves(run_dir)
    losses = _points(curves["train/loss"])
    [(window, samples, mean)] = report["history"]["window_losses"]
    assert (window, samples, len(losses)) == (0, 32 * 16, 32)
    assert sum(losses) / len(losses) == pytest.approx(mean, rel=1e-5)
    assert _points(curves["eval/auc"]) == pytest.approx([e["auc"] for e in report["history"]["evals"]], rel=1e-6)
