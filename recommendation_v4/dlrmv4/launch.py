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

Across nodes (a c10d rendezvous), each node also checks the rendezvous port before torchrun waits on
it, since torch's own waits there run in native code that neither the join timeout nor a SIGTERM
reaches: the node that hosts the store (``is_host`` in ``--rdzv-conf``) that no other program
holds the port, the others, up to the join timeout, that a store answers there. A failure of the
rendezvous says which one it is: the nodes did not all join, or the store went away with its node.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from dlrmv4.distributed.launcher_parent import LAUNCHER_PID_ENV
from dlrmv4.distributed.rendezvous_port import (
    RefusalWatch,
    leave_refusal,
    port_held_line,
    port_is_free,
    probe_port,
    read_refusal,
    stale_store_line,
    wait_for_store,
)
from dlrmv4.errors import ERROR_PREFIX, LAUNCHER_ENV
from dlrmv4.launch_failures import AgentStops, failure_line

DEFAULT_JOIN_TIMEOUT_S = 600  # torchrun's own for the c10d rendezvous
DEFAULT_RDZV_PORT = 29400  # torchrun's, for an endpoint without one


def conf_value(rdzv_conf: str, name: str) -> str | None:
    """One key's value in torchrun's ``--rdzv-conf`` (``key=value,...``)."""
    for item in filter(None, rdzv_conf.split(",")):
        key, _, value = item.partition("=")
        if key.strip() == name:
            return value.strip()
    return None


def join_timeout(rdzv_conf: str) -> float:
    """The rendezvous's ``join_timeout`` from torchrun's ``--rdzv-conf``."""
    value = conf_value(rdzv_conf, "join_timeout")
    return DEFAULT_JOIN_TIMEOUT_S if value is None else float(value)


def with_join_timeout(rdzv_conf: str, seconds: float) -> str:
    """``--rdzv-conf`` with its ``join_timeout`` set to ``seconds``."""
    items = [item for item in filter(None, rdzv_conf.split(",")) if item.partition("=")[0].strip() != "join_timeout"]
    return ",".join([*items, f"join_timeout={seconds:g}"])


def hosts_the_store(rdzv_conf: str, host: str) -> tuple[bool, bool]:
    """(whether this node hosts the rendezvous store, whether ``--rdzv-conf`` says so): its
    ``is_host``, or torch's own guess from the endpoint's host name."""
    value = conf_value(rdzv_conf, "is_host")
    if value is not None:
        return value.lower() in ("1", "true", "yes", "y", "on"), True
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(host), False


def check_the_port(args: argparse.Namespace, waiting: str) -> str | None:
    """The problem's line, or None, before torchrun's rendezvous: its waits at the port run in native
    code, where a program that never answers as a store holds a node for minutes, beyond the join
    timeout and deaf to SIGTERM. A node that joins as a client leaves torchrun the join timeout it
    has left."""
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_RDZV_PORT)
    hosting, said = hosts_the_store(args.rdzv_conf, host)
    if hosting:
        if port_is_free(port):
            return None
        answer = probe_port(host, port)
        if answer.kind == "store" and not said:
            return None  # torch's guess: another node on this machine hosts it, torch joins as a client
        line = port_held_line(host, port, answer)
        if answer.kind == "store":  # the other nodes join that store: they learn of the refusal there
            leave_refusal(host, port, f"node {args.node_rank} refused it: {line}")
        return line
    timeout = join_timeout(args.rdzv_conf)
    started = time.monotonic()
    answer = wait_for_store(host, port, timeout)
    if answer.kind == "store":
        refused = read_refusal(host, port)
        if refused is not None:
            return stale_store_line(refused)
        args.rdzv_conf = with_join_timeout(args.rdzv_conf, max(1, math.ceil(timeout - (time.monotonic() - started))))
        return None
    if answer.kind != "nothing":
        return port_held_line(host, port, answer)
    return (
        f"the nodes did not all join: waited for {waiting}: no rendezvous store answered there (the node that "
        "hosts it, NODE_RANK 0, has not started, or the endpoint does not name it)"
    )


def rendezvous_failure(exc: RendezvousError, args: argparse.Namespace, waiting: str) -> str:
    """What a failed rendezvous means: the nodes did not all join in time, another node closed it, or
    the store went away with the node that held it."""
    first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, RendezvousTimeoutError):
        return f"the nodes did not all join: waited for {waiting}: {first}"
    if isinstance(exc, RendezvousClosedError):
        return f"another node ended the run and closed the rendezvous at {args.rdzv_endpoint} (its output says why)"
    host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_RDZV_PORT)
    if hosts_the_store(args.rdzv_conf, host)[0]:
        cause = exc.__cause__ or exc
        return (
            f"the rendezvous store this node holds at {args.rdzv_endpoint} failed: {' '.join(str(cause).split())[:200]}"
        )
    return (
        f"lost the rendezvous store at {args.rdzv_endpoint}: the node that holds it stopped or failed (its "
        "output says why); this node's ranks were stopped"
    )


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


def _say(line: str) -> None:
    """One write per line: ranks started unbuffered (torchrun's -u) share this console."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    nodes = str(args.nnodes).split(":")[-1]
    node = f"node {args.node_rank}"
    waiting = ""
    if not args.standalone and nodes != "1":
        waiting = f"{nodes} nodes at {args.rdzv_endpoint} (up to {join_timeout(args.rdzv_conf):g} s)"
        _say(f"[dlrmv4] {node}: waiting for {waiting}")
    quiet_the_agent()
    os.environ[LAUNCHER_ENV] = "1"
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # its ranks end when it does (launcher_parent.py)
    # torchrun's agent handles these once its ranks have started; before, through the rendezvous (up
    # to its join timeout across nodes), SIGINT left a traceback and SIGTERM no line at all.
    for stop in (signal.SIGTERM, signal.SIGINT):
        signal.signal(stop, _raise_signal_exception)
    stops = AgentStops()
    refusals: RefusalWatch | None = None
    try:
        c10d = bool(waiting) and args.rdzv_backend == "c10d"
        problem = check_the_port(args, waiting) if c10d else None
        if problem is not None:
            _say(f"{ERROR_PREFIX}{node}: {problem}")
            return 1
        if c10d:
            host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_RDZV_PORT)
            if not hosts_the_store(args.rdzv_conf, host)[0]:  # a node that joins the store another hosts
                refusals = RefusalWatch(host, port, join_timeout(args.rdzv_conf))
        with stops.recording():
            torchrun.run(args)
    except ChildFailedError as exc:
        _say(f"{ERROR_PREFIX}{failure_line(exc.failures, stops)}")
        return 1
    except RendezvousError as exc:
        _say(f"{ERROR_PREFIX}{node}: {rendezvous_failure(exc, args, waiting)}")
        return 1
    except SignalException as exc:
        if refusals is not None and refusals.line is not None:
            _say(f"{ERROR_PREFIX}{node}: {stale_store_line(refusals.line)}")
            return 1
        name = signal.Signals(exc.sigval).name
        _say(f"[dlrmv4] terminated ({name}): every rank was stopped")
        return 128 + int(exc.sigval)
    finally:
        if refusals is not None:
            refusals.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
