"""What a delta checkpoint costs (``checkpoint/table_deltas.py``): the step's wait to find the changed
rows and copy them to host memory, and the delta's bytes and write time, against the whole tables.

The state: ``--gib`` of fp32 tables (E = 512, as the real job's, with their row-wise momentum) on the
device, in 8 tables. For each share of changed rows: the snapshot is taken (as at a whole checkpoint),
that share of rows, drawn at random, gets an Adagrad-like update, and the changed rows are found and
copied (``ChangedRows.take``: what the step waits for at a delta save, besides the dense state's copy),
then written as a checkpoint by ``save_checkpoint`` into ``--work-dir`` (the background write's work).

    python benchmarks/checkpoints/bench_delta_checkpoint.py --gib 32 --changed-pct 0.5 2 8 --work-dir /data/b
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import torch
from harness import command_line, device_facts, device_label, write_results

from dlrmv4.checkpoint.state import CheckpointPosition
from dlrmv4.checkpoint.table_deltas import ENTRY, ChangedRows, TableRowsDelta, delta_bytes
from dlrmv4.checkpoint.writer import save_checkpoint
from dlrmv4.distributed.cluster import Cluster

GIB = 1 << 30
DIM = 512  # the real job's rows
TABLES = 8


class Tables:
    """Plain tables on one device, the part of a backend that checkpoints read."""

    def __init__(self, gib: float, device: torch.device) -> None:
        rows = int(gib * GIB / (DIM * 4 + 4) / TABLES)
        self.cluster, self.dim = Cluster.single(device), DIM
        self.tables = {
            f"table{i}": {
                "weight": torch.rand(rows, DIM, device=device),
                "momentum": torch.rand(rows, device=device),
            }
            for i in range(TABLES)
        }

    def live_tables(self) -> dict:
        return self.tables

    @property
    def rows(self) -> int:
        return sum(t["momentum"].numel() for t in self.tables.values())

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for t in self.tables.values() for p in t.values())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def _update(tables: Tables, share: float, generator: torch.Generator) -> None:
    for table in tables.tables.values():
        rows = table["momentum"].numel()
        picked = torch.randperm(rows, generator=generator)[: int(rows * share)].to(table["weight"].device)
        table["momentum"][picked] += 1e-3
        table["weight"][picked] -= 1e-3


def measure(tables: Tables, share: float, work: Path) -> dict:
    device = tables.cluster.device
    tracker = ChangedRows()
    _synchronize(device)
    started = time.perf_counter()
    tracker.reset(tables)
    snapshot_seconds = time.perf_counter() - started
    _update(tables, share, torch.Generator().manual_seed(int(share * 1e6)))
    _synchronize(device)
    started = time.perf_counter()
    rows = tracker.take(tables)
    take_seconds = time.perf_counter() - started
    changed = sum(p["ids"].numel() for p in rows.values())
    started = time.perf_counter()
    path = save_checkpoint(work, CheckpointPosition(1, 1, 0), {ENTRY: TableRowsDelta(rows, 0)}, keep_last=1)
    write_seconds = time.perf_counter() - started
    written = sum(f.stat().st_size for f in path.iterdir())
    shutil.rmtree(work / "checkpoints")
    return {
        "changed_pct": share * 100,
        "changed_rows": changed,
        "snapshot_seconds": snapshot_seconds,
        "take_seconds": take_seconds,
        "take_ms_per_gib": take_seconds * 1e3 / (tables.nbytes / GIB),
        "delta_bytes": delta_bytes(rows),
        "written_bytes": written,
        "share_of_whole": written / tables.nbytes,
        "write_seconds": write_seconds,
        "write_gb_per_s": written / write_seconds / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=32.0, help="fp32 tables (with their momentum) on the device")
    parser.add_argument("--changed-pct", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    parser.add_argument("--work-dir", default=None, help="where the deltas are written (default: a temp dir)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tables = Tables(args.gib, device)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        results = [measure(tables, pct / 100, Path(tmp)) for pct in args.changed_pct]
    lines = [
        f"Delta checkpoints on {device_label(device_facts(device))}: {tables.nbytes / GIB:.1f} GiB of fp32 tables "
        f"({tables.rows:,} rows of {DIM}, {TABLES} tables, with their momentum) on the device. 'snapshot': the "
        "rows' fingerprints taken at a whole checkpoint; 'find + copy': what the step waits for at a delta "
        "save (fingerprints, compare, the changed rows to host memory); 'write': save_checkpoint of the "
        "delta (in the background in a run).",
        "",
        "| changed rows | rows | snapshot s | find + copy s | find + copy ms per GiB | delta on disk | "
        "share of the whole tables | write s | write GB/s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['changed_pct']:g} % | {r['changed_rows']:,} | {r['snapshot_seconds']:.2f} | "
            f"{r['take_seconds']:.2f} | {r['take_ms_per_gib']:.0f} | {r['written_bytes'] / 2**20:,.0f} MiB | "
            f"{r['share_of_whole'] * 100:.2f} % | {r['write_seconds']:.2f} | {r['write_gb_per_s']:.2f} |"
        )
    print("\n".join(lines))
    if not args.no_save:
        name = f"delta_checkpoint_{'gpu' if device.type == 'cuda' else 'cpu'}"
        write_results(
            name,
            {"gib": tables.nbytes / GIB, "rows": tables.rows, "results": results, "command": command_line()},
            "\n".join(lines),
            device=device,
        )


if __name__ == "__main__":
    main()
