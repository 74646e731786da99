"""A rank's failure and the others' knowledge of it: the line a failed rank posts in the ranks' store,
the watch that ends every other rank with it, the signs of life by which a lost collective names the
rank that stopped answering, and how a rank of several ends.

Every rank's failure watch polls the store once a second: it adds to this rank's counter (its sign
of life) and looks for a failed rank's line. A rank whose collective fails reads that line, or
watches the counters for ``SILENCE_SECONDS`` to name the ranks that stood still, or, where the
store itself is gone, the process or node that held it.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import threading
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dlrmv4.errors import UserError, exit_with_error

if TYPE_CHECKING:
    from dlrmv4.distributed.cluster import Cluster

FAILURE_KEY = "dlrmv4/failed_rank"  # the rendezvous store's key for a rank's own failure
FAILURE_POLL_SECONDS = 1.0  # how often every rank looks for a failure another rank posted
# A failed rank stays this long after posting its line: the store may live in its own process
# (rank 0 of a launch without torchrun), and the others must read the line before it goes.
FAILURE_LINGER_SECONDS = 3 * FAILURE_POLL_SECONDS
# Each rank's failure watch adds 1 to its own counter at every poll: a lost collective names the ranks
# whose counter stood still while it watched them this long.
ALIVE_KEY = "dlrmv4/alive/"
SILENCE_SECONDS = 3 * FAILURE_POLL_SECONDS
# How long a rank that lost a collective waits for each answer of the store: its holder may have
# stopped answering too, and the run's collective timeout would hold the line back that long.
STORE_ANSWER_SECONDS = 5.0


class RankLostError(UserError):
    """A collective failed: another rank exited, was killed, or stopped answering."""

    caused_by_another_rank = True

    def __init__(self, message: str, peer_said_why: bool) -> None:
        super().__init__(message)
        self.peer_said_why = peer_said_why  # False: the other rank left no line (stopped, killed, hung)


def _store():
    return dist.distributed_c10d._get_default_store()


def post_failure(cluster: Cluster, line: str) -> None:
    """Leave this rank's one-line failure in the ranks' store, where the other ranks look when their
    next collective fails (best effort: the store may be gone too)."""
    if cluster.world_size > 1:
        try:
            _store().set(FAILURE_KEY, line)
        except Exception:  # noqa: BLE001 - reporting must never mask the failure itself
            pass


def post_failure_and_linger(cluster: Cluster, line: str) -> None:
    """``post_failure``, then wait until every rank's watch has had time to read it."""
    if cluster.world_size > 1:
        post_failure(cluster, line)
        time.sleep(FAILURE_LINGER_SECONDS)


def watch_failures(cluster: Cluster) -> FailureWatch | None:
    """A watch that ends this rank as soon as another rank posts its failure (None: one process)."""
    return FailureWatch(cluster) if cluster.world_size > 1 else None


def posted_failure(cluster: Cluster) -> str | None:
    """The line a failed rank posted, if any."""
    if cluster.world_size == 1:
        return None
    try:
        store = _store()
        return store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
    except Exception:  # noqa: BLE001 - the store may have gone with the failed rank
        return None


def beat(cluster: Cluster) -> None:
    """A sign of life in the store (every poll of this rank's failure watch)."""
    try:
        _store().add(f"{ALIVE_KEY}{cluster.rank}", 1)
    except Exception:  # noqa: BLE001 - the store may be gone; the collective says the rest
        pass


def hurry_the_store() -> None:
    """From now on, each answer of the store waits up to ``STORE_ANSWER_SECONDS``: for a rank whose
    collective failed, whose store holder may have stopped answering too."""
    try:
        _store().set_timeout(datetime.timedelta(seconds=STORE_ANSWER_SECONDS))
    except Exception:  # noqa: BLE001 - no store, no wait
        pass


def silent_ranks(cluster: Cluster, seconds: float = SILENCE_SECONDS) -> list[int] | None:
    """The other ranks that gave no sign of life in the store for ``seconds`` (ranks that never gave
    one are not counted: their watch had not started); None when the store itself is gone or does
    not answer, found after ``seconds`` all the same: under torchrun the agent reads the same store,
    notices within its monitor interval, stops this rank and says the node's line."""
    others = [r for r in range(cluster.world_size) if r != cluster.rank]
    until = time.monotonic() + seconds
    try:
        store = _store()
        before = [store.add(f"{ALIVE_KEY}{r}", 0) for r in others]
        time.sleep(seconds)
        after = [store.add(f"{ALIVE_KEY}{r}", 0) for r in others]
    except Exception:  # noqa: BLE001 - a store that is gone is the answer
        time.sleep(max(0.0, until - time.monotonic()))
        return None
    return [r for r, b, a in zip(others, before, after) if a == b > 0]


