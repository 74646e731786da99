"""The whole training step on one GPU at the reference model: samples/s, MFU (the reference's yardstick, docs/model.md)
against the datasheet and the matmul peak measured in the same run, peak memory, the step's memory
per token, cold start, and a profiler breakdown of the device time (attention, GEMMs,
norms/elementwise, embedding lookup + update, dense optimizer, other).

The step is ``TrainStep`` (both optimizers, clipping, the divergence monitor) with either embedding
backend (``--backends plain torchrec``), in ``--chunks`` chunks per step and each ``--recompute``
mode, on batches already in device memory, drawn with the "jagged" length mix of
``length_mix.py`` (mean about 2,850 tokens, like the real data at the reference shape) and
uniform random ids, or Zipf-skewed ones (``--id-skew``: a few rows own much of each batch). The
dense model is the reference's (3 STU layers, D 512, 4x128 heads, max sequence 4,096, dropout on,
bf16); the tables are sized to fit one GPU (``--table-rows``, every
table the same), which the results name. Data loading is not in this step (see bench_loop.py).

    python benchmarks/step/bench_end_to_end.py                      # on a GPU: the table in one call
    python benchmarks/step/bench_end_to_end.py --backends plain torchrec --batches 128 256
    python benchmarks/step/bench_end_to_end.py --batches 256 --recompute none cheap layer --label recompute
    python benchmarks/step/bench_end_to_end.py --batches 256 --steps 20 --attention-kernels triton --label profile_triton
    python benchmarks/step/bench_end_to_end.py --smoke              # tiny shapes on the CPU (the script runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from harness import (
    DATASHEET_BF16_TFLOPS,
    SMOKE_MODEL,
    command_line,
    device_name,
    git_commit,
    matmul_peak_tflops,
    sync,
    write_results,
)
from kernel_parts import PART_NAMES, step_part
from length_mix import jagged_lengths
from model_inputs import random_table_batch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.model.flops import batch_flops
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.plan.activations import ActivationShape, kept_bytes_per_token
from dlrmv4.train.step import TrainStep
from dlrmv4.train.trainer import build_step

WARM_STEPS = 6  # the first is the cold start; all are untimed


def reference_config(
    table_rows: int,
    smoke: bool,
    backend: str = "plain",
    chunks: int = 1,
    recompute: str = "none",
    last_layer: str = "candidates",
    attention: str = "auto",
) -> BenchmarkConfig:
    cfg = load_config("yambda-5b")
    emb = dataclasses.replace(
        cfg.embeddings, embedding_backend=backend, item_rows=table_rows, artist_rows=table_rows, album_rows=table_rows
    )
    sampler = dataclasses.replace(cfg.sampler, **{f"{name}_rows": table_rows for name in CONTEXTUAL_FEATURES})
    cfg = dataclasses.replace(
        cfg,
        embeddings=emb,
        sampler=sampler,
        model=dataclasses.replace(cfg.model, recompute=recompute, last_layer=last_layer, attention_kernels=attention),
        train=dataclasses.replace(cfg.train, warmup_steps=100, learning_rate=1e-4, chunks=chunks),
    )
    if smoke:
        model = dataclasses.replace(cfg.model, **SMOKE_MODEL)
        cfg = dataclasses.replace(cfg, model=model, sampler=dataclasses.replace(sampler, max_seq_len=128))
    return cfg


def start_single_process_group(device: torch.device) -> None:
    """World size 1 (TorchRec's DistributedModelParallel needs a process group)."""
    import tempfile

    import torch.distributed as dist

    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )


def measure(
    cfg: BenchmarkConfig,
    batch_size: int,
    steps: int,
    device: torch.device,
    rows: int,
    profile: bool,
    top: int = 25,
    skew: float = 0.0,
) -> dict:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = build_step(cfg, (rows, rows, rows), device, seed=0)
    lengths = [jagged_lengths("jagged", batch_size, rng, cfg.sampler.max_seq_len) for _ in range(steps + WARM_STEPS)]
    batches = [random_table_batch(n, rows, rng, skew).to(device) for n in lengths]
    started = time.perf_counter()
    step(batches[0], 0, 0)
    sync(device)
    cold = time.perf_counter() - started
    for i in range(1, WARM_STEPS):  # autotuning meets the other sequence-length buckets here
        step(batches[i], i, 0)
    sync(device)
    resting = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    for i in range(WARM_STEPS, steps + WARM_STEPS):
        step(batches[i], i, 0)
    sync(device)
    seconds = time.perf_counter() - started
    step.finite.check()
    flops = sum(batch_flops(cfg.model, n).stu for n in lengths[WARM_STEPS:])
    executed = sum(batch_flops(cfg.model, n, executed=True).stu for n in lengths[WARM_STEPS:])
    row = {
        "batch": batch_size,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": steps * batch_size / seconds,
        "step_ms": 1e3 * seconds / steps,
        "stu_tflops": flops / seconds / 1e12,
        "stu_tflops_executed": executed / seconds / 1e12,
        "cold_start_s": cold,
        "mean_tokens": float(np.mean(np.concatenate(lengths[WARM_STEPS:]))),
        "backend": step.embeddings.backend,
        "chunks": step.chunks,
        "recompute": cfg.model.recompute,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        # What a step adds over the resting tables, weights and optimizer state, per token of its
        # largest batch: the lookup's rows and gradients plus one chunk's activations.
        "step_kib_per_token": (
            (torch.cuda.max_memory_allocated(device) - resting) / 1024 / max(int(n.sum()) for n in lengths[WARM_STEPS:])
        )
        if device.type == "cuda"
        else None,
    }
    row["kept_kib_per_token"] = kept_kib_per_token(step.model, step.embeddings, batches[-1])
    shape = ActivationShape.from_config(cfg.model)
    row["plan_kept_kib_per_token"] = (
        kept_bytes_per_token(shape, cfg.model.recompute, cfg.sampler.max_seq_len, step.model.num_contextual) / 1024
    )
    if profile:
        row["breakdown"], row["top_kernels"] = breakdown(step, batches[WARM_STEPS : WARM_STEPS + 5], device, top)
    return row


