"""benchmarks/bench_scaling.py on two gloo ranks with TorchRec row-wise tables and the sparse-dist
pipeline: both world sizes train the same span of the stream, the table names the pipeline, and
the dense replicas end identical."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from multi_process import launch_env, make_data, run_flags

pytestmark = pytest.mark.slow  # three torchrun launches

pytest.importorskip("torchrec")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scaling.py"


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
