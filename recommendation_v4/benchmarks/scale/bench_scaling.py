"""Scaling over processes: samples/s of the training step on 1 and N processes of one machine, the
same model, launched by torchrun exactly like a run (real loader slices, DDP for the dense model,
the embedding backend's own exchange), vs the one-process run measured in the same call.

Weak scaling (default): a fixed batch per process, global batch = processes x batch; strong
scaling (``--scaling strong``): one global batch split over the processes. Every world size
times the same span of the stream (``--warmup-samples`` untimed, then ``--samples`` timed, in
whole global batches), so each trains on the same data; rank 0 reports after a barrier. With the
plain backend every rank holds every table: the run checks the replicas ended identical.

    python benchmarks/scale/bench_scaling.py --data-path ../data --worlds 1 2 --per-rank-batch 256 --label gpu-ref ...
    python benchmarks/scale/bench_scaling.py --data-path data --worlds 1 2 --scaling strong --label cpu-gloo

A row too long for one sitting is finished by a later call on the same machine with
``--continue-row`` (the same flags): its repeats are added to the saved row of that label.

Any config flag passes through (model shape, backend, workers). The store must exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import torch
from harness import RESULTS, command_line, cpu_model, device_name, save_labelled_row

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import add_config_arguments, config_from_args
from dlrmv4.distributed.liveness import exit_process


def _replace(cfg: BenchmarkConfig, overrides: dict) -> BenchmarkConfig:
    sections: dict[str, dict] = {}
    for (section, name), value in overrides.items():
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})


def real_table_rows(plan_world: int, world: int, store_counts: tuple[int, int, int]) -> dict:
    """Overrides giving every table Yambda-5B's rows x world / plan_world: each of ``world`` ranks
    then holds what one of ``plan_world`` ranks holds in the real job's row-wise plan (none: 0).
    The uid table keeps its rows (the raw uid is the row), and the item, artist and album tables
    at least the store's counts (its ids index them)."""
    if not plan_world:
        return {}
    from dlrmv4.config import SamplerConfig
    from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
    from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS

    def scaled(rows: int) -> int:
        return -(-rows * world // plan_world)

    real = SamplerConfig()
    out = {
        ("embeddings", f"{name}_rows"): max(scaled(rows), count)
        for name, rows, count in zip(("item", "artist", "album"), YAMBDA_5B_TABLE_COUNTS, store_counts)
    }
    out.update(
        {
            ("sampler", f"{name}_rows"): scaled(getattr(real, f"{name}_rows"))
            for name in CONTEXTUAL_FEATURES
            if name != "uid"
        }
    )
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank of one world size (started by torchrun from ``main``)."""
    from dlrmv4.data.loader import make_window_loader
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.store import open_store
    from dlrmv4.distributed.process_start import start_cluster
    from dlrmv4.model.embeddings import store_table_counts
    from dlrmv4.plan.explain import refusal
    from dlrmv4.plan.machine import plan_for_run
    from dlrmv4.plan.resolve import resolved_config
    from dlrmv4.train.prefetch import with_next
    from dlrmv4.train.run import seed_everything, start_run
    from dlrmv4.train.trainer import build_trainer

    world = int(os.environ["WORLD_SIZE"])
    base = config_from_args(args)
    gbs = args.per_rank_batch * world if args.scaling == "weak" else args.per_rank_batch
    store = open_store(store_dir(base.dataset))
    cfg = _replace(
        base, {("loader", "batch_size"): gbs, **real_table_rows(args.real_tables_of, world, store_table_counts(store))}
    )
    cluster = start_cluster(cfg.distributed)
    device = cluster.device
    # The memory plan, as the train command makes it: chunks, recompute and (TorchRec) which tables
    # live in host memory, for this world size on this machine.
    plan = plan_for_run(cfg, cluster, store_table_counts(store))
    if not plan.fits:
        raise SystemExit(f"[dlrmv4] error: {refusal(plan)}")
    cfg = resolved_config(plan, cfg)
    runlog, resume_from = start_run(cfg, cluster, restart=True)  # steps on bare batches: no run to resume
    seed_everything(cfg.seed)
    trainer = build_trainer(cfg, store, cluster, runlog, resume_from, log=lambda _: None)
    model, embeddings = trainer.model, trainer.embeddings
    loader = make_window_loader(
        store,
        trainer.windows,
        cfg,
        drop_last=True,
        rank=cluster.rank,
        world_size=world,
        worker_start=trainer.worker_start,
        dedup_ids=trainer.dedup_ids,
    )
    stream = iter(loader)
    plan = loader.dataset.plan
    warmup, steps = args.warmup_samples // gbs, args.samples // gbs
    if len(plan) < warmup + 2 * steps or steps < 1:
        raise SystemExit(f"the store has {len(plan)} global batches of {gbs}; lower --warmup-samples/--samples")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def paired(batches):  # with the sparse-dist pipeline each step starts the next batch's ids
        return with_next(batches) if trainer.step.pipelined else ((batch, None) for batch in batches)

    pairs = paired(batch.to(device, non_blocking=True) for batch in stream)
    tokens = 0
    started = 0.0
    for i in range(warmup + steps):
        batch, upcoming = next(pairs)
        if i == warmup:
            sync()
            cluster.barrier()
            started = time.perf_counter()
        if i >= warmup:
            tokens += batch.total_tokens
        trainer.step(batch, i, plan[i].window, upcoming)
    sync()
    cluster.barrier()
    seconds = time.perf_counter() - started
    # The bare step: the next batches already in device memory (no loader, no host-to-device copy);
    # the first is the one whose ids the last timed step sent ahead.
    bare_batches = [batch for batch, _ in itertools.islice(pairs, min(steps, len(plan) - warmup - steps))]
    sync()
    cluster.barrier()
    bare_started = time.perf_counter()
    for j, (batch, upcoming) in enumerate(paired(bare_batches)):
        trainer.step(batch, warmup + steps + j, plan[warmup + steps + j].window, upcoming)
    sync()
    cluster.barrier()
    bare_seconds = time.perf_counter() - bare_started
    if args.profile:
        profile_bare_steps(trainer, bare_batches[:10], plan, warmup + steps, cluster.is_main)
    trainer.finite.check()
    tokens_all = cluster.gather(tokens)
    # Replicas (plain backend) and dense weights must be identical on every rank.
    digest = hashlib.sha256()
    for name, parts in sorted(embeddings.live_tables().items()):
        for part, t in sorted(parts.items()):
            if t is not None and not hasattr(t, "local_shards"):
                digest.update(t.detach().cpu().numpy().tobytes())
    for _, t in sorted(model.state_dict().items()):
        digest.update(t.detach().cpu().numpy().tobytes())
    digests = cluster.gather(digest.hexdigest())
    if cluster.is_main:
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        Path(args.worker_out).write_text(
            json.dumps(
                {
                    "world_size": world,
                    "global_batch": gbs,
                    "per_rank_batch": gbs // world,
                    "steps": steps,
                    "seconds": seconds,
                    "samples_per_s": steps * gbs / seconds,
                    "bare_steps": len(bare_batches),
                    "bare_samples_per_s": len(bare_batches) * gbs / bare_seconds,
                    "mean_history_tokens": sum(tokens_all) / (steps * gbs),
                    "peak_gib_rank0": peak,
                    "replicas_identical": len(set(digests)) == 1,
                    "backend": embeddings.backend,
                    "chunks": cfg.train.chunks,
                    "placement": cfg.embeddings.placement if embeddings.backend == "torchrec" else None,
                    "threads_per_rank": torch.get_num_threads(),
                }
            )
        )
    cluster.shutdown()


def profile_bare_steps(trainer, batches, plan, first_step: int, print_it: bool) -> None:
    """Where the time of a few bare steps goes (rank 0 prints the profiler's tables)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for j, batch in enumerate(batches):
            trainer.step(batch, first_step + j, plan[first_step + j].window)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if print_it:
        averages = prof.key_averages()
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        print(f"profile of {len(batches)} bare steps, by device time:\n" + averages.table(sort_by=sort, row_limit=25))
        print("by host time:\n" + averages.table(sort_by="cpu_time_total", row_limit=25), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    parser.add_argument(
        "--worlds", type=int, nargs="+", default=[1, 2], help="process counts (the first is the baseline)"
    )
    parser.add_argument(
        "--per-rank-batch", type=int, default=256, help="batch per process (weak) or the global batch (strong)"
    )
    parser.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    parser.add_argument("--warmup-samples", type=int, default=10_240, help="untimed samples first (compile, autotune)")
    parser.add_argument("--samples", type=int, default=25_600, help="timed samples")
    parser.add_argument("--label", default=None, help="row name in results/scaling (default: the device)")
    parser.add_argument("--no-save", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where scaling.json and .md are kept")
    parser.add_argument("--profile", action="store_true", help="print a profile of 10 bare steps per process count")
    parser.add_argument(
        "--real-tables-of",
        type=int,
        default=0,
        metavar="N",
        help="every table at Yambda-5B's rows x processes / N: each rank holds its share of the "
        "N-GPU row-wise plan (0: the config's tables)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="times each world size runs, alternating")
    parser.add_argument(
        "--continue-row",
        action="store_true",
        help="add these repeats to the saved row of the same label and device (a later call on the same machine)",
    )
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.worker_out:
        worker(args)
        exit_process(0)  # a rank of several: no interpreter teardown (see exit_process)
    config_from_args(args)  # a bad flag fails here, once
    passthrough = [a for a in sys.argv[1:]]
    results = _saved_results(args) if args.continue_row else []
    first_repeat = results[-1]["repeat"] + 1 if results else 0
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(first_repeat + r, w) for r in range(args.repeats) for w in args.worlds]
        for i, (repeat, world) in enumerate(runs):
            out = Path(tmp) / f"world{world}.{repeat}.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={world}",
                __file__,
                *passthrough,
                "--worker-out",
                str(out),
            ]
            env = dict(os.environ)
            # Each rank gets its share of the cores (torchrun alone would give it one thread), as
            # run_and_time.sh does.
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"world size {world} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
            if args.profile:
                print(proc.stdout[-20000:])
            results.append({**json.loads(out.read_text()), "repeat": repeat})
            print(f"world {world} (repeat {repeat}): {results[-1]['samples_per_s']:,.0f} samples/s", flush=True)
            if (i + 1) % len(args.worlds) == 0:
                row = _row(args, results)
                if not args.no_save:  # after every whole repeat: a call cut short keeps the repeats it finished
                    _save(row, args.results_dir)
    print(_table([row]))


def _saved_results(args: argparse.Namespace) -> list[dict]:
    """The repeats already saved in the row this call continues; it must exist, on this device, at these worlds."""
    label = _label(args)
    path = args.results_dir / "scaling.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    row = next((r for r in rows if r["label"] == label), None)
    if row is None:
        raise SystemExit(f"--continue-row: no saved row labelled {label!r} in {path}")
    if row["device"] != _device_name() or sorted({r["world_size"] for r in row["results"]}) != sorted(args.worlds):
        raise SystemExit(f"--continue-row: row {label!r} was measured on {row['device']} at other process counts")
    return row["results"]


def _label(args: argparse.Namespace) -> str:
    return args.label or ("gpu" if torch.cuda.is_available() else "cpu")


def _row(args: argparse.Namespace, results: list[dict]) -> dict:
    """The results so far as one labelled row, each speedup against the baseline world size of its repeat."""
    for r in results:
        base = next(b for b in results if b["repeat"] == r["repeat"] and b["world_size"] == args.worlds[0])
        for kind in ("", "bare_"):
            r[f"{kind}speedup"] = r[f"{kind}samples_per_s"] / base[f"{kind}samples_per_s"]
            r[f"{kind}efficiency"] = r[f"{kind}speedup"] / (r["world_size"] / base["world_size"])
    cfg = config_from_args(args)
    return {
        "label": _label(args),
        "device": _device_name(),
        "torch": torch.__version__,
        "scaling": args.scaling,
        "d_model": cfg.model.d_model,
        "num_layers": cfg.model.num_layers,
        "max_seq_len": cfg.sampler.max_seq_len,
        "num_workers": cfg.loader.num_workers,
        "real_tables_of": args.real_tables_of,
        "qcomm": cfg.embeddings.qcomm,
        "rank_slicing": cfg.loader.rank_slicing,
        "sparse_pipeline": cfg.train.sparse_pipeline,
        "dedup_ids": cfg.embeddings.dedup_ids and results[0]["backend"] == "torchrec",
        "repeats_finished": results[-1]["repeat"] + 1,
        "results": results,
    }


def _device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {device_name('cuda')}"
    return f"{cpu_model()} CPU, {os.cpu_count()} cores"


def _table(rows: list[dict]) -> str:
    lines = [
        "| row | device | scaling | model D x layers, max seq | backend | tables, all-to-all, slicing | processes "
        "| repeat | batch / process | global batch | mean history tokens | loop samples/s | loop speedup (efficiency) "
        "| bare step samples/s | bare speedup (efficiency) | replicas identical |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        tables = f"1/{row['real_tables_of']} of Yambda-5B per rank" if row.get("real_tables_of") else "config's"
        setup = f"{tables}, {row.get('qcomm', 'none')}, {row.get('rank_slicing', 'contiguous')}"
        if row["results"][0]["backend"] == "torchrec" and "sparse_pipeline" in row:
            setup += ", pipelined ids" if row["sparse_pipeline"] else ", ids not pipelined"
            setup += ", distinct ids looked up" if row.get("dedup_ids") else ""
        for r in row["results"]:
            lines.append(
                f"| {row['label']} | {row['device']} | {row['scaling']} | {row['d_model']} x "
                f"{row['num_layers']}, {row['max_seq_len']} | {r['backend']} | {setup} | {r['world_size']} "
                f"| {r.get('repeat', 0)} | "
                f"{r['per_rank_batch']} | {r['global_batch']} | {r['mean_history_tokens']:.0f} | "
                f"{r['samples_per_s']:,.0f} | {r['speedup']:.2f}x ({r['efficiency']:.0%}) | "
                f"{r['bare_samples_per_s']:,.0f} | {r['bare_speedup']:.2f}x ({r['bare_efficiency']:.0%}) | "
                f"{'yes' if r['replicas_identical'] else 'NO'} |"
            )
    spreads = [spread_line(row) for row in rows]
    return "\n".join(lines + ([""] if any(spreads) else []) + [line for line in spreads if line])


def spread_line(row: dict) -> str:
    """The loop speedup's spread over the repeats, per world size (rows measured more than once)."""
    parts = []
    for world in sorted({r["world_size"] for r in row["results"]})[1:]:
        speedups = sorted(r["speedup"] for r in row["results"] if r["world_size"] == world)
        if len(speedups) > 1:
            parts.append(
                f"{world} processes: {speedups[0]:.2f}x / {statistics.median(speedups):.2f}x / "
                f"{speedups[-1]:.2f}x over {len(speedups)} repeats"
            )
    return f"- {row['label']}: loop speedup min / median / max: " + "; ".join(parts) if parts else ""


def _save(row: dict, results_dir: Path) -> None:
    save_labelled_row(
        "scaling",
        row,
        (
            "Scaling over processes of one machine, vs one process in the same call; efficiency = speedup / "
            "process ratio. 'loop': the training step fed by the real loader (each rank builds its slice, pinned "
            "host-to-device copy); 'bare step': the same step on batches already in device memory (DDP dense model "
            "and the backend's table exchange included). Both cover the same span of the data for every process "
            "count. 'replicas identical': every rank's dense weights (and plain-backend tables) hashed equal at "
            "the end."
        ),
        _table,
        device="cuda" if torch.cuda.is_available() else "cpu",
        out=results_dir,
        command=command_line(without=("--results-dir",)),
    )


if __name__ == "__main__":
    main()
