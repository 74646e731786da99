"""The 3-layer STU stack (D=512, 4x128 heads) forward+backward on a GPU: samples/s, TFLOP/s,
MFU against the datasheet and the measured matmul peak, peak memory, the ratio to the PyTorch
reference ops, the last layer for the candidate rows only against the full last layer (same
batch, same run), the full model's loss parity between kernel modes, and cold start.

TFLOP/s by the yardstick counts every layer in full (the benchmark's work); "executed" counts
what runs (model/flops.py).

    python benchmarks/kernels/bench_stu.py                    # on a GPU: the whole table in one call
    python benchmarks/kernels/bench_stu.py --smoke            # tiny shapes on the CPU (checks the script runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from harness import (
    DATASHEET_BF16_TFLOPS,
    RESULTS,
    command_line,
    device_name,
    git_commit,
    matmul_peak_tflops,
    median_seconds,
    write_results,
)
from length_mix import jagged_lengths

from dlrmv4.config import ModelConfig
from dlrmv4.config_loading import load_config
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.flops import batch_flops
from dlrmv4.model.stu import STUStack


def stack_inputs(cfg: ModelConfig, lengths: np.ndarray, device: torch.device, seed: int):
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.from_numpy(np.cumsum(lengths))
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(int(lengths.sum()), cfg.d_model, generator=g).to(device).requires_grad_()
    return x, offsets.to(device), int(lengths.max())


def measure_stack(cfg: ModelConfig, batch: int, mix: str, device: torch.device, reps: int) -> dict:
    lengths = jagged_lengths(mix, batch, np.random.default_rng(batch), max_len=4096)
    torch.manual_seed(0)
    stack = STUStack(cfg).to(device)
    x, offsets, max_len = stack_inputs(cfg, lengths, device, seed=batch)
    grad = torch.randn(len(lengths), cfg.d_model, device=device)  # the stack's output: the candidate rows
    dtype = torch.bfloat16 if cfg.sequence_dtype == "bfloat16" else torch.float32

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            out = stack(x, offsets, max_len, [1, 2, 3][: cfg.num_layers])
        out.backward(grad)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        seconds = median_seconds(step, reps)
    except torch.OutOfMemoryError:
        return {"kernels": cfg.kernels, "last_layer": cfg.last_layer, "batch": batch, "mix": mix, "oom": True}
    out = {
        "kernels": cfg.kernels,
        "last_layer": cfg.last_layer,
        "batch": batch,
        "mix": mix,
        "mean_len": float(lengths.mean()),
        "seconds": seconds,
        "samples_per_s": batch / seconds,
        "tflops": batch_flops(cfg, lengths).stu / seconds / 1e12,
        "tflops_executed": batch_flops(cfg, lengths, executed=True).stu / seconds / 1e12,
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


COLD_START = """
import time, sys
t0 = time.time()
import torch
sys.path.insert(0, {bench_dir!r})
from bench_stu import measure_stack
from dlrmv4.config_loading import load_config
import dataclasses
cfg = dataclasses.replace(load_config("yambda-5b").model, kernels="triton")
measure_stack(cfg, {batch}, "jagged", torch.device("cuda"), reps=1)
print("COLD", time.time() - t0)
"""


def cold_start(batch: int) -> float:
    """Seconds from process start to the end of the first fwd+bwd, with an empty Triton cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache}
        start = time.time()
        proc = subprocess.run(
            [sys.executable, "-c", COLD_START.format(bench_dir=str(Path(__file__).parent), batch=batch)],
            env=env,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr)
        return time.time() - start


