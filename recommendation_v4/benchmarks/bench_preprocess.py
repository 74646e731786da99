"""Preprocessing throughput and peak memory at two synthetic sizes (issue goal: >= 2 M events/s on
2 cores, peak RSS flat in the dataset size and <= 4 GB).

Each measurement runs in a fresh child process that reports its own peak RSS. The baseline in the
same run is the floor of any streaming preprocessor: reading the same columns of the same parquet
file once with pyarrow (also in a fresh child).

    python benchmarks/bench_preprocess.py                      # medium (~5M) and 50m (~49M events)
    python benchmarks/bench_preprocess.py --sizes tiny small   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import RESULTS, command_line, write_results

GOAL_EVENTS_PER_S = 2e6
GOAL_RSS_BYTES = 4 * 2**30

CHILD_PREPROCESS = """
import json, resource, sys, time
from pathlib import Path
from dlrmv4.config import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.yambda_schema import RawFiles
root, size, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
cfg = load_config("synthetic-" + size)
t = time.perf_counter()
meta = preprocess(RawFiles.under(root, size), out, cfg.dataset, cfg.preprocess, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "events": meta["counts"]["raw_events"],
                  "anchors": meta["counts"]["anchors"],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

CHILD_READ = """
import json, resource, sys, time
import pyarrow.parquet as pq
from dlrmv4.data.preprocess import RAW_COLUMNS
t = time.perf_counter()
rows = 0
for batch in pq.ParquetFile(sys.argv[1]).iter_batches(batch_size=4_000_000, columns=RAW_COLUMNS):
    rows += batch.num_rows
print(json.dumps({"seconds": time.perf_counter() - t, "events": rows,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def _child(code: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(size: str, work: Path, seed: int) -> dict:
    from dlrmv4.data.synthetic import generate

    raw_root = work / f"raw-{size}"
    t = time.perf_counter()
    files = generate(raw_root, size, seed, progress=False)
    gen_s = time.perf_counter() - t
    read = _child(CHILD_READ, str(files.multi_event))
    run = _child(CHILD_PREPROCESS, str(raw_root), size, str(work / f"store-{size}"))
    return {
        "size": size,
        "events": run["events"],
        "anchors": run["anchors"],
        "generate_s": gen_s,
        "read_s": read["seconds"],
        "read_peak_rss": read["peak_rss"],
        "preprocess_s": run["seconds"],
        "peak_rss": run["peak_rss"],
        "events_per_s": run["events"] / run["seconds"],
    }


def table(rows: list[dict]) -> str:
    lines = [
        "| size | events | preprocess s | M events/s | vs goal 2 M/s | vs parquet read | peak RSS GB | RSS vs smallest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base_rss = rows[0]["peak_rss"]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['events']:,} | {r['preprocess_s']:.2f} | {r['events_per_s'] / 1e6:.2f} | "
            f"{r['events_per_s'] / GOAL_EVENTS_PER_S:.2f}x | {r['preprocess_s'] / r['read_s']:.1f}x slower | "
            f"{r['peak_rss'] / 2**30:.2f} | {r['peak_rss'] / base_rss:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["medium", "50m"])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--work-dir", default=None, help="where to put generated data (default: a temp dir)")
    parser.add_argument("--out", default=str(RESULTS / "preprocess"), help="result path without extension")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        rows = [measure(size, Path(tmp), args.seed) for size in args.sizes]
    text = table(rows)
    print(text)
    info = {"goal_events_per_s": GOAL_EVENTS_PER_S, "goal_peak_rss_bytes": GOAL_RSS_BYTES, "rows": rows}
    out = Path(args.out)
    write_results(
        out.name, info, f"`{command_line()}` on {os.cpu_count()} CPUs\n\n{text}", device="cpu", out=out.parent
    )


if __name__ == "__main__":
    main()
