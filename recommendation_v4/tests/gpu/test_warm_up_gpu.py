"""The kernels' warm-up on the GPU: with it, the timed run compiles and autotunes no Triton kernel (without
it, it does), and the run is the same bit for bit (deterministic mode: the autotuner's timed choice
would differ between any two processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from multi_process import launch_env, make_data, run_flags

GPU = {
    "model.sequence_dtype": "bfloat16",
    "model.kernels": "triton",
    "train.max_steps": "12",
    "train.target_auc": "1.0",
}
RUNNER = "import sys, torch; torch.use_deterministic_algorithms({}); from dlrmv4.cli import main; sys.exit(main(sys.argv[1:]))"
COMPILED = re.compile(r"Triton kernels after RUN_START: (\d+)(?: \([^)]*\))? compiled, (\d+)(?: \([^)]*\))? autotuned")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("warm_up_gpu"))


def _train(data_path: Path, run_dir: Path, warm_up: str, deterministic: bool, **extra: str) -> tuple[dict, str]:
    flags = run_flags(data_path, run_dir, **GPU, **{"train.warm_up": warm_up}, **extra)
    # A Triton cache of its own: kernels compiled by an earlier process must not hide a compilation.
    env = dict(launch_env(), TRITON_CACHE_DIR=str(run_dir.parent / f"triton-{run_dir.name}"))
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    cmd = [sys.executable, "-c", RUNNER.format(deterministic), "train", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "report.json").read_text()), proc.stdout + proc.stderr


def test_after_the_warm_up_the_timed_run_compiles_nothing(data_path, tmp_path):
    _, cold = _train(data_path, tmp_path / "cold", "false", deterministic=False)
    _, warm = _train(data_path, tmp_path / "warm", "true", deterministic=False)
    (before,) = COMPILED.findall(cold)
    (after,) = COMPILED.findall(warm)
    assert int(before[0]) > 0 and after == ("0", "0"), (before, after)
    assert "kernels compiled and tuned before RUN_START: " in warm


@pytest.mark.parametrize("backend", ["plain", "torchrec"])
def test_the_warm_up_changes_no_bit(data_path, tmp_path, backend):
    if backend == "torchrec":
        pytest.importorskip("torchrec")
    extra = {"embeddings.embedding_backend": backend, "train.chunks": "2"}
    cold, _ = _train(data_path, tmp_path / "cold", "false", deterministic=True, **extra)
    warm, _ = _train(data_path, tmp_path / "warm", "true", deterministic=True, **extra)
    assert warm["parameters_sha256"] == cold["parameters_sha256"] is not None
    assert [e["auc"] for e in warm["history"]["evals"]] == [e["auc"] for e in cold["history"]["evals"]]
