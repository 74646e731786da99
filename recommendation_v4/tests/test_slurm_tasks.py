"""An srun task of several takes its rank from SLURM's variables (dlrmv4/slurm_tasks.py)."""

from __future__ import annotations

import pytest

from dlrmv4.errors import UserError
from dlrmv4.slurm_tasks import adopt_slurm_tasks

TASK = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"}


def test_a_task_of_several_becomes_its_rank():
    env = {**TASK, "MASTER_ADDR": "node-a"}
    assert adopt_slurm_tasks(env)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")} == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_PORT": "29500",
    }


@pytest.mark.parametrize(
    "env",
    [
        {},  # not under srun
        {**TASK, "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"},  # one task: one process
        {**TASK, "RANK": "2", "MASTER_ADDR": "node-a"},  # a launcher's own names win
    ],
)
def test_other_processes_are_left_alone(env):
    before = dict(env)
    assert not adopt_slurm_tasks(env) and env == before


def test_a_task_without_the_first_node_is_one_line():
    with pytest.raises(UserError, match="srun task 5 of 8: MASTER_ADDR must name the first node"):
        adopt_slurm_tasks(dict(TASK))
