"""Run in a fresh interpreter by tests/test_fork_server.py: prints whether a worker forked from the
fork server starts with torch imported, after ``start_fork_server()`` ("preload") or with Python's
default server ("default"). Imports nothing heavy itself, so the worker's modules are the server's."""

import multiprocessing
import sys


def report(queue) -> None:
    queue.put("torch" in sys.modules)


if __name__ == "__main__":
    if sys.argv[1] == "preload":
        from dlrmv4.data.fork_server import start_fork_server

        start_fork_server()
    context = multiprocessing.get_context("forkserver")
    queue = context.Queue()
    worker = context.Process(target=report, args=(queue,))
    worker.start()
    print("torch in the worker:", queue.get(timeout=120))
    worker.join()
