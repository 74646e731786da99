"""Worker processes end with their parent, however it ends: ``prepare`` killed with SIGKILL while its
generator's and its preprocessing's workers run leaves no process of its own behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # kills a whole prepare


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _kill_once_it_has_workers(proc: subprocess.Popen, what: str) -> set[int]:
    """SIGKILL ``proc`` once two children of it are seen; their pids."""
    workers: set[int] = set()
    deadline = time.monotonic() + 120
    while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
        workers |= _children(proc.pid)
        time.sleep(0.05)
    assert len(workers) >= 2, f"no workers seen while {what}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return workers


def _gone_within(workers: set[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(workers), f"workers {sorted(_alive(workers))} outlived their parent"


@pytest.mark.parametrize("phase", ["generating", "preprocessing"])
def test_prepare_killed_with_sigkill_leaves_no_workers(tmp_path, phase):
    data = tmp_path / "data"
    # synthetic-medium: its 5 M events are 5 row groups, so the preprocessing too runs a pool.
    if phase == "preprocessing":  # the raw files first, so that the kill lands in the preprocessing's pool
        subprocess.run([sys.executable, "-m", "dlrmv4", "download", "--preset", "synthetic-medium", "--data-path",
                        str(data), "--no-progress"], check=True, capture_output=True, timeout=300)  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrmv4", "prepare", "--preset", "synthetic-medium", "--data-path", str(data),
         "--no-progress", "--workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _gone_within(_kill_once_it_has_workers(proc, phase), 10)


def test_train_killed_with_sigkill_leaves_no_loader_workers(tmp_path):
    """The loader's workers (PyTorch's DataLoader) watch their parent themselves, every 5 s."""
    data = tmp_path / "data"
    subprocess.run([sys.executable, "-m", "dlrmv4", "prepare", "--data-path", str(data), "--no-progress"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlrmv4", "train", "--data-path", str(data), "--run-dir", str(tmp_path / "run"),
         "--no-progress", "--num-workers", "2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _gone_within(_kill_once_it_has_workers(proc, "training"), 15)


_ORPHAN = """
import os, sys, time
from concurrent.futures import ProcessPoolExecutor
from dlrmv4.parallel import exit_with_parent
pool = ProcessPoolExecutor(2, initializer=exit_with_parent, initargs=(os.getpid(),))
futures = [pool.submit(time.sleep, 600) for _ in range(2)]
time.sleep(1.0)
print(" ".join(str(p) for p in pool._processes), flush=True)
time.sleep(600)
"""


def test_a_pool_started_with_exit_with_parent_ends_with_its_parent():
    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN], stdout=subprocess.PIPE, text=True)
    workers = {int(p) for p in proc.stdout.readline().split()}
    assert len(_alive(workers)) == 2
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(workers)


def test_a_worker_that_starts_after_its_parent_died_ends_too():
    """The parent's pid comes from the parent: a worker that runs its initializer only after its parent
    was killed (and so already has another parent) ends as well."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE,
        text=True,
    )
    dead_parent = int(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    late = subprocess.run(
        [sys.executable, "-c", f"import time; from dlrmv4.parallel import exit_with_parent; "
         f"exit_with_parent({dead_parent}, 0.05); time.sleep(30)"],
        timeout=20,
    )  # fmt: skip
    assert late.returncode == 1
