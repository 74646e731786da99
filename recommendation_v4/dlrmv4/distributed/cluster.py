"""The processes of one run as each rank sees them (``Cluster``), and the few collectives the loop needs
beyond TorchRec's and DDP's own.

Tensors travel on the main group (NCCL on GPUs, gloo on the CPU); host-side control messages (paths,
decisions, small objects) on a gloo group, so they never wait for the device. Every collective has
the configured timeout, and a failed one becomes one line naming this rank (``liveness.py`` finds
which rank was lost); ``process_start.py`` makes the Cluster.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlrmv4.distributed.liveness import lost_rank_error
from dlrmv4.errors import UserError

# How long collectives that wait on another rank's checkpoint bytes (written, read or hashed) may wait:
# a node's whole checkpoint of Yambda-5B's tables (about 600 GB) at 0.2 GB/s takes under an hour. The
# run's collective timeout (--timeout-seconds) still bounds every other wait.
CHECKPOINT_IO_TIMEOUT_SECONDS = 2 * 3600.0


@dataclass(frozen=True)
class Cluster:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None = None  # None: one process, no process group
    control: Any = None  # the gloo group for host-side messages (None: one process)
    timeout_seconds: float = 600.0

    @classmethod
    def single(cls, device: torch.device) -> "Cluster":
        """One process on ``device``, no process group."""
        return cls(0, 1, 0, 1, device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def for_checkpoint_io(self) -> "Cluster":
        """This cluster with a control group of its own whose collectives wait up to
        ``CHECKPOINT_IO_TIMEOUT_SECONDS`` (or the run's timeout, if longer): for the exchanges that wait
        while a rank writes, reads or hashes a checkpoint. A collective: every rank calls it."""
        if self.world_size == 1:
            return self
        seconds = max(self.timeout_seconds, CHECKPOINT_IO_TIMEOUT_SECONDS)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
        return dataclasses.replace(self, control=group, timeout_seconds=seconds)

    def release_checkpoint_io(self, io: "Cluster") -> None:
        """Close the control group of ``io``, made by ``for_checkpoint_io`` and no longer used."""
        if io.control is not self.control:
            dist.destroy_process_group(io.control)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def describe(self) -> str:
        if not self.distributed:
            return f"one process on {self.device}"
        return (
            f"{self.world_size} processes ({self.local_world_size} per node, {self.backend}), "
            f"rank {self.rank} on {self.device}"
        )

    # -- host-side control messages --------------------------------------------------------
    def guard(self, what: str):
        """A context in which a failed collective becomes one line naming this rank."""
        return _Guard(self, what)

    def barrier(self) -> None:
        if self.world_size > 1:
            with self.guard("barrier"):
                dist.barrier(group=self.control)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with self.guard("broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in rank order (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        with self.guard("gather"):
            dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (same length on every rank), on every rank."""
        if self.world_size == 1:
            return [list(values)]
        local = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        with self.guard("all_gather"):
            dist.all_gather(out, local, group=self.control)
        return [t.tolist() for t in out]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (a decision all ranks must share)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        with self.guard("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    # -- device tensors ----------------------------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over every rank, on the main group (no host read)."""
        if self.world_size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
            with self.guard("all_reduce"):
                dist.all_reduce(tensor, op=reduce_op)
        return tensor

    def mean(self, tensor: torch.Tensor) -> float:
        """The mean of a scalar over the ranks, read on the host."""
        return float(self.all_reduce_(tensor.clone())) / self.world_size

    def all_gather_rows(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0, rank order; ``sizes[r]`` is rank r's row
        count, known on the host (so the exchange needs no device read)."""
        if self.world_size == 1:
            return tensor
        longest = max(sizes)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        out = tensor.new_empty((self.world_size * longest, *tensor.shape[1:]))
        with self.guard("all_gather"):
            dist.all_gather_into_tensor(out, padded)
        return torch.cat([out[r * longest : r * longest + n] for r, n in enumerate(sizes)])

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


class _Guard:
    """Turns a failed collective into one clear line naming this rank."""

    def __init__(self, cluster: Cluster, what: str) -> None:
        self.cluster, self.what = cluster, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and is_comm_failure(exc) and not isinstance(exc, UserError):
            raise lost_rank_error(self.cluster, self.what, exc) from exc


_COMM_FAILURE = re.compile(r"gloo|nccl|connection|timed out|timeout|peer|socket|broken pipe", re.IGNORECASE)


def check_batch_splits(global_batch: int, world_size: int) -> None:
    """Every rank takes an equal share of each global batch: refused in one line otherwise."""
    if world_size < 1 or global_batch % world_size:
        raise UserError(
            f"the global batch size {global_batch:,} does not split evenly over {world_size:,} processes: use a "
            "multiple of the world size"
        )


def is_comm_failure(exc: BaseException) -> bool:
    """A failure of the transport under a collective (not a bug in the step itself)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc))))
