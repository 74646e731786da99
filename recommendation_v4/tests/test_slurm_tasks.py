"""An srun task of several takes its rank from SLURM's variables (dlrmv4/slurm_tasks.py)."""

from __future__ import annotations

import pytest

from dlrmv4.errors import UserError
from dlrmv4.slurm_tasks import adopt_slurm_tasks

TASK = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_NODEID": "1",
}


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
        {**TASK, "SLURM_NTASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"},  # one task: one process
        {**TASK, "RANK": "2", "MASTER_ADDR": "node-a"},  # a launcher's own names win
    ],
)
def test_other_processes_are_left_alone(env):
    before = dict(env)
    assert not adopt_slurm_tasks(env) and env == before


def test_a_task_without_the_first_node_is_one_line():
    with pytest.raises(UserError, match="srun task 5 of 8: MASTER_ADDR must name the first node"):
        adopt_slurm_tasks(dict(TASK))


@pytest.mark.parametrize(
    "variables, tasks_here",
    [
        # srun -N2 -n16 --gpus-per-task=1: no --ntasks-per-node, so no SLURM_NTASKS_PER_NODE
        ({"SLURM_NTASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_TASKS_PER_NODE": "8(x2)"}, 8),
        # a 2-node step inside an sbatch of --ntasks-per-node=8: the step's own count wins
        ({"SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "8"}, 2),
        # uneven nodes: this node's own count (the ranks then refuse different counts in one line)
        ({"SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, 1),
        ({"SLURM_NTASKS": "7", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, 2),
        ({"SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4"}, 4),  # only the option's variable
        ({"SLURM_NTASKS": "3"}, 3),  # none: one node
    ],
)
def test_the_tasks_on_this_node_are_the_step_s(variables, tasks_here):
    env = {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "MASTER_ADDR": "node-a", **variables}
    assert adopt_slurm_tasks(env) and env["LOCAL_WORLD_SIZE"] == str(tasks_here)


def test_a_node_outside_the_counts_is_one_line():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "2"}
    with pytest.raises(UserError, match="SLURM_NODEID=2 but SLURM_STEP_TASKS_PER_NODE=2.x2. names 2 node"):
        adopt_slurm_tasks({**env, "MASTER_ADDR": "node-a"})
