"""Jagged HSTU attention on the GPU: the portable Triton kernels and the Hopper Gluon forward
(``ops/attention_kernels.py``), forward and forward+backward TFLOP/s against the PyTorch reference,
cuDNN's causal softmax attention at the same shapes and the bf16 matmul peak, all measured in the
same process, plus the cold start.

Shape: B=32, H=4, d=128 (q/k and v), bf16, one candidate per sequence, the three length mixes of
``length_mix.py``: all 4,096; jagged like the real data (2,740 + 1,355 * Beta(0.3, 3.5): mean ~2,850,
range 2,740-4,095, N = the batch's longest); all 2,048.
FLOPs on the real lengths: fwd = sum_b 2 * (L_b^2 / 2) * H * 2d; fwd+bwd = 3.5 x fwd (the reference's
yardstick, whatever the kernels really do). cuDNN (torch SDPA, SDPBackend.CUDNN_ATTENTION, causal,
bf16): the batch padded to the mix's longest sequence, its FLOPs counted over the causal triangle of
that padded length (the work it does); "gluon / cuDNN" is the ratio of the two rates. Prints a
table last; writes results/attention.{json,md}.

    python benchmarks/kernels/bench_attention.py [--variants] [--no-cold-start] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
import triton
from harness import RESULTS, command_line, device_name, matmul_peak_tflops, window_ms, write_results
from length_mix import jagged_lengths
from triton.testing import do_bench

from dlrmv4.ops.gluon import attention as hopper
from dlrmv4.ops.reference.attention import hstu_attention_reference
from dlrmv4.ops.triton import attention as tri

HERE = Path(__file__).resolve().parent
MIXES = {"full 4,096": "full", "jagged (real-data-like)": "jagged", "full 2,048": "half"}
# (name, dq mode, SiLU form: one for every kernel or one per kernel kind), the default first so each
# is timed beside it; the default is packed bf16 in dK/dV, fp32 tanh in the forward and dQ.
VARIANTS = (
    ("default", None, None),
    ("tanh in every kernel", "separate", "tanh"),
    ("bf16x2 in every kernel", "separate", "bf16x2"),
    ("bf16x2 in dK/dV and dQ", "separate", {"dq": "bf16x2"}),
)

COLD_START = """
import time, torch
t0 = time.perf_counter()
from dlrmv4.ops.attention import hstu_attention
lengths = {lengths}
offsets = torch.tensor([0] + lengths, device="cuda").cumsum(0)
x = torch.randn(offsets[-1].item(), {heads} * 4 * {dim}, device="cuda", dtype=torch.bfloat16).requires_grad_()
v, q, k = (x[:, i * {heads} * {dim}:(i + 1) * {heads} * {dim}].view(-1, {heads}, {dim}) for i in range(1, 4))
nt = torch.ones(len(lengths), dtype=torch.int64, device="cuda")
out = hstu_attention(q, k, v, offsets, max(lengths), num_targets=nt, alpha={dim} ** -0.5, kernels="triton")
out.float().sum().backward()
torch.cuda.synchronize()
print("COLD", time.perf_counter() - t0)
"""


def mixes(batch: int, seed: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(seed)
    return {name: jagged_lengths(mix, batch, rng).tolist() for name, mix in MIXES.items()}


def inputs(lengths: list[int], heads: int, dim: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    proj = torch.randn(total, heads * 4 * dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    v, q, k = (proj[:, i * heads * dim : (i + 1) * heads * dim].view(total, heads, dim) for i in range(1, 4))
    offsets = torch.tensor([0] + lengths, device="cuda").cumsum(0)
    targets = torch.ones(len(lengths), dtype=torch.int64, device="cuda")
    grad = torch.randn(total, heads, dim, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, k, v, offsets, targets, grad


def fwd_flops(lengths: list[int], heads: int, dim: int) -> float:
    return float(sum(2 * (n * n / 2) * heads * 2 * dim for n in lengths))


def time_triton(q, k, v, offsets, targets, grad, n, alpha, **kw) -> dict[str, float]:
    fwd = lambda: tri.attention_fwd(q, k, v, offsets, targets, n, alpha, silu=kw.get("silu"))
    both = lambda: (fwd(), tri.attention_bwd(grad, q, k, v, offsets, targets, n, alpha, **kw))
    both()  # autotune + compile outside the timed region
    return {
        "fwd_ms": window_ms(fwd),
        "fwd_bwd_ms": window_ms(both),
        "do_bench_fwd_ms": do_bench(fwd, return_mode="median"),
        "do_bench_fwd_bwd_ms": do_bench(both, return_mode="median"),
    }


def time_gluon(q, k, v, offsets, targets, grad, n, alpha) -> dict[str, float]:
    """The Gluon forward, with the portable backward after it (what ``attention="auto"`` runs on
    sm_90); the backwards alone: portable, Gluon (dQ summed in a fixed order), and Gluon with dQ
    added by atomics (``ordered=False``: what the fixed order costs)."""
    fwd = lambda: hopper.attention_fwd(q, k, v, offsets, targets, n, alpha)
    both = lambda: (fwd(), tri.attention_bwd(grad, q, k, v, offsets, targets, n, alpha))
    gluon_bwd = lambda: hopper.attention_bwd(grad, q, k, v, offsets, targets, n, alpha)
    unordered_bwd = lambda: hopper.attention_bwd(grad, q, k, v, offsets, targets, n, alpha, ordered=False)
    portable_bwd = lambda: tri.attention_bwd(grad, q, k, v, offsets, targets, n, alpha)
    for f in (both, gluon_bwd, unordered_bwd):
        f()
    return {
        "fwd_ms": window_ms(fwd),
        "fwd_bwd_ms": window_ms(both),
        "portable_bwd_ms": window_ms(portable_bwd),
        "gluon_bwd_ms": window_ms(gluon_bwd),
        "gluon_unordered_bwd_ms": window_ms(unordered_bwd),
    }


def time_cudnn(lengths: list[int], heads: int, dim: int, seed: int) -> dict[str, float]:
    """cuDNN's causal softmax attention on the batch padded to its longest sequence: ms and TFLOP/s
    (FLOPs over the padded causal triangle; fwd+bwd = 3.5 x fwd as for ours)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batch, length = len(lengths), max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, g = (
        torch.randn(batch, heads, length, dim, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)
    )
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        fwd = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        both = lambda: torch.autograd.grad(fwd(), (q, k, v), g)
        both()
        fwd_ms, both_ms = window_ms(fwd), window_ms(both)
    flops = fwd_flops([length] * batch, heads, dim)
    return {
        "fwd_ms": fwd_ms,
        "fwd_bwd_ms": both_ms,
        "fwd_tflops": flops / fwd_ms / 1e9,
        "fwd_bwd_tflops": 3.5 * flops / both_ms / 1e9,
    }


