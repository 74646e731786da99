"""Several GPUs of one machine (NCCL, TorchRec row-wise tables, bf16 sequences), at 2, 4 and 8
processes where the machine has the GPUs: the run follows the 1-GPU run on the same global batches,
a checkpoint moves from N GPUs to one and back to N, a GPU that cannot allocate ends every rank with
one line naming it, the sparse-dist pipeline follows the unpipelined run, and tasks a scheduler
bound to one GPU each train as the node does. The gloo twins of these tests are in
tests/test_distributed.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from multi_process import (
    STEPS,
    assert_same_trajectory,
    free_port,
    lookups_sent_ahead,
    make_data,
    rank_env,
    run_flags,
    run_with_rank_1_out_of_memory,
    torchrun,
    train_report,
)

pytest.importorskip("torchrec")


def gpu_counts(*counts: int) -> list:
    """World sizes as parameters, each skipped on a machine with fewer GPUs."""
    return [
        pytest.param(
            n,
            id=f"{n}gpus",
            marks=pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs (nvidia-h200-x{n})"),
        )
        for n in counts
    ]


WORLDS = gpu_counts(2, 4, 8)
# bf16 sequences (Triton kernels) and TorchRec row-wise tables on the GPUs.
GPU = {
    "model.sequence_dtype": "bfloat16",
    "model.kernels": "triton",
    "embeddings.embedding_backend": "torchrec",
    "embeddings.sharding_types": "*=row_wise",
}
BF16_LOSS_RTOL = 2e-2  # 8 mantissa bits: two reduction orders drift apart over 70 steps by about this much
BF16_AUC_ATOL = 2e-2
RESUMES = (30, 50)  # N GPUs stop at the first, one GPU goes on to the second, N GPUs finish


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("multi_gpu"))


@pytest.fixture(scope="module")
def one_gpu(data_path, tmp_path_factory):
    return train_report(1, data_path, tmp_path_factory.mktemp("one_gpu"), **{"train.max_steps": STEPS, **GPU})


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize(
    "qcomm, slicing, dedup_ids", [("none", "strided", False), ("fp16", "balanced", False), ("fp16", "balanced", True)]
)
def test_n_gpus_follow_the_one_gpu_trajectory(data_path, tmp_path, one_gpu, world, qcomm, slicing, dedup_ids):
    report = train_report(
        world,
        data_path,
        tmp_path / "run",
        **{
            "train.max_steps": STEPS,
            **GPU,
            "embeddings.qcomm": qcomm,
            "loader.rank_slicing": slicing,
            "embeddings.dedup_ids": dedup_ids,
        },
    )
    assert report["world_size"] == world and report["device"].startswith("cuda")
    assert all(row["ranks"] == list(range(world)) for row in report["sharding_plan"])
    assert_same_trajectory(report, one_gpu, loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL)


@pytest.mark.parametrize("world", WORLDS)
def test_a_checkpoint_moves_from_n_gpus_to_one_and_back(data_path, tmp_path, one_gpu, world):
    run_dir = tmp_path / "run"
    paused = train_report(world, data_path, run_dir, **{"train.max_steps": RESUMES[0], **GPU})
    assert (paused["history"]["status"], paused["history"]["steps"]) == ("stopped", RESUMES[0])
    for (first, second), steps in zip(((world, 1), (1, world)), (RESUMES[1], STEPS)):
        proc = torchrun(second, run_flags(data_path, run_dir, **{"train.max_steps": steps, **GPU}))
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert f"checkpoint written by {first} process(es), resuming on {second}" in proc.stdout
    assert_same_trajectory(
        json.loads((run_dir / "report.json").read_text()), one_gpu, loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL
    )


@pytest.mark.parametrize("world", WORLDS)
def test_a_gpu_that_cannot_allocate_ends_every_rank(data_path, tmp_path, world):
    """Rank 1 asks its GPU for twice its memory at step 5 (tests/failure_injection): the allocator
    refuses, rank 1 exits with one line saying so, and every other rank, waiting in the step's
    collective, exits within the collective timeout with one line naming rank 1 and the cause."""
    lines = run_with_rank_1_out_of_memory(data_path, tmp_path / "run", timeout_seconds=20.0, world=world, **GPU)
    assert not any("injected" in line for line in lines)  # the allocator's own error, not the CPU stand-in


@pytest.mark.parametrize("world", WORLDS)
def test_the_sparse_pipeline_on_n_gpus(data_path, tmp_path, world):
    """The next batch's ids travel (on their own stream) while each step computes: the trajectory is
    the unpipelined one within bf16 tolerance (kernels on several GPUs are not bit-reproducible run to
    run), and every lookup but the first (and each eval's first) took ids sent ahead."""
    runs = {
        on: train_report(
            world, data_path, tmp_path / str(on), **{"train.max_steps": STEPS, **GPU, "train.sparse_pipeline": on}
        )
        for on in (True, False)
    }
    assert (runs[True]["lookups_distributed_ahead"], runs[False]["lookups_distributed_ahead"]) == (
        lookups_sent_ahead(runs[True]),
        0,
    )
    assert_same_trajectory(runs[True], runs[False], loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL)


def _tasks_bound_to(gpus: list[int], data_path, run_dir) -> list[tuple[int, str, str]]:
    """One srun-like task per entry, each seeing only that GPU (CUDA_VISIBLE_DEVICES, as srun
    --gpus-per-task=1 leaves it): (status, stdout, stderr) by rank."""
    port, world = free_port(), len(gpus)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dlrmv4",
                "train",
                *run_flags(data_path, run_dir, **{"train.max_steps": STEPS, **GPU}),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=rank_env(rank, world, port, CUDA_VISIBLE_DEVICES=str(gpu)),
        )
        for rank, gpu in enumerate(gpus)
    ]
    outputs = [proc.communicate(timeout=600) for proc in procs]
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]


@pytest.mark.parametrize("world", WORLDS)
def test_tasks_bound_to_one_gpu_each_train_as_the_node(data_path, tmp_path, one_gpu, world):
    """A scheduler that binds one GPU to each task (each sees one device, numbered 0): every rank
    takes its own and the run follows the one-GPU trajectory."""
    for status, _, err in _tasks_bound_to(list(range(world)), data_path, tmp_path / "run"):
        assert status == 0, err[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["world_size"] == world
    assert_same_trajectory(report, one_gpu, loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL)


@pytest.mark.parametrize("world", gpu_counts(2))
def test_two_tasks_bound_to_the_same_gpu_are_refused(data_path, tmp_path, world):
    for status, _, err in _tasks_bound_to([0] * world, data_path, tmp_path / "run"):
        errors = [line for line in err.splitlines() if line.startswith("[dlrmv4] error:")]
        assert status != 0 and len(errors) == 1, err[-3000:]
        assert "ranks 0 and 1 run on the same GPU" in errors[0], errors[0]
