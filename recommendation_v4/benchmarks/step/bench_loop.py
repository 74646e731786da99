"""What the streaming loop and the loader cost: samples/s of ``Trainer.run`` against the
bare training step on the same batches, already in device memory (goal: loop within 5 %).

The loop run is the real one (loader workers, pinned host-to-device copies, LR schedule,
divergence monitor, progress accounting) over the first ``--steps`` batches of the plan, with evals
and checkpoints off; the bare run calls ``trainer.step`` on those batches after one untimed pass
over them. Both alternate ``--repeats`` times from the same initial state and the medians are
compared, so a noisy shared machine hits both alike.

    python benchmarks/step/bench_loop.py                      # CPU: the embedded default (synthetic-tiny)
    python benchmarks/step/bench_loop.py --preset synthetic-small --num-workers 8 ...   # any config flags
    python benchmarks/step/bench_loop.py --label gpu-ref ...  # the row's name in results/loop_overhead.*

The store must exist (``python -m dlrmv4 prepare`` with the same data flags).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from harness import cpu_model, device_name, save_labelled_row, sync

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import add_config_arguments, config_from_args
from dlrmv4.data.loader import make_window_loader
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import open_store
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.train.run import seed_everything, start_run
from dlrmv4.train.trainer import Trainer, build_trainer


def make_trainer(cfg: BenchmarkConfig, store, device: torch.device) -> Trainer:
    """A fresh run's trainer (its run directory cleared: every run starts cold)."""
    cluster = Cluster.single(device)
    runlog, resume_from = start_run(cfg, cluster, restart=True)
    seed_everything(cfg.seed)
    return build_trainer(cfg, store, cluster, runlog, resume_from, log=lambda _: None)


def bare_seconds(cfg: BenchmarkConfig, store, device: torch.device, batches) -> float:
    trainer = make_trainer(cfg, store, device)
    for i, b in enumerate(batches):  # warm-up pass: allocator, kernels, autotuning
        trainer.step(b, i, 0)
    sync(device)
    started = time.perf_counter()
    for i, b in enumerate(batches):
        trainer.step(b, i, 0)
    sync(device)
    return time.perf_counter() - started


def loop_seconds(cfg: BenchmarkConfig, store, device: torch.device) -> float:
    trainer = make_trainer(cfg, store, device)
    history = trainer.run()
    assert history.status == "stopped" and history.steps == cfg.train.max_steps, history
    return history.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=60, help="batches in each timed run")
    parser.add_argument("--repeats", type=int, default=3, help="alternating bare/loop pairs; medians are compared")
    parser.add_argument("--label", default=None, help="row name in results/loop_overhead (default: the device)")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = config_from_args(args)
    store = open_store(store_dir(base.dataset))
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {
            ("train", "max_steps"): args.steps,
            ("train", "eval_every_data_pct"): 1.0,
            ("train", "checkpoint_every_window"): False,
            ("train", "checkpoint_every_steps"): 0,
            ("train", "checkpoint_every_seconds"): 0.0,
            ("train", "run_dir"): tmp,
        }
        cfg = _replace(base, overrides)
        loader = make_window_loader(store, list(range(store.num_windows - 1)), cfg, drop_last=True)
        batches = []
        for b in loader:
            batches.append(b.to(device))
            if len(batches) == args.steps:
                break
        if len(batches) < args.steps:
            raise SystemExit(f"the store has only {len(batches)} train batches; lower --steps")
        bare, loop = [], []
        for r in range(args.repeats):
            bare.append(bare_seconds(cfg, store, device, batches))
            loop.append(loop_seconds(cfg, store, device))
            print(f"repeat {r}: bare {bare[-1]:.2f} s, loop {loop[-1]:.2f} s", flush=True)
    samples = args.steps * cfg.loader.batch_size
    tokens = sum(b.total_tokens for b in batches) / samples
    row = {
        "label": args.label or device.type,
        "device": _device_name(device),
        "torch": torch.__version__,
        "batch_size": cfg.loader.batch_size,
        "num_workers": cfg.loader.num_workers,
        "steps": args.steps,
        "repeats": args.repeats,
        "mean_history_tokens": tokens,
        "d_model": cfg.model.d_model,
        "num_layers": cfg.model.num_layers,
        "kernels": cfg.model.kernels,
        "embedding_backend": "plain"
        if cfg.embeddings.embedding_backend in ("plain", "auto")
        else cfg.embeddings.embedding_backend,
        "bare_samples_per_s": samples / float(np.median(bare)),
        "loop_samples_per_s": samples / float(np.median(loop)),
        "bare_seconds": bare,
        "loop_seconds": loop,
    }
    row["overhead"] = row["bare_samples_per_s"] / row["loop_samples_per_s"] - 1
    print(_table([row]))
    if not args.no_save:
        _save(row, device)


def _replace(cfg: BenchmarkConfig, overrides: dict) -> BenchmarkConfig:
    sections = {}
    for (section, name), value in overrides.items():
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return device_name(device)
    return f"{cpu_model()} CPU, {torch.get_num_threads()} threads"


def _table(rows: list[dict]) -> str:
    lines = [
        "| row | device | batch | workers | model D x layers | mean history tokens | bare step samples/s | "
        "loop samples/s | loop overhead |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['device']} | {r['batch_size']} | {r['num_workers']} | "
            f"{r['d_model']} x {r['num_layers']} ({r['kernels']}) | {r['mean_history_tokens']:.0f} | "
            f"{r['bare_samples_per_s']:,.0f} | {r['loop_samples_per_s']:,.0f} | {r['overhead']:+.1%} |"
        )
    return "\n".join(lines)


def _save(row: dict, device: torch.device) -> None:
    save_labelled_row(
        "loop_overhead",
        row,
        (
            "Loop and loader cost: `Trainer.run` vs the bare step on the same batches already in device "
            "memory (medians of alternating repeats; overhead = bare / loop - 1). Plain-PyTorch embeddings."
        ),
        _table,
        device=device,
    )


if __name__ == "__main__":
    main()
