"""``python -m dlrmv4 score``: a set of runs' logs checked and scored with mlperf-logging's own checkers
and summarizer, against the score worked out by hand from the same logs (the committed fresh set of ten
synthetic-tiny runs at GBS 256, rcp/synthetic-tiny-check/256; the set of four synthetic-medium runs on
an H200, benchmarks/results/set_medium_h200)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SET = REPO / "rcp" / "synthetic-tiny-check" / "256"
RCPS = REPO / "rcp" / "rcps_dlrmv4_synthetic-tiny.json"
GPU_SET = REPO / "recommendation_v4" / "benchmarks" / "results" / "set_medium_h200"
MLLOG = ":::MLLOG "
# The recipe the set ran at (rcp/generate_rcps.py: the preset's rates scaled to GBS 256).
RECIPE = [
    "--preset",
    "synthetic-tiny",
    "--batch-size",
    "256",
    "--learning-rate",
    "0.006",
    "--sparse-learning-rate",
    "0.006",
]


def _dlrmv4(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "recommendation_v4")}
    return subprocess.run(
        [sys.executable, "-m", "dlrmv4", *args, "--no-progress"], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.fixture(scope="module")
def data_path(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("score") / "data"
    proc = _dlrmv4("prepare", "--preset", "synthetic-tiny", "--data-path", str(data))
    assert proc.returncode == 0, proc.stderr
    return data


def _records(log: Path) -> list[dict]:
    return [json.loads(line[len(MLLOG) :]) for line in log.read_text().splitlines() if line.startswith(MLLOG)]


def _by_hand(logs: list[Path], dropped: int = 0, rcps: Path = RCPS, gbs: int = 256) -> float:
    """The olympic mean of the runs' minutes (fastest and slowest out; a dropped run is the slowest)
    times the RCP factor: the RCP's olympic mean over the set's olympic mean of samples to target."""
    minutes, samples = [], []
    for log in logs:
        times = {r["key"]: r["time_ms"] for r in _records(log) if r["key"] in ("run_start", "run_stop")}
        minutes.append((times["run_stop"] - times["run_start"]) / 60_000)
        samples.append([r for r in _records(log) if r["key"] == "eval_accuracy"][-1]["metadata"]["samples_count"])
    minutes.sort()
    olympic = np.mean(minutes[1 : len(minutes) - (1 - dropped)])
    points = sorted(json.loads(rcps.read_text())[f"dlrmv4_ref_{gbs}"]["Epochs to converge"])
    factor = max(1.0, np.mean(points[1:-1]) / np.mean(sorted(samples)[1:-1]))
    return float(olympic * factor)


def _score_line(out: str) -> float:
    line = next(line for line in out.splitlines() if line.startswith("score: "))
    return float(line.split()[1])


def test_the_committed_set_scores_as_worked_out_by_hand(data_path):
    proc = _dlrmv4("score", str(SET), "--data-path", str(data_path), *RECIPE)
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| result_")]
    assert len(rows) == 10 and all(row.endswith("| ok |") for row in rows)
    assert "seed checker passed" in proc.stdout and "RCP check (pruned RCPs): PASSED" in proc.stdout
    assert _score_line(proc.stdout) == pytest.approx(_by_hand(sorted(SET.glob("result_*.txt"))), abs=1e-3)
    assert "Not enough runs" not in proc.stdout + proc.stderr  # ten logs: an official set's count


def test_the_committed_gpu_set_scores_as_its_table_says(tmp_path):
    """Four synthetic-medium runs on an H200 at the preset's recipe (GBS 512): scaled by the RCP check
    (their olympic mean converged faster than the RCPs'), with the summarizer's warning for four runs."""
    data = tmp_path / "data"
    assert _dlrmv4("prepare", "--preset", "synthetic-medium", "--data-path", str(data)).returncode == 0
    folder = GPU_SET / "results" / "h200" / "dlrmv4"
    proc = _dlrmv4("score", str(folder), "--data-path", str(data), "--preset", "synthetic-medium")
    assert proc.returncode == 0, proc.stderr
    assert "RCP check (pruned RCPs): PASSED (RCP found); scaling factor 1.0526" in proc.stdout
    by_hand = _by_hand(
        sorted(folder.glob("result_*.txt")), rcps=REPO / "rcp" / "rcps_dlrmv4_synthetic-medium.json", gbs=512
    )
    assert _score_line(proc.stdout) == pytest.approx(by_hand, abs=1e-3)
    assert "Found: 4, required: 10" in proc.stdout
    # The table the results file quotes is the one this command prints.
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| result_")]
    quoted = (GPU_SET.parent / "set_medium_h200.md").read_text()
    assert len(printed) == 4 and all(row in quoted for row in printed)
    assert next(line for line in proc.stdout.splitlines() if line.startswith("score: ")) in quoted


def test_a_log_damaged_after_the_fact_is_dropped_by_name(data_path, tmp_path):
    logs = sorted(SET.glob("result_*.txt"))
    for log in logs:
        shutil.copy(log, tmp_path)
    damaged = tmp_path / "result_104.txt"
    damaged.write_text("".join(line + "\n" for line in damaged.read_text().splitlines() if '"run_stop"' not in line))
    proc = _dlrmv4("score", str(tmp_path), "--data-path", str(data_path), *RECIPE)
    assert proc.returncode == 0, proc.stderr
    assert "| result_104.txt | 104 | - | - | fails the compliance checker |" in proc.stdout
    kept = [tmp_path / log.name for log in logs if log.name != "result_104.txt"]
    assert _score_line(proc.stdout) == pytest.approx(_by_hand(kept, dropped=1), abs=1e-3)


def test_a_seed_logged_twice_fails_the_seed_checker(data_path, tmp_path):
    for log in sorted(SET.glob("result_*.txt")):
        shutil.copy(log, tmp_path)
    shutil.copy(SET / "result_101.txt", tmp_path / "result_111.txt")
    proc = _dlrmv4("score", str(tmp_path), "--data-path", str(data_path), *RECIPE)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith("the seed checker failed (two runs log the same seed from the same line)")
    )


def test_a_set_converging_faster_than_the_rcps_allow_fails(data_path, tmp_path):
    for log in sorted(SET.glob("result_*.txt")):
        lines = []
        for record in _records(log):
            if record["key"] == "eval_accuracy":
                record["metadata"]["samples_count"] = int(record["metadata"]["samples_count"] * 0.6)
            lines.append(MLLOG + json.dumps(record))
        (tmp_path / log.name).write_text("\n".join(lines) + "\n")
    proc = _dlrmv4("score", str(tmp_path), "--data-path", str(data_path), *RECIPE)
    assert proc.returncode == 1 and "the RCP check failed" in proc.stderr.strip().splitlines()[-1]


def test_too_few_runs_are_scored_with_the_summarizers_warning(data_path, tmp_path):
    for log in sorted(SET.glob("result_*.txt"))[:4]:
        shutil.copy(log, tmp_path)
    proc = _dlrmv4("score", str(tmp_path), "--data-path", str(data_path), *RECIPE)
    assert "WARNING: Not enough runs found for an official submission. Found: 4, required: 10" in proc.stdout
    assert "score: " in proc.stdout


def test_a_folder_without_logs_is_one_line(data_path, tmp_path):
    proc = _dlrmv4("score", str(tmp_path), "--data-path", str(data_path), *RECIPE)
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"[dlrmv4] error: no result_*.txt in {tmp_path}: a set's MLPerf logs are named result_<i>.txt"
    )
