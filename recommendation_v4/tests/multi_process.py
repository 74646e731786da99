"""Runs of ``python -m dlrmv4 train`` under torchrun on a small store: the flags, the environment,
and the comparison of two runs' trajectories (the CPU tests in test_distributed.py and the 2-GPU
tests in gpu/test_multi_gpu.py share them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from raw_factory import random_events, write_raw

from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.verify import verify_and_stamp

REPO = Path(__file__).resolve().parents[2]
# A small store and model (fp32, PyTorch kernels): a run of 70 steps takes seconds per process.
OVERRIDES = {
    "preprocess.last_timestamp": 0,
    "preprocess.num_train_days": 6,
    "preprocess.min_history": 20,
    "sampler.max_seq_len": 48,
    "sampler.scan_window": 200,
    **{
        f"sampler.{name}_rows": 1_000
        for name in (
            "uid",
            "user_artist",
            "user_album",
            "user_hour",
            "item_hour",
            "artist_hour",
            "user_organic",
            "user_artist_hour",
        )
    },
    "loader.batch_size": 16,
    "loader.num_workers": 0,
    "model.embedding_dim": 8,
    "model.d_model": 8,
    "model.num_layers": 1,
    "model.num_heads": 1,
    "model.qk_dim": 16,
    "model.v_dim": 16,
    "model.preprocessor_hidden": 8,
    "model.action_dim": 2,
    "model.item_tower_hidden": 8,
    "model.head_hidden": 8,
    "model.num_position_buckets": 64,
    "model.num_time_buckets": 16,
    "model.sequence_dtype": "float32",
    "model.kernels": "pytorch",
    "model.input_dropout": 0.0,
    "model.linear_dropout": 0.0,
    "train.learning_rate": 0.01,
    "train.warmup_steps": 5,
    "train.eval_every_data_pct": 0.1,
    "train.target_auc": 1.0,
    "train.checkpoint_every_window": False,
    "train.checkpoint_every_steps": 10,
    "distributed.timeout_seconds": 60.0,
}
STEPS = 70  # two windows and a half; resumes split it at PAUSE
PAUSE = 35
# Same global batches, different reduction order: fp32 noise only. The holdout here has a few
# hundred samples, so two near-equal logits trading places moves the AUC by about 2.4e-3.
LOSS_RTOL = 2e-4
AUC_ATOL = 1e-2
QCOMM_LOSS_RTOL = 2e-3  # bf16 embedding all-to-all (8 mantissa bits)


def run_flags(data_path: Path, run_dir: Path, **extra) -> list[str]:
    values = {**OVERRIDES, "dataset.data_path": str(data_path), "train.run_dir": str(run_dir), **extra}
    return ["--preset=", "--no-progress"] + [f"--{k.split('.')[1].replace('_', '-')}={v}" for k, v in values.items()]


def launch_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "recommendation_v4"), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def torchrun(nproc: int, flags: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "dlrmv4",
        "train",
        *flags,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launch_env())


def train_report(nproc: int, data_path: Path, run_dir: Path, **extra) -> dict:
    proc = torchrun(nproc, run_flags(data_path, run_dir, **extra))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads((run_dir / "report.json").read_text())


def assert_same_trajectory(got: dict, want: dict, loss_rtol: float = LOSS_RTOL, auc_atol: float = AUC_ATOL) -> None:
    g, w = got["history"], want["history"]
    assert (g["steps"], g["samples"], g["status"]) == (w["steps"], w["samples"], w["status"])
    assert [(win, n) for win, n, _ in g["window_losses"]] == [(win, n) for win, n, _ in w["window_losses"]]
    assert [loss for *_, loss in g["window_losses"]] == pytest.approx(
        [loss for *_, loss in w["window_losses"]], rel=loss_rtol
    )
    assert [e["samples_count"] for e in g["evals"]] == [e["samples_count"] for e in w["evals"]]
    assert [e["auc"] for e in g["evals"]] == pytest.approx([e["auc"] for e in w["evals"]], abs=auc_atol)


def lookups_sent_ahead(report: dict, after_step: int = 0) -> int:
    """What a pipelined run (train.sparse_pipeline, holdout evals) reports as lookups_distributed_ahead:
    every step's lookup but the process's first, and every eval batch's but each eval's first (an
    eval pipelines its own batches), counting the steps and evals of this process (after
    ``after_step``, where it resumed)."""
    batch_size = report["config"]["loader"]["batch_size"]
    eval_batches = -(-report["eval_samples"] // batch_size)
    evals = sum(1 for e in report["history"]["evals"] if e["step"] > after_step)
    return report["history"]["steps"] - after_step - 1 + evals * (eval_batches - 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_data(root: Path) -> Path:
    """The small store every run here trains on (9 days of 40 users), verified as ``prepare`` leaves
    it (a multi-process run refuses a store it cannot tell is verified); returns its data path."""
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in OVERRIDES.items()})
    raw = write_raw(root / "raw", random_events(21, num_users=40, max_events=300, span_days=9))
    store = root / "data" / "processed" / "synthetic-tiny"
    preprocess(raw, store, cfg.dataset, cfg.preprocess, progress=False)
    assert verify_and_stamp(store, progress=False) == []
    return root / "data"


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """The environment of rank ``rank`` of ``world`` started like an srun task (no launcher)."""
    return dict(
        launch_env(),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def start_injected_ranks(
    world: int, data_path: Path, run_dir: Path, hooks: dict[str, str], **extra
) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m dlrmv4 train`` started like srun tasks (no launcher), with the
    failure-injection hook of tests/failure_injection on their path, switched on by ``hooks``."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port, **hooks)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent / "failure_injection"), env["PYTHONPATH"]])
        cmd = [sys.executable, "-m", "dlrmv4", "train", *run_flags(data_path, run_dir, **extra)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    return procs


def run_with_rank_1_out_of_memory(
    data_path: Path, run_dir: Path, timeout_seconds: float, world: int = 2, hooks: dict[str, str] | None = None, **extra
) -> list[str]:
    """``world`` ranks started like srun tasks (no launcher); rank 1 runs out of device memory at
    step 5 (tests/failure_injection; ``hooks``: more of its switches). Every rank must exit 1 within
    the collective timeout (plus start-up) with one error line, naming rank 1 and the cause, and no
    traceback; returns the lines, by rank."""
    flags = {**extra, "distributed.timeout_seconds": timeout_seconds}
    procs = start_injected_ranks(world, data_path, run_dir, {"DLRMV4_TEST_OOM": "1:5", **(hooks or {})}, **flags)
    started = time.time()
    outputs = [proc.communicate(timeout=300) for proc in procs]
    assert time.time() - started < timeout_seconds + 120  # no hang
    lines = []
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs)):
        errors = [line for line in err.splitlines() if line.startswith("[dlrmv4] error:")]
        assert proc.returncode == 1 and len(errors) == 1, f"rank {rank}: {err[-3000:]}"
        assert f"rank 1 of {world} ran out of device memory: CUDA out of memory" in errors[0], errors[0]
        assert "Traceback" not in err, err[-3000:]
        lines.append(errors[0])
    for rank, line in enumerate(lines):
        if rank == 1:
            assert line.startswith(f"[dlrmv4] error: rank 1 of {world}"), line
        else:
            assert line.startswith(f"[dlrmv4] error: rank {rank} of {world}:"), line
            assert f"failed because rank 1 of {world}" in line, line
    return lines
