"""A submission's set of runs through ``run_and_time.sh`` (NEXP / --runs, dlrmv4/run_set.py) on the embedded
default: each run's own seed, run directory and result_<i>.txt in the submission layout, a set stopped
mid-run and continued with RESUME=1 (the finished run kept, the stopped one resumed, the rest started),
then the set scored with mlperf-logging's checkers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # whole runs in subprocesses

REPO = Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NEXP", "RESUME", "SEEDS", "SEED")}
    return {**env, "DLRMV4_NO_VENV": "1", **extra}


def _set_command(data: Path, runs: Path) -> list[str]:
    return ["bash", str(REPO / "run_and_time.sh"), "--data-path", str(data), "--run-dir", str(runs), "--no-progress"]


def test_a_set_stopped_mid_run_continues_and_is_scored(tmp_path):
    data, runs = tmp_path / "data", tmp_path / "runs"
    results = runs / "results" / "box" / "dlrmv4"
    first = subprocess.Popen(
        [*_set_command(data, runs), "--system", "box"],
        env=_env(NEXP="3", SEEDS="11,12,13"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    out, deadline = [], time.monotonic() + 600
    assert first.stdout is not None
    for line in first.stdout:  # stop the second run once it has a checkpoint to resume from
        out.append(line)
        checkpoints = runs / "set" / "run_2" / "checkpoints"
        if "run 2 of 3" in "".join(out) and checkpoints.is_dir() and any(checkpoints.glob("step-*")):
            first.send_signal(signal.SIGTERM)  # dlrmv4.run_set passes it on to the run in flight
            break
        assert time.monotonic() < deadline, "".join(out)[-3000:]
    rest, _ = first.communicate(timeout=300)
    out.append(rest)
    said = "".join(out)
    assert first.returncode != 0, said[-3000:]
    assert "a set of 3 runs, seeds 11, 12, 13" in said
    assert "RESUME=1 with the same command continues the set" in said
    assert sorted(p.name for p in results.iterdir()) == ["result_1.txt"]
    kept = (results / "result_1.txt").read_bytes()
    # The system's description is drafted beside results/ at the set's start, its blanks named.
    system = runs / "systems" / "box.json"
    assert f"system description {system} (drafted from this machine)" in said
    assert "fields for the submitter to fill: submitter, division, status" in said
    desc = json.loads(system.read_text())
    desc.update(submitter="Example Org", division="closed", status="Available on-premise", cooling="air")
    desc.update({k: "N/A" for k, v in desc.items() if v == ""})
    system.write_text(json.dumps(desc))

    second = subprocess.run(
        _set_command(data, runs),
        env=_env(NEXP="3", RESUME="1"),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    said = second.stdout + second.stderr
    assert "run 1 of 3 (seed 11): finished before, kept" in said
    assert "run 2 of 3 (seed 12): resuming from its checkpoint" in said
    assert re.search(r"run 3 of 3 \(seed 13\)\n", said)
    # The submission layout holds the three logs and nothing else; the finished run's log is untouched.
    assert sorted(p.name for p in results.iterdir()) == ["result_1.txt", "result_2.txt", "result_3.txt"]
    assert (results / "result_1.txt").read_bytes() == kept
    for i, seed in enumerate((11, 12, 13), start=1):
        records = [json.loads(line[9:]) for line in (results / f"result_{i}.txt").read_text().splitlines()]
        assert [r["value"] for r in records if r["key"] == "seed"] == [seed]
        assert [r["key"] for r in records].count("run_start") == 1  # the resumed run's log continues
    assert len((runs / "set" / "RESULT.txt").read_text().splitlines()) == 3
    rows = [line for line in second.stdout.splitlines() if line.startswith("| result_")]
    assert [row.split("|")[2].strip() for row in rows] == ["11", "12", "13"]
    assert all(row.endswith("| ok |") for row in rows), second.stdout[-3000:]
    assert "seeds: distinct (seed checker passed)" in second.stdout
    # The submitter's description is kept as it is and passes the checker.
    assert f"system description {system} (kept as it was)" in said
    assert json.loads(system.read_text()) == desc
    assert re.search(r"system_desc_checker \(mlperf-logging [\d.]+, training 6\.1\.0\): passed", said)
    # The score command as a user would type it again; its status is the set's: 0 exactly when the
    # RCP check passed.
    assert re.search(r"\[dlrmv4\] score: python -m dlrmv4 score \S+/results/\S+/dlrmv4", said), said[-3000:]
    assert (second.returncode == 0) == ("RCP check (pruned RCPs): PASSED" in second.stdout), said[-3000:]


def test_a_sets_per_run_flags_are_refused_in_one_line(tmp_path):
    proc = subprocess.run(
        [*_set_command(tmp_path / "data", tmp_path / "runs"), "--seed", "3"],
        env=_env(NEXP="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("[dlrmv4] error: --seed (or its knob) is set for each run of a set")


def test_resume_without_a_set_is_one_line(tmp_path):
    proc = subprocess.run(
        _set_command(tmp_path / "data", tmp_path / "runs"),
        env=_env(NEXP="3", RESUME="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert (
        proc.stderr.strip()
        == f"[dlrmv4] error: RESUME=1: no set to continue in {tmp_path / 'runs' / 'set'} (no set.json)"
    )
