"""One rank of the real job on one GPU: Yambda-5B's tables at this rank's share of the 8-GPU
row-wise plan, 1,024 samples per step (GBS 8,192 over 8 GPUs) at the real length mix with
Zipf-skewed ids, at the chunk count, recompute mode and table placement the memory plan picks for
8 GPUs like this one; against the fastest single-chunk batch on the same tables and GPU.

The memory plan is made for 8 ranks of this GPU (``--host-memory-gib``: the host RAM of one
8-GPU node, for tables the plan puts in host memory). This process then holds rank 0's share of
every table (the plan's rows on its fullest rank, each table's rows / 8) with TorchRec, row-wise
over one rank, the plan's placements, and runs ``TrainStep`` over 1,024-sample slices packed as
the loader packs them (each distinct history id looked up once, with ``embeddings.dedup_ids``): one
lookup, the planned chunks, one fused sparse update, one Adam step. What a single GPU cannot show: the
embedding all-to-all (one rank sends nothing).

    python benchmarks/step/bench_rehearsal.py --steps 50             # on a GPU (TorchRec installed)
    python benchmarks/step/bench_rehearsal.py --smoke                # tiny shapes on the CPU (the script runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from bench_end_to_end import start_single_process_group
from harness import SMOKE_MODEL, command_line, device_name, git_commit, sync, write_results
from length_mix import jagged_lengths
from model_inputs import random_table_batch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.model.embeddings import looks_up_distinct_ids, make_embeddings, table_specs
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.ops.attention_kernels import ATTENTION_KERNEL_CHOICES
from dlrmv4.plan.explain import describe, refusal
from dlrmv4.plan.resolve import resolved_config
from dlrmv4.plan.search import make_memory_plan
from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS
from dlrmv4.train.optim import FiniteMonitor
from dlrmv4.train.step import TrainStep

PLAN_WORLD = 8
SLICE = 1_024  # GBS 8,192 over 8 ranks
POOL = 4  # distinct batches kept on the device, used in turn
WARM_STEPS = 4


def rank_config(
    plan, cfg: BenchmarkConfig, smoke: bool, sparse_pipeline: bool = True, attention_kernels: str = "auto"
) -> tuple[BenchmarkConfig, dict[str, int]]:
    """The config of one process holding rank 0's share of every table, as the 8-rank plan lays it."""
    planned = resolved_config(plan, cfg)
    rows = {s.name: math.ceil(s.rows / PLAN_WORLD) for s in table_specs(cfg, *YAMBDA_5B_TABLE_COUNTS)}
    if smoke:
        rows = {name: 1_000 for name in rows}
    emb = dataclasses.replace(
        planned.embeddings,
        embedding_backend="torchrec",
        item_rows=rows["item"],
        artist_rows=rows["artist"],
        album_rows=rows["album"],
        sharding_types="*=row_wise",
    )
    sampler = dataclasses.replace(planned.sampler, **{f"{name}_rows": rows[name] for name in CONTEXTUAL_FEATURES})
    train = dataclasses.replace(planned.train, learning_rate=1e-4, warmup_steps=100, sparse_pipeline=sparse_pipeline)
    loader = dataclasses.replace(planned.loader, batch_size=SLICE)
    model = dataclasses.replace(planned.model, attention_kernels=attention_kernels)
    out = dataclasses.replace(planned, model=model, embeddings=emb, sampler=sampler, train=train, loader=loader)
    if smoke:
        model = dataclasses.replace(out.model, **SMOKE_MODEL, kernels="pytorch")
        out = dataclasses.replace(
            out,
            model=model,
            sampler=dataclasses.replace(sampler, max_seq_len=128),
            embeddings=dataclasses.replace(emb, placement=""),
        )
    return out, rows


