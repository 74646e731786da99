"""One preparation of a store at a time: an exclusive lock that ``prepare`` holds while it downloads
(or generates), preprocesses and verifies a store.

The lock is ``flock`` on ``<store>.prepare.lock`` beside the store's folder (the preprocessing writes
the folder anew, so the lock cannot live inside it). The kernel releases it when its holder dies, so
a killed preparation never blocks the next one. The file names its holder (PID, host, start time)
while a preparation holds it, and is emptied when it ends. A second preparation of the same store,
two ``run_and_time.sh`` on one missing data path say, waits for the first, saying so in one line,
and then finds the store the first one left (``waited``).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

from dlrmv4.lock_file import lock_holder, name_holder, release

LOCK_SUFFIX = ".prepare.lock"


def lock_path(store: Path) -> Path:
    return store.parent / f"{store.name}{LOCK_SUFFIX}"


class PrepareLock:
    def __init__(self, store: Path, log: Callable[[str], None] = print) -> None:
        self.store, self.path, self.log = store, lock_path(store), log
        self.waited = False  # whether another preparation held the store when this one came
        self._fd: int | None = None

    def __enter__(self) -> PrepareLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(fd) or "a process that has not written its name yet"
                self.log(f"waiting for another preparation of {self.store} to finish ({holder}; lock {self.path})")
                fcntl.flock(fd, fcntl.LOCK_EX)  # a signal's exception (SIGTERM, Ctrl-C) ends the wait
                self.waited = True
        except BaseException:
            os.close(fd)
            raise
        name_holder(fd)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            release(self._fd)
            self._fd = None
