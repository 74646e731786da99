"""One run per run directory: an exclusive lock that rank 0 holds for the life of a run.

The lock is ``flock`` on ``<run_dir>/run.lock``. The kernel releases it when its holder dies, so a
killed run never blocks the next one. The file names its holder (PID, host, start time) while a run
holds it, and is emptied when the run ends. A run that finds it not empty but not held takes it
over and says so: the previous holder ended without releasing it (kill -9, a lost node). Every rank
of a launch works under its rank 0's lock.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Callable

from dlrmv4.errors import UserError

LOCK_FILE = "run.lock"


class RunDirectoryLock:
    def __init__(self, run_dir: Path, log: Callable[[str], None] = print) -> None:
        self.path = run_dir / LOCK_FILE
        self.log = log
        self._fd: int | None = None

    def __enter__(self) -> RunDirectoryLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd) or "a process that has not written its name yet"
            os.close(fd)
            raise UserError(
                f"run directory {self.path.parent} is in use by a live run ({holder}); wait for it to end, "
                "or give this run another --run-dir"
            ) from None
        previous = _read(fd)
        if previous:
            self.log(f"taking over {self.path}: its run ({previous}) ended without releasing it")
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)  # released cleanly: the next run has nothing to take over
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()
