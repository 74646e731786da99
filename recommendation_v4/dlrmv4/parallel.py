"""Work fanned out and taken back in order: to a pool of processes with a bounded number ahead, or
to threads (numpy and hashlib let go of the GIL)."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def usable_cores() -> int:
    """The cores this process may run on (``taskset`` and cgroup cpusets narrow it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_order(pool: Executor, fn: Callable[[T], R], items: Iterable[T], ahead: int) -> Iterator[R]:
    """``fn(item)`` for each item, computed by ``pool`` and yielded in the items' order, with at
    most ``ahead`` items submitted and not yet taken (what bounds the results held in memory)."""
    queued = iter(items)
    pending: deque[Future] = deque(pool.submit(fn, item) for item in itertools.islice(queued, max(1, ahead)))
    while pending:
        result = pending.popleft().result()
        for item in itertools.islice(queued, 1):
            pending.append(pool.submit(fn, item))
        yield result


def parallel_map(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """``[fn(x) for x in items]`` on ``workers`` threads, in order."""
    items = list(items)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))


def exit_with_parent(parent: int, poll_seconds: float = 0.5) -> None:
    """In a worker process: end it when its parent ends, however the parent ends (SIGKILL included),
    instead of waiting for work that will never come. ``parent`` is the pid of the process that started
    the pool (passed in, not read here: a worker that starts after its parent died already has another
    parent). A daemon thread sees the worker re-parented within ``poll_seconds``. Call it from a pool's
    initializer."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
