"""Live TensorBoard scalars of a run: event files in ``<run_dir>/tensorboard/``, written by rank 0
(``train.tensorboard``; where the tensorboard package is missing the run says so once and goes on).

A step only keeps its loss tensor: the losses since the last read are read where the loop syncs
with the device anyway (before an eval, at a window's end, before a checkpoint), averaged over the
ranks (the global batch's loss) and written one event per step with the learning rates that step
trained with. Every point is keyed by the global step: step N is the N-th optimizer step, the
``step`` of report.json's evals and of the checkpoints.

A resumed run continues the same curves: as its MLPerf log is cut back to the checkpoint, the
points up to the checkpoint's step are copied into the resumed run's file and the earlier files
removed, so what an interrupted run wrote past its checkpoint (steps that are trained again) is
gone and no reader shows a step twice. (A purge marker in the file, SummaryWriter's purge_step,
is not enough: ``tensorboard --logdir`` drops a curve's later points only where the curve gets a
point at the same step again, so a checkpoint's wait that the interrupted run logged stays.) A
run that starts fresh (``--restart``, or no checkpoint to resume from) removes the folder first,
with or without scalars of its own; a resumed run without scalars leaves it as it is.

An event file deleted during the run (or its folder) would otherwise take every later point into
the deleted inode, with nothing said: each write first looks whether the file is still the one it
opened, and if not, says so in one line and goes on in a new file, so the curves continue from
there (the points written before are gone with the file).
"""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.train.history import EvalRecord
from dlrmv4.train.optim import WarmupSchedule

if TYPE_CHECKING:
    from torch.utils.tensorboard.writer import FileWriter

TENSORBOARD_DIR = "tensorboard"
EVENT_FILES = "events.out.tfevents.*"
GIB = float(1 << 30)


