"""How long a loader's workers that start from the fork server take to their first batch, with
Python's default fork server (it imports only ``__main__``: each worker imports torch and the loader
itself) and with the server the trainer starts and waits for before RUN_START (``data/fork_server.py``: torch and
the loader imported once, in the server).

Each measurement is a fresh process: it starts the server (the trainer's way, or not at all: the
loader then starts Python's default one), then times a loader of ``--workers`` workers over the
store's first window from its creation to its first batch, the span an eval's first batch waits
inside the timed run. The server's own start is timed apart (before RUN_START in a run).

    python benchmarks/data/bench_worker_start.py                        # synthetic-tiny in data/benchtiny
    python benchmarks/data/bench_worker_start.py --workers 8 --label 16cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

from harness import RESULTS, command_line, cpu_model, write_results

MODES = {"default": "Python's default fork server", "preloaded": "the trainer's fork server (torch, the loader)"}


def probe(mode: str, store_path: str, preset: str, workers: int) -> dict[str, float]:
    """One fresh process's measurement (``--probe``): the server's start, then the first batch."""
    started = time.perf_counter()
    if mode == "preloaded":
        from dlrmv4.data.fork_server import start_fork_server

        start_fork_server()
    server_s = time.perf_counter() - started
    from dlrmv4.config_loading import load_config
    from dlrmv4.data.loader import make_window_loader
    from dlrmv4.data.store import open_store

    cfg = load_config(preset)
    cfg = dataclasses.replace(cfg, loader=dataclasses.replace(cfg.loader, num_workers=workers))
    started = time.perf_counter()
    loader = make_window_loader(open_store(store_path), [0], cfg, worker_start="forkserver")
    next(iter(loader))
    return {"server_s": server_s, "first_batch_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="synthetic-tiny")
    parser.add_argument("--data-path", default="data/benchtiny", help="where the store is (made when missing)")
    parser.add_argument("--workers", type=int, default=8, help="the loader's workers")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per mode")
    parser.add_argument("--label", default="", help="suffix of the results file names")
    parser.add_argument("--out", default=str(RESULTS), help="where the results files go")
    parser.add_argument("--probe", choices=tuple(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    store_path = str(Path(args.data_path) / "processed" / args.preset)
    if args.probe:
        print(json.dumps(probe(args.probe, store_path, args.preset, args.workers)))
        return
    subprocess.run(
        [sys.executable, "-m", "dlrmv4", "prepare", "--preset", args.preset, "--data-path", args.data_path]
        + ["--if-missing", "--no-progress"],
        check=True,
        capture_output=True,
    )
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:  # alternating, so a slow spell of the machine falls on both
            done = subprocess.run(
                [sys.executable, __file__, "--probe", mode, "--preset", args.preset, "--data-path", args.data_path]
                + ["--workers", str(args.workers)],
                check=True,
                capture_output=True,
                text=True,
            )
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    medians = {mode: statistics.median(r["first_batch_s"] for r in rows) for mode, rows in runs.items()}
    lines = [
        f"A loader of {args.workers} workers started from the fork server, to its first batch ({args.preset}, "
        f"window 0; {cpu_model()}); each a fresh process, {args.repeats} per mode.",
        "",
        "| fork server | first batch s, each run | median s | × the trainer's | server's own start s (before RUN_START) |",
        "|---|---|---:|---:|---:|",
    ]
    for mode, rows in runs.items():
        each = " / ".join(f"{r['first_batch_s']:.2f}" for r in rows)
        start = statistics.median(r["server_s"] for r in rows)
        lines.append(
            f"| {MODES[mode]} | {each} | {medians[mode]:.2f} | {medians[mode] / medians['preloaded']:.1f} | "
            f"{'-' if mode == 'default' else f'{start:.2f}'} |"
        )
    command = command_line(without=("--out",))  # where the results go is no part of what was measured
    table = "\n".join(lines) + f"\n\nCommand: `{command}`"
    print(table)
    result = {"preset": args.preset, "workers": args.workers, "runs": runs, "median_first_batch_s": medians}
    write_results("worker_start" + (f"_{args.label}" if args.label else ""), result, table, out=args.out)


if __name__ == "__main__":
    main()
