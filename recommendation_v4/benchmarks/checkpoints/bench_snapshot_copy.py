"""The steps beside a checkpoint's copy to host (``checkpoint/device_snapshot.py``): how much slower a
step that reads the device runs while the writer's thread copies the device snapshot to pinned host
memory, by the size of the copy's pieces.

A step here has the train step's shape in miniature: ``--reads`` segments of ``--matmuls`` bf16 GEMMs
of ``--dim``, each ending in a read of a device scalar (as the step reads its lengths and its loss).
The state: ``--gib`` of fp32 tables in 8 tensors and their row-wise momentum, all in the snapshot. For
each piece size ("whole": a tensor a copy, as the copy went before it had pieces, two queued at most)
the snapshot is taken on the step's stream and copied to host in a thread, as the writer does, while
steps run; ``--repeats`` copies each. The ratio is the steady step's time over the mean time of the
steps that ran while the copy did (the train command's goal for a checkpoint's neighbours: 0.90).

    python benchmarks/checkpoints/bench_snapshot_copy.py --gib 16 --label h200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import torch
from harness import command_line, device_facts, device_label, write_results

from dlrmv4.checkpoint.device_snapshot import PIECE_BYTES, DeviceSnapshot

GIB = 1 << 30
MIB = 1 << 20
TABLES = 8
DIM = 512  # the real job's rows
WHOLE = 1 << 62  # a piece larger than any tensor: one copy a tensor


def make_state(gib: float, device: torch.device) -> dict:
    rows = int(gib * GIB / (DIM * 4 + 4) / TABLES)
    return {
        f"table{i}": {"weight": torch.rand(rows, DIM, device=device), "momentum": torch.rand(rows, device=device)}
        for i in range(TABLES)
    }


class Steps:
    """The miniature step: segments of GEMMs, each ending in a read of a device scalar."""

    def __init__(self, dim: int, matmuls: int, reads: int, device: torch.device) -> None:
        self.a = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
        self.matmuls, self.reads = matmuls, reads

    def one(self) -> float:
        started = time.perf_counter()
        for _ in range(self.reads):
            out = self.a
            for _ in range(self.matmuls):
                out = torch.mm(out, self.b)
            out[0, 0].item()
        return time.perf_counter() - started


def measure(snapshot: DeviceSnapshot, state: dict, steps: Steps, piece_bytes: int, repeats: int) -> dict:
    """Steps run while the snapshot's copy to host does, ``repeats`` times; their times and the copies'."""
    snapshot.piece_bytes = piece_bytes
    during: list[float] = []
    copy_seconds: list[float] = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        snapshot.take(state)
        finished: list[float] = []
        started = time.perf_counter()
        thread = threading.Thread(target=lambda: (snapshot.to_host(), finished.append(time.perf_counter())))
        thread.start()
        while not finished:
            during.append(steps.one())
        thread.join()
        copy_seconds.append(finished[0] - started)
    return {"step_seconds": during, "copy_seconds": copy_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0, help="fp32 tables (with their momentum) in the snapshot")
    parser.add_argument("--pieces-mib", type=float, nargs="+", default=[256, PIECE_BYTES / MIB, 4])
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--matmuls", type=int, default=2, help="GEMMs between two reads of the device")
    parser.add_argument("--reads", type=int, default=6, help="reads of the device a step")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--label", default="gpu", help="results/snapshot_copy_<label>.md")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_snapshot_copy.py: needs a GPU (the copy to host and the step's reads share its copy engine)")
    device = torch.device("cuda", torch.cuda.current_device())
    state = make_state(args.gib, device)
    snapshot = DeviceSnapshot(state, device, budget=WHOLE)
    steps = Steps(args.dim, args.matmuls, args.reads, device)
    for _ in range(5):
        steps.one()  # cuBLAS's handles and the clocks
    steady = statistics.median(steps.one() for _ in range(20))
    rows = []
    for label, piece in [("whole", WHOLE)] + [(f"{mib:g} MiB", int(mib * MIB)) for mib in args.pieces_mib]:
        r = measure(snapshot, state, steps, piece, args.repeats)
        mean = statistics.fmean(r["step_seconds"])
        rows.append(
            {
                "pieces": label,
                "piece_bytes": piece,
                "steps": len(r["step_seconds"]),
                "step_ms": mean * 1e3,
                "worst_step_ms": max(r["step_seconds"]) * 1e3,
                "ratio": steady / mean,
                "copy_seconds": statistics.median(r["copy_seconds"]),
                "copy_gb_per_s": snapshot.nbytes / statistics.median(r["copy_seconds"]) / 1e9,
            }
        )
    lines = [
        f"A checkpoint's copy to host beside the steps on {device_label(device_facts(device))}: a snapshot of "
        f"{snapshot.nbytes / GIB:.1f} GiB on the device copied to pinned host memory in a thread, while steps "
        f"of {args.reads} x ({args.matmuls} bf16 GEMMs of {args.dim} then a read of a device scalar) run; "
        f"{args.repeats} copies each. The steady step: {steady * 1e3:.1f} ms. The package copies in pieces of "
        f"{PIECE_BYTES / MIB:g} MiB.",
        "",
        "| the copy's pieces | steps beside it | ms a step (worst) | steady / beside (goal >= 0.90) | copy s | copy GB/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pieces']} | {r['steps']} | {r['step_ms']:.1f} ({r['worst_step_ms']:.1f}) | {r['ratio']:.2f} | "
            f"{r['copy_seconds']:.2f} | {r['copy_gb_per_s']:.1f} |"
        )
    print("\n".join(lines))
    if not args.no_save:
        write_results(
            f"snapshot_copy_{args.label}",
            {"gib": snapshot.nbytes / GIB, "steady_step_seconds": steady, "results": rows, "command": command_line()},
            "\n".join(lines),
            device=device,
        )


if __name__ == "__main__":
    main()