class TensorBoardScalars:
    """One run's scalars. Every rank makes one and calls it at the same points of the loop (the step
    losses are averaged with a collective); rank 0 writes."""

    def __init__(
        self, run_dir: Path, cluster: Cluster, schedule: WarmupSchedule, wanted: bool, log: Callable[[str], None]
    ) -> None:
        self.folder = Path(run_dir) / TENSORBOARD_DIR
        self.cluster, self.schedule, self.wanted, self.log = cluster, schedule, wanted, log
        self.collecting = False  # on every rank: whether rank 0 writes, so the step losses are kept
        self._writer: FileWriter | None = None
        self._file: tuple[Path, int, int] | None = None  # the writer's event file: path, device, inode
        self._summary: Any = None  # tensorboard's Summary message, imported with the writer
        self._losses: list[torch.Tensor] = []  # device scalars, not read yet
        self._wall_times: list[float] = []  # when each of those steps was queued
        self._next_step = 1  # the global step of the first loss in _losses

    def open(self, steps_done: int, resumed: bool) -> None:
        """Start writing after ``steps_done`` steps (a collective where scalars are wanted)."""
        if self.cluster.is_main:
            if not resumed:
                self._remove_previous()
            if self.wanted:
                self._writer = self._make_writer(steps_done if resumed else None)
        if self.wanted:
            self.collecting = self.cluster.broadcast(self._writer is not None)
        self._next_step = steps_done + 1

    def _remove_previous(self) -> None:
        try:
            shutil.rmtree(self.folder)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise UserError(f"cannot remove the previous run's TensorBoard scalars in {self.folder}: {exc}") from exc

    def _make_writer(self, resumed_at: int | None) -> FileWriter | None:
        """A new event file; a resumed run's starts with the points up to ``resumed_at`` of the earlier ones."""
        try:
            from google.protobuf.message import DecodeError
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard.writer import FileWriter
        except ImportError:
            self.log(
                "tensorboard is not installed: this run writes no TensorBoard scalars "
                "(pip install tensorboard, or --tensorboard false to turn them off)"
            )
            return None
        self._summary = Summary
        earlier = sorted(self.folder.glob(EVENT_FILES)) if resumed_at is not None else []
        writer = self._new_file_writer(FileWriter)
        for path in earlier:
            for record in _records(path):
                try:
                    event = Event.FromString(record)
                except DecodeError:
                    break  # a damaged record: what follows it is not trusted either
                if event.HasField("summary") and event.step <= resumed_at:
                    writer.add_event(event, walltime=event.wall_time)
        writer.flush()  # the copies are on disk before the originals go
        for path in earlier:
            path.unlink()
        return writer

    def _new_file_writer(self, file_writer: type[FileWriter]) -> FileWriter:
        """A writer of a new event file in the folder (made if missing), whose file is remembered."""
        before = set(self.folder.glob(EVENT_FILES))
        writer = file_writer(str(self.folder))
        (path,) = set(self.folder.glob(EVENT_FILES)) - before
        stat = path.stat()
        self._file = path, stat.st_dev, stat.st_ino
        return writer

    def _reopen_if_deleted(self) -> None:
        """Before a write: where the event file is no longer in the folder (deleted, or replaced by
        another file of its name), say so once and write on to a new file."""
        if self._writer is None or self._file is None:
            return
        path, device, inode = self._file
        try:
            stat = os.stat(path)
            if (stat.st_dev, stat.st_ino) == (device, inode):
                return
        except (FileNotFoundError, NotADirectoryError):  # the file, or its folder, is gone
            pass
        self._writer.close()  # what it held goes to the deleted file
        try:
            self._writer = self._new_file_writer(type(self._writer))
        except OSError as exc:
            self._writer, self._file = None, None
            self.log(
                f"the TensorBoard event file {path} was deleted during the run and a new one cannot be made "
                f"({exc}): this run writes no more TensorBoard scalars"
            )
            return
        self.log(
            f"the TensorBoard event file {path} was deleted during the run: the scalars go on in "
            f"{self._file[0].name} (the points written before are gone)"
        )

    def add_step(self, loss: torch.Tensor) -> None:
        """Keep one step's loss (a device scalar: nothing is read here)."""
        if self.collecting:
            self._losses.append(loss)
            self._wall_times.append(time.time())

    def write_steps(self) -> None:
        """Write the steps since the last call: call where the loop has just synced with the device, on
        every rank (the losses are averaged over the ranks)."""
        self._reopen_if_deleted()
        if self._losses:
            self._write_losses()
        self.flush()

    def _write_losses(self) -> None:
        losses = self.cluster.all_reduce_(torch.stack(self._losses).float()) / self.cluster.world_size
        if self._writer is not None:
            for offset, (loss, wall_time) in enumerate(zip(losses.tolist(), self._wall_times)):
                step = self._next_step + offset
                self._add(
                    step,
                    {
                        "train/loss": loss,
                        # Step N trained with the rates of step index N - 1 (the warm-up starts at 0).
                        "train/learning_rate_dense": self.schedule.lr_at(step - 1),
                        "train/learning_rate_sparse": self.schedule.sparse_lr_at(step - 1),
                    },
                    wall_time,
                )
            device = self.cluster.device
            if device.type == "cuda":  # the allocator's counters: host values, no sync
                stats = torch.cuda.memory_stats(device)
                self._add(
                    self._next_step + len(self._losses) - 1,
                    {
                        "train/gpu_memory_gib": stats.get("allocated_bytes.all.current", 0) / GIB,
                        "train/gpu_peak_memory_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
                    },
                )
        self._next_step += len(self._losses)
        self._losses.clear()
        self._wall_times.clear()

    def write_window(self, steps: int, mean_loss: float, samples_per_s: float) -> None:
        """A train window's end: its mean loss and training rate (report.json's window_losses and throughput)."""
        self._reopen_if_deleted()
        self._add(steps, {"train/window_mean_loss": mean_loss, "train/samples_per_s": samples_per_s})
        self.flush()

    def write_eval(self, record: EvalRecord) -> None:
        self._reopen_if_deleted()
        self._add(
            record.step,
            {"eval/auc": record.auc, "eval/seconds": record.eval_seconds, "eval/samples_count": record.samples_count},
        )
        self.flush()

    def write_checkpoint_wait(self, steps: int, seconds: float) -> None:
        """How long the loop waited for the checkpoint at ``steps`` (its copy, or its whole write)."""
        self._reopen_if_deleted()
        self._add(steps, {"checkpoint/wait_seconds": seconds})
        self.flush()

    def _add(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        if self._writer is None:
            return
        # One event for the step's values: a third of the cost of one event per value.
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self._writer.add_summary(summary, step, time.time() if wall_time is None else wall_time)

    def flush(self) -> None:
        """Everything written so far, on disk (each write does it: the loop's sync points are far apart)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the file (steps not read yet are left out: the run ended between syncs)."""
        if self._writer is not None:
            self._writer.close()
            self._writer, self._file = None, None
        self.collecting = False
        self._losses.clear()
        self._wall_times.clear()


def _records(path: Path) -> Iterator[bytes]:
    """The records of an event file (TFRecord: length, its checksum, data, its checksum), up to a
    record that a killed run left cut short."""
    with open(path, "rb") as f:
        while len(header := f.read(12)) == 12:
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length + 4)
            if len(data) < length + 4:
                return
            yield data[:length]
