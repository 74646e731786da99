"""One voice per job on GPUs, where FBGEMM's kernels and NCCL speak too: a run's console, Python's
warnings on, holds only the project's lines (rank 0's, each once; a block's indented lines). On one
GPU FBGEMM's notices appear; on two, NCCL's process-group teardown at exit. The gloo twin is
tests/test_distributed.py::test_a_two_process_job_speaks_with_one_voice."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from multi_process import launch_env, make_data, run_flags

pytest.importorskip("torchrec")

GPU = {
    "model.sequence_dtype": "bfloat16",
    "model.kernels": "triton",
    "embeddings.embedding_backend": "torchrec",
    "embeddings.sharding_types": "*=row_wise",
    "train.target_auc": "0.0",  # the first eval ends the run: a whole run, set-up to exit
}


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("console"))


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_gpu_job_speaks_with_one_voice(data_path, tmp_path, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    train = ["-m", "dlrmv4", "train", *run_flags(data_path, tmp_path / "run", **GPU)]
    launcher = ["-m", "dlrmv4.launch", "--standalone", f"--nproc-per-node={gpus}"] if gpus > 1 else []
    env = launch_env()
    env.pop("PYTHONWARNINGS")
    proc = subprocess.run([sys.executable, *launcher, *train], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    strangers = [line for line in lines if not line.startswith(("[dlrmv4] ", "  "))]
    assert not strangers, strangers
    ours = [line for line in lines if line.startswith("[dlrmv4] ")]
    assert len(ours) == len(set(ours)) and any(line.startswith("[dlrmv4] training on ") for line in ours), ours
