"""Reference convergence points for a synthetic preset: N seeds x several global batch sizes.

Each run is ``python -m dlrmv4 train`` with its own seed, batch size and learning rate (linear in
the batch size, ``--lr-per-128`` at 128), writing its MLPerf log as
``<out>/<gbs>/result_<seed>.txt``. The RCP of a batch size lists, per seed, the ``samples_count``
of the first eval that reached the target: the format of ``rcps_dlrmv4.json`` in mlperf-logging.

    python rcp/generate_rcps.py --preset synthetic-tiny --data-path data --batch-sizes 64 128 256 \\
        --seeds 20 --parallel 8 --out rcp/synthetic-tiny
    python -m mlperf_logging.rcp_checker <dir of 10 fresh result_*.txt> --rcp_version 6.1.0 \\
        --custom_rcps rcp/synthetic-tiny/rcps_dlrmv4_synthetic-tiny.json

The store must exist (``python -m dlrmv4 prepare --preset ...``). Runs that do not converge are
recorded as such and left out of the RCP (the checker's own rule for submissions).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def read_result(log: Path) -> tuple[int | None, float] | None:
    """(samples_count of the eval before a successful RUN_STOP, else None; seconds from INIT_START to
    RUN_STOP), or None when the log has no RUN_STOP (the run did not finish)."""
    samples, status, first_ms, stop_ms = None, None, None, None
    for line in log.read_text().splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        record = json.loads(line[len(":::MLLOG "):])
        first_ms = record["time_ms"] if first_ms is None else first_ms
        if record["key"] == "eval_accuracy":
            samples = int(record["metadata"]["samples_count"])
        elif record["key"] == "run_stop":
            status, stop_ms = record["metadata"]["status"], record["time_ms"]
    if stop_ms is None:
        return None
    return (samples if status == "success" else None), (stop_ms - first_ms) / 1000


def run_one(args: argparse.Namespace, gbs: int, seed: int) -> tuple[int, int, int | None, float]:
    out = Path(args.out) / str(gbs)
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"result_{seed}.txt"
    if args.reuse and log.exists() and (finished := read_result(log)) is not None:
        return gbs, seed, *finished
    lr = args.lr_per_128 * gbs / 128
    cmd = [sys.executable, "-m", "dlrmv4", "train", "--restart", "--no-progress", "--preset", args.preset,
           "--data-path", args.data_path, "--batch-size", str(gbs), "--learning-rate", repr(lr),
           "--seed", str(seed), "--run-dir", str(Path(args.work) / f"{gbs}_{seed}"),
           "--log-file", str(log), *args.extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=args.env)
    if proc.returncode != 0:
        raise RuntimeError(f"run gbs={gbs} seed={seed} failed: {proc.stderr.strip()[-2000:]}")
    finished = read_result(log)
    if finished is None:
        raise RuntimeError(f"run gbs={gbs} seed={seed} exited 0 but its log {log} has no run_stop")
    return gbs, seed, *finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-tiny")
    parser.add_argument("--data-path", default="data")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seeds", type=int, default=20, help="seeds per batch size (references need 20)")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--lr-per-128", type=float, default=0.003, help="learning rate at batch size 128")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--out", default="rcp/synthetic-tiny")
    parser.add_argument("--work", default="runs/rcp", help="run directories (checkpoints)")
    parser.add_argument("--platform", default="", help="where the runs ran (recorded in the RCP JSON)")
    parser.add_argument("--no-json", action="store_true", help="only the result files (a fresh set to check)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep result files that already end in run_stop (resume an interrupted generation)")
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    args = parser.parse_args()
    import os

    args.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    jobs = [(gbs, seed) for gbs in args.batch_sizes for seed in range(args.first_seed, args.first_seed + args.seeds)]
    started = time.perf_counter()
    results: dict[int, dict[int, int | None]] = {gbs: {} for gbs in args.batch_sizes}
    run_seconds = 0.0
    with ThreadPoolExecutor(args.parallel) as pool:
        for gbs, seed, samples, seconds in pool.map(lambda job: run_one(args, *job), jobs):
            results[gbs][seed] = samples
            run_seconds += seconds
            print(f"gbs {gbs} seed {seed}: {'did not converge' if samples is None else f'{samples:,} samples'} "
                  f"({seconds:.0f} s)", flush=True)
    print(f"{len(jobs)} runs, {run_seconds / 60:.1f} run-minutes, {(time.perf_counter() - started) / 60:.1f} min "
          f"now with {args.parallel} at once", flush=True)
    if args.no_json:
        return
    rcps = {}
    for gbs, by_seed in results.items():
        converged = [s for _, s in sorted(by_seed.items()) if s is not None]
        rcps[f"dlrmv4_ref_{gbs}"] = {
            "Benchmark": "dlrmv4", "Creator": "dlrmv4 reference package", "When": time.strftime("%Y-%m-%d"),
            "Platform": args.platform or "unspecified", "Precision": "FP32", "BS": gbs,
            "Hyperparams": {"opt_base_learning_rate": args.lr_per_128 * gbs / 128,
                            "gradient_accumulation_steps": 1},
            "Epochs to converge": converged,
            "Runs": len(by_seed), "Not converged": len(by_seed) - len(converged),
            "Run minutes, summed over runs (all batch sizes)": round(run_seconds / 60, 1)}
    path = Path(args.out) / f"rcps_dlrmv4_{args.preset}.json"
    path.write_text(json.dumps(rcps, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
