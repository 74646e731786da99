"""Test-wide set-up. Without a GPU, Triton kernels run on CPU tensors through Triton's
interpreter; the variable must be set before triton is first imported."""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# The random stores, model inputs and plain-Python references that tests and benchmarks share.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# cuBLAS is deterministic only with a fixed workspace; torch's deterministic mode refuses it without.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture(scope="module")
def gloo_world_of_one(tmp_path_factory):
    """World size 1 over gloo with a file store, as TorchRec's DistributedModelParallel needs (kept
    when a process group already exists)."""
    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` for one test: torch's ops and the project's
    kernels take their ordered paths (no atomics, no configs picked by timing)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)
