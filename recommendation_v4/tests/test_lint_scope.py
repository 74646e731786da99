"""The linter and the formatter check see the whole package: a pattern that excludes the generated
stores (``./data``, ``./runs``) must not also exclude the package's own ``data`` folders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def test_ruff_checks_every_source_folder_and_skips_the_stores():
    listed = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    files = {Path(line.strip()).resolve().relative_to(PROJECT).as_posix() for line in listed.splitlines() if line}
    for source in ("dlrmv4/data/loader.py", "benchmarks/data/bench_loader.py", "dlrmv4/train/trainer.py"):
        assert source in files, f"ruff does not see {source}"
    assert not any(f.startswith(("data/", "runs/")) for f in files)
