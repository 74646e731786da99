"""Reference convergence points for a synthetic preset: N seeds x one or more global batch sizes.

Each run is ``python -m dlrmv4 train`` with its own seed and batch size, on the preset's own recipe:
its learning rates scaled linearly with the batch size from the preset's (``--learning-rate`` and
``--sparse-learning-rate`` give other rates at the preset's batch size). Each run's MLPerf log is
written as ``<out>/<gbs>/result_<seed>.txt``; the RCP of a batch size lists, per seed, the
``samples_count`` of the first eval that reached the target: the format of ``rcps_dlrmv4.json`` in
mlperf-logging. Every run's AUC curve (samples, AUC per eval) goes to ``<out>/curves.json``.

    python rcp/generate_rcps.py --preset synthetic-tiny --data-path data --batch-sizes 64 128 256 \\
        --seeds 20 --parallel 8 --out rcp/synthetic-tiny
    python rcp/generate_rcps.py --preset synthetic-medium --data-path data/medium --batch-sizes 512 \\
        --seeds 8 --devices 0 1 2 3 --out runs/rcp-medium -- --num-workers 6   # one run per GPU at a time
    python -m mlperf_logging.rcp_checker <dir of 10 fresh result_*.txt> --rcp_version 6.1.0 \\
        --custom_rcps rcp/synthetic-tiny/rcps_dlrmv4_synthetic-tiny.json

The store must exist (``python -m dlrmv4 prepare --preset ...``). Runs that do not converge are
recorded as such and left out of the RCP (the checker's own rule for submissions).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunResult:
    """One run's log: the AUC of each eval (samples, AUC), the samples of the eval that reached the target
    (None: it did not converge) and the seconds from the log's first line to RUN_STOP."""

    curve: list[tuple[int, float]] = field(default_factory=list)
    converged_at: int | None = None
    seconds: float = 0.0


def read_result(log: Path) -> RunResult | None:
    """The run in ``log``, or None when the log has no RUN_STOP (the run did not finish)."""
    result, status, first_ms, stop_ms = RunResult(), None, None, None
    for line in log.read_text().splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        record = json.loads(line[len(":::MLLOG ") :])
        first_ms = record["time_ms"] if first_ms is None else first_ms
        if record["key"] == "eval_accuracy":
            result.curve.append((int(record["metadata"]["samples_count"]), float(record["value"])))
        elif record["key"] == "run_stop":
            status, stop_ms = record["metadata"]["status"], record["time_ms"]
    if stop_ms is None:
        return None
    if status == "success" and result.curve:
        result.converged_at = result.curve[-1][0]
    result.seconds = (stop_ms - first_ms) / 1000
    return result


def preset_recipe(preset: str) -> tuple[int, float, float, str]:
    """(global batch size, learning rate, the tables' own learning rate (0: the dense one), the sequence
    model's precision) of ``preset``."""
    from dlrmv4.config_loading import load_config

    cfg = load_config(preset)
    precision = {"bfloat16": "BF16", "float16": "FP16", "float32": "FP32"}[cfg.model.sequence_dtype]
    return cfg.loader.batch_size, cfg.train.learning_rate, cfg.train.sparse_learning_rate, precision


