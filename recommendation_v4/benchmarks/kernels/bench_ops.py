"""The non-attention HSTU ops on a GPU at the model's shape (32 sequences of ~2,850 tokens,
D 512, bf16): Triton vs the PyTorch reference (and the torch.compile'd reference), forward and
forward+backward, with the achieved bandwidth against a device-to-device copy measured in the
same run. Bytes are the fewest an op must move: each input read once, each output written once.

    python benchmarks/kernels/bench_ops.py                 # on a GPU; writes results/ops.json and ops.md
    python benchmarks/kernels/bench_ops.py --no-compile    # without the torch.compile column
    python benchmarks/kernels/bench_ops.py --smoke         # tiny shapes on the CPU (checks the script runs)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from harness import RESULTS, command_line, device_name, do_bench_ms, write_results
from length_mix import jagged_lengths

from dlrmv4.ops.gather_rows import gather_rows
from dlrmv4.ops.jagged import concat_sequence_timestamps, take_last
from dlrmv4.ops.layer_norm import layer_norm, swish_layer_norm
from dlrmv4.ops.output_block import output_block
from dlrmv4.ops.position import encode_sequences, position_time_encode
from dlrmv4.ops.reference import gather_rows as ref_gather
from dlrmv4.ops.reference import jagged as ref_jagged
from dlrmv4.ops.reference import layer_norm as ref_ln
from dlrmv4.ops.reference import output_block as ref_ob
from dlrmv4.ops.reference import position as ref_pos

NUM_CONTEXTUAL = 8
POS_ROWS, TIME_ROWS = 8192, 2048


@dataclass
class Case:
    name: str
    shape: str
    leaves: list[torch.Tensor]
    impls: dict[str, Callable[[], torch.Tensor]]  # "triton" / "pytorch" / "compiled" -> forward
    fwd_bytes: int
    fwd_bwd_bytes: int
    grad: torch.Tensor | None = field(default=None)


def copy_bandwidth(device: torch.device, numel: int) -> float:
    """GB/s of a device-to-device copy, bytes read + written."""
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / do_bench_ms(lambda: dst.copy_(src), device) / 1e6


def build_cases(
    batch: int, dim: int, dtype: torch.dtype, device: torch.device, smoke: bool, compile_ref: bool
) -> list[Case]:
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    max_len = 64 if smoke else 4096
    seq_lens = jagged_lengths("jagged", batch, rng, max_len=max_len)
    hist_lens = torch.from_numpy(seq_lens - NUM_CONTEXTUAL - 1)
    hist_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), hist_lens.cumsum(0)]).to(device)
    t_hist = int(hist_lens.sum())
    t_all = t_hist + batch * (NUM_CONTEXTUAL + 1)
    e = torch.finfo(dtype).bits // 8

    def rand(*shape, dt=dtype, grad=True):
        t = torch.randn(*shape, generator=g).to(device=device, dtype=dt)
        return t.requires_grad_(grad)

    maybe_compile = (lambda f: torch.compile(f, dynamic=False)) if compile_ref else None
    cases = []

    def add(name, shape, leaves, tri, ref, fwd_bytes, fwd_bwd_bytes, compile_ok=True):
        impls = {"triton": tri, "pytorch": ref}
        if maybe_compile and compile_ok:
            impls["compiled"] = maybe_compile(ref)
        cases.append(Case(name, shape, leaves, impls, fwd_bytes, fwd_bwd_bytes))

    # LayerNorm of the STU input; SwishLayerNorm of the preprocessor's 256-wide branches.
    for fn, ref_fn, width in (
        (layer_norm, ref_ln.layer_norm, dim),
        (swish_layer_norm, ref_ln.swish_layer_norm, dim // 2),
    ):
        x, w, b = rand(t_all, width), rand(width, dt=torch.float32), rand(width, dt=torch.float32)
        add(
            fn.__name__,
            f"[{t_all}, {width}]",
            [x, w, b],
            lambda fn=fn, x=x, w=w, b=b: fn(x, w, b, 1e-6, kernels="triton"),
            lambda ref_fn=ref_fn, x=x, w=w, b=b: ref_fn(x, w, b, 1e-6),
            2 * t_all * width * e,
            5 * t_all * width * e,
            compile_ok=fn is layer_norm,
        )

    # Output block: u, before the SiLU the block applies, is a column slice of the uvqk projection;
    # dropout 0.1 as in training. The SiLU adds arithmetic only, so the byte counts are unchanged.
    uvqk, attn = rand(t_all, 4 * dim), rand(t_all, dim)
    w, b = rand(dim, dt=torch.float32), rand(dim, dt=torch.float32)
    add(
        "output_block (p=0.1)",
        f"[{t_all}, {dim}] -> [{t_all}, {3 * dim}]",
        [uvqk, attn, w, b],
        lambda: output_block(uvqk[:, :dim], attn, w, b, 1e-6, 0.1, 1234, True, kernels="triton"),
        lambda: ref_ob.output_block(uvqk[:, :dim], attn, w, b, 1e-6, 0.1, True),
        5 * t_all * dim * e,
        10 * t_all * dim * e,
    )

    values = rand(t_all, dim)
    seq_offsets = ref_jagged.sequence_offsets(hist_offsets, NUM_CONTEXTUAL)
    add(
        "take_last",
        f"[{t_all}, {dim}] -> [{batch}, {dim}]",
        [values],
        lambda: take_last(values, seq_offsets, kernels="triton"),
        lambda: ref_jagged.take_last(values, seq_offsets),
        2 * batch * dim * e,
        3 * batch * dim * e + t_all * dim * e,
        compile_ok=False,
    )

    query = torch.randint(1_600_000_000, 1_700_000_000, (batch,), generator=g)
    ago = torch.cat(
        [torch.sort(torch.randint(0, 31_536_000, (int(n),), generator=g), descending=True).values for n in hist_lens]
    )  # up to a year back, oldest first
    hist_ts = (query.repeat_interleave(hist_lens) - ago).to(device)
    query = query.to(device)
    ts = concat_sequence_timestamps(hist_ts, hist_offsets, query, NUM_CONTEXTUAL)
    x = rand(t_all, dim)
    pt, tt = rand(POS_ROWS, dim, dt=torch.float32), rand(TIME_ROWS, dim, dt=torch.float32)
    pos, bucket = ref_pos.positions_and_buckets(seq_offsets, ts, query, NUM_CONTEXTUAL, POS_ROWS, TIME_ROWS, 60.0)
    rows_used = int(pos.unique().numel() + bucket.unique().numel())
    scale = math.sqrt(dim)
    add(
        "position_time_encode",
        f"[{t_all}, {dim}] + tables [{POS_ROWS}|{TIME_ROWS}, {dim}] fp32",
        [x, pt, tt],
        lambda: position_time_encode(x, seq_offsets, ts, query, NUM_CONTEXTUAL, pt, tt, scale, kernels="triton"),
        lambda: ref_pos.position_time_encode(x, seq_offsets, ts, query, NUM_CONTEXTUAL, pt, tt, scale),
        2 * t_all * dim * e + rows_used * dim * 4,
        4 * t_all * dim * e + rows_used * dim * 4 + (POS_ROWS + TIME_ROWS) * dim * 4,
    )
    # The model's form: the contextual rows and the tokens in, no concatenated copy between.
    ctx, tokens = rand(batch, NUM_CONTEXTUAL, dim), rand(t_hist + batch, dim)
    add(
        "encode_sequences",
        f"{batch}×[{NUM_CONTEXTUAL}+L+1, {dim}] + tables -> [{t_all}, {dim}]",
        [ctx, tokens, pt, tt],
        lambda: encode_sequences(ctx, tokens, hist_offsets, hist_ts, query, pt, tt, scale, kernels="triton")[0],
        lambda: encode_sequences(ctx, tokens, hist_offsets, hist_ts, query, pt, tt, scale, kernels="pytorch")[0],
        2 * t_all * dim * e + rows_used * dim * 4,
        4 * t_all * dim * e + rows_used * dim * 4 + (POS_ROWS + TIME_ROWS) * dim * 4,
        compile_ok=False,
    )

    # A deduplicated batch's distinct item rows spread to its history tokens and the candidates'
    # rows after them (Zipf(1.2) over 0.5 % of the tokens, about what synthetic-50m's batches hold).
    distinct = max(2, t_hist // 200)
    p = 1.0 / torch.arange(1, distinct + 1, dtype=torch.float64) ** 1.2
    inverse = torch.multinomial(p, t_hist, replacement=True, generator=g)
    index = torch.cat([inverse, torch.arange(distinct, distinct + batch)]).to(device=device, dtype=torch.int32)
    rows = rand(distinct + batch, dim)
    add(
        "gather_rows",
        f"[{distinct + batch}, {dim}] -> [{t_hist + batch}, {dim}]",
        [rows],
        lambda: gather_rows(rows, index, kernels="triton"),
        lambda: ref_gather.gather_rows(rows, index),
        (t_hist + batch) * dim * e + (distinct + batch) * dim * e,
        2 * (t_hist + batch) * dim * e + 2 * (distinct + batch) * dim * e,
        compile_ok=False,
    )
    return cases


def measure(case: Case, impl: str, device: torch.device, copy_gbs: float) -> list[dict]:
    fwd = case.impls[impl]
    t0 = time.perf_counter()
    try:  # the first calls compile (Triton or inductor); keep them out of the timings
        grad = torch.randn_like(fwd())
        torch.autograd.grad(fwd(), case.leaves, grad)
    except Exception as exc:  # a failed torch.compile must not cost the other rows
        if impl != "compiled":
            raise
        print(f"{case.name}: torch.compile failed: {' '.join(str(exc).split())[:300]}")
        return []
    warm_s = time.perf_counter() - t0
    t_fwd = do_bench_ms(fwd, device)
    t_both = do_bench_ms(lambda: torch.autograd.grad(fwd(), case.leaves, grad), device)
    rows = []
    for label, ms, nbytes in (("fwd", t_fwd, case.fwd_bytes), ("fwd+bwd", t_both, case.fwd_bwd_bytes)):
        gbs = nbytes / ms / 1e6
        rows.append(
            {
                "op": case.name,
                "shape": case.shape,
                "pass": label,
                "impl": impl,
                "ms": ms,
                "min_bytes": nbytes,
                "GB_per_s": gbs,
                "fraction_of_copy": gbs / copy_gbs,
                "first_call_s": warm_s,
            }
        )
        print(f"{case.name} {label} {impl}: {ms:.3f} ms, {gbs:,.0f} GB/s", flush=True)
    return rows


def sweep(batch_tokens: int, dim: int, dtype: torch.dtype, device: torch.device, copy_gbs: float) -> list[dict]:
    """The Triton LayerNorm and output-block kernels under other launch shapes (tile elements,
    elements per thread, programs per SM for the backward), called below autograd."""
    from dlrmv4.ops.triton import layer_norm as tln
    from dlrmv4.ops.triton import output_block as tob

    g = torch.Generator().manual_seed(1)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(device=device, dtype=dt)  # noqa: E731
    x, dy, w, b = r(batch_tokens, dim), r(batch_tokens, dim), r(dim, dt=torch.float32), r(dim, dt=torch.float32)
    uvqk, attn, dy3 = r(batch_tokens, 4 * dim), r(batch_tokens, dim), r(batch_tokens, 3 * dim)
    u = uvqk[:, :dim]
    e, n = x.element_size(), batch_tokens * dim
    _, mean, rstd = tln.forward(x, w, b, 1e-6, False)
    _, omean, orstd, okeep = tob.forward(u, attn, w, b, 1e-6, 0.1, 7, True)
    fwd_tiles = [(2048, 8), (4096, 8), (4096, 16), (8192, 16)]
    bwd_tiles = [(512, 4, 16), (1024, 4, 8), (1024, 8, 16), (2048, 8, 8), (2048, 16, 16), (4096, 16, 4)]
    runs = [("layer_norm fwd", t, 2 * n * e, lambda t=t: tln.forward(x, w, b, 1e-6, False, tile=t)) for t in fwd_tiles]
    runs += [
        ("layer_norm bwd", t, 3 * n * e, lambda t=t: tln.backward(x, w, b, dy, mean, rstd, False, tile=t))
        for t in bwd_tiles
    ]
    # The preprocessor's SwishLayerNorm runs at half the width.
    xs, dys, ws, bs = x[:, : dim // 2].contiguous(), dy[:, : dim // 2].contiguous(), w[: dim // 2], b[: dim // 2]
    _, smean, srstd = tln.forward(xs, ws, bs, 1e-6, True)
    runs += [
        (
            "swish_layer_norm bwd",
            t,
            3 * n * e // 2,
            lambda t=t: tln.backward(xs, ws, bs, dys, smean, srstd, True, tile=t),
        )
        for t in bwd_tiles
    ]
    for p in (0.1, 0.0):
        runs += [
            (
                f"output_block fwd p={p}",
                t,
                5 * n * e,
                lambda t=t, p=p: tob.forward(u, attn, w, b, 1e-6, p, 7, True, tile=t),
            )
            for t in (fwd_tiles if p else [tob.FWD_TILE])
        ]
        runs += [
            (
                f"output_block bwd p={p}",
                t,
                5 * n * e,
                lambda t=t, p=p: tob.backward(u, attn, w, b, dy3, omean, orstd, okeep if p else None, p, tile=t),
            )
            for t in (bwd_tiles if p else [tob.BWD_TILE])
        ]
    rows = []
    for name, t, nbytes, fn in runs:
        try:
            ms = do_bench_ms(fn, device)
        except Exception as exc:  # a launch shape that does not compile (resources) is skipped
            print(f"{name} {t}: failed: {' '.join(str(exc).split())[:200]}")
            continue
        print(f"{name} {t}: {ms:.3f} ms", flush=True)
        default = t in ((tob.FWD_TILE, tob.BWD_TILE) if name.startswith("output") else (tln.FWD_TILE, tln.BWD_TILE))
        rows.append(
            {
                "kernel": name,
                "tile": list(t),
                "default": default,
                "ms": ms,
                "GB_per_s": nbytes / ms / 1e6,
                "fraction_of_copy": nbytes / ms / 1e6 / copy_gbs,
            }
        )
    return rows


def sweep_table(rows: list[dict]) -> str:
    out = ["| kernel | tile (elements, per thread[, programs/SM]) | ms | GB/s | of copy |", "|---|---|---|---|---|"]
    out += [
        f"| {r['kernel']} | {tuple(r['tile'])}{' (default)' if r['default'] else ''} | {r['ms']:.3f} "
        f"| {r['GB_per_s']:,.0f} | {r['fraction_of_copy']:.0%} |"
        for r in rows
    ]
    return "\n".join(out) + "\n"


def table(rows: list[dict], copy_gbs: float) -> str:
    by = {(r["op"], r["pass"], r["impl"]): r for r in rows}
    keys = list(dict.fromkeys((r["op"], r["pass"]) for r in rows))
    out = [
        "| op | pass | Triton ms | PyTorch ms | × PyTorch | compiled ms | × compiled | Triton GB/s "
        f"| of copy ({copy_gbs:,.0f} GB/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for op, p in keys:
        tri, ref, comp = (by.get((op, p, k)) for k in ("triton", "pytorch", "compiled"))
        comp_ms = f"{comp['ms']:.3f}" if comp else "-"
        comp_x = f"{comp['ms'] / tri['ms']:.2f}" if comp else "-"
        out.append(
            f"| {op} | {p} | {tri['ms']:.3f} | {ref['ms']:.3f} | {ref['ms'] / tri['ms']:.2f} | {comp_ms} "
            f"| {comp_x} | {tri['GB_per_s']:,.0f} | {tri['fraction_of_copy']:.0%} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd reference")
    parser.add_argument("--sweep", action="store_true", help="also time other launch shapes of two kernels")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device, no result files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("bench_ops: no CUDA device; run it on a GPU, or pass --smoke to check the script")
    if args.smoke:
        args.batch, args.dim = 3, 32
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    copy_gbs = copy_bandwidth(device, 1 << 28 if device.type == "cuda" else 1 << 16)
    cases = build_cases(
        args.batch, args.dim, dtype, device, args.smoke, compile_ref=not args.no_compile and not args.smoke
    )
    tokens = int(cases[0].leaves[0].shape[0])
    name = device_name(device)
    command = command_line()
    facts = {
        "device": name,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": args.batch,
        "dim": args.dim,
        "tokens": tokens,
        "copy_GB_per_s": copy_gbs,
        "timing": "triton.testing.do_bench median, L2 flushed before each run",
    }
    rows, sweep_rows = [], []

    def report() -> str:
        text = table(rows, copy_gbs)
        if sweep_rows:
            text += "\nLaunch shapes (Triton kernels alone, below autograd):\n\n" + sweep_table(sweep_rows)
        if not args.smoke:
            write_results(
                "ops",
                {**facts, "rows": rows, "sweep": sweep_rows},
                (
                    f"# Non-attention ops (`{command}`)\n\n{name}, torch {torch.__version__}, {facts['dtype']}, "
                    f"{args.batch} sequences, {tokens:,} tokens, D {args.dim}. Bytes are the fewest each op must move "
                    "(inputs read once, outputs written once); `of copy` compares with a device-to-device copy timed "
                    "in the same run. `×` columns: reference time / Triton time (above 1: Triton is faster). fwd+bwd "
                    f"runs the forward with grad enabled, then autograd.grad.\n\n{text}"
                ),
                device=device,
                out=args.out,
            )
        return text

    # Results are written after each phase; torch.compile comes last, since a failure inside a
    # compiled kernel (a device-side assert) leaves the CUDA context unusable.
    rows += [r for c in cases for impl in ("triton", "pytorch") for r in measure(c, impl, device, copy_gbs)]
    report()
    if args.sweep:
        sweep_rows += sweep(tokens, args.dim, dtype, device, copy_gbs)
        report()
    for c in cases:
        if "compiled" in c.impls:
            rows += measure(c, "compiled", device, copy_gbs)
            report()
    text = report()
    print(json.dumps(facts))
    print(text)


if __name__ == "__main__":
    main()
