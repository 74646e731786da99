"""The holder line of an ``flock``ed lock file: who holds it (pid, host, start time), written when the
lock is taken and emptied when it is released, so a waiting or refused process can name the holder
and a lock left by a process that died says so."""

from __future__ import annotations

import fcntl
import os
import socket
import time


def lock_holder(fd: int) -> str:
    """The holder line the lock file holds ('' when none)."""
    return os.pread(fd, 4096, 0).decode(errors="replace").strip()


def name_holder(fd: int) -> None:
    """Write this process as the holder, over any line left there."""
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {started}".encode(), 0)


def release(fd: int) -> None:
    """Empty the holder line (nothing names a holder that has gone), unlock and close."""
    os.ftruncate(fd, 0)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
