"""The project's launcher: torchrun's flags and command, one line when the job fails.

    python -m dlrmv4.launch --standalone --nproc-per-node 4 -m dlrmv4 train --preset synthetic-medium

torchrun reports a failed rank in a block of some fifty lines (``ChildFailedError``, its agent's
log lines around it), and each rank it then stops says ``terminated (SIGTERM)``, so the cause (a
rank's own one-line error, or the signal that killed it) is easy to miss. This runs torchrun's own
launcher in this process and ends a failed job with one line naming the first rank that failed and
why; the ranks it starts leave the SIGTERM that stops them unsaid (``DLRMV4_LAUNCHER``) and leave
their own line where torchrun's agent reads it (``TORCHELASTIC_ERROR_FILE``). A rank whose failure
only follows another's (a collective that lost its peer) is never named the cause while that other
rank's failure is known.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous.api import RendezvousError

from dlrmv4.errors import CAUSED_BY_ANOTHER_RANK, ERROR_PREFIX, LAUNCHER_ENV

DEFAULT_JOIN_TIMEOUT_S = 600  # torchrun's own for the c10d rendezvous
# Exit statuses of a rank that the agent stopped: our CLI's 143, or the signal itself.
STOPPED_BY_THE_AGENT = (128 + signal.SIGTERM, -signal.SIGTERM)


def failed_rank(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """The rank whose failure is the cause, the earliest of them (then the lowest rank): one that left
    its own line (even if the agent stopped it afterwards, while it waited for the others to read
    it), or one that ended by itself with no line (a signal, an exit status); not one whose failure
    only follows another's, nor one the agent stopped, while a cause is known."""

    def cause(failure: ProcessFailure) -> bool:
        data = failure.error_file_data
        if isinstance(data, dict) and CAUSED_BY_ANOTHER_RANK in data:
            return not data[CAUSED_BY_ANOTHER_RANK]
        return failure.exitcode not in STOPPED_BY_THE_AGENT

    candidates = [(rank, f) for rank, f in failures.items() if cause(f)] or list(failures.items())
    return min(candidates, key=lambda item: (item[1].timestamp, item[0]))


def failure_line(failures: dict[int, ProcessFailure]) -> str:
    """The job's one line for a failure: the rank and its own line, the signal that killed it, or
    its exit status."""
    rank, failure = failed_rank(failures)
    data = failure.error_file_data
    # A line the rank left itself (dlrmv4.errors.leave_for_launcher), not torch's placeholder.
    message = data.get("message") if isinstance(data, dict) and CAUSED_BY_ANOTHER_RANK in data else None
    if isinstance(message, str) and message:
        return message if message.startswith(f"rank {rank} ") else f"rank {rank}: {message}"
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()} (pid {failure.pid}); the other ranks were stopped"
    return f"rank {rank} exited with status {failure.exitcode} (its output above says why)"


def join_timeout(rdzv_conf: str) -> float:
    """The rendezvous's ``join_timeout`` from torchrun's ``--rdzv-conf`` (``key=value,...``)."""
    for item in filter(None, rdzv_conf.split(",")):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout":
            return float(value)
    return DEFAULT_JOIN_TIMEOUT_S


AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


def quiet_the_agent() -> None:
    """The agent's own log lines repeat what the one line says (and its start-up notes are noise).
    torch gives each of its modules' loggers a level of its own (WARNING), so the parents' level
    alone does not reach them."""
    for name in AGENT_LOGGERS:
        logging.getLogger(name)
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and name.startswith(AGENT_LOGGERS):
            logger.setLevel(logging.CRITICAL)


def _raise_signal_exception(signum: int, frame: object) -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    nodes = str(args.nnodes).split(":")[-1]
    waiting = ""
    if not args.standalone and nodes != "1":
        waiting = f"{nodes} nodes at {args.rdzv_endpoint} (up to {join_timeout(args.rdzv_conf):g} s)"
        print(f"[dlrmv4] node {args.node_rank}: waiting for {waiting}", file=sys.stderr, flush=True)
    quiet_the_agent()
    os.environ[LAUNCHER_ENV] = "1"
    # torchrun's agent handles these once its ranks have started; before, through the rendezvous (up
    # to its join timeout across nodes), SIGINT left a traceback and SIGTERM no line at all.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _raise_signal_exception)
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        print(f"{ERROR_PREFIX}{failure_line(exc.failures)}", file=sys.stderr, flush=True)
        return 1
    except RendezvousError as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        print(
            f"{ERROR_PREFIX}node {args.node_rank}: the nodes did not all join: waited for {waiting}: {first}",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        print(f"[dlrmv4] terminated ({name}): every rank was stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