def time_reference(q, k, v, offsets, targets, grad, n, alpha) -> tuple[float, float]:
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    fwd = lambda: hstu_attention_reference(*leaves, offsets, n, targets, alpha)

    def both():
        fwd().backward(grad)

    with torch.no_grad():
        f = window_ms(fwd, min_ms=100.0, reps=3)
    return f, window_ms(both, min_ms=100.0, reps=3)


def kernel_breakdown(q, k, v, offsets, targets, grad, n, alpha, iters: int = 5, **kw) -> dict[str, float]:
    """Mean CUDA time per fwd+bwd of each kernel (profiler), to see where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            tri.attention_fwd(q, k, v, offsets, targets, n, alpha, silu=kw.get("silu"))
            tri.attention_bwd(grad, q, k, v, offsets, targets, n, alpha, **kw)
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.key_averages():
        times[e.key[:60]] = getattr(e, "self_device_time_total", 0.0) / 1e3 / iters
    return {key: ms for key, ms in sorted(times.items(), key=lambda kv: -kv[1]) if ms > 0.001}


def _kernel_ms(variant: dict, kind: str) -> str:
    """The profiled time of the variant's ``kind`` kernel (``_hstu_attention_<kind>``), or "-"."""
    times = [ms for name, ms in variant["kernel_ms"].items() if name.startswith(f"_hstu_attention_{kind}")]
    return f"{sum(times):.3f}" if times else "-"