def timed(step: TrainStep, batches, steps: int, first: int, device: torch.device) -> float:
    """Seconds for ``steps`` steps over ``batches`` in turn (after the warm-up)."""
    sync(device)
    started = time.perf_counter()
    for i in range(steps):  # with the sparse-dist pipeline, each step sends the next batch's ids
        step(batches[i % len(batches)], first + i, 0, batches[(i + 1) % len(batches)] if i + 1 < steps else None)
    sync(device)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps of 1,024 samples")
    parser.add_argument(
        "--baseline-batches",
        type=int,
        nargs="+",
        default=[128, 256],
        help="single-chunk batch sizes to find the fastest one",
    )
    parser.add_argument("--baseline-steps", type=int, default=16)
    parser.add_argument("--id-skew", type=float, default=1.2, help="Zipf exponent of every table's ids")
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        default=2048.0,
        help="host RAM of one 8-GPU node, for the plan's host-memory tables",
    )
    parser.add_argument(
        "--sparse-pipeline",
        default="true",
        choices=("true", "false"),
        help="the next batch's ids distributed while a step computes (train.sparse_pipeline)",
    )
    parser.add_argument(
        "--attention-kernels",
        default="auto",
        choices=ATTENTION_KERNEL_CHOICES,
        help="kernels of the STU layers' attention (model.attention_kernels)",
    )
    parser.add_argument("--label", default="", help="suffix of the results file name")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU; nothing saved")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    name = device_name(device)
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80 << 30
    cfg = load_config("yambda-5b")
    cfg = dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, embedding_backend="torchrec"))
    plan = make_memory_plan(
        cfg,
        world_size=PLAN_WORLD,
        gpus_per_node=PLAN_WORLD,
        device_kind="cuda",
        device_memory_bytes=device_bytes,
        host_memory_bytes=int(args.host_memory_gib * 2**30),
        table_counts=YAMBDA_5B_TABLE_COUNTS,
        backend="torchrec",
    )
    print(describe(plan), flush=True)
    if not plan.fits:
        sys.exit(f"[dlrmv4] error: {refusal(plan)}")
    rcfg, rows = rank_config(plan, cfg, args.smoke, args.sparse_pipeline == "true", args.attention_kernels)
    start_single_process_group(device)
    torch.manual_seed(0)
    model = DlrmHSTU(rcfg.model, seed=0).to(device)
    built = time.perf_counter()
    embeddings = make_embeddings(table_specs(rcfg, 0, 0, 0), rcfg, device, seed=0)
    sync(device)
    init_s = time.perf_counter() - built
    resting = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step = TrainStep(model, embeddings, rcfg.train, FiniteMonitor(device))
    rng = np.random.default_rng(0)
    max_len = rcfg.sampler.max_seq_len
    lengths = [jagged_lengths("jagged", SLICE, rng, max_len) for _ in range(POOL)]
    # The lookup's ids as the loader packs them for this backend (each distinct history id once).
    dedup = looks_up_distinct_ids(rcfg, "torchrec")

    def batches(size: int) -> list:
        return [random_table_batch(n[:size], rows, rng, args.id_skew, dedup).to(device) for n in lengths]

    pool = batches(SLICE)
    for i in range(WARM_STEPS):
        step(pool[i % POOL], i, 0)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, pool, args.steps, WARM_STEPS, device)
    step.finite.check()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    rehearsal = {
        "samples_per_s": args.steps * SLICE / seconds,
        "step_ms": 1e3 * seconds / args.steps,
        "chunks": step.chunks,
        "recompute": rcfg.model.recompute,
        "peak_gib": peak / 2**30,
        "resting_gib": resting / 2**30,
        "mean_tokens": float(np.mean(np.concatenate(lengths))),
    }
    print(
        f"rehearsal: {rehearsal['samples_per_s']:,.0f} samples/s, {rehearsal['step_ms']:.0f} ms/step, "
        f"peak {rehearsal['peak_gib']:.1f} GiB",
        flush=True,
    )
    baseline = []
    for batch in args.baseline_batches:
        single = TrainStep(model, embeddings, dataclasses.replace(rcfg.train, chunks=1), FiniteMonitor(device))
        cut = batches(min(batch, SLICE))  # the pool's first lengths, ids drawn alike
        try:
            for i in range(2):
                single(cut[i], 1000 + i, 0)
            secs = timed(single, cut, args.baseline_steps, 1002, device)
        except torch.OutOfMemoryError:
            baseline.append({"batch": batch, "oom": True})
            print(f"single chunk of {batch}: out of memory", flush=True)
            del single, cut
            gc.collect()
            torch.cuda.empty_cache()
            break
        baseline.append({"batch": batch, "samples_per_s": args.baseline_steps * batch / secs})
        print(f"single chunk of {batch}: {baseline[-1]['samples_per_s']:,.0f} samples/s", flush=True)
        del single, cut
    fastest = max((b for b in baseline if not b.get("oom")), key=lambda b: b["samples_per_s"], default=None)
    result = {
        "device": name,
        "torch": torch.__version__,
        "commit": git_commit(),
        "plan": describe(plan),
        "placement": rcfg.embeddings.placement,
        "rank_rows": rows,
        "table_gib": sum(rows.values()) * rcfg.model.embedding_dim * 4 / 2**30,
        "init_s": init_s,
        "id_skew": args.id_skew,
        "sparse_pipeline": rcfg.train.sparse_pipeline,
        "attention_kernels": rcfg.model.attention_kernels,
        "dedup_ids": dedup,
        "steps": args.steps,
        "rehearsal": rehearsal,
        "baseline": baseline,
        "ratio_to_fastest": rehearsal["samples_per_s"] / fastest["samples_per_s"] if fastest else None,
        "command": command_line(),
    }
    table = _table(result)
    print(table)
    if not args.smoke:
        tag = "h200" if "H200" in name else "h100" if "H100" in name else "gpu"
        write_results(f"rehearsal_{tag}" + (f"_{args.label}" if args.label else ""), result, table, device=device)


def _table(result: dict) -> str:
    r = result["rehearsal"]
    fastest = max((b for b in result["baseline"] if not b.get("oom")), key=lambda b: b["samples_per_s"], default=None)
    ratio = f"{result['ratio_to_fastest']:.3f}" if result["ratio_to_fastest"] else "-"
    lines = [
        f"One rank of Yambda-5B at GBS 8,192 on 8 GPUs, rehearsed on one {result['device']} (commit "
        f"{result['commit']}): rank 0's share of the row-wise plan, {result['table_gib']:.1f} GiB of fp32 tables "
        f"(placement: {result['placement'] or 'all in HBM'}), 1,024 samples per step, jagged length mix (mean "
        f"{r['mean_tokens']:,.0f} tokens), Zipf({result['id_skew']:g}) ids, {result['steps']} timed steps"
        + (", each distinct history id looked up once" if result.get("dedup_ids") else "")
        + (", the next batch's ids distributed during each step" if result.get("sparse_pipeline") else "")
        + f", attention kernels {result.get('attention_kernels', 'auto')}.",
        "",
        "| device | chunks | recompute | peak GiB | resting GiB | samples/s | ms/step | fastest single chunk | ratio |",
        "|---|---:|---|---:|---:|---:|---:|---|---:|",
    ]
    best = f"{fastest['samples_per_s']:,.0f} (batch {fastest['batch']})" if fastest else "-"
    lines.append(
        f"| {result['device']} | {r['chunks']} | {r['recompute']} | {r['peak_gib']:.1f} | "
        f"{r['resting_gib']:.1f} | {r['samples_per_s']:,.0f} | {r['step_ms']:.0f} | {best} | {ratio} |"
    )
    lines += ["", "The memory plan (8 ranks of this GPU):", "", "```", result["plan"], "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
