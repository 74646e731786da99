"""The fork server the loaders' "forkserver" workers come from imports torch and the loader once,
before RUN_START, so a worker does not import them itself after it (data/fork_server.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).with_name("fork_server_probe.py")


@pytest.mark.parametrize("mode,expected", [("preload", "True"), ("default", "False")])
def test_a_forked_worker_starts_with_the_server_s_modules(mode, expected):
    done = subprocess.run(
        [sys.executable, str(PROBE), mode], capture_output=True, text=True, timeout=300, cwd=PROBE.parent
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == f"torch in the worker: {expected}"