def tuned_configs() -> dict[str, dict]:
    out = {}
    for name, tuner in (("fwd", tri._fwd_tuned), ("dkdv", tri._dkdv_tuned), ("dq", tri._dq_tuned)):
        out[name] = {str(key): str(cfg) for key, cfg in tuner.cache.items()}
    return out


def cold_start(lengths: list[int], heads: int, dim: int) -> dict:
    """Fresh process and empty Triton cache: import -> first fwd+bwd done, at the jagged shape."""
    code = COLD_START.format(lengths=lengths, heads=heads, dim=dim)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(HERE.parents[1])}
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    inner = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("COLD")))
    return {"import_to_first_fwd_bwd_s": inner, "process_wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants", action="store_true", help="also time other dq modes / SiLU forms on the jagged mix"
    )
    parser.add_argument("--no-cold-start", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU")
    alpha = args.dim**-0.5
    lengths_by_mix = mixes(args.batch, args.seed)
    jagged = lengths_by_mix["jagged (real-data-like)"]
    cold = {} if args.no_cold_start else cold_start(jagged, args.heads, args.dim)

    peak = matmul_peak_tflops("cuda", n=8192, timer="do_bench")

    rows, variants, breakdown, tuning = [], [], {}, {}
    for mix, lengths in lengths_by_mix.items():
        n = max(lengths)
        q, k, v, offsets, targets, grad = inputs(lengths, args.heads, args.dim, args.seed)
        ref_out = hstu_attention_reference(q, k, v, offsets, n, targets, alpha)
        err = (
            (tri.attention_fwd(q, k, v, offsets, targets, n, alpha).float() - ref_out.float()).norm()
            / ref_out.float().norm()
        ).item()
        timing = time_triton(q, k, v, offsets, targets, grad, n, alpha)
        fwd_ms, both_ms = timing["fwd_ms"], timing["fwd_bwd_ms"]
        tuning[mix] = {
            name: {str(c): t[0] for c, t in getattr(tuner, "configs_timings", {}).items()}
            for name, tuner in (("fwd", tri._fwd_tuned), ("dkdv", tri._dkdv_tuned), ("dq", tri._dq_tuned))
        }
        ref_fwd_ms, ref_both_ms = time_reference(q, k, v, offsets, targets, grad, n, alpha)
        flops = fwd_flops(lengths, args.heads, args.dim)
        gluon = time_gluon(q, k, v, offsets, targets, grad, n, alpha)
        gluon_err = (
            (hopper.attention_fwd(q, k, v, offsets, targets, n, alpha).float() - ref_out.float()).norm()
            / ref_out.float().norm()
        ).item()
        cudnn = time_cudnn(lengths, args.heads, args.dim, args.seed)
        gluon_tflops = {"fwd": flops / gluon["fwd_ms"] / 1e9, "fwd_bwd": 3.5 * flops / gluon["fwd_bwd_ms"] / 1e9}
        rows.append(
            {
                "mix": mix,
                "tokens": sum(lengths),
                "mean_len": float(np.mean(lengths)),
                "min_len": min(lengths),
                "max_len": n,
                "fwd_ms": fwd_ms,
                "fwd_tflops": flops / fwd_ms / 1e9,
                "fwd_bwd_ms": both_ms,
                "fwd_bwd_tflops": 3.5 * flops / both_ms / 1e9,
                "ref_fwd_ms": ref_fwd_ms,
                "ref_fwd_bwd_ms": ref_both_ms,
                "speedup_fwd_bwd_vs_ref": ref_both_ms / both_ms,
                "fraction_of_matmul_peak": 3.5 * flops / both_ms / 1e9 / peak,
                "rel_err_vs_reference_bf16": err,
                "gluon_fwd_ms": gluon["fwd_ms"],
                "gluon_fwd_tflops": gluon_tflops["fwd"],
                "gluon_fwd_bwd_ms": gluon["fwd_bwd_ms"],
                "gluon_fwd_bwd_tflops": gluon_tflops["fwd_bwd"],
                "gluon_rel_err_vs_reference_bf16": gluon_err,
                "cudnn": cudnn,
                "gluon_over_cudnn_fwd": gluon_tflops["fwd"] / cudnn["fwd_tflops"],
                "gluon_over_cudnn_fwd_bwd": gluon_tflops["fwd_bwd"] / cudnn["fwd_bwd_tflops"],
                "portable_bwd_ms": gluon["portable_bwd_ms"],
                "gluon_bwd_ms": gluon["gluon_bwd_ms"],
                "gluon_unordered_bwd_ms": gluon["gluon_unordered_bwd_ms"],
                "do_bench_fwd_ms": timing["do_bench_fwd_ms"],
                "do_bench_fwd_bwd_ms": timing["do_bench_fwd_bwd_ms"],
            }
        )
        if mix.startswith("jagged"):
            breakdown = kernel_breakdown(q, k, v, offsets, targets, grad, n, alpha)
            if args.variants:
                for name, dq_mode, silu in VARIANTS:
                    kw = {"dq_mode": dq_mode, "silu": silu}
                    var = time_triton(q, k, v, offsets, targets, grad, n, alpha, **kw)
                    kernels = kernel_breakdown(q, k, v, offsets, targets, grad, n, alpha, **kw)
                    f, fb = var["fwd_ms"], var["fwd_bwd_ms"]
                    variants.append(
                        {
                            "variant": name,
                            "dq_mode": dq_mode or tri.DQ_MODE,
                            "silu": silu,
                            "fwd_ms": f,
                            "fwd_bwd_ms": fb,
                            "fwd_tflops": flops / f / 1e9,
                            "fwd_bwd_tflops": 3.5 * flops / fb / 1e9,
                            "kernel_ms": kernels,
                        }
                    )
        del q, k, v, grad, ref_out
        torch.cuda.empty_cache()

    header = (
        "| mix | tokens | mean L | max L | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | × matmul peak "
        "| ref fwd+bwd ms | × ref |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    table = header + "".join(
        f"| {r['mix']} | {r['tokens']:,} | {r['mean_len']:,.0f} | {r['max_len']:,} | {r['fwd_ms']:.3f} "
        f"| {r['fwd_tflops']:.0f} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_tflops']:.0f} | {r['fraction_of_matmul_peak']:.2f} "
        f"| {r['ref_fwd_bwd_ms']:.1f} | {r['speedup_fwd_bwd_vs_ref']:.0f} |\n"
        for r in rows
    )
    gtable = (
        "| mix | Gluon fwd ms | Gluon fwd TFLOP/s (× peak) | cuDNN fwd TFLOP/s | Gluon / cuDNN fwd "
        "| Gluon fwd + Triton bwd TFLOP/s (× peak) | cuDNN fwd+bwd TFLOP/s (× peak) | ours / cuDNN fwd+bwd |\n"
        "|---|---|---|---|---|---|---|---|\n"
    ) + "".join(
        f"| {r['mix']} | {r['gluon_fwd_ms']:.3f} | {r['gluon_fwd_tflops']:.0f} ({r['gluon_fwd_tflops'] / peak:.2f}) "
        f"| {r['cudnn']['fwd_tflops']:.0f} | {r['gluon_over_cudnn_fwd']:.2f} "
        f"| {r['gluon_fwd_bwd_tflops']:.0f} ({r['gluon_fwd_bwd_tflops'] / peak:.2f}) "
        f"| {r['cudnn']['fwd_bwd_tflops']:.0f} ({r['cudnn']['fwd_bwd_tflops'] / peak:.2f}) "
        f"| {r['gluon_over_cudnn_fwd_bwd']:.2f} |\n"
        for r in rows
    )
    btable = (
        "| mix | portable bwd ms (TFLOP/s) | Gluon bwd ms (TFLOP/s) | Gluon bwd, dQ by atomics, ms (TFLOP/s) |\n"
        "|---|---|---|---|\n"
    ) + "".join(
        f"| {r['mix']} | "
        + " | ".join(
            f"{r[key]:.3f} ({2.5 * r['fwd_tflops'] * r['fwd_ms'] / r[key]:.0f})"
            for key in ("portable_bwd_ms", "gluon_bwd_ms", "gluon_unordered_bwd_ms")
        )
        + " |\n"
        for r in rows
    )
    vtable = "".join(
        f"| {x['variant']} | {x['dq_mode']} | {x['fwd_ms']:.3f} ({x['fwd_tflops']:.0f}) "
        f"| {x['fwd_bwd_ms']:.3f} ({x['fwd_bwd_tflops']:.0f}) | {_kernel_ms(x, 'fwd')} | {_kernel_ms(x, 'dkdv')} "
        f"| {_kernel_ms(x, 'dq')} |\n"
        for x in variants
    )
    if vtable:
        vtable = (
            "| variant | dq mode | fwd ms (TFLOP/s) | fwd+bwd ms (TFLOP/s) | fwd kernel ms | dK/dV kernel ms "
            "| dQ kernel ms |\n|---|---|---|---|---|---|---|\n" + vtable
        )
    env = {
        "device": device_name("cuda"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "matmul_peak_tflops": peak,
        "dq_mode_default": tri.DQ_MODE,
    }
    command = command_line(without=("--out",))  # where the results go is no part of what was measured
    result = {
        "env": env,
        "shape": {
            "batch": args.batch,
            "heads": args.heads,
            "dim": args.dim,
            "dtype": "bfloat16",
            "num_targets": 1,
            "lengths": lengths_by_mix,
        },
        "rows": rows,
        "variants": variants,
        "kernel_ms_per_fwd_bwd_jagged": breakdown,
        "tuned_configs": tuned_configs(),
        "autotune_ms": tuning,
        "cold_start": cold,
        "timing": "median of 7 CUDA-event windows of back-to-back calls (>= 40 ms each), "
        "warm (after autotune); do_bench_* (L2 flushed, launch gap counted) kept for comparison",
    }
    cold_line = (
        f"Cold start (fresh process, empty Triton cache, import -> first fwd+bwd at the jagged shape): "
        f"{cold['import_to_first_fwd_bwd_s']:.1f} s ({cold['process_wall_s']:.1f} s with interpreter start).\n"
        if "import_to_first_fwd_bwd_s" in cold
        else f"Cold start: {cold or 'not measured'}\n"
    )
    md = (
        f"# Jagged HSTU attention (`{command}`)\n\n{env['device']} (sm_{env['capability']}), torch {env['torch']}, "
        f"triton {env['triton']}; bf16 matmul peak measured in the same run: {peak:.0f} TFLOP/s. B={args.batch}, "
        f"H={args.heads}, d={args.dim}, bf16, one candidate per sequence; TFLOP/s on the real lengths "
        f"(fwd+bwd = 3.5 x fwd); dQ mode `{tri.DQ_MODE}`; medians of CUDA-event windows of back-to-back "
        f'calls.\n\n{table}\nThe Hopper Gluon forward (what `attention="auto"` runs on sm_90; the backward is the '
        f"portable one) beside cuDNN's causal softmax attention on the batch padded to each mix's longest "
        f"sequence (FLOPs over that padded triangle):\n\n{gtable}\n"
        f"The backwards alone (bwd = 2.5 x fwd FLOPs): the portable kernels (dK/dV, then dQ recomputing S "
        f"and dP), the Gluon kernel (dQ summed in a fixed order, the default), and the Gluon kernel with dQ "
        f"added by atomics (`ordered=False`, not deterministic):\n\n{btable}\n"
        + (f"Variants on the jagged mix:\n\n{vtable}\n" if vtable else "")
        + cold_line
    )
    write_results("attention", result, md, device="cuda", out=args.out)
    print(json.dumps({"kernels_ms": breakdown, "tuned": tuned_configs(), "cold_start": cold, "env": env}, indent=1))
    if vtable:
        print(vtable)
    print(table)
    print(gtable)
    print(btable)


if __name__ == "__main__":
    main()
