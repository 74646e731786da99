"""GPU tests: skipped as a whole without CUDA (on CI they are collected and skipped)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))  # the shared test helpers


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (see benchmarks/README.md)")
    for item in items:
        if "/gpu/" in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def process_group(tmp_path_factory):
    """World size 1 over NCCL (TorchRec's DistributedModelParallel needs a process group)."""
    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group(
            "nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
    yield
    if created:
        dist.destroy_process_group()
