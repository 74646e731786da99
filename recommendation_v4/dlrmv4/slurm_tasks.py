"""A process started by ``srun`` as one task of several takes its rank from SLURM's variables.

srun starts every task itself (no torchrun), so the names the process group reads (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_PORT``) are set here from
``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS`` and the step's tasks on this node
(``SLURM_STEP_TASKS_PER_NODE`` at ``SLURM_NODEID``), before any command reads them;
``MASTER_ADDR`` must name the first node (tools/slurm/dlrmv4.sbatch sets it). A launcher's own
names win, and a single task is a single process.
"""

from __future__ import annotations

import os
from typing import MutableMapping

from dlrmv4.errors import UserError

DEFAULT_MASTER_PORT = "29500"


def adopt_slurm_tasks(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set the launcher's names from srun's; True when this process is one rank of several tasks."""
    if "RANK" in environ or "SLURM_PROCID" not in environ:
        return False
    try:
        tasks = int(environ.get("SLURM_NTASKS", "1"))
        if tasks <= 1:
            return False
        per_node = tasks_on_this_node(environ, tasks)
        rank, local_rank = int(environ["SLURM_PROCID"]), int(environ.get("SLURM_LOCALID", "0"))
    except ValueError as exc:
        raise UserError(f"srun task: a SLURM task variable is not an integer ({exc})") from exc
    if not environ.get("MASTER_ADDR"):
        raise UserError(
            f"srun task {rank} of {tasks}: MASTER_ADDR must name the first node (tools/slurm/dlrmv4.sbatch sets it)"
        )
    environ.update(RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(tasks), LOCAL_WORLD_SIZE=str(per_node))
    environ.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)
    return True


def tasks_on_this_node(environ: MutableMapping[str, str], tasks: int) -> int:
    """The step's tasks on this node. srun always sets ``SLURM_STEP_TASKS_PER_NODE`` (``"8(x2)"``,
    ``"2(x3),1"``: a count per node, in node order); ``SLURM_NTASKS_PER_NODE`` only with
    ``--ntasks-per-node`` (and an sbatch's value reaches its smaller steps too); ``tasks`` when
    neither is set (one node)."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if environ.get(name):
            counts, node = _expand_counts(environ[name]), int(environ.get("SLURM_NODEID", "0"))
            if not 0 <= node < len(counts):
                raise UserError(
                    f"srun task: SLURM_NODEID={node} but {name}={environ[name]} names {len(counts)} node(s)"
                )
            return counts[node]
    return tasks


def _expand_counts(text: str) -> list[int]:
    """``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    return counts
