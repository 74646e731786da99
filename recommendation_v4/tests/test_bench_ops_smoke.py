"""``bench_ops.py --smoke`` runs every op it times, forward and backward, through Triton's interpreter on
the CPU (the kernels' run-time loop bounds included: dlrmv4/ops/triton/interpreter.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = (
    "layer_norm",
    "swish_layer_norm",
    "output_block (p=0.1)",
    "take_last",
    "position_time_encode",
    "encode_sequences",
    "gather_rows",
)


def test_the_smoke_run_times_every_op_through_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "benchmarks/kernels/bench_ops.py", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split(" | ")[:2] for line in proc.stdout.splitlines() if line.startswith("| ") and " | fwd" in line]
    assert sorted(tuple(r) for r in rows) == sorted((f"| {op}", p) for op in OPS for p in ("fwd", "fwd+bwd"))
