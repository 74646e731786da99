"""A process that ends as a rank of several does (``exit_process``: ``os._exit``) holding loaders whose
workers a fork server started, as a trainer holds its holdout loader (persistent workers) and its
training loader's iteration, for ``test_loader.py``. ``killed``: a training loader's worker is
SIGKILLed mid-stream; ``damaged``: the store's first batch fails in a worker; ``done``: the
training loader runs to its end. The failures end in the project's one error line."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path

import numpy as np
from store_factory import random_store

from dlrmv4.config import BenchmarkConfig, LoaderConfig, SamplerConfig
from dlrmv4.data.loader import make_window_loader
from dlrmv4.data.store import open_store
from dlrmv4.distributed.liveness import exit_process
from dlrmv4.errors import UserError, report_failure

CONFIG = BenchmarkConfig(
    sampler=SamplerConfig(max_seq_len=39, scan_window=60), loader=LoaderConfig(batch_size=7, num_workers=2)
)


def damage(path: Path) -> None:
    """Every event's item id past the item tables: the first batch a worker builds fails."""
    items = np.load(path / "train" / "item_id.npy", mmap_mode="r+")
    items[:] = len(np.load(path / "items" / "artist_id.npy")) + 7
    items.flush()


def run(scenario: str, root: Path, held: list) -> int:
    """Train-like use of the loaders; everything they are goes into ``held``, alive to the exit."""
    path = random_store(root / "store", seed=11, lengths=[40, 90, 130, 25], min_history=5, num_windows=4)
    if scenario == "damaged":
        damage(path)
    store = open_store(path)
    try:
        if scenario != "damaged":
            holdout = make_window_loader(store, [3], CONFIG, worker_start="forkserver", persistent_workers=True)
            held.append(holdout)
            assert sum(1 for _ in holdout) > 2  # an eval: the workers stay for the next one
        batches = iter(make_window_loader(store, [0, 1, 2], CONFIG, worker_start="forkserver"))
        held.append(batches)
        for i, _ in enumerate(batches):
            if scenario == "killed" and i == 3:
                training = [p for p in multiprocessing.active_children() if p not in held[0]._iterator._workers]
                os.kill(training[0].pid, signal.SIGKILL)
    except UserError as exc:
        report_failure(str(exc))
        return 1
    except Exception as exc:  # the killed worker: "DataLoader worker ... exited unexpectedly", or its lost batch
        report_failure(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
        return 1
    print(f"{scenario}: loader done", flush=True)
    return 0


if __name__ == "__main__":  # the fork server imports this file as its main module
    held: list = []
    exit_process(run(sys.argv[1], Path(sys.argv[2]), held))
