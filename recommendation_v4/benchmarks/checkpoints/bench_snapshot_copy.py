"""The steps beside a checkpoint's copy to host (``checkpoint/device_snapshot.py``): how much slower a
step that reads the device runs while the writer's thread copies the device snapshot to pinned host
memory, by the size of the copy's pieces.

A step here has the train step's shape in miniature: ``--reads`` segments of ``--matmuls`` bf16 GEMMs
of ``--dim``, each ending in a read of the device: a small tensor's copy to host (``.to("cpu")``, as
TorchRec's input distribution reads its splits every step) or a scalar (``.item()``). The state:
``--gib`` of fp32 tables in 8 tensors and their row-wise momentum, all in the snapshot. For each read
and each way to copy, the snapshot is taken and copied to host in a thread, as the writer does, while
steps run, ``--repeats`` times: "queued at once" is the copy before it had pieces (every tensor's copy
queued, then one wait), the others ``DeviceSnapshot.to_host`` with pieces of that size. The ratio is
the steady step's time over the mean time of the steps that ran beside the copy (the train command's
goal for a checkpoint's neighbours: 0.90).

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

from dlrmv4.checkpoint.device_snapshot import PIECE_BYTES, DeviceSnapshot, device_bytes, tensor_leaves

GIB = 1 << 30
MIB = 1 << 20
TABLES = 8
DIM = 512  # the real job's rows
QUEUED_AT_ONCE = 0  # the copy before pieces
READS = ("to_cpu", "item")


def make_state(gib: float, device: torch.device) -> dict:
    rows = int(gib * GIB / (DIM * 4 + 4) / TABLES)
    return {
        f"table{i}": {"weight": torch.rand(rows, DIM, device=device), "momentum": torch.rand(rows, device=device)}
        for i in range(TABLES)
    }


class Steps:
    """The miniature step: segments of GEMMs, each ending in a read of the device (``read``)."""

    def __init__(self, dim: int, matmuls: int, reads: int, device: torch.device) -> None:
        self.a = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
        self.splits = torch.arange(8, device=device)
        self.matmuls, self.reads = matmuls, reads

    def one(self, read: str) -> float:
        started = time.perf_counter()
        for _ in range(self.reads):
            out = self.a
            for _ in range(self.matmuls):
                out = torch.mm(out, self.b)
            if read == "item":
                out[0, 0].item()
            else:
                (self.splits + 1).to("cpu")
        return time.perf_counter() - started


def queued_at_once(snapshot: DeviceSnapshot) -> None:
    """The copy to host as it was before pieces: every tensor's copy queued on the snapshot's stream, then one wait."""
    assert snapshot.stream is not None and snapshot.taken is not None
    with torch.cuda.stream(snapshot.stream):
        snapshot.stream.wait_event(snapshot.taken)
        for host, view in zip(tensor_leaves(snapshot.host), snapshot.views):
            if view is not None:
                host.copy_(view, non_blocking=True)
    snapshot.stream.synchronize()


def measure(snapshot: DeviceSnapshot, state: dict, steps: Steps, read: str, piece_bytes: int, repeats: int) -> dict:
    """Steps run while the snapshot's copy to host does, ``repeats`` times; their times and the copies'."""
    snapshot.piece_bytes = piece_bytes
    copy = snapshot.to_host if piece_bytes != QUEUED_AT_ONCE else lambda: queued_at_once(snapshot)
    during: list[float] = []
    copy_seconds: list[float] = []
    for _ in range(repeats):
        snapshot.take(state)
        torch.cuda.synchronize()
        finished: list[float] = []
        started = time.perf_counter()
        thread = threading.Thread(target=lambda: (copy(), finished.append(time.perf_counter())))
        thread.start()
        while not finished:
            during.append(steps.one(read))
        thread.join()
        copy_seconds.append(finished[0] - started)
    return {"step_seconds": during, "copy_seconds": copy_seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0, help="fp32 tables (with their momentum) in the snapshot")
    parser.add_argument("--pieces-mib", type=float, nargs="+", default=[PIECE_BYTES / MIB, 4])
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--matmuls", type=int, default=2, help="GEMMs between two reads of the device")
    parser.add_argument("--reads", type=int, default=6, help="reads of the device a step")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--label", default="gpu", help="results/snapshot_copy_<label>.md")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_snapshot_copy.py: needs a GPU (the copy to host and the step's reads share its copy engine)")
    device = torch.device("cuda", torch.cuda.current_device())
    state = make_state(args.gib, device)
    snapshot = DeviceSnapshot(state, device, budget=device_bytes(state, device))  # the whole state
    steps = Steps(args.dim, args.matmuls, args.reads, device)
    for _ in range(5):
        steps.one("item")  # cuBLAS's handles and the clocks
    ways = [("queued at once", QUEUED_AT_ONCE)] + [
        (f"pieces of {mib:g} MiB", int(mib * MIB)) for mib in args.pieces_mib
    ]
    rows = []
    for read in READS:
        steady = statistics.median(steps.one(read) for _ in range(10))
        for label, piece in ways:
            r = measure(snapshot, state, steps, read, piece, args.repeats)
            mean = statistics.fmean(r["step_seconds"])
            rows.append(
                {
                    "read": read,
                    "copy": label,
                    "piece_bytes": piece,
                    "steady_ms": steady * 1e3,
                    "steps": len(r["step_seconds"]),
                    "step_ms": mean * 1e3,
                    "worst_step_ms": max(r["step_seconds"]) * 1e3,
                    "ratio": steady / mean,
                    "copy_seconds": statistics.fmean(r["copy_seconds"]),
                    "copy_gb_per_s": snapshot.nbytes / statistics.fmean(r["copy_seconds"]) / 1e9,
                }
            )
    read_names = {"to_cpu": '`.to("cpu")` of 8 ints', "item": "`.item()`"}
    lines = [
        f"A checkpoint's copy to host beside the steps on {device_label(device_facts(device))}: a snapshot of "
        f"{snapshot.nbytes / GIB:.1f} GiB on the device copied to pinned host memory in a thread, while steps "
        f"of {args.reads} x ({args.matmuls} bf16 GEMMs of {args.dim}, then a read of the device) run; "
        f"{args.repeats} copies each. The package copies in pieces of {PIECE_BYTES / MIB:g} MiB.",
        "",
        "| the step's reads | the copy | steady ms a step | steps beside it | ms a step (worst) | "
        "steady / beside (goal >= 0.90) | copy s | copy GB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {read_names[r['read']]} | {r['copy']} | {r['steady_ms']:.1f} | {r['steps']} | {r['step_ms']:.1f} "
            f"({r['worst_step_ms']:.1f}) | {r['ratio']:.2f} | {r['copy_seconds']:.2f} | {r['copy_gb_per_s']:.1f} |"
        )
    print("\n".join(lines))
    if not args.no_save:
        write_results(
            f"snapshot_copy_{args.label}",
            {"gib": snapshot.nbytes / GIB, "results": rows, "command": command_line()},
            "\n".join(lines),
            device=device,
        )


if __name__ == "__main__":
    main()