def kept_kib_per_token(model: DlrmHSTU, embeddings, batch) -> float:
    """KiB per sequence token that one training-mode forward keeps for its backward: every saved
    tensor's storage once, leaving out the parameters and the looked-up rows (the memory plan counts
    those apart)."""
    emb = embeddings(batch)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *emb.tensors())}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(batch, emb)
    del out, emb
    embeddings.sparse_step()  # nothing pending is left behind (the plain backend's lookup has no backward here)
    return sum(kept.values()) / 1024 / (batch.total_tokens + batch.num_samples * (model.num_contextual + 1))


def breakdown(step: TrainStep, batches, device: torch.device, top: int) -> tuple[dict[str, float], list[dict]]:
    """Share of the device time per category over a few profiled steps (host time where no GPU),
    and the ``top`` kernels by time: name, category, ms and launches per step."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]) as prof:
        for i, batch in enumerate(batches):
            step(batch, 1000 + i, 0)
        sync(device)
    totals = dict.fromkeys(PART_NAMES, 0.0)
    kernels = []
    for event in prof.key_averages():
        spent = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if spent <= 0 or (on_gpu and event.device_type != torch.autograd.DeviceType.CUDA):
            continue
        category = step_part(event.key)
        totals[category] += spent
        kernels.append(
            {
                "name": event.key[:120],
                "category": category,
                "ms_per_step": spent / 1e3 / len(batches),
                "calls_per_step": event.count / len(batches),
            }
        )
    whole = sum(totals.values()) or 1.0
    kernels.sort(key=lambda k: -k["ms_per_step"])
    return {k: v / whole for k, v in totals.items()}, kernels[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="per-GPU batch sizes to try")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--table-rows", type=int, default=1_000_000, help="rows of every table (fits one GPU)")
    parser.add_argument("--top", type=int, default=25, help="kernels listed per batch size, by device time")
    parser.add_argument(
        "--id-skew",
        type=float,
        default=0.0,
        help="Zipf exponent of the ids (e.g. 1.2: one row takes about a fifth of a batch); 0: uniform",
    )
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["plain"],
        choices=("plain", "torchrec"),
        help="embedding backends to measure (torchrec needs fbgemm-gpu)",
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[1], help="chunks per step to measure")
    parser.add_argument(
        "--recompute",
        nargs="+",
        default=["none"],
        choices=("none", "cheap", "layer"),
        help="recompute modes to measure",
    )
    parser.add_argument(
        "--last-layer",
        nargs="+",
        default=["candidates"],
        choices=("candidates", "all"),
        help="last STU layer: candidate rows only (the default) or all rows",
    )
    parser.add_argument(
        "--attention-kernels",
        default="auto",
        choices=("auto", "gluon", "triton"),
        help="kernels of the STU layers' attention (ops/attention_kernels.py)",
    )
    parser.add_argument("--label", default="", help="suffix of the results file names")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; nothing saved")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if "torchrec" in args.backends:
        start_single_process_group(device)
    peak = matmul_peak_tflops(device, n=8192 if device.type == "cuda" else 256, reps=10)
    rows = []
    for backend, recompute, chunks, last_layer in itertools.product(
        args.backends, args.recompute, args.chunks, args.last_layer
    ):
        cfg = reference_config(
            args.table_rows, args.smoke, backend, chunks, recompute, last_layer, args.attention_kernels
        )
        for batch in args.batches:
            try:
                row = measure(
                    cfg, batch, args.steps, device, args.table_rows, profile=True, top=args.top, skew=args.id_skew
                )
            except torch.OutOfMemoryError:
                print(
                    f"{backend}, {recompute}, {chunks} chunk(s), last layer {last_layer}, batch {batch}: out of memory",
                    flush=True,
                )
                rows.append(
                    {
                        "batch": batch,
                        "backend": backend,
                        "chunks": chunks,
                        "recompute": recompute,
                        "last_layer": last_layer,
                        "oom": True,
                    }
                )
                gc.collect()
                torch.cuda.empty_cache()
                break
            row["last_layer"] = last_layer
            row["mfu_datasheet"] = row["stu_tflops"] / DATASHEET_BF16_TFLOPS
            row["mfu_measured"] = row["stu_tflops"] / peak
            row["mfu_executed"] = row["stu_tflops_executed"] / peak
            rows.append(row)
            print(
                f"{backend}, {recompute}, {chunks} chunk(s), last layer {last_layer}, batch {batch}: "
                f"{row['samples_per_s']:,.0f} samples/s, {row['step_ms']:.1f} ms/step, {row['stu_tflops']:.0f} "
                f"TFLOP/s (yardstick), {row['stu_tflops_executed']:.0f} executed",
                flush=True,
            )
            for k in row["top_kernels"]:
                print(
                    f"  {k['ms_per_step']:8.2f} ms x{k['calls_per_step']:<4.0f} {k['category']:<26} {k['name']}",
                    flush=True,
                )
            del row
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = {
        "device": device_name(device),
        "torch": torch.__version__,
        "commit": git_commit(),
        "matmul_peak_tflops": peak,
        "datasheet_tflops": DATASHEET_BF16_TFLOPS,
        "table_rows": args.table_rows,
        "id_skew": args.id_skew,
        "model": dataclasses.asdict(reference_config(args.table_rows, args.smoke).model),
        "rows": rows,
        "command": command_line(),
    }
    table = _table(result)
    print(table)
    if not args.smoke:
        name = (
            "end_to_end" + (f"_zipf{args.id_skew:g}" if args.id_skew else "") + (f"_{args.label}" if args.label else "")
        )
        write_results(name, result, table, device=device)


def _table(result: dict) -> str:
    cats = PART_NAMES
    ids = f"Zipf({result['id_skew']:g}) ids" if result.get("id_skew") else "uniform ids"
    lines = [
        f"End-to-end training step on one {result['device']} (commit {result['commit']}; {result['table_rows']:,} "
        f"rows per table, {ids}, batches in device memory, jagged length mix); matmul peak measured in the same "
        f"run: {result['matmul_peak_tflops']:.0f} TFLOP/s (datasheet {result['datasheet_tflops']:.0f}). Step KiB "
        "per token: the step's peak over the resting tables, weights and optimizer state, per token of its "
        "largest batch. Kept KiB per token: what one forward keeps for the backward (saved-tensor hooks; the "
        "tables' rows and the weights left out), against the memory plan's analytic inventory.",
        "",
        "| backend | recompute | chunks | last layer | batch | mean tokens | samples/s | ms/step | STU TFLOP/s | "
        "MFU datasheet | MFU measured | MFU executed | peak GiB | step KiB/token | kept KiB/token | plan's kept KiB/token | cold start s | "
        + " | ".join(cats)
        + " |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cats),
    ]
    for r in result["rows"]:
        head = f"| {r['backend']} | {r['recompute']} | {r['chunks']} | {r.get('last_layer', 'all')} | {r['batch']} |"
        if r.get("oom"):
            lines.append(head + " out of memory |")
            continue
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        per_token = f"{r['step_kib_per_token']:.1f}" if r["step_kib_per_token"] is not None else "-"
        shares = " | ".join(f"{r['breakdown'][c]:.0%}" for c in cats)
        lines.append(
            f"{head} {r['mean_tokens']:,.0f} | {r['samples_per_s']:,.0f} | {r['step_ms']:.1f} | "
            f"{r['stu_tflops']:.0f} | {r['mfu_datasheet']:.1%} | {r['mfu_measured']:.1%} | "
            f"{r['mfu_executed']:.1%} | {peak} | "
            f"{per_token} | {r['kept_kib_per_token']:.2f} | {r['plan_kept_kib_per_token']:.2f} | "
            f"{r['cold_start_s']:.1f} | {shares} |"
        )
    measured = [r for r in result["rows"] if not r.get("oom")]
    if measured:
        last = measured[-1]
        lines += [
            "",
            f"Kernels by device time, {last['backend']}, {last['recompute']}, {last['chunks']} chunk(s), "
            f"batch {last['batch']} (per step):",
            "",
            "| kernel | category | ms | launches |",
            "|---|---|---:|---:|",
        ]
        lines += [
            f"| `{k['name']}` | {k['category']} | {k['ms_per_step']:.2f} | {k['calls_per_step']:.0f} |"
            for k in last["top_kernels"]
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
