"""Which rank failed a launched job, and the job's one line that says so (``dlrmv4.launch``).

torchrun's agent stops the other ranks once one fails (SIGTERM, then SIGKILL 30 s later), so the
failures it reports mix the cause with the ranks it stopped; each rank's own line, marked when it
only follows another's, and the signals the agent sent tell them apart.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Iterator

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dlrmv4.errors import CAUSED_BY_ANOTHER_RANK

# Exit statuses of a rank that the agent stopped: our CLI's 143, or the signal itself.
STOPPED_BY_THE_AGENT = (128 + signal.SIGTERM, -signal.SIGTERM)
# How long torchrun's agent waits for its SIGTERM before it sends SIGKILL (torch's PContext.close).
AGENT_KILL_AFTER_SECONDS = 30


class AgentStops:
    """The signals torchrun's agent sent each rank's process group when it stopped the job, by pid: a
    rank it killed is not the job's cause. After each SIGTERM it also sends SIGCONT, as service
    managers do, so a rank that was stopped (SIGSTOP, a debugger) ends on the SIGTERM at once
    instead of the agent's SIGKILL 30 s later."""

    def __init__(self) -> None:
        self.sent: dict[int, set[int]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import (
            SubprocessHandler,
        )

        original = SubprocessHandler.close
        sent = self.sent

        def close(handler: SubprocessHandler, death_sig: signal.Signals | None = None) -> None:
            sig = death_sig or signal.SIGTERM
            sent.setdefault(handler.proc.pid, set()).add(int(sig))
            original(handler, death_sig)
            if sig == signal.SIGTERM:
                with contextlib.suppress(OSError):
                    os.killpg(handler.proc.pid, signal.SIGCONT)

        SubprocessHandler.close = close  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            SubprocessHandler.close = original  # type: ignore[method-assign]

    def stopped(self, failure: ProcessFailure) -> bool:
        """Whether the rank ended by the agent's stop: its SIGTERM (a job's ranks get no other), or a
        signal the agent sent this rank."""
        if failure.exitcode in STOPPED_BY_THE_AGENT:
            return True
        return failure.exitcode < 0 and -failure.exitcode in self.sent.get(failure.pid, set())

    def killed(self, failure: ProcessFailure) -> bool:
        """Whether the agent had to kill the rank: it did not end on the agent's SIGTERM."""
        return failure.exitcode == -signal.SIGKILL and int(signal.SIGKILL) in self.sent.get(failure.pid, set())


def _own_line(failure: ProcessFailure) -> tuple[str, bool] | None:
    """(the line the rank left itself, whether its failure only follows another's), or None."""
    data = failure.error_file_data
    if isinstance(data, dict) and CAUSED_BY_ANOTHER_RANK in data and isinstance(data.get("message"), str):
        return data["message"], bool(data[CAUSED_BY_ANOTHER_RANK])
    return None


def failed_rank(failures: dict[int, ProcessFailure], stops: AgentStops | None = None) -> tuple[int, ProcessFailure]:
    """The rank whose failure is the cause, the earliest of them (then the lowest rank): one that left
    its own line (even if the agent stopped it afterwards, while it waited for the others to read
    it), or one that ended by itself with no line (a signal, an exit status); not one whose failure
    only follows another's, nor one the agent stopped or killed. Where none is a cause, a rank that
    left a line (one that names the rank that stopped answering) before the others."""
    stops = stops or AgentStops()

    def cause(failure: ProcessFailure) -> bool:
        own = _own_line(failure)
        if own is not None:
            return not own[1]
        return not stops.stopped(failure)

    candidates = [(rank, f) for rank, f in failures.items() if cause(f)]
    candidates = candidates or [(rank, f) for rank, f in failures.items() if _own_line(f)] or list(failures.items())
    return min(candidates, key=lambda item: (item[1].timestamp, item[0]))


def failure_line(failures: dict[int, ProcessFailure], stops: AgentStops | None = None) -> str:
    """The job's one line for a failure: the rank and its own line, the signal that killed it, or
    its exit status; and the ranks the launcher had to kill because they did not end on its SIGTERM."""
    stops = stops or AgentStops()
    rank, failure = failed_rank(failures, stops)
    own = _own_line(failure)
    if own is not None and own[0]:
        line = own[0] if own[0].startswith(f"rank {rank} ") else f"rank {rank}: {own[0]}"
    elif failure.exitcode < 0:
        line = f"rank {rank} was killed by {failure.signal_name()} (pid {failure.pid}); the other ranks were stopped"
    else:
        line = f"rank {rank} exited with status {failure.exitcode} (its output above says why)"
    killed = sorted(r for r, f in failures.items() if r != rank and stops.killed(f))
    if killed:
        which = ", ".join(map(str, killed))
        line += (
            f"; the launcher killed rank{'s' if len(killed) > 1 else ''} {which} (SIGKILL) after "
            f"{AGENT_KILL_AFTER_SECONDS} s without an end on its SIGTERM"
        )
    return line
