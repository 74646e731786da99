"""Preprocessing throughput and peak memory by synthetic size and by cores: the generator, then
for each core count the preprocessing pinned to that many cores (its worker processes too, one per
core), then the store's verification on the most cores.

Each measurement runs in a fresh child process pinned with ``sched_setaffinity`` (what ``taskset``
does) that reports its own peak RSS and its largest worker's (each one's VmHWM). The baseline in the same run is the
floor of any streaming preprocessor: reading the same columns of the same parquet file once with
pyarrow on one core (also in a fresh child).

    python benchmarks/data/bench_preprocess.py                                  # medium and 50m, all cores
    python benchmarks/data/bench_preprocess.py --sizes 50m --cores 1 2          # a cores curve
    python benchmarks/data/bench_preprocess.py --sizes 1b --cores 1 2 4 8 16 --work-dir /data/bench --label 1b
    python benchmarks/data/bench_preprocess.py --sizes 50m --cores 2 --rows-per-chunk 1000000 2000000 4000000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

from harness import RESULTS, command_line, cpu_model, write_results

GOAL_EVENTS_PER_S = 2e6
EARLIER_CHUNK_ROWS = 4_000_000  # what rows measured before the --rows-per-chunk option ran with
GOAL_RSS_BYTES = 4 * 2**30

# Peaks are each process's own VmHWM (the high-water mark of its address space since exec). The
# rusage figures would count, for a spawned worker, the RSS of the process it was forked from
# before the exec (Linux folds the old address space's peak into ru_maxrss), which overstated the
# workers by the parent's size.
CHILD_PREPROCESS = """
import json, os, shutil, sys, threading, time
from pathlib import Path
os.sched_setaffinity(0, range(int(sys.argv[4])))
from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.yambda_schema import RawFiles

