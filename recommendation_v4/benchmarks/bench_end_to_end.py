"""The whole training step on one GPU at the reference model: samples/s, MFU (SPEC §5 yardstick)
against the datasheet and the matmul peak measured in the same run, peak memory, cold start, and
a profiler breakdown of the device time (attention, GEMMs, norms/elementwise, embedding lookup +
update, dense optimizer, other).

The step is ``TrainStep`` (both optimizers, clipping, the divergence monitor) with the plain
embedding backend on batches already in device memory, drawn with the "jagged" length mix of
``length_mix.py`` (mean about 2,850 tokens, like the real data at the reference shape) and
uniform random ids. The dense model is the reference's (3 STU layers, D 512, 4x128 heads, max
sequence 4,096, dropout on, bf16); the tables are sized to fit one GPU (``--table-rows``, every
table the same), which the results name. Data loading is not in this step (see bench_loop.py).

    python benchmarks/bench_end_to_end.py                      # on a GPU: the table in one call
    python benchmarks/bench_end_to_end.py --smoke              # tiny shapes on the CPU (the script runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench_stu import DATASHEET_BF16_TFLOPS, matmul_peak_tflops
from dlrmv4.config import BenchmarkConfig, load_config
from dlrmv4.data.batch import JaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, NUM_CONTEXTUAL
from dlrmv4.model.flops import batch_flops
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.embeddings import make_embeddings, table_specs
from dlrmv4.train.optim import FiniteMonitor
from dlrmv4.train.step import TrainStep
from length_mix import jagged_lengths

RESULTS = Path(__file__).parent / "results"
WARM_STEPS = 6  # the first is the cold start; all are untimed
# Device-time categories, first match wins (kernel names of PyTorch, Triton and cuBLAS).
CATEGORIES = [
    ("attention", r"hstu|_fwd_kernel|_bwd_kernel|_dq_kernel|_dkdv_kernel|attention"),
    ("dense optimizer", r"adam|multi_tensor|foreach|clip|norm_kernel|l2norm"),
    ("embedding lookup + update", r"index|embedding|sort|segment|scatter|gather|radix|unique|cumsum|embedding_dense"),
    ("GEMMs", r"gemm|sm90|cutlass|cublas|matmul|nvjet|xmma|splitk"),
    ("norms / elementwise", r"layer_norm|layernorm|_ln_|norm|elementwise|vectorized|reduce|silu|swish|dropout|"
                            r"mul|add|copy|cat|fill|where|sigmoid|bernoulli"),
]


def random_batch(cfg: BenchmarkConfig, lengths: np.ndarray, rows: int, rng: np.random.Generator):
    """A jagged batch with the given sequence lengths (history = length - 9) and ids below ``rows``."""
    hist = np.maximum(lengths - 9, 1).astype(np.int32)
    b, t = len(hist), int(hist.sum())
    offsets = np.zeros(b + 1, np.int64)
    np.cumsum(hist, out=offsets[1:])
    ts = np.concatenate([np.sort(rng.integers(0, 10**7, n)) for n in hist]).astype(np.int64)
    query = ts[offsets[1:] - 1]
    ids = lambda n: rng.integers(0, rows, n).astype(np.int64)  # noqa: E731
    batch = JaggedBatch(
        history_lengths=hist, history_offsets=offsets, history_item_id=ids(t), history_artist_id=ids(t),
        history_album_id=ids(t), history_action=rng.choice([1, 2, 4], t).astype(np.int64), history_timestamp=ts,
        contextual_ids=rng.integers(0, rows, (b, NUM_CONTEXTUAL)).astype(np.int64), candidate_item_id=ids(b),
        candidate_artist_id=ids(b), candidate_album_id=ids(b), candidate_timestamp=query + rng.integers(0, 600, b),
        query_time=query, label=rng.integers(0, 2, b).astype(np.float32), anchor_index=np.arange(b, dtype=np.int64))
    batch.validate()
    return batch.to_torch()


def reference_config(table_rows: int, smoke: bool) -> BenchmarkConfig:
    cfg = load_config("yambda-5b")
    emb = dataclasses.replace(cfg.embeddings, embedding_backend="plain", item_rows=table_rows, artist_rows=table_rows,
                              album_rows=table_rows)
    sampler = dataclasses.replace(cfg.sampler, **{f"{name}_rows": table_rows for name in CONTEXTUAL_FEATURES})
    cfg = dataclasses.replace(cfg, embeddings=emb, sampler=sampler,
                              train=dataclasses.replace(cfg.train, warmup_steps=100, learning_rate=1e-4))
    if smoke:
        model = dataclasses.replace(cfg.model, embedding_dim=16, d_model=16, num_layers=1, num_heads=1, qk_dim=16,
                                    v_dim=16, preprocessor_hidden=16, item_tower_hidden=16, head_hidden=16,
                                    sequence_dtype="float32", num_position_buckets=256)
        cfg = dataclasses.replace(cfg, model=model, sampler=dataclasses.replace(sampler, max_seq_len=128))
    return cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(cfg: BenchmarkConfig, batch_size: int, steps: int, device: torch.device, rows: int, profile: bool) -> dict:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = DlrmHSTU(cfg.model, seed=0).to(device)
    embeddings = make_embeddings(table_specs(cfg, rows, rows, rows), cfg, device, seed=0)
    step = TrainStep(model, embeddings, cfg.train, FiniteMonitor(device))
    lengths = [jagged_lengths("jagged", batch_size, rng, cfg.sampler.max_seq_len) for _ in range(steps + WARM_STEPS)]
    batches = [random_batch(cfg, n, rows, rng).to(device) for n in lengths]
    started = time.perf_counter()
    step(batches[0], 0, 0)
    sync(device)
    cold = time.perf_counter() - started
    for i in range(1, WARM_STEPS):  # autotuning meets the other sequence-length buckets here
        step(batches[i], i, 0)
    sync(device)
    started = time.perf_counter()
    for i in range(WARM_STEPS, steps + WARM_STEPS):
        step(batches[i], i, 0)
    sync(device)
    seconds = time.perf_counter() - started
    step.finite.check()
    flops = sum(batch_flops(cfg.model, n).stu for n in lengths[WARM_STEPS:])
    row = {"batch": batch_size, "steps": steps, "seconds": seconds, "samples_per_s": steps * batch_size / seconds,
           "step_ms": 1e3 * seconds / steps, "stu_tflops": flops / seconds / 1e12, "cold_start_s": cold,
           "mean_tokens": float(np.mean(np.concatenate(lengths[WARM_STEPS:]))),
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}
    if profile:
        row["breakdown"] = breakdown(step, batches[WARM_STEPS:WARM_STEPS + 5], device)
    return row


def breakdown(step: TrainStep, batches, device: torch.device) -> dict[str, float]:
    """Share of the device time per category over a few profiled steps (host time where no GPU)."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]) as prof:
        for i, batch in enumerate(batches):
            step(batch, 1000 + i, 0)
        sync(device)
    totals = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for event in prof.key_averages():
        spent = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if spent <= 0 or (on_gpu and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        name = event.key.lower()
        category = next((c for c, pattern in CATEGORIES if re.search(pattern, name)), "other")
        totals[category] += spent
    whole = sum(totals.values()) or 1.0
    return {k: v / whole for k, v in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="per-GPU batch sizes to try")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--table-rows", type=int, default=1_000_000, help="rows of every table (fits one GPU)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; nothing saved")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg = reference_config(args.table_rows, args.smoke)
    peak = matmul_peak_tflops(device, n=8192 if device.type == "cuda" else 256, reps=10)
    rows = []
    for batch in args.batches:
        try:
            row = measure(cfg, batch, args.steps, device, args.table_rows, profile=True)
        except torch.OutOfMemoryError:
            print(f"batch {batch}: out of memory", flush=True)
            torch.cuda.empty_cache()
            break
        row["mfu_datasheet"] = row["stu_tflops"] / DATASHEET_BF16_TFLOPS
        row["mfu_measured"] = row["stu_tflops"] / peak
        rows.append(row)
        print(f"batch {batch}: {row['samples_per_s']:,.0f} samples/s, {row['step_ms']:.1f} ms/step, "
              f"{row['stu_tflops']:.0f} TFLOP/s", flush=True)
        del row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
              "torch": torch.__version__, "matmul_peak_tflops": peak, "datasheet_tflops": DATASHEET_BF16_TFLOPS,
              "table_rows": args.table_rows, "model": dataclasses.asdict(cfg.model), "rows": rows,
              "command": "python benchmarks/bench_end_to_end.py " + " ".join(sys.argv[1:])}
    table = _table(result)
    print(table)
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "end_to_end.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / "end_to_end.md").write_text(table + f"\n\nCommand: `{result['command']}`\n")


def _table(result: dict) -> str:
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"End-to-end training step on one {result['device']} (plain embeddings, {result['table_rows']:,} rows "
             f"per table, batches in device memory, jagged length mix); matmul peak measured in the same run: "
             f"{result['matmul_peak_tflops']:.0f} TFLOP/s (datasheet {result['datasheet_tflops']:.0f}).", "",
             "| batch | mean tokens | samples/s | ms/step | STU TFLOP/s | MFU datasheet | MFU measured | peak GiB | "
             "cold start s | " + " | ".join(cats) + " |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cats)]
    for r in result["rows"]:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        shares = " | ".join(f"{r['breakdown'][c]:.0%}" for c in cats)
        lines.append(f"| {r['batch']} | {r['mean_tokens']:,.0f} | {r['samples_per_s']:,.0f} | {r['step_ms']:.1f} | "
                     f"{r['stu_tflops']:.0f} | {r['mfu_datasheet']:.1%} | {r['mfu_measured']:.1%} | {peak} | "
                     f"{r['cold_start_s']:.1f} | {shares} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
