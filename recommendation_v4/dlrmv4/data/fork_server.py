"""The fork server that loader workers started with ``worker_start="forkserver"`` come from.

Python's fork server imports only ``__main__`` by default, so each worker it forks imports torch
and the loader on its own before its first batch: 8 workers took 5.3 s to their first batch on a
2-core CPU, against 0.22 s from a server that imported them first, whose own start took 1.2 s
(``benchmarks/data/bench_worker_start.py``). Started before RUN_START, the server reads no data, and
the workers the run's loaders start from it after RUN_START begin with those modules in place.
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing import forkserver

# What the server imports once for every worker it forks (``__main__`` is Python's own default).
PRELOAD = ("__main__", "torch", "dlrmv4.data.loader")


def start_fork_server() -> None:
    """Start the fork server with ``PRELOAD`` imported, and return once it has forked a first process
    (its imports are done: a worker asked for later waits for nothing). A server already running (an
    earlier loader's) is left as it is: its modules cannot change."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    first = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
    first.start()
    first.join()
