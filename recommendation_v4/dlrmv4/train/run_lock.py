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
from pathlib import Path
from typing import Callable

from dlrmv4.errors import UserError
from dlrmv4.lock_file import lock_holder, name_holder, release

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
            holder = lock_holder(fd) or "a process that has not written its name yet"
            os.close(fd)
            raise UserError(
                f"run directory {self.path.parent} is in use by a live run ({holder}); wait for it to end, "
                "or give this run another --run-dir"
            ) from None
        previous = lock_holder(fd)
        if previous:
            self.log(f"taking over {self.path}: its run ({previous}) ended without releasing it")
        name_holder(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            release(self._fd)
            self._fd = None
