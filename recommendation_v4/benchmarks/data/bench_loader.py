"""The loader at scale: samples/s of one loader worker from a store, page cache cold and warm, and
the node's total with every rank's workers running at once.

A worker's work is what ``WindowDataset`` does for a rank: the global batches of the run's plan
(consecutive train windows, the run's order), the rank's share of each (the run's slicing), built
by the sampler and packed for the device (``to_torch``). Measured:

- one worker, cold: the store's files dropped from the page cache first (``posix_fadvise
  DONTNEED``, no root needed), then ``--batches`` batches of rank 0 after its first (the
  worker's one-off set-up);
- the same worker again over the same batches, warm;
- the node: ``--ranks`` x ``--workers-per-rank`` processes, each taking every
  ``workers-per-rank``-th batch of its rank's plan, timed together from a barrier after their
  set-up; their samples over the slowest one's time.

The goal (issue: the loader never limits 8 GPUs) is at least ``--goal`` samples/s per node.

    python -m dlrmv4 prepare --preset synthetic-1b --data-path data/bench1b --if-missing
    python benchmarks/data/bench_loader.py --preset synthetic-1b --data-path data/bench1b --workers-per-rank 2
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

from harness import RESULTS, command_line, cpu_model, write_results

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import load_config
from dlrmv4.data.loader import WindowDataset
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import open_store, store_files
from dlrmv4.parallel import usable_cores


def dataset(cfg: BenchmarkConfig, rank: int, ranks: int) -> WindowDataset:
    store = open_store(store_dir(cfg.dataset))
    return WindowDataset(
        store,
        range(store.num_windows - 1),
        cfg.sampler,
        batch_size=cfg.loader.batch_size,
        rank=rank,
        world_size=ranks,
        order=cfg.loader.window_order,
        slicing=cfg.loader.rank_slicing,
        drop_last=True,  # whole global batches only, as training takes them
    )


def run_worker(
    cfg: BenchmarkConfig, rank: int, ranks: int, worker: int, workers: int, batches: int, start=None
) -> tuple[int, int, float]:
    """(samples, history tokens, seconds) of ``batches`` batches of this worker's share of rank
    ``rank``'s plan, after its first batch (the worker's one-off set-up: the store opened, the item
    table packed). ``start``: a barrier every process of the node passes before its timed batches."""
    data = dataset(cfg, rank, ranks)
    data.plan = data.plan[worker::workers]
    stream = iter(data)
    next(stream)
    if start is not None:
        start.wait()
    samples = tokens = 0
    started = time.perf_counter()
    for batch in itertools.islice(stream, batches):
        samples += batch.num_samples
        tokens += batch.total_tokens
    return samples, tokens, time.perf_counter() - started


def _node_worker(job: tuple, start, results) -> None:
    results.put(run_worker(*job, start=start))


def drop_from_page_cache(path: Path) -> int:
    """Ask the kernel to drop the store's pages from its cache; the bytes asked for."""
    total = 0
    for f in store_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += f.stat().st_size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-1b")
    parser.add_argument("--data-path", default="data/bench1b")
    parser.add_argument("--global-batch", type=int, default=8_192, help="the reference's GBS")
    parser.add_argument("--ranks", type=int, default=8, help="ranks of the node (GBS / ranks samples per batch)")
    parser.add_argument("--workers-per-rank", type=int, default=2)
    parser.add_argument("--batches", type=int, default=8, help="batches per worker in each measurement")
    parser.add_argument("--goal", type=float, default=8 * 2_500, help="samples/s the node must load")
    parser.add_argument("--label", default="", help="suffix of the results files")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    cfg = load_config(
        args.preset, None, {("dataset", "data_path"): args.data_path, ("loader", "batch_size"): args.global_batch}
    )
    path = store_dir(cfg.dataset)
    if not (path / "meta.json").exists():
        raise SystemExit(f"no store at {path}: prepare it first (see this script's docstring)")
    store_bytes = drop_from_page_cache(path)
    rows = {}
    for cache in ("cold", "warm"):
        samples, tokens, seconds = run_worker(cfg, 0, args.ranks, 0, 1, args.batches)
        rows[cache] = {"samples": samples, "tokens": tokens, "seconds": seconds, "samples_per_s": samples / seconds}
        print(cache, rows[cache], flush=True)
    processes = args.ranks * args.workers_per_rank
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(processes), context.Queue()
    jobs = [
        (cfg, rank, args.ranks, worker, args.workers_per_rank, args.batches)
        for rank in range(args.ranks)
        for worker in range(args.workers_per_rank)
    ]
    node = [context.Process(target=_node_worker, args=(job, start, results)) for job in jobs]
    for process in node:
        process.start()
    done = [results.get() for _ in node]
    for process in node:
        process.join()
    seconds = max(s for *_, s in done)  # timed together from the barrier: the node takes the slowest's time
    samples = sum(n for n, _, _ in done)
    rows["node"] = {
        "samples": samples,
        "tokens": sum(t for _, t, _ in done),
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "processes": processes,
    }
    print("node", rows["node"], flush=True)
    result = {
        "preset": args.preset,
        "store": path.name,
        "store_gb": store_bytes / 1e9,
        "train_events": open_store(path).train.num_events,
        "global_batch": cfg.loader.batch_size,
        "ranks": args.ranks,
        "workers_per_rank": args.workers_per_rank,
        "cores": usable_cores(),
        "max_seq_len": cfg.sampler.max_seq_len,
        "goal_samples_per_s": args.goal,
        "rows": rows,
        "command": command_line(),
    }
    write_results(
        "loader" + (f"_{args.label}" if args.label else ""), result, table(result), device="cpu", out=args.out
    )
    print(table(result))


def table(r: dict) -> str:
    per_rank = r["global_batch"] // r["ranks"]
    lines = [
        f"The loader on {r['store']} ({r['train_events']:,} train events, {r['store_gb']:.1f} GB; {r['cores']} usable "
        f"cores of {cpu_model()}): rank shares of {per_rank:,} samples (GBS {r['global_batch']:,} over {r['ranks']} "
        f"ranks, up to {r['max_seq_len']:,} tokens each), built and packed as a loader worker does.",
        "",
        "| measurement | processes | samples | mean tokens | seconds | samples/s | vs the node's goal |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label in (("cold", "one worker, page cache cold"), ("warm", "one worker, warm"), ("node", "the node")):
        row = r["rows"][name]
        lines.append(
            f"| {label} | {row.get('processes', 1)} | {row['samples']:,} | {row['tokens'] / row['samples']:,.0f} | "
            f"{row['seconds']:.1f} | {row['samples_per_s']:,.0f} | {row['samples_per_s'] / r['goal_samples_per_s']:.2f}x |"
        )
    lines += ["", f"Command: `{r['command']}`"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
