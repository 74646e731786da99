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
from kernel_targets import KERNELS, TARGET_KERNELS

from dlrmv4.ops.triton import attention
from dlrmv4.ops.triton.targets import TARGETS, KernelTarget, target_named

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ATTENTION = {"_hstu_attention_fwd", "_hstu_attention_dkdv", "_hstu_attention_dq"}


def compile_all(tmp_path: Path, configs: str, resources: bool = False) -> list[dict]:
    out = tmp_path / f"compiled-{configs}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "kernel_targets.py"), "--configs", configs, "--json", str(out)]
        + (["--resources"] if resources else []),
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
        assert {r["kernel"] for r in mine} == KERNELS | TARGET_KERNELS.get(target.name, frozenset()), target.name
        for r in mine:
            assert r["shared_memory"] <= target.shared_memory, (
                f"{r['kernel']} {r['constants']} needs {r['shared_memory']} bytes of shared memory on "
                f"{target.name}, which has {target.shared_memory}"
            )


def test_every_kernel_compiles_and_fits_on_every_target(first_configs):
    check_targets(first_configs)


def test_amd_targets_take_the_portable_paths(first_configs):
    """The PTX SiLU forms only on NVIDIA (packed 16-bit in the dK/dV kernel, tanh.approx elsewhere);
    AMD and fp32 take x * sigmoid(x), and AMD's products the "ieee" precision it accepts."""
    seen = set()
    for r in (r for r in first_configs if r["kernel"] in ATTENTION):
        target, constants = target_named(r["target"]), r["constants"]
        if not target.nvidia:
            want = ("sigmoid", "ieee")
        elif r["dtype"] == "float32":
            want = ("sigmoid", "tf32x3")
        elif r["kernel"] == "_hstu_attention_dkdv":
            want = ({"bfloat16": "bf16x2", "float16": "f16x2"}[r["dtype"]], "tf32")
        else:
            want = ("tanh", "tf32")
        assert (constants["SILU"], constants["PREC"]) == want, r
        seen.add((target.backend, r["dtype"]))
    assert seen == {(b, d) for b in ("cuda", "hip") for d in ("bfloat16", "float16", "float32")}


@pytest.mark.slow
def test_every_config_a_target_keeps_compiles_fits_and_spills_nothing(tmp_path):
    """Every config each target keeps, with its registers and spills: at 16-bit inputs (training
    and eval) no kernel spills on any target. fp32 (3xTF32 products, the accuracy path) is exempt:
    its attention spills on NVIDIA at 128-wide heads whatever the tile."""
    rows = compile_all(tmp_path, "all", resources=True)
    check_targets(rows)
    spilled = [
        f"{r['kernel']} {r['dtype']} {r['constants']} warps={r['num_warps']} stages={r['num_stages']} on "
        f"{r['target']}: {r['spills']}"
        for r in rows
        if r["spilled"] and r["dtype"] in ("bfloat16", "float16")
    ]
    assert not spilled, "\n".join(spilled)
    for target in TARGETS:
        for kernel in ATTENTION:
            kept = {
                (r["num_warps"], r["num_stages"], r["constants"]["BLOCK_M"])
                for r in rows
                if r["target"] == target.name and r["kernel"] == kernel
            }
            assert kept, (target.name, kernel)


def keep(kind: str, target: KernelTarget, monkeypatch, dim: int = 128) -> list[str]:
    monkeypatch.setattr(attention, "current_target", lambda: target)
    q = attention._rows(torch.empty(1, 1, dim, dtype=torch.bfloat16))
    return [str(c) for c in attention._pruner(kind)(None, {"Q": q}, DQK=dim, DV=dim)]


def test_each_backend_keeps_its_own_list_and_small_memory_configs_where_none_fits(monkeypatch):
    h100, mi350x, mi300x = target_named("sm_90"), target_named("gfx950"), target_named("gfx942")
    small_lds = KernelTarget("small-lds", "none", "hip", "gfx942", 64, 45_000)
    for kind in ("fwd", "dkdv", "dq"):
        for target in (h100, mi350x):  # at 128-wide heads every listed config fits these
            listed = [str(attention._config(*c)) for c in attention.CONFIGS[target.backend][kind]]
            assert keep(kind, target, monkeypatch) == listed, (kind, target.name)
        listed = [str(attention._config(*c)) for c in attention.CONFIGS["hip"][kind]]
        kept = keep(kind, mi300x, monkeypatch)  # MI300X's 64 KB: part of the AMD list
        assert kept and set(kept) <= set(listed), kind
        small = [str(attention._config(*c)) for c in attention.SMALL_MEMORY_CONFIGS[kind]]
        assert keep(kind, small_lds, monkeypatch) == small, kind
    with pytest.raises(RuntimeError, match="no fwd attention config fits small-lds"):
        keep("fwd", small_lds, monkeypatch, dim=256)
