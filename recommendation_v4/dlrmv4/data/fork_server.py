"""The fork server that loader workers started with ``worker_start="forkserver"`` come from.

Python's fork server imports only ``__main__`` by default, so each worker it forks imports torch
and the loader on its own before its first batch: 2.7 s on a 2-core CPU, against 0.2 s when the
server imported them first (``tests/test_fork_server.py`` checks the modules a forked worker
starts with). Started before RUN_START, the server reads no data, and the workers the
run's loaders start from it after RUN_START begin with those modules in place.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver

# What the server imports once for every worker it forks (``__main__`` is Python's own default).
PRELOAD = ("__main__", "torch", "dlrmv4.data.loader")


def start_fork_server() -> None:
    """Start the fork server with ``PRELOAD`` imported. A server already running (an earlier loader's)
    is left as it is: its modules cannot change."""
    multiprocessing.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
