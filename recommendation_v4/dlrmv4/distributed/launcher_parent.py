"""A rank started by ``dlrmv4.launch`` ends when its launcher does.

torchrun starts each rank in a session of its own, so a launcher killed alone (SIGKILL to it, not to
the job's process group) leaves its ranks training on with nobody to stop them, report them or meet
the other nodes at the end. Each such rank asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``, Linux); on a SIGTERM it then checks whether the launcher is still there, and
if not says so in its own line, since no launcher is left to say the job's.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dlrmv4.errors import under_launcher

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The launcher's pid, in its ranks' environment: a rank may start after its launcher died, when its
# parent is no longer the launcher.
LAUNCHER_PID_ENV = "DLRMV4_LAUNCHER_PID"
# How long a rank that is being stopped waits to learn whether its launcher is dying.
STOP_WAIT_SECONDS = 0.5


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie), from /proc."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@dataclass(frozen=True)
class LauncherParent:
    pid: int | None  # the launcher's pid; None where this process follows no launcher

    @classmethod
    def follow(cls) -> LauncherParent:
        """Under ``dlrmv4.launch`` (torchrun's ranks) on Linux: SIGTERM to this process when its parent,
        the launcher, dies. Where it died before this call, ``gone`` says so at once."""
        pid = os.environ.get(LAUNCHER_PID_ENV, "")
        if not (under_launcher() and pid.isdigit() and "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux"):
            return cls(None)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # ``gone`` still tells, when this process next asks
        return cls(int(pid))

    def gone(self, wait_seconds: float = 0.0) -> bool:
        """Whether the launcher this process followed has died: this process has another parent, or the
        launcher is a zombie. The death signal comes when the launcher's thread that started this
        process ends, which can be before its other threads do (a SIGKILL ends them one by one), while
        this process's parent is still the launcher: ``wait_seconds`` gives that that long."""
        if self.pid is None:
            return False
        deadline = time.monotonic() + wait_seconds
        while os.getppid() == self.pid and _alive(self.pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def line(self) -> str:
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        return (
            f"rank {rank} of {world}: its launcher (pid {self.pid}) is gone (killed, or it failed): the rank "
            "stops instead of training on with no launcher"
        )