def hwm(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0

worker_peaks = {}
def watch_workers():  # the workers' high-water marks, read until they exit
    me = f"PPid:\\t{os.getpid()}\\n"
    while True:
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and me in (d / "status").read_text():
                    worker_peaks[d.name] = max(worker_peaks.get(d.name, 0), hwm(d.name))
            except OSError:
                pass
        time.sleep(0.1)

if __name__ == "__main__":
    threading.Thread(target=watch_workers, daemon=True).start()
    root, size, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    cfg = load_config("synthetic-" + size, None, {("preprocess", "rows_per_chunk"): int(sys.argv[5])})
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    meta = preprocess(RawFiles.under(root, size), out, cfg.dataset, cfg.preprocess, progress=False)
    print(json.dumps({"seconds": time.perf_counter() - t, "events": meta["counts"]["raw_events"],
                      "anchors": meta["counts"]["anchors"], "train_events": meta["counts"]["train_events"],
                      "append_s": meta["append_seconds"], "workers": meta["workers"],
                      "peak_rss": hwm("self"), "worker_peak_rss": max(worker_peaks.values(), default=0),
                      "store_bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}))
"""

CHILD_VERIFY = """
import json, os, sys, time
from pathlib import Path
os.sched_setaffinity(0, range(int(sys.argv[2])))
from dlrmv4.data.verify import verify_store
t = time.perf_counter()
problems = verify_store(Path(sys.argv[1]), progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "problems": problems}))
"""

CHILD_READ = """
import json, resource, sys, time
import pyarrow.parquet as pq
from dlrmv4.data.raw_chunks import RAW_COLUMNS
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


def measure(size: str, work: Path, seed: int, cores: list[int], chunk_rows: list[int]) -> list[dict]:
    from dlrmv4.data.synthetic import generate
    from dlrmv4.parallel import usable_cores

    raw_root = work / f"raw-{size}"
    t = time.perf_counter()
    files = generate(raw_root, size, seed, progress=False)
    gen_s = time.perf_counter() - t
    raw_bytes = sum(f.stat().st_size for f in files.all())
    read = _child(CHILD_READ, str(files.multi_event))
    store = work / f"store-{size}"
    rows = []
    for n, chunk in ((n, chunk) for chunk in chunk_rows for n in cores):
        run = _child(CHILD_PREPROCESS, str(raw_root), size, str(store), str(n), str(chunk))
        rows.append(
            {
                "size": size,
                "cores": n,
                "rows_per_chunk": chunk,
                "events": run["events"],
                "train_events": run["train_events"],
                "anchors": run["anchors"],
                "generate_s": gen_s,
                "generate_cores": usable_cores(),
                "raw_bytes": raw_bytes,
                "store_bytes": run["store_bytes"],
                "read_s": read["seconds"],
                "read_peak_rss": read["peak_rss"],
                "preprocess_s": run["seconds"],
                "peak_rss": run["peak_rss"],
                "worker_peak_rss": run["worker_peak_rss"] if n > 1 else 0,
                "events_per_s": run["events"] / run["seconds"],
                "workers": run["workers"],
                "append_s": run["append_s"],
                "parent_ceiling_events_per_s": run["events"] / run["append_s"],
            }
        )
    check = _child(CHILD_VERIFY, str(store), str(max(cores)))
    if check["problems"]:
        raise SystemExit(f"the {size} store failed verification: {check['problems'][0]}")
    rows[-1]["verify_s"] = check["seconds"]
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| size | events | cores | rows per chunk | preprocess s | M events/s | vs 1 core | min per billion events | "
        "vs parquet read (1 core) | parent's appends s (its ceiling, M events/s) | peak RSS GB: parent + workers x "
        "largest | store GB | generate s (cores) | verify s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        chunk = r.get("rows_per_chunk", EARLIER_CHUNK_ROWS)
        one = next(
            (
                o
                for o in rows
                if o["size"] == r["size"] and o["cores"] == 1 and o.get("rows_per_chunk", EARLIER_CHUNK_ROWS) == chunk
            ),
            None,
        )
        speedup = f"{r['events_per_s'] / one['events_per_s']:.2f}x" if one else "-"
        workers = f" + {r['cores']} x {r['worker_peak_rss'] / 2**30:.2f}" if r["worker_peak_rss"] else ""
        verify = f"{r['verify_s']:.1f}" if "verify_s" in r else "-"
        lines.append(
            f"| {r['size']} | {r['events']:,} | {r['cores']} | {chunk:,} | {r['preprocess_s']:.2f} | {r['events_per_s'] / 1e6:.2f} | "
            f"{speedup} | {1e9 / r['events_per_s'] / 60:.2f} | {r['preprocess_s'] / r['read_s']:.1f}x slower | "
            f"{r['append_s']:.1f} ({r['parent_ceiling_events_per_s'] / 1e6:.1f}) | "
            f"{r['peak_rss'] / 2**30:.2f}{workers} | {r['store_bytes'] / 1e9:.2f} | "
            f"{r['generate_s']:.1f} ({r['generate_cores']}) | {verify} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["medium", "50m"])
    parser.add_argument("--cores", type=int, nargs="+", default=None, help="core counts to pin to (default: all)")
    parser.add_argument(
        "--rows-per-chunk",
        type=int,
        nargs="+",
        default=None,
        help="preprocess.rows_per_chunk values to run (a worker's unit of work, which sets its memory; default: the config's)",
    )
    parser.add_argument("--label", default="", help="suffix of the results files")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--work-dir", default=None, help="where to put the raw files and stores, and keep them (default: a temp dir)"
    )
    parser.add_argument("--out", default=str(RESULTS), help="results folder")
    args = parser.parse_args()
    from dlrmv4.config import PreprocessConfig
    from dlrmv4.parallel import usable_cores

    cores = args.cores or [usable_cores()]
    if max(cores) > usable_cores():
        raise SystemExit(f"--cores {max(cores)}: this process may use {usable_cores()} cores")
    with contextlib.ExitStack() as stack:
        work = Path(args.work_dir) if args.work_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        work.mkdir(parents=True, exist_ok=True)
        chunk_rows = args.rows_per_chunk or [PreprocessConfig().rows_per_chunk]
        rows = [row for size in args.sizes for row in measure(size, work, args.seed, cores, chunk_rows)]
    text = table(rows)
    print(text)
    info = {"goal_events_per_s": GOAL_EVENTS_PER_S, "goal_peak_rss_bytes": GOAL_RSS_BYTES, "rows": rows}
    name = "preprocess" + (f"_{args.label}" if args.label else "")
    intro = (
        f"`{command_line()}` on {usable_cores()} usable cores of {cpu_model()}. Goals: at least "
        f"{GOAL_EVENTS_PER_S / 1e6:.0f} M events/s on 2 cores; 1 minute per billion events on 16; peak RSS at "
        "most 16 GB."
    )
    write_results(name, info, f"{intro}\n\n{text}", device="cpu", out=Path(args.out))


if __name__ == "__main__":
    main()
