"""Every Triton kernel the model launches, compiled on this CPU for the benchmark's GPUs: MI350X
(gfx950), MI300X (gfx942), B200 (sm_100) and H100/H200 (sm_90), for every sequence dtype.

The fast tier compiles each autotuned kernel's first config the target keeps; the slow tier every
config it keeps. The compiles run in a child process without the interpreter (this process runs
Triton's interpreter, whose kernels cannot be compiled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from kernel_targets import KERNELS

from dlrmv4.ops.triton import attention
from dlrmv4.ops.triton.targets import TARGETS, KernelTarget, target_named

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ATTENTION = {"_hstu_attention_fwd", "_hstu_attention_dkdv", "_hstu_attention_dq"}


def compile_all(tmp_path: Path, configs: str) -> list[dict]:
    out = tmp_path / f"compiled-{configs}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kernel_targets.py"), "--configs", configs, "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def first_configs(tmp_path_factory) -> list[dict]:
    return compile_all(tmp_path_factory.mktemp("kernels"), "first")


def check_targets(rows: list[dict]) -> None:
    for target in TARGETS:
        mine = [r for r in rows if r["target"] == target.name]
        assert {r["kernel"] for r in mine} == KERNELS, target.name
        for r in mine:
            assert r["shared_memory"] <= target.shared_memory, (
                f"{r['kernel']} {r['constants']} needs {r['shared_memory']} bytes of shared memory on "
                f"{target.name}, which has {target.shared_memory}"
            )


def test_every_kernel_compiles_and_fits_on_every_target(first_configs):
    check_targets(first_configs)


def test_amd_targets_take_the_portable_paths(first_configs):
    """The PTX SiLU forms only on NVIDIA (packed bf16 in the dK/dV kernel, tanh.approx elsewhere);
    AMD and fp32 take x * sigmoid(x), and AMD's products the "ieee" precision it accepts."""
    seen = set()
    for r in (r for r in first_configs if r["kernel"] in ATTENTION):
        target, constants = target_named(r["target"]), r["constants"]
        if not target.nvidia:
            want = ("sigmoid", "ieee")
        elif r["dtype"] == "float32":
            want = ("sigmoid", "tf32x3")
        elif r["dtype"] == "bfloat16" and r["kernel"] == "_hstu_attention_dkdv":
            want = ("bf16x2", "tf32")
        else:
            want = ("tanh", "tf32")
        assert (constants["SILU"], constants["PREC"]) == want, r
        seen.add((target.backend, r["dtype"]))
    assert seen == {(b, d) for b in ("cuda", "hip") for d in ("bfloat16", "float16", "float32")}


@pytest.mark.slow
def test_every_config_a_target_keeps_compiles_and_fits(tmp_path):
    rows = compile_all(tmp_path, "all")
    check_targets(rows)
    for target in TARGETS:
        for kernel in ATTENTION:
            kept = {
                (r["num_warps"], r["num_stages"], r["constants"]["BLOCK_M"])
                for r in rows
                if r["target"] == target.name and r["kernel"] == kernel
            }
            assert kept, (target.name, kernel)


def keep(kind: str, target: KernelTarget, monkeypatch) -> list[triton.Config]:
    monkeypatch.setattr(attention, "current_target", lambda: target)
    configs = {"fwd": attention.FWD_CONFIGS, "dkdv": attention.DKDV_CONFIGS, "dq": attention.DQ_CONFIGS}[kind]
    q = torch.empty(1, 1, 128, dtype=torch.bfloat16)
    return attention._pruner(kind)([attention._config(*c) for c in configs], {"Q": q}, DQK=128, DV=128)


def test_the_rule_keeps_small_memory_configs_where_no_other_fits(monkeypatch):
    mi300x, h100 = target_named("gfx942"), target_named("sm_90")
    for kind in ("fwd", "dkdv", "dq"):
        small = [attention._config(*c) for c in attention.SMALL_MEMORY_CONFIGS[kind]]
        assert [str(c) for c in keep(kind, mi300x, monkeypatch)] == [str(c) for c in small], kind
        assert all(str(c) not in map(str, small) for c in keep(kind, h100, monkeypatch)), kind
    tiny = KernelTarget("tiny", "none", "hip", "gfx942", 64, 16_384)
    with pytest.raises(RuntimeError, match="no fwd attention config fits tiny"):
        keep("fwd", tiny, monkeypatch)
