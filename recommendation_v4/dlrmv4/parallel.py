"""Work fanned out to a pool of processes and taken back in order, with a bounded number ahead."""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Executor, Future
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


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
