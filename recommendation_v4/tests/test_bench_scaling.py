"""benchmarks/scale/bench_scaling.py on two gloo ranks with TorchRec row-wise tables and the sparse-dist
pipeline: both world sizes train the same span of the stream, the table names the pipeline, and
the dense replicas end identical."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from multi_process import launch_env, make_data, run_flags

pytestmark = pytest.mark.slow  # three torchrun launches

pytest.importorskip("torchrec")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "scale" / "bench_scaling.py"


def test_a_gloo_row_with_the_sparse_pipeline(tmp_path):
    data_path = make_data(tmp_path)
    flags = run_flags(
        data_path,
        tmp_path / "run",
        **{"embeddings.embedding_backend": "torchrec", "embeddings.sharding_types": "*=row_wise"},
    )
    cmd = [sys.executable, str(BENCH), *flags, "--worlds", "1", "2", "--per-rank-batch", "8"]
    cmd += ["--warmup-samples", "32", "--samples", "64", "--no-save", "--label", "ci-gloo-pipelined"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = re.findall(
        r"^\| ci-gloo-pipelined \|.*\| torchrec \| ([^|]+) \| (\d) \|.*\| (yes|NO) \|$", proc.stdout, re.M
    )
    assert [(world, same) for _, world, same in rows] == [("1", "yes"), ("2", "yes")], proc.stdout
    assert all("pipelined ids" in setup for setup, _, _ in rows)


def test_a_later_call_adds_its_repeats_to_the_saved_row(tmp_path):
    """A row cut short by a call's time limit is finished by a second call with --continue-row: the saved
    row then holds both calls' repeats, numbered in order, each speedup against its own repeat's base."""
    data_path = make_data(tmp_path)
    flags = run_flags(data_path, tmp_path / "run")
    cmd = [sys.executable, str(BENCH), *flags, "--worlds", "1", "--per-rank-batch", "8", "--warmup-samples", "16"]
    cmd += ["--samples", "32", "--label", "ci-continued", "--results-dir", str(tmp_path / "results")]
    for extra in ([], ["--continue-row"]):
        proc = subprocess.run(cmd + extra, capture_output=True, text=True, env=launch_env(), timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "results" / "scaling.json").read_text())["rows"]
    assert row["repeats_finished"] == 2 and [r["repeat"] for r in row["results"]] == [0, 1]
    assert all(r["speedup"] == 1.0 for r in row["results"])
    other = subprocess.run(
        cmd[:-4] + ["--label", "never-saved", "--results-dir", str(tmp_path / "results"), "--continue-row"],
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=600,
    )
    assert other.returncode != 0 and "no saved row labelled 'never-saved'" in other.stderr
