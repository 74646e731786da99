"""The whole training step on one GPU at the reference model: samples/s, MFU (SPEC §5 yardstick)
against the datasheet and the matmul peak measured in the same run, peak memory, cold start, and
a profiler breakdown of the device time (attention, GEMMs, norms/elementwise, embedding lookup +
update, dense optimizer, other).

The step is ``TrainStep`` (both optimizers, clipping, the divergence monitor) with the plain
embedding backend on batches already in device memory, drawn with the "jagged" length mix of
``length_mix.py`` (mean about 2,850 tokens, like the real data at the reference shape) and
uniform random ids, or Zipf-skewed ones (``--id-skew``: a few rows own much of each batch). The
dense model is the reference's (3 STU layers, D 512, 4x128 heads, max sequence 4,096, dropout on,
bf16); the tables are sized to fit one GPU (``--table-rows``, every
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
    ("attention", r"hstu_attention"),
    ("dense optimizer", r"adam|multi_tensor|foreach|clip|norm_kernel|l2norm"),
    ("embedding lookup + update", r"adagrad|index|embedding|sort|segment|scatter|gather|radix|unique|cumsum"),
    ("GEMMs", r"gemm|sm90|cutlass|cublas|matmul|nvjet|xmma|splitk"),
    ("norms / elementwise", r"layer_norm|layernorm|_ln_|norm|output_block|position_time|jagged|elementwise|"
                            r"vectorized|reduce|silu|swish|dropout|mul|add|copy|cat|fill|where|sigmoid|bernoulli"),
]


def random_batch(cfg: BenchmarkConfig, lengths: np.ndarray, rows: int, rng: np.random.Generator, skew: float = 0.0):
    """A jagged batch with the given sequence lengths (history = length - 9) and ids below ``rows``:
    uniform, or Zipf-distributed with exponent ``skew`` (> 1: a few very popular rows, as in real
    listening data)."""
    hist = np.maximum(lengths - 9, 1).astype(np.int32)
    b, t = len(hist), int(hist.sum())
    offsets = np.zeros(b + 1, np.int64)
    np.cumsum(hist, out=offsets[1:])
    ts = np.concatenate([np.sort(rng.integers(0, 10**7, n)) for n in hist]).astype(np.int64)
    query = ts[offsets[1:] - 1]
    def ids(n: int) -> np.ndarray:
        return ((rng.zipf(skew, n) - 1) % rows if skew else rng.integers(0, rows, n)).astype(np.int64)
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


def measure(cfg: BenchmarkConfig, batch_size: int, steps: int, device: torch.device, rows: int, profile: bool,
            top: int = 25, skew: float = 0.0) -> dict:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model = DlrmHSTU(cfg.model, seed=0).to(device)
    embeddings = make_embeddings(table_specs(cfg, rows, rows, rows), cfg, device, seed=0)
    step = TrainStep(model, embeddings, cfg.train, FiniteMonitor(device))
    lengths = [jagged_lengths("jagged", batch_size, rng, cfg.sampler.max_seq_len) for _ in range(steps + WARM_STEPS)]
    batches = [random_batch(cfg, n, rows, rng, skew).to(device) for n in lengths]
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
        row["breakdown"], row["top_kernels"] = breakdown(step, batches[WARM_STEPS:WARM_STEPS + 5], device, top)
    return row


def breakdown(step: TrainStep, batches, device: torch.device, top: int) -> tuple[dict[str, float], list[dict]]:
    """Share of the device time per category over a few profiled steps (host time where no GPU),
    and the ``top`` kernels by time: name, category, ms and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]) as prof:
        for i, batch in enumerate(batches):
            step(batch, 1000 + i, 0)
        sync(device)
    totals = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    kernels = []
    for event in prof.key_averages():
        spent = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if spent <= 0 or (on_gpu and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        category = next((c for c, pattern in CATEGORIES if re.search(pattern, event.key.lower())), "other")
        totals[category] += spent
        kernels.append({"name": event.key[:120], "category": category, "ms_per_step": spent / 1e3 / len(batches),
                        "calls_per_step": event.count / len(batches)})
    whole = sum(totals.values()) or 1.0
    kernels.sort(key=lambda k: -k["ms_per_step"])
    return {k: v / whole for k, v in totals.items()}, kernels[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="per-GPU batch sizes to try")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--table-rows", type=int, default=1_000_000, help="rows of every table (fits one GPU)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per batch size, by device time")
    parser.add_argument("--id-skew", type=float, default=0.0,
                        help="Zipf exponent of the ids (e.g. 1.2: one row takes about a fifth of a batch); 0: uniform")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; nothing saved")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    cfg = reference_config(args.table_rows, args.smoke)
    peak = matmul_peak_tflops(device, n=8192 if device.type == "cuda" else 256, reps=10)
    rows = []
    for batch in args.batches:
        try:
            row = measure(cfg, batch, args.steps, device, args.table_rows, profile=True, top=args.top,
                          skew=args.id_skew)
        except torch.OutOfMemoryError:
            print(f"batch {batch}: out of memory", flush=True)
            torch.cuda.empty_cache()
            break
        row["mfu_datasheet"] = row["stu_tflops"] / DATASHEET_BF16_TFLOPS
        row["mfu_measured"] = row["stu_tflops"] / peak
        rows.append(row)
        print(f"batch {batch}: {row['samples_per_s']:,.0f} samples/s, {row['step_ms']:.1f} ms/step, "
              f"{row['stu_tflops']:.0f} TFLOP/s", flush=True)
        for k in row["top_kernels"]:
            print(f"  {k['ms_per_step']:8.2f} ms x{k['calls_per_step']:<4.0f} {k['category']:<26} {k['name']}",
                  flush=True)
        del row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.machine(),
              "torch": torch.__version__, "matmul_peak_tflops": peak, "datasheet_tflops": DATASHEET_BF16_TFLOPS,
              "table_rows": args.table_rows, "id_skew": args.id_skew, "model": dataclasses.asdict(cfg.model),
              "rows": rows,
              "command": "python benchmarks/bench_end_to_end.py " + " ".join(sys.argv[1:])}
    table = _table(result)
    print(table)
    if not args.smoke:
        name = "end_to_end" + (f"_zipf{args.id_skew:g}" if args.id_skew else "")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS / f"{name}.md").write_text(table + f"\n\nCommand: `{result['command']}`\n")


def _table(result: dict) -> str:
    cats = [c for c, _ in CATEGORIES] + ["other"]
    ids = f"Zipf({result['id_skew']:g}) ids" if result.get("id_skew") else "uniform ids"
    lines = [f"End-to-end training step on one {result['device']} (plain embeddings, {result['table_rows']:,} rows "
             f"per table, {ids}, batches in device memory, jagged length mix); matmul peak measured in the same run: "
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
    if result["rows"]:
        last = result["rows"][-1]
        lines += ["", f"Kernels by device time at batch {last['batch']} (per step):", "",
                  "| kernel | category | ms | launches |", "|---|---|---:|---:|"]
        lines += [f"| `{k['name']}` | {k['category']} | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} |"
                  for k in last["top_kernels"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
