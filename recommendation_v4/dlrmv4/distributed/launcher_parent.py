"""A rank started by ``dlrmv4.launch`` ends when its launcher does.

torchrun starts each rank in a session of its own, so a launcher killed alone (SIGKILL to it, not to
the job's process group) leaves its ranks training on with nobody to stop them, report them or meet
the other nodes at the end. Each such rank asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``, Linux); on a SIGTERM it then checks whether its parent is still the launcher,
and if not says so in its own line, since no launcher is left to say the job's.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass

from dlrmv4.errors import under_launcher

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class LauncherParent:
    pid: int | None  # the launcher's pid; None where this process follows no launcher

    @classmethod
    def follow(cls) -> LauncherParent:
        """Under ``dlrmv4.launch`` (torchrun's ranks) on Linux: SIGTERM to this process when its parent,
        the launcher, dies; sent at once where it already has."""
        if not (under_launcher() and "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux"):
            return cls(None)
        parent = os.getppid()
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
                return cls(None)
        except (OSError, AttributeError):
            return cls(None)
        if os.getppid() != parent:  # it died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return cls(parent)

    def gone(self) -> bool:
        """Whether the launcher this process followed has died (the process was handed to another parent)."""
        return self.pid is not None and os.getppid() != self.pid

    def line(self) -> str:
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        return (
            f"rank {rank} of {world}: its launcher (pid {self.pid}) is gone (killed, or it failed): the rank stops "
            "instead of training on with no launcher"
        )
