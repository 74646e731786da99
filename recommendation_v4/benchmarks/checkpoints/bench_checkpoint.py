"""What a checkpoint costs the training, blocking and asynchronous, against the disk's own bandwidth
measured in the same run.

The state: ``--gib`` of fp32 tables on the device (the real job holds about 70 GiB per rank) plus a
small dense model with Adam, written by the project's ``CheckpointWriter`` as a run writes them.
A stand-in training loop (a bf16 matmul and 200 small kernels per iteration, so that it needs the
host to launch as a step does) runs before, during and after each write:

- disk: one file of ``--disk-gib`` written sequentially from host memory and fsynced;
- blocking: the step waits for the whole save;
- asynchronous: the step waits for the copy to host memory, then the loop runs while the
  background thread writes; its slowdown over the loop alone is the rest of the cost.

    python benchmarks/checkpoints/bench_checkpoint.py --gib 32 --work-dir /data/ckpt-bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import torch
from harness import RESULTS, command_line, device_facts, device_label, write_results

from dlrmv4.checkpoint.state import CheckpointPosition, ModelAndOptimizers
from dlrmv4.checkpoint.writer import CheckpointWriter
from dlrmv4.distributed.cluster import Cluster

GIB = 1 << 30


class Tables(torch.nn.Module):
    def __init__(self, gib: float, device: torch.device, pieces: int = 8) -> None:
        super().__init__()
        rows = int(gib * GIB / 4 / 512 / pieces)
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.rand(rows, 512, device=device)) for _ in range(pieces)
        )

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.weights)


def _loop(device: torch.device, a: torch.Tensor, seconds: float | None = None, until=None) -> tuple[int, float]:
    """Iterations and seconds of the stand-in step, for ``seconds`` or until ``until()``."""
    small = torch.ones(64, device=device)
    started, n = time.perf_counter(), 0
    while True:
        a @ a
        for _ in range(200):
            small.add_(1.0)
        torch.cuda.synchronize(device) if device.type == "cuda" else None
        n += 1
        elapsed = time.perf_counter() - started
        if (seconds is not None and elapsed >= seconds) or (until is not None and until()):
            return n, elapsed


def _disk_gbps(root: Path, gib: float) -> float:
    buffer = torch.empty(256 << 20, dtype=torch.uint8).numpy()
    buffer[:] = 7
    path = root / "disk-bandwidth.bin"
    started = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(int(gib * GIB // buffer.nbytes)):
            fh.write(buffer)
        fh.flush()
        os.fsync(fh.fileno())
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    return size / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="table bytes on the device")
    parser.add_argument("--disk-gib", type=float, default=8.0, help="size of the disk's own sequential write")
    parser.add_argument("--work-dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cluster = Cluster.single(device)
    tables = Tables(args.gib, device)
    dense = torch.nn.Linear(1024, 1024, device=device)
    adam = torch.optim.Adam(dense.parameters())
    dense(torch.ones(2, 1024, device=device)).sum().backward()
    adam.step()
    state = {"tables": tables, "dense": ModelAndOptimizers(dense, [adam]), "note": "bench"}
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    _loop(device, a, seconds=2.0)
    n, s = _loop(device, a, seconds=5.0)
    alone = s / n

    disk = _disk_gbps(work, args.disk_gib)
    rows = []
    for asynchronous in (False, True):
        run_dir = work / ("async" if asynchronous else "blocking")
        shutil.rmtree(run_dir, ignore_errors=True)
        writer = CheckpointWriter(run_dir, 1, cluster, asynchronous)
        for step in (1, 2):  # the second save reuses the pinned staging buffer
            started = time.perf_counter()
            writer.save(CheckpointPosition(step, step, 0), state)
            waited = time.perf_counter() - started
            pending = writer._pending
            n, during = _loop(device, a, until=lambda: pending is None or pending.done())
            writer.wait()
            write_seconds = writer.write_seconds if asynchronous else waited
            slowdown = max(0.0, during - n * alone) if asynchronous else 0.0
            rows.append(
                {
                    "mode": "asynchronous" if asynchronous else "blocking",
                    "save": step,
                    "bytes": tables.nbytes,
                    "step_waited_s": waited,
                    "write_s": write_seconds,
                    "write_gbps": tables.nbytes / write_seconds / 1e9,
                    "loop_slowdown_s": slowdown,
                    "loop_during_write_s": during if asynchronous else 0.0,
                    "cost_s": waited + slowdown,
                }
            )
            print(rows[-1], flush=True)
        writer.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    facts = device_facts(device)
    lines = [
        f"Checkpoints of {tables.nbytes / GIB:.1f} GiB of tables on {device_label(facts)}; the disk's own "
        f"sequential write in the same run: **{disk:.2f} GB/s** ({args.disk_gib:.0f} GiB, fsynced). "
        f"Stand-in step alone: {alone * 1e3:.1f} ms.",
        "",
        "| mode | save | step waited s | write s | write GB/s | vs disk | loop slowdown during the write s | cost to training s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['save']} | {r['step_waited_s']:.2f} | {r['write_s']:.2f} | {r['write_gbps']:.2f} | "
            f"{r['write_gbps'] / disk:.2f}x | {r['loop_slowdown_s']:.2f} | {r['cost_s']:.2f} |"
        )
    lines.append("")
    lines.append(f"Command: `{command_line()}`")
    text = "\n".join(lines)
    print(text)
    name = "checkpoint" + (f"_{args.label}" if args.label else "")
    write_results(
        name, {"disk_gbps": disk, "step_alone_s": alone, "rows": rows}, text, device=device, out=Path(args.out)
    )


if __name__ == "__main__":
    main()
