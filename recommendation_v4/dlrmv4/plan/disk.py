"""The run directory's disk in the plan: what a whole checkpoint and a delta write, which of the run's
settings write checkpoints at all, and whether the whole one fits the free space.

The run directory lies on a file system every node sees, so a checkpoint's bytes are the job's:
every table's fp32 rows with their row-wise Adagrad value, and the dense weights with Adam's two
moments; each node writes its ranks' share of the tables.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from dlrmv4.config import BenchmarkConfig
from dlrmv4.plan.costs import DELTA_ROW_SHARE, GIB

# A delta keeps each changed row's id (int64) beside the row and its Adagrad value.
_DELTA_ID_BYTES = 8


@dataclass(frozen=True)
class CheckpointDisk:
    whole: int  # bytes of a whole checkpoint (the job's)
    per_node: int  # the share of it each node writes
    delta: int  # bytes of a delta checkpoint at DELTA_ROW_SHARE of the rows changed
    free: int | None  # free bytes in the run directory's file system (None: not checked)
    writers: tuple[str, ...]  # the settings that make the run write checkpoints (empty: none)
    keep: int  # restore points kept (train.keep_last_checkpoints)
    run_dir: str

    @property
    def fits(self) -> bool:
        return not self.writers or self.free is None or self.whole <= self.free

    @property
    def room(self) -> int | None:
        """Whole checkpoints the free space holds (None: not checked)."""
        return None if self.free is None else self.free // max(self.whole, 1)

    @property
    def at_once(self) -> int:
        """Whole checkpoints on disk at the busiest moment: the kept restore points, each on its own
        chain, and the new one being written before the oldest is pruned."""
        return self.keep + 1


def checkpoint_writers(cfg: BenchmarkConfig) -> tuple[str, ...]:
    """The settings under which the run writes checkpoints (flags as a user types them)."""
    t = cfg.train
    named = (
        ("--checkpoint-every-window", t.checkpoint_every_window),
        ("--checkpoint-every-steps", t.checkpoint_every_steps > 0),
        ("--checkpoint-every-seconds", t.checkpoint_every_seconds > 0),
        ("--final-checkpoint", t.final_checkpoint),
    )
    return tuple(flag for flag, on in named if on)


def checkpoint_disk(
    cfg: BenchmarkConfig, table_rows: dict[str, int], dense_parameters: int, nodes: int, free: int | None
) -> CheckpointDisk:
    dim = cfg.model.embedding_dim
    rows = sum(table_rows.values())
    tables = rows * (dim * 4 + 4)
    dense = 12 * dense_parameters  # weights and Adam's two moments, fp32
    changed = int(DELTA_ROW_SHARE * rows)
    return CheckpointDisk(
        whole=tables + dense,
        per_node=tables // max(nodes, 1) + dense,
        delta=changed * (dim * 4 + 4 + _DELTA_ID_BYTES) + dense,
        free=free,
        writers=checkpoint_writers(cfg),
        keep=cfg.train.keep_last_checkpoints,
        run_dir=cfg.train.run_dir,
    )


def free_bytes(run_dir: str) -> int:
    """Free bytes on the file system that holds ``run_dir`` (its nearest existing ancestor until it is made)."""
    path = Path(run_dir).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def describe_disk(disk: CheckpointDisk) -> str:
    head = (
        f"  disk (run directory {disk.run_dir}, a file system every node sees): a whole checkpoint "
        f"{_gib(disk.whole)} GiB ({_gib(disk.per_node)} GiB written by each node), a delta about "
        f"{_gib(disk.delta)} GiB ({DELTA_ROW_SHARE:.1%} of the rows changed)"
    )
    if not disk.writers:
        return head + "; this run writes no checkpoint"
    if disk.free is None:
        return head
    return (
        f"{head}; {_gib(disk.free)} GiB free: room for {disk.room:,} whole checkpoint(s), the run keeps up "
        f"to {disk.at_once} at once (keep_last_checkpoints {disk.keep}, and the one being written)"
    )


def disk_problem(disk: CheckpointDisk) -> tuple[str, list[str]]:
    """Why the run's checkpoints do not fit its disk, and what would make them fit."""
    assert disk.free is not None
    problem = (
        f"a whole checkpoint of this run is {_gib(disk.whole)} GiB, but the run directory {disk.run_dir} has "
        f"{_gib(disk.free)} GiB free"
    )
    knobs = [
        f"a run directory on a file system with at least {_gib(disk.whole)} GiB free (--run-dir; "
        f"{_gib(disk.at_once * disk.whole)} GiB for {disk.at_once} at once)",
        "a run that writes no checkpoint: "
        + " ".join(f"{flag} {_off(flag)}" for flag in disk.writers)
        + " (it cannot be resumed)",
    ]
    return problem, knobs


def short_of_room(disk: CheckpointDisk) -> str:
    """One line when the free space holds a whole checkpoint but not as many as the run keeps at once."""
    if not disk.writers or disk.room is None or disk.room >= disk.at_once or not disk.fits:
        return ""
    return (
        f"warning: the run directory {disk.run_dir} has room for {disk.room} whole checkpoint(s) of "
        f"{_gib(disk.whole)} GiB, and the run keeps up to {disk.at_once} at once: a later whole checkpoint "
        "will not fit (--keep-last-checkpoints 1 keeps fewer, or a larger disk)"
    )


def _off(flag: str) -> str:
    return "false" if flag in ("--checkpoint-every-window", "--final-checkpoint") else "0"


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f}"
