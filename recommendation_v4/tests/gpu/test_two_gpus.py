"""Two GPUs of one machine (NCCL, TorchRec row-wise tables, bf16 sequences): the 2-GPU run follows
the 1-GPU run on the same global batches, a checkpoint moves between 1 and 2 GPUs, and a GPU that
cannot allocate ends both ranks with one line naming it, and the sparse-dist pipeline follows the
unpipelined run. The gloo twins of these tests are in tests/test_distributed.py."""

from __future__ import annotations

import json

import pytest
import torch
from multi_process import (
    PAUSE,
    STEPS,
    assert_same_trajectory,
    lookups_sent_ahead,
    make_data,
    run_flags,
    run_with_rank_1_out_of_memory,
    torchrun,
    train_report,
)

pytest.importorskip("torchrec")
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")

# bf16 sequences (Triton kernels) and TorchRec row-wise tables on the GPUs.
GPU = {
    "model.sequence_dtype": "bfloat16",
    "model.kernels": "triton",
    "embeddings.embedding_backend": "torchrec",
    "embeddings.sharding_types": "*=row_wise",
}
BF16_LOSS_RTOL = 2e-2  # 8 mantissa bits: two reduction orders drift apart over 70 steps by about this much
BF16_AUC_ATOL = 2e-2


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("two_gpus"))


@pytest.fixture(scope="module")
def one_gpu(data_path, tmp_path_factory):
    return train_report(1, data_path, tmp_path_factory.mktemp("one_gpu"), **{"train.max_steps": STEPS, **GPU})


@pytest.mark.parametrize(
    "qcomm, slicing, dedup_ids", [("none", "strided", False), ("fp16", "balanced", False), ("fp16", "balanced", True)]
)
def test_two_gpus_follow_the_one_gpu_trajectory(data_path, tmp_path, one_gpu, qcomm, slicing, dedup_ids):
    report = train_report(
        2,
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
    assert report["world_size"] == 2 and report["device"].startswith("cuda")
    assert all(row["ranks"] == [0, 1] for row in report["sharding_plan"])
    assert_same_trajectory(report, one_gpu, loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL)


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resume_across_gpu_counts(data_path, tmp_path, one_gpu, first, second):
    run_dir = tmp_path / "run"
    paused = train_report(first, data_path, run_dir, **{"train.max_steps": PAUSE, **GPU})
    assert (paused["history"]["status"], paused["history"]["steps"]) == ("stopped", PAUSE)
    proc = torchrun(second, run_flags(data_path, run_dir, **{"train.max_steps": STEPS, **GPU}))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert f"checkpoint written by {first} process(es), resuming on {second}" in proc.stdout
    assert_same_trajectory(
        json.loads((run_dir / "report.json").read_text()), one_gpu, loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL
    )


def test_a_gpu_that_cannot_allocate_ends_both_ranks(data_path, tmp_path):
    """Rank 1 asks its GPU for twice its memory at step 5 (tests/failure_injection): the allocator
    refuses, rank 1 exits with one line saying so, and rank 0, waiting in the step's collective,
    exits within the collective timeout with one line naming rank 1 and the cause."""
    lines = run_with_rank_1_out_of_memory(data_path, tmp_path / "run", timeout_seconds=20.0, **GPU)
    assert not any("injected" in line for line in lines)  # the allocator's own error, not the CPU stand-in


def test_the_sparse_pipeline_on_two_gpus(data_path, tmp_path):
    """The next batch's ids travel (on their own stream) while each step computes: the trajectory is
    the unpipelined one within bf16 tolerance (kernels on two GPUs are not bit-reproducible run to
    run), and every lookup but the first (and each eval's first) took ids sent ahead."""
    runs = {
        on: train_report(
            2, data_path, tmp_path / str(on), **{"train.max_steps": STEPS, **GPU, "train.sparse_pipeline": on}
        )
        for on in (True, False)
    }
    assert (runs[True]["lookups_distributed_ahead"], runs[False]["lookups_distributed_ahead"]) == (
        lookups_sent_ahead(runs[True]),
        0,
    )
    assert_same_trajectory(runs[True], runs[False], loss_rtol=BF16_LOSS_RTOL, auc_atol=BF16_AUC_ATOL)