def model_parity(device: torch.device) -> dict:
    """The full model on one jagged batch: Triton vs PyTorch ops, same weights, no dropout."""
    from model_inputs import random_batch, random_embeddings

    from dlrmv4.model.hstu import DlrmHSTU

    base = dataclasses.replace(load_config("yambda-5b").model, input_dropout=0.0, linear_dropout=0.0)
    lengths = jagged_lengths("jagged", 8, np.random.default_rng(1), max_len=4096) - 9
    batch = random_batch(lengths, seed=2).to(device)
    out = {}
    for dtype in ("float32", "bfloat16"):
        losses = {}
        for kernels in ("pytorch", "triton"):
            torch.manual_seed(0)
            model = DlrmHSTU(dataclasses.replace(base, kernels=kernels, sequence_dtype=dtype)).to(device)
            emb = random_embeddings(batch, base.embedding_dim, seed=3)
            emb = dataclasses.replace(
                emb, **{n: getattr(emb, n).detach().to(device) for n in SequenceEmbeddings.TENSORS}
            )
            result = model(batch, emb)
            result.loss.backward()
            grad = torch.cat([p.grad.flatten() for p in model.stu.parameters()])
            losses[kernels] = (float(result.loss.detach()), grad)
        ref, tri = losses["pytorch"], losses["triton"]
        out[dtype] = {
            "loss_pytorch": ref[0],
            "loss_triton": tri[0],
            "loss_rel_diff": abs(tri[0] - ref[0]) / abs(ref[0]),
            "stu_grad_rel_diff": float((tri[1] - ref[1]).norm() / ref[1].norm()),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device (script check)")
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--reference-batch", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "stu"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config("yambda-5b").model
    if args.smoke:
        cfg = dataclasses.replace(cfg, d_model=32, num_heads=2, qk_dim=16, v_dim=16, sequence_dtype="float32")
        args.batches, args.reference_batch = [2], 2
    rows = []
    peak = matmul_peak_tflops(device, n=512 if args.smoke else 8192, reps=2 if args.smoke else 20)
    ref = measure_stack(
        dataclasses.replace(cfg, kernels="pytorch"), args.reference_batch, "jagged", device, reps=1 if args.smoke else 3
    )
    rows.append(ref)
    tri_same = measure_stack(
        dataclasses.replace(cfg, kernels="triton" if device.type == "cuda" else "pytorch"),
        args.reference_batch,
        "jagged",
        device,
        reps=1 if args.smoke else 5,
    )
    tri_same["vs_reference"] = ref["seconds"] / tri_same["seconds"]
    rows.append(tri_same)
    fast = "triton" if device.type == "cuda" else "pytorch"
    for b in args.batches:
        full = measure_stack(
            dataclasses.replace(cfg, kernels=fast, last_layer="all"), b, "jagged", device, reps=1 if args.smoke else 5
        )
        trimmed = measure_stack(
            dataclasses.replace(cfg, kernels=fast, last_layer="candidates"),
            b,
            "jagged",
            device,
            reps=1 if args.smoke else 5,
        )
        if not full.get("oom") and not trimmed.get("oom"):
            trimmed["vs_full_last_layer"] = full["seconds"] / trimmed["seconds"]
        rows += [full, trimmed]
    extra = {}
    if device.type == "cuda" and not args.smoke:
        extra["model_parity"] = model_parity(device)
        extra["cold_start_s"] = cold_start(256)
    name = device_name(device)
    lines = [
        f"Device: {name}; "
        f"commit {git_commit()}; torch {torch.__version__}; measured bf16 matmul peak {peak:.0f} TFLOP/s; datasheet {DATASHEET_BF16_TFLOPS:.0f}",
        "",
        "| ops | last layer | samples/step | mean tokens | step ms | samples/s | STU TFLOP/s (yardstick) "
        "| executed | MFU datasheet | MFU measured peak | peak GiB | vs PyTorch ops | vs full last layer |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['kernels']} | {r['last_layer']} | {r['batch']} | | out of memory | | | | | | | | |")
            continue
        lines.append(
            f"| {r['kernels']} | {r['last_layer']} | {r['batch']} | {r['mean_len']:.0f} | "
            f"{r['seconds'] * 1e3:.1f} | {r['samples_per_s']:,.0f} | {r['tflops']:.0f} | "
            f"{r['tflops_executed']:.0f} | {r['tflops'] / DATASHEET_BF16_TFLOPS:.1%} | "
            f"{r['tflops'] / peak:.1%} | {r.get('peak_mem_gib', float('nan')):.1f} | "
            + (f"{r['vs_reference']:.1f}x |" if "vs_reference" in r else "- |")
            + (f" {r['vs_full_last_layer']:.2f}x |" if "vs_full_last_layer" in r else " - |")
        )
    if "model_parity" in extra:
        lines += [
            "",
            "Full model, Triton vs PyTorch ops (8 jagged samples, no dropout):",
            "",
            "| dtype | loss PyTorch | loss Triton | loss rel. diff | STU grad rel. diff |",
            "|---|---:|---:|---:|---:|",
        ]
        for dtype, p in extra["model_parity"].items():
            lines.append(
                f"| {dtype} | {p['loss_pytorch']:.6f} | {p['loss_triton']:.6f} | {p['loss_rel_diff']:.1e} | "
                f"{p['stu_grad_rel_diff']:.1e} |"
            )
        lines += [
            "",
            f"Cold start (fresh process, empty Triton cache, to the end of the first fwd+bwd at 256 "
            f"samples): {extra['cold_start_s']:.1f} s",
        ]
    text = "\n".join(lines)
    print(text)
    if not args.smoke:
        info = {"matmul_peak_tflops": peak, "device": name, "torch": torch.__version__, "rows": rows, **extra}
        out = Path(args.out)
        write_results(out.name, info, f"`{command_line()}`\n\n{text}", device=device, out=out.parent)


if __name__ == "__main__":
    main()
