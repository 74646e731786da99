"""GPU tests: skipped as a whole without CUDA (on CI they are collected and skipped)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # the shared test helpers


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent GPU: see benchmarks/README.md)")
    for item in items:
        if "/gpu/" in str(item.fspath):
            item.add_marker(skip)
