"""The README's first command: ``./run_and_time.sh`` with the embedded default, from nothing, on
this machine's CPU: generate, preprocess, verify against the published sums, train to the target,
pass the official compliance checker and print the RESULT line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from dlrmv4.config_loading import load_config

pytestmark = pytest.mark.slow  # the whole main job from nothing

REPO = Path(__file__).resolve().parents[2]


def test_run_and_time_reaches_the_target_from_nothing(tmp_path):
    # DLRMV4_NO_VENV: this interpreter already has the packages; DATA_PATH is a submission knob.
    env = {**os.environ, "DLRMV4_NO_VENV": "1", "DATA_PATH": str(tmp_path / "data")}
    proc = subprocess.run(
        [str(REPO / "run_and_time.sh"), "--run-dir", str(tmp_path / "run"), "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "generating synthetic Yambda-schema data (tiny" in out
    assert "match the published sums for synthetic-tiny" in out
    target = load_config("synthetic-tiny").train.target_auc
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    history = report["history"]
    assert history["status"] == "success"
    assert history["evals"][-1]["auc"] >= target > 0.6
    assert all(e["auc"] < target for e in history["evals"][:-1])  # it stops at the first eval that reaches it
    assert re.search(r"run success: .* best AUC 0\.\d{4} \(target " + re.escape(str(target)), out)
    assert re.search(r"\[dlrmv4\] run finished in \d+ s", out)
    assert (tmp_path / "run" / "auc_vs_samples.png").exists()
    assert report["rcp_band"]["source"] == "rcps_dlrmv4_synthetic-tiny.json"  # drawn against its references
    # The official checker, with the project rules for this dataset, passes the run's log.
    assert re.search(r"mlperf_log\.txt PASSED the MLPerf compliance checker \(training 6\.1\.0, the project rules", out)
    result = re.search(r"^RESULT,dlrmv4,0,(\d+),[^,]+,\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [AP]M$", out, re.M)
    assert result and 0 < int(result[1]) <= history["seconds"] + 60


@pytest.mark.parametrize("knob, value", [("GPUS_PER_NODE", "two"), ("NNODES", "0")])
def test_run_and_time_refuses_a_bad_process_count(tmp_path, knob, value):
    env = {**os.environ, "DLRMV4_NO_VENV": "1", knob: value}
    proc = subprocess.run([str(REPO / "run_and_time.sh")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"[dlrmv4] error: GPUS_PER_NODE and NNODES must be positive integers, got '{value}'"
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize(
    "sig, status, line",
    [(signal.SIGTERM, 143, "[dlrmv4] terminated (SIGTERM)"), (signal.SIGINT, 130, "[dlrmv4] interrupted")],
)
def test_a_signal_to_run_and_time_stops_its_training_step(tmp_path, sig, status, line):
    """SIGTERM (a batch scheduler's time limit) or SIGINT to the script reaches the training child,
    which ends with its own line; the script ends with its status, and no child is left training."""
    env = {**os.environ, "DLRMV4_NO_VENV": "1", "DATA_PATH": str(tmp_path / "data")}
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(
            [str(REPO / "run_and_time.sh"), "--run-dir", str(run_dir), "--no-progress"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        for out in proc.stdout:
            if "memory plan:" in out:  # the train step has started
                break
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == status
    assert (tmp_path / "stderr").read_text().strip().splitlines()[-1] == line
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and str(run_dir).encode() in _cmdline(p)]
    assert left == []


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""