class FailureWatch:
    """A thread that ends this rank with one line as soon as another rank posts its own failure.

    The main thread cannot always do it: on GPUs it may be blocked in native code waiting for a
    collective that the failed rank will never join, and NCCL's watchdog would end the process at the
    collective timeout with a native stack trace instead of a line. ``stop`` (on this rank's own
    failure, or at the end) makes sure that at most one of the two reports. Each poll also leaves
    this rank's sign of life in the store (``beat``), by which a lost collective names the
    rank that stopped answering."""

    def __init__(self, cluster: Cluster, poll_seconds: float = FAILURE_POLL_SECONDS) -> None:
        self._cluster, self._poll_seconds = cluster, poll_seconds
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dlrmv4-failure-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        beat(self._cluster)
        while not self._stopped.wait(self._poll_seconds):
            beat(self._cluster)
            posted = posted_failure(self._cluster)
            if posted is None:
                continue
            with self._lock:
                if self._stopped.is_set():
                    return
                c = self._cluster
                linger = FAILURE_LINGER_SECONDS if hosts_the_store() else 0.0
                exit_with_error(f"rank {c.rank} of {c.world_size}: training failed because {posted}", linger)

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()


def lost_rank_error(cluster: Cluster, what: str, exc: BaseException) -> RankLostError:
    """The line of a rank whose collective failed: the cause another rank posted, or which rank went
    silent (watched for ``SILENCE_SECONDS``; a rank's own line posted meanwhile still wins)."""
    hurry_the_store()
    posted = posted_failure(cluster)
    silent: list[int] | None = []
    if posted is None:
        silent = silent_ranks(cluster)
        posted = posted_failure(cluster)
    if posted is not None:
        return RankLostError(f"rank {cluster.rank} of {cluster.world_size}: {what} failed because {posted}", True)
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    return RankLostError(
        f"rank {cluster.rank} of {cluster.world_size}: {what} failed, {_who_left(cluster, silent)}"
        f"{_how_it_failed(cluster, text)}: {_clipped(first_line, LIBRARY_TEXT_CHARS)}",
        False,
    )


LIBRARY_TEXT_CHARS = 200  # of the transport's own message, in the line
_TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_CONNECTION_CLOSED = re.compile(r"closed|reset by peer|broken pipe|read error|end of file|EOF", re.IGNORECASE)


def _who_left(cluster: Cluster, silent: list[int] | None) -> str:
    """``silent_ranks``'s answer, for the line: the ranks that stopped answering, or, where the ranks'
    store is gone (None), the process or node that held it. Under torchrun the ranks' store is the
    launcher's on the node of global rank 0 (ranks 0 .. local world - 1), which need not be
    NODE_RANK 0 (that node holds the rendezvous store); without it, rank 0's process holds it."""
    if silent:
        return f"another rank exited or stopped answering: rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
    if silent is None and "TORCHELASTIC_RUN_ID" in os.environ:
        local = cluster.local_world_size
        if cluster.rank < local:
            return "this node's launcher, which held the ranks' store, is gone"
        holders = "rank 0" if local == 1 else f"ranks 0-{local - 1}"
        return f"the node of {holders} stopped or failed (its launcher held the ranks' store, gone with it)"
    if silent is None and cluster.rank != 0:
        return "rank 0 exited or stopped answering (its process held the ranks' store, which is gone too)"
    return "another rank exited or stopped answering"


def _how_it_failed(cluster: Cluster, text: str) -> str:
    """What the transport's message says happened: a timeout (the run's), or a peer that closed its
    connection; nothing where it says neither."""
    if _TIMED_OUT.search(text):
        return f" (timeout {cluster.timeout_seconds:g} s)"
    if _CONNECTION_CLOSED.search(text):
        return " (its connection closed)"
    return ""


def _clipped(text: str, limit: int) -> str:
    """``text`` up to ``limit`` characters, cut at a word's end (with "...") where it is longer."""
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:")
    return f"{cut} ..."


def own_failure_line(cluster: Cluster, exc: BaseException) -> str:
    """One line for this rank's own failure: out of device memory, a UserError, or another error."""
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else ""
    if isinstance(exc, torch.OutOfMemoryError):
        return f"rank {cluster.rank} of {cluster.world_size} ran out of device memory: {first}"
    if isinstance(exc, UserError):
        return first
    return f"rank {cluster.rank} of {cluster.world_size} failed: {type(exc).__name__}: {first}"


def hosts_the_store() -> bool:
    """Whether this process holds the rendezvous store that the ranks read a failed rank's line from:
    rank 0 of ranks started without torchrun (srun tasks; torchrun's agent holds it otherwise). Its
    exit takes the store with it, so on a failure it stays until the others have had time to read."""
    return (
        os.environ.get("RANK") == "0"
        and int(os.environ.get("WORLD_SIZE", "1")) > 1
        and "TORCHELASTIC_RUN_ID" not in os.environ
    )


def exit_process(code: int) -> None:
    """End the process with ``code``; one of several processes leaves without the interpreter's
    teardown, in which torch's autograd and gloo threads can hang or abort the process after the
    run has ended (pytorch/pytorch#190489; seen here about once in ten two-process runs). What the
    process wrote must be closed by now."""
    if code == 1 and hosts_the_store() and dist.is_initialized():  # a store no rank joined has no reader
        time.sleep(FAILURE_LINGER_SECONDS)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
