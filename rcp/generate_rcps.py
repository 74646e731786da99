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


def first_converged_samples(log: Path) -> int | None:
    """samples_count of the eval before a successful RUN_STOP (the checker's reading), else None."""
    samples, status = None, None
    for line in log.read_text().splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        record = json.loads(line[len(":::MLLOG "):])
        if record["key"] == "eval_accuracy":
            samples = int(record["metadata"]["samples_count"])
        elif record["key"] == "run_stop":
            status = record["metadata"]["status"]
    return samples if status == "success" else None


def run_one(args: argparse.Namespace, gbs: int, seed: int) -> tuple[int, int, int | None, float]:
    out = Path(args.out) / str(gbs)
    out.mkdir(parents=True, exist_ok=True)
    lr = args.lr_per_128 * gbs / 128
    cmd = [sys.executable, "-m", "dlrmv4", "train", "--restart", "--no-progress", "--preset", args.preset,
           "--data-path", args.data_path, "--batch-size", str(gbs), "--learning-rate", repr(lr),
           "--seed", str(seed), "--run-dir", str(Path(args.work) / f"{gbs}_{seed}"),
           "--log-file", str(out / f"result_{seed}.txt"), *args.extra]
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=args.env)
    if proc.returncode != 0:
        raise RuntimeError(f"run gbs={gbs} seed={seed} failed: {proc.stderr.strip()[-2000:]}")
    return gbs, seed, first_converged_samples(out / f"result_{seed}.txt"), time.perf_counter() - started


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
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    args = parser.parse_args()
    import os

    args.env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    jobs = [(gbs, seed) for gbs in args.batch_sizes for seed in range(args.first_seed, args.first_seed + args.seeds)]
    started = time.perf_counter()
    results: dict[int, dict[int, int | None]] = {gbs: {} for gbs in args.batch_sizes}
    with ThreadPoolExecutor(args.parallel) as pool:
        for gbs, seed, samples, seconds in pool.map(lambda job: run_one(args, *job), jobs):
            results[gbs][seed] = samples
            print(f"gbs {gbs} seed {seed}: {'did not converge' if samples is None else f'{samples:,} samples'} "
                  f"({seconds:.0f} s)", flush=True)
    total = time.perf_counter() - started
    print(f"{len(jobs)} runs in {total / 60:.1f} min with {args.parallel} at once", flush=True)
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
            "Generation minutes (all batch sizes)": round(total / 60, 1)}
    path = Path(args.out) / f"rcps_dlrmv4_{args.preset}.json"
    path.write_text(json.dumps(rcps, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
