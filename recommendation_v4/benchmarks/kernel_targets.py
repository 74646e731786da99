"""Every Triton kernel the benchmark's model launches, compiled for a GPU target on this machine
(no GPU needed): the compile test (tests/test_kernel_targets.py) and the resources table
(kernels/bench_kernel_resources.py) share it.

The launches are the model's own: a training step (forward, backward, both optimizers, the
tables' row-wise Adagrad) and an eval forward of the reference-width model on CPU tensors, for
each sequence dtype, recompute mode and last-layer choice, once under deterministic algorithms, and
with the portable attention for the 16-bit dtypes (the default takes the Gluon forward on sm_90)
(``ops/triton/cross_compile.py`` turns each launch into a compile for the target).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from model_inputs import random_batch

from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.ops.triton.cross_compile import CONFIG_CHOICES, CompiledVariant, compiling_for
from dlrmv4.ops.triton.targets import TARGETS, KernelTarget, target_named
from dlrmv4.train.chunks import chunked_logits
from dlrmv4.train.trainer import build_step

PRESET = "yambda-5b"  # the reference's model widths
DTYPES = ("bfloat16", "float16", "float32")
ROWS = 100  # rows of every table (random_batch draws ids below 100)
LENGTHS = (700, 1, 300, 50)  # histories: several tiles, a one-token one, and sums over 256 ids a row
# Every kernel of ops/triton/ the model launches on every target; a kernel added there must be
# launched here too.
KERNELS = frozenset(
    {
        "_hstu_attention_fwd",
        "_hstu_attention_dkdv",
        "_hstu_attention_dq",
        "_candidate_attention_fwd",
        "_candidate_attention_bwd",
        "_jagged_take_last",
        "_layer_norm_fwd",
        "_layer_norm_bwd",
        "_output_block_fwd",
        "_output_block_bwd",
        "_position_time_fwd",
        "_position_time_bwd",
        "_segment_sums",
        "_long_runs",
    }
)
# Kernels a target runs besides those: the Gluon attention forward (ops/gluon/) where the attention
# seam takes it by default (ops/attention_kernels.py: sm_90, 16-bit sequences).
TARGET_KERNELS = {"sm_90": frozenset({"_hstu_attention_fwd_ws"})}


@dataclasses.dataclass(frozen=True)
class ModelVariant:
    dtype: str
    recompute: str = "none"
    last_layer: str = "candidates"
    deterministic: bool = False
    attention: str = "auto"  # the attention seam's choice (ops/attention_kernels.py)


def variants(dtypes: tuple[str, ...] = DTYPES) -> list[ModelVariant]:
    """The benchmark's dtype (bf16) in every mode; the other dtypes in the default mode."""
    out = [ModelVariant(d) for d in dtypes]
    if "bfloat16" in dtypes:
        out += [ModelVariant("bfloat16", recompute=r) for r in ("cheap", "layer")]
        out += [ModelVariant("bfloat16", last_layer="all"), ModelVariant("bfloat16", deterministic=True)]
    # The portable attention where auto takes the Gluon forward (sm_90). The opt-in Gluon backward
    # (attention "gluon") is left out: it spills (notes_attention.md), which the no-spill rule refuses.
    out += [ModelVariant(d, attention="triton") for d in dtypes if d != "float32"]
    return out


@contextlib.contextmanager
def _deterministic(on: bool) -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def launch_model_kernels(variant: ModelVariant) -> None:
    """A training step and an eval forward of the reference-width model on CPU tensors."""
    cfg = load_config(PRESET)
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(
            cfg.model,
            kernels="triton",
            sequence_dtype=variant.dtype,
            recompute=variant.recompute,
            last_layer=variant.last_layer,
            attention_kernels=variant.attention,
        ),
        embeddings=dataclasses.replace(cfg.embeddings, embedding_backend="plain"),
        sampler=dataclasses.replace(cfg.sampler, **{f"{name}_rows": ROWS for name in CONTEXTUAL_FEATURES}),
    )
    batch = random_batch(LENGTHS, seed=0)
    with _deterministic(variant.deterministic):
        step = build_step(cfg, (ROWS, ROWS, ROWS), "cpu", seed=0)
        step(batch, 0, 0)
        step.model.eval()
        with torch.no_grad():
            chunked_logits(step.model, batch, step.embeddings(batch), 1)