def run_one(args: argparse.Namespace, gbs: int, seed: int, devices: queue.Queue) -> tuple[int, int, RunResult]:
    out = Path(args.out) / str(gbs)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"result_{seed}.txt"
    if args.reuse and log.exists() and (finished := read_result(log)) is not None:
        return gbs, seed, finished
    scale = gbs / args.recipe_gbs
    cmd = [
        sys.executable, "-m", "dlrmv4", "train", "--restart", "--no-progress", "--preset", args.preset,
        "--data-path", args.data_path, "--batch-size", str(gbs), "--learning-rate", repr(args.lr * scale),
        "--sparse-learning-rate", repr(args.sparse_lr * scale), "--seed", str(seed),
        "--run-dir", str(Path(args.work) / f"{gbs}_{seed}"), "--log-file", str(log),
        "--final-checkpoint", "false", *args.extra,  # a seed is never continued: its end writes no checkpoint
    ]  # fmt: skip
    device = devices.get()
    try:
        env = dict(args.env, **({"CUDA_VISIBLE_DEVICES": device} if device else {}))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        devices.put(device)
    (Path(args.work) / f"{gbs}_{seed}.console.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"run gbs={gbs} seed={seed} failed: {proc.stderr.strip()[-2000:]}")
    finished = read_result(log)
    if finished is None:
        raise RuntimeError(f"run gbs={gbs} seed={seed} exited 0 but its log {log} has no run_stop")
    return gbs, seed, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-tiny")
    parser.add_argument("--data-path", default="data")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seeds", type=int, default=20, help="seeds per batch size (references need 20)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=0.0, help="dense rate at the preset's GBS (0: its own)")
    parser.add_argument(
        "--sparse-learning-rate", type=float, default=0.0, help="tables' rate at the preset's GBS (0: its own)"
    )
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (with --devices: one per device)")
    parser.add_argument("--devices", nargs="*", default=[], help="CUDA devices, one run on each at a time")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--out", default="rcp/synthetic-tiny")
    parser.add_argument("--work", default="runs/rcp", help="run directories (checkpoints)")
    parser.add_argument("--platform", default="", help="where the runs ran (recorded in the RCP JSON)")
    parser.add_argument("--no-json", action="store_true", help="only the result files (a fresh set to check)")
    parser.add_argument(
        "--reuse", action="store_true", help="keep result files that already end in run_stop (resume a generation)"
    )
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    args = parser.parse_args()
    args.recipe_gbs, preset_lr, preset_sparse_lr, precision = preset_recipe(args.preset)
    args.lr = args.learning_rate or preset_lr
    args.sparse_lr = args.sparse_learning_rate or preset_sparse_lr  # 0: the dense rate, as in the trainer
    args.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    Path(args.work).mkdir(parents=True, exist_ok=True)
    devices: queue.Queue = queue.Queue()
    for device in args.devices or [""] * args.parallel:
        devices.put(device)
    jobs = [(gbs, seed) for gbs in args.batch_sizes for seed in range(args.first_seed, args.first_seed + args.seeds)]
    started = time.perf_counter()
    results: dict[int, dict[int, RunResult]] = {gbs: {} for gbs in args.batch_sizes}
    with ThreadPoolExecutor(devices.qsize()) as pool:
        for gbs, seed, run in pool.map(lambda job: run_one(args, *job, devices), jobs):
            results[gbs][seed] = run
            best = max(run.curve, key=lambda point: point[1], default=(0, float("nan")))
            print(
                f"gbs {gbs} seed {seed}: "
                f"{'did not converge' if run.converged_at is None else f'{run.converged_at:,} samples'} "
                f"({run.seconds:.0f} s; {len(run.curve)} evals, best AUC {best[1]:.4f} at {best[0]:,})",
                flush=True,
            )
    run_seconds = sum(run.seconds for by_seed in results.values() for run in by_seed.values())
    print(
        f"{len(jobs)} runs, {run_seconds / 60:.1f} run-minutes, {(time.perf_counter() - started) / 60:.1f} min "
        f"now with {devices.qsize()} at once",
        flush=True,
    )
    curves = {f"{gbs}/{seed}": run.curve for gbs, by_seed in results.items() for seed, run in by_seed.items()}
    (Path(args.out) / "curves.json").write_text(json.dumps(curves) + "\n")
    if args.no_json:
        return
    rcps = {}
    for gbs, by_seed in results.items():
        converged = [run.converged_at for _, run in sorted(by_seed.items()) if run.converged_at is not None]
        rcps[f"dlrmv4_ref_{gbs}"] = {
            "Benchmark": "dlrmv4",
            "Creator": "dlrmv4 reference package",
            "When": time.strftime("%Y-%m-%d"),
            "Platform": args.platform or "unspecified",
            "Precision": precision,
            "BS": gbs,
            "Hyperparams": {
                "opt_base_learning_rate": args.lr * gbs / args.recipe_gbs,
                "opt_sparse_base_learning_rate": (args.sparse_lr or args.lr) * gbs / args.recipe_gbs,
                "gradient_accumulation_steps": 1,
            },
            "Epochs to converge": converged,
            "Runs": len(by_seed),
            "Not converged": len(by_seed) - len(converged),
            "Run minutes, summed over runs (all batch sizes)": round(run_seconds / 60, 1),
        }
    path = Path(args.out) / f"rcps_dlrmv4_{args.preset}.json"
    path.write_text(json.dumps(rcps, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
