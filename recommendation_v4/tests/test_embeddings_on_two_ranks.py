"""The embedding all-to-all's precision on two gloo ranks: TorchRec's fp16 wire and the plain
backend's rounding where TorchRec's rows and gradients would cross it give the same tables, and
the rounding shows (without it the plain backend's tables are those of an fp32 wire)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # torchrun, two processes

pytest.importorskip("torchrec")

TESTS = Path(__file__).parent


def _tables(qcomm: str, out: Path) -> dict:
    paths = [TESTS.parent, TESTS, TESTS.parent / "benchmarks"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, paths)), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*cmd, str(TESTS / "wire_worker.py"), qcomm, str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out / f"tables_{qcomm}.pt")


def _largest_difference(a: dict, b: dict) -> float:
    """The largest difference of two sets of tables, relative to each table's largest weight."""
    return max(float((a[n]["weight"] - b[n]["weight"]).abs().max() / a[n]["weight"].abs().max()) for n in a)


def test_the_plain_backend_rounds_as_torchrecs_fp16_all_to_all(tmp_path):
    fp16, fp32 = _tables("fp16", tmp_path), _tables("none", tmp_path)
    # Same rounding: the backends agree to fp32 (a row's duplicate gradients add up in another order).
    assert _largest_difference(fp16["plain"], fp16["torchrec"]) < 1e-6
    assert _largest_difference(fp32["plain"], fp32["torchrec"]) < 1e-6
    # The wire's rounding is far above that: fp16 keeps 11 bits of a row and of its gradient.
    assert _largest_difference(fp16["torchrec"], fp32["torchrec"]) > 1e-5
    assert _largest_difference(fp16["plain"], fp32["plain"]) > 1e-5