def compile_model_kernels(
    target: KernelTarget, configs: str = "first", dtypes: tuple[str, ...] = DTYPES
) -> list[CompiledVariant]:
    """Each distinct kernel variant the model launches, compiled for ``target``."""
    with compiling_for(target, configs) as compiled:
        for variant in variants(dtypes):
            launch_model_kernels(variant)
    return compiled


SM_REGISTERS, SM_SHARED, SM_WARPS, SM_BLOCKS = 65_536, 233_472, 64, 32
AMD_WAVES_PER_SIMD = 8


def _amd(asm: str) -> dict:
    def value(pattern: str) -> int:
        found = re.search(pattern, asm)
        return int(found.group(1)) if found else 0

    waves = value(r"; Occupancy: (\d+)")
    vgpr_spills, sgpr_spills = value(r"\.vgpr_spill_count:\s+(\d+)"), value(r"\.sgpr_spill_count:\s+(\d+)")
    return {
        "registers": value(r"\.vgpr_count:\s+(\d+)") + value(r"\.agpr_count:\s+(\d+)"),
        "spills": f"{vgpr_spills} VGPRs, {sgpr_spills} SGPRs",
        "spilled": vgpr_spills > 0,
        "occupancy": waves / AMD_WAVES_PER_SIMD,
        "occupancy_text": f"{waves} waves/SIMD",
    }


def _nvidia(variant: CompiledVariant, target: KernelTarget) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{target.arch}a"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(variant.binary.asm["ptx"])
        proc = subprocess.run(
            [get_ptxas(int(target.arch)).path, "--verbose", f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp) / "k")],
            capture_output=True,
            text=True,
            check=True,
        )
    report = proc.stdout + proc.stderr
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stores = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    loads = int(re.search(r"(\d+) bytes spill loads", report).group(1))
    warps = variant.num_warps
    per_warp = math.ceil(registers * 32 / 256) * 256
    blocks = min(
        SM_REGISTERS // (per_warp * warps),
        SM_SHARED // (variant.shared_memory + 1024),
        SM_WARPS // warps,
        SM_BLOCKS,
    )
    return {
        "registers": registers,
        "spills": f"{stores} B stored, {loads} B loaded",
        "spilled": stores + loads > 0,
        "occupancy": blocks * warps / SM_WARPS,
        "occupancy_text": f"{blocks} blocks x {warps} warps",
    }


def resources(variant: CompiledVariant, target: KernelTarget) -> dict:
    """Registers, spills and occupancy of a compiled variant: AMD's from its ``amdgcn`` assembly,
    NVIDIA's from Triton's own ``ptxas --verbose`` on its PTX. ``spilled``: VGPRs (AMD) or bytes
    (NVIDIA) go to memory; SGPRs an AMD kernel parks in VGPR lanes do not count."""
    return _nvidia(variant, target) if target.nvidia else _amd(variant.binary.asm["amdgcn"])


def describe(variant: CompiledVariant, target: KernelTarget, with_resources: bool = False) -> dict:
    """A variant as JSON: where it was compiled for, its constants, options and shared memory (and
    with ``with_resources``, its registers and spills)."""
    plain = (bool, int, float, str, type(None))
    facts = resources(variant, target) if with_resources else {}
    return {
        "target": target.name,
        "kernel": variant.kernel,
        "dtype": variant.dtype,
        "constants": {k: v if isinstance(v, plain) else str(v) for k, v in variant.constants},
        "num_warps": variant.num_warps,
        "num_stages": variant.num_stages,
        "shared_memory": variant.shared_memory,
        **facts,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=[t.name for t in TARGETS], choices=[t.name for t in TARGETS])
    parser.add_argument("--configs", default="first", choices=CONFIG_CHOICES, help="an autotuned kernel's configs")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--json", required=True, help="where to write the compiled variants")
    parser.add_argument("--resources", action="store_true", help="with each variant's registers and spills")
    args = parser.parse_args(argv)
    rows = []
    for name in args.targets:
        target = target_named(name)
        started = time.perf_counter()
        compiled = compile_model_kernels(target, args.configs, tuple(args.dtypes))
        print(f"{name}: {len(compiled)} kernel variants in {time.perf_counter() - started:.1f} s", flush=True)
        rows += [describe(v, target, args.resources) for v in compiled]
    Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
