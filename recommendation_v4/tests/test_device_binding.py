"""Which GPU a process takes: its local rank's when it sees all the node's GPUs (torchrun, srun
--gpus-per-node), the one it sees when a scheduler bound one to each task (srun --gpus-per-task=1);
two ranks on one GPU, or nodes with different process counts, are refused in one line."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.distributed import process_start
from dlrmv4.errors import UserError


@pytest.fixture
def gpus(monkeypatch):
    """Pretend CUDA sees ``count`` GPUs; returns the indices set_device was called with."""
    chosen: list[int] = []

    def see(count: int) -> list[int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen

    return see


def test_a_process_that_sees_the_whole_node_takes_its_local_rank(gpus):
    chosen = gpus(8)
    assert process_start._device(3, 8) == torch.device("cuda", 3) and chosen == [3]


def test_a_process_bound_to_one_gpu_takes_it(gpus):
    chosen = gpus(1)
    assert process_start._device(5, 8) == torch.device("cuda", 0) and chosen == [0]


def test_too_few_gpus_for_the_node_is_refused(gpus):
    chosen = gpus(2)
    with pytest.raises(UserError, match="8 processes on this node but 2 visible GPUs: one GPU per process"):
        process_start._device(5, 8)
    assert chosen == []


def test_no_gpu_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert process_start._device(1, 2) == torch.device("cpu")


def test_layouts():
    assert process_start.layout_problem([(2, "GPU-a"), (2, "GPU-b"), (2, "GPU-a2"), (2, "GPU-b2")]) is None
    assert process_start.layout_problem([(2, ""), (2, "")]) is None  # gloo ranks on the CPU
    shared = process_start.layout_problem([(4, "GPU-a"), (4, "GPU-b"), (4, "GPU-c"), (4, "GPU-b")])
    assert shared is not None and shared.startswith("ranks 1 and 3 run on the same GPU (GPU-b): one GPU per process")
    counts = process_start.layout_problem([(2, "GPU-a"), (2, "GPU-b"), (1, "GPU-c")])
    assert counts is not None and counts.startswith(
        "the nodes run different numbers of processes: rank 0's node 2, rank 2's node 1"
    )


def test_the_plan_places_each_rank_s_shards_on_its_own_gpu():
    """TorchRec places rank r on GPU r % local world size; tasks bound to one GPU each run on cuda:0
    (the placement a shard's tensor is checked against when the tables are built)."""
    from dlrmv4.model.embeddings.torchrec_backend.sharding import placed_on_the_ranks_devices, target_plan

    rows = {"item": 1000, "artist": 10}
    plan = target_plan(
        rows,
        8,
        {"item": "row_wise", "artist": "table_wise"},
        None,
        world_size=4,
        local_world_size=2,
        compute_device="cuda",
        hbm_cap_bytes=1 << 30,
        ddr_cap_bytes=1 << 30,
    )
    (tables,) = plan.plan.values()

    def placements(name: str) -> list[str]:
        return [str(shard.placement) for shard in tables[name].sharding_spec.shards]

    def layout(name: str) -> list[tuple[list[int], list[int]]]:
        return [(shard.shard_offsets, shard.shard_sizes) for shard in tables[name].sharding_spec.shards]

    assert placements("item") == ["rank:0/cuda:0", "rank:1/cuda:1", "rank:2/cuda:0", "rank:3/cuda:1"]
    (artist_rank,) = tables["artist"].ranks
    assert placements("artist") == [f"rank:{artist_rank}/cuda:{artist_rank % 2}"]
    before = layout("item"), layout("artist")
    assert placed_on_the_ranks_devices(plan, [0, 0, 0, 0]) is plan
    assert placements("item") == ["rank:0/cuda:0", "rank:1/cuda:0", "rank:2/cuda:0", "rank:3/cuda:0"]
    assert placements("artist") == [f"rank:{artist_rank}/cuda:0"]
    assert (layout("item"), layout("artist")) == before
