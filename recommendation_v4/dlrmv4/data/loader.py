"""Streaming loader: jagged batches of one or more windows, in strict time order (docs/training.md).

A window's anchors are cut into consecutive batches, in the store's order (ascending event index:
user-major, the reference's) or, with ``loader.window_order = "time"``, in time order (ties by
index); the optional in-window shuffle permutes that order with a generator seeded from
(seed, window). Batches never span two windows. Batch i of the plan is built by worker
i mod num_workers, which is exactly the order the DataLoader's round-robin collects them in,
so the stream is identical for any number of workers. Workers convert numpy to torch (zero
copy); the main process pins them when a GPU is present.

In a run of several processes the plan is the global one (the batch size is the global batch
size) and each rank builds only its share of every batch (``rank_share``: samples r, r + W, ... as
the reference does, a contiguous slice, or token-balanced shares), so the global batches, the step
count and the eval points do not depend on the world size.
"""

from __future__ import annotations

import functools
import heapq
import os
import threading
import time
from multiprocessing import util as mp_util
from multiprocessing.synchronize import SemLock
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from dlrmv4.config import BenchmarkConfig, SamplerConfig
from dlrmv4.data.batch import JaggedBatch, TorchJaggedBatch
from dlrmv4.data.sampler import build_batch, history_lengths, pack_item_sides
from dlrmv4.data.store import Store, open_store
from dlrmv4.errors import UserError


class BatchSlice(NamedTuple):
    """Batch = anchors ``order[start:stop]`` of ``window`` (``order`` = the window's anchors, maybe shuffled)."""

    window: int
    start: int
    stop: int


# How often a loader worker looks whether the process that owns its loader still runs.
OWNER_POLL_SECONDS = 0.5

RANK_SLICINGS = ("strided", "contiguous", "balanced")


def share_size(num_samples: int, rank: int, world_size: int, slicing: str = "strided") -> int:
    """How many of a batch's ``num_samples`` samples rank ``rank`` takes (known without the samples)."""
    if slicing == "contiguous":
        return num_samples * (rank + 1) // world_size - num_samples * rank // world_size
    if slicing in ("strided", "balanced"):
        return num_samples // world_size + (rank < num_samples % world_size)
    raise ValueError(f"rank slicing {slicing!r} is not one of {', '.join(RANK_SLICINGS)}")


def balanced_shares(tokens: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Every rank's positions (ascending) in a batch of samples with these token counts: rank r takes
    ``share_size(n, r, W, "balanced")`` samples, and the token sums are balanced greedily (the
    longest sample first, each to the rank with the fewest tokens that still has room; ties go to
    the earlier sample and the lower rank), so the result depends on the batch alone."""
    tokens = np.asarray(tokens, dtype=np.int64)
    room = [share_size(len(tokens), r, world_size, "balanced") for r in range(world_size)]
    heap = [(0, r) for r in range(world_size) if room[r]]
    owner = np.empty(len(tokens), dtype=np.int64)
    for position in np.argsort(-tokens, kind="stable").tolist():
        total, r = heapq.heappop(heap)
        owner[position] = r
        room[r] -= 1
        if room[r]:
            heapq.heappush(heap, (total + int(tokens[position]), r))
    return [np.flatnonzero(owner == r) for r in range(world_size)]


def rank_share(
    part: BatchSlice, rank: int, world_size: int, slicing: str = "strided", tokens: np.ndarray | None = None
) -> np.ndarray:
    """Positions (into the window's order) of rank ``rank``'s samples of a batch: ``strided``
    takes samples r, r + W, r + 2W, ... (the reference's), ``contiguous`` an equal consecutive
    slice, ``balanced`` the ``balanced_shares`` of the batch's per-sample ``tokens``; either way the
    shares' sizes differ by at most one."""
    if slicing == "strided":
        return np.arange(part.start + rank, part.stop, world_size, dtype=np.int64)
    if slicing == "contiguous":
        n = part.stop - part.start
        return np.arange(part.start + n * rank // world_size, part.start + n * (rank + 1) // world_size, dtype=np.int64)
    if slicing == "balanced":
        if world_size == 1:
            return np.arange(part.start, part.stop, dtype=np.int64)
        if tokens is None or len(tokens) != part.stop - part.start:
            raise ValueError("balanced rank slicing needs the token count of every sample of the batch")
        return balanced_shares(tokens, world_size)[rank] + part.start
    raise ValueError(f"rank slicing {slicing!r} is not one of {', '.join(RANK_SLICINGS)}")


def plan_batches(window_sizes: Sequence[tuple[int, int]], batch_size: int, drop_last: bool) -> list[BatchSlice]:
    """Consecutive batches of each (window, num_anchors), windows in the given order."""
    plan: list[BatchSlice] = []
    for window, size in window_sizes:
        stop = size - size % batch_size if drop_last else size
        plan.extend(BatchSlice(window, s, min(s + batch_size, size)) for s in range(0, stop, batch_size))
    return plan


def window_order(store: Store, window: int, order: str, shuffle: bool, seed: int) -> np.ndarray:
    """The window's anchors in batch order: the store's (ascending event index) or time order (ties
    by index), then, with ``shuffle``, a permutation seeded by (seed, window)."""
    anchors = np.asarray(store.window_anchors(window))
    if order == "time":
        anchors = anchors[np.lexsort((anchors, np.asarray(store.train.timestamp)[anchors]))]
    elif order != "index":
        raise ValueError(f"window order {order!r} is not one of index, time")
    if not shuffle:
        return anchors
    return anchors[np.random.default_rng([seed, window]).permutation(len(anchors))]


class WindowDataset(IterableDataset):
    """Yields ``TorchJaggedBatch`` for the batches ``plan[start_batch:]``.

    Holds the store's path, not its arrays, so it pickles cheaply into workers under any start
    method; each worker opens the store (memory maps) and packs the per-item table once.
    """

    def __init__(
        self,
        store: Store,
        windows: Sequence[int],
        cfg: SamplerConfig,
        *,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        start_batch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        order: str = "index",
        slicing: str = "strided",
        dedup_ids: bool = False,
    ) -> None:
        super().__init__()
        windows = [int(w) for w in windows]
        bad = [w for w in windows if not 0 <= w < store.num_windows]
        if bad:
            raise ValueError(f"windows {bad} are outside the store's [0, {store.num_windows})")
        offsets = np.asarray(store.window_offsets)
        sizes = [(w, int(offsets[w + 1] - offsets[w])) for w in windows]
        self.plan = plan_batches(sizes, batch_size, drop_last)
        if not 0 <= start_batch <= len(self.plan):
            raise ValueError(f"start_batch {start_batch} is outside [0, {len(self.plan)}] for these windows")
        self.store_path: Path = store.path
        self.cfg = cfg
        self.shuffle = shuffle
        self.seed = seed
        self.start_batch = start_batch
        self.rank, self.world_size = rank, world_size
        self.order, self.slicing = order, slicing
        self.dedup_ids = dedup_ids

    def __len__(self) -> int:
        return len(self.plan) - self.start_batch

    def __iter__(self) -> Iterator[TorchJaggedBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = self.plan[self.start_batch + worker :: num_workers]
        if not mine:
            return
        store = open_store(self.store_path)
        item_sides = pack_item_sides(store)
        order_window, order = -1, np.zeros(0, dtype=np.int64)
        for part in mine:
            if part.window != order_window:
                order_window, order = part.window, window_order(store, part.window, self.order, self.shuffle, self.seed)
            tokens = None
            if self.slicing == "balanced" and self.world_size > 1:  # the whole batch's lengths decide the shares
                tokens = history_lengths(store, order[part.start : part.stop], self.cfg)
            share = rank_share(part, self.rank, self.world_size, self.slicing, tokens)
            if not len(share):  # a tail batch smaller than the world: this rank scores a stand-in, ignored
                share = np.array([part.start], dtype=np.int64)
            batch = build_batch(store, order[share], self.cfg, item_sides)
            check_item_ids(batch, len(item_sides), store.path, part.window)
            yield batch.to_torch(dedup_ids=self.dedup_ids)


def check_item_ids(batch: JaggedBatch, num_items: int, store_path: Path, window: int) -> None:
    """Item ids beyond the store's item tables can only come from a damaged store (preprocessing
    sizes the tables to cover every item of the data); the embedding lookup would fail on them
    with an IndexError naming nothing. One line naming the store and what to do instead."""
    top = max(int(batch.history_item_id.max(initial=0)), int(batch.candidate_item_id.max(initial=0)))
    if top >= num_items:
        raise UserError(
            f"{store_path}: item id {top} in a batch of window {window} is outside the store's {num_items:,} "
            f"items: the store is damaged (python -m dlrmv4 verify --store {store_path} names the file; "
            "prepare it again)"
        )


class WindowLoader(DataLoader):
    """A DataLoader whose workers' one-line errors stay one line (PyTorch re-raises a worker's
    exception with the worker's whole traceback as its message) and whose workers' semaphores
    outlive no process.

    Workers that do not fork (``worker_start`` "forkserver") share their queues through named
    semaphores. Python unlinks the names when the queues are collected or at a normal exit; a rank
    of several ends with ``os._exit`` (after a loader worker was killed, say, or with a persistent
    loader's workers alive) and a process may be killed, and then Python's resource tracker unlinks
    them, warning "There appear to be N leaked semaphore objects" after the run's last line. So the
    names go as soon as every worker has opened them (each has sent its first batch, or its end), or
    once a failed iteration has stopped its workers; the open semaphores work on without them."""

    dataset: WindowDataset

    @property
    def batch_plan(self) -> list[BatchSlice]:
        """Every batch of the loader's windows from the first (a resumed loader starts part way):
        its window and samples, the position a trainer reads the window of each step from."""
        return self.dataset.plan

    def __iter__(self):
        before = set(_semaphore_finalizers())
        batches = super().__iter__()  # starts the workers (a persistent loader's once)
        names = [f for key, f in _semaphore_finalizers().items() if key not in before]
        try:
            for i, batch in enumerate(batches, 1):
                if i == self.num_workers:  # batch i - 1 came from worker i - 1: every worker has started
                    _unlink(names)
                yield batch
        except GeneratorExit:
            raise  # the consumer stopped early: a worker still starting needs the names
        except BaseException as exc:
            self._stop_workers(batches)  # a failed iteration's workers end with it, before the names go
            _unlink(names)
            if isinstance(exc, UserError):
                raise UserError(_worker_message(str(exc))) from None
            raise
        _unlink(names)  # the iteration's end: every worker has run

    def _stop_workers(self, batches: object) -> None:
        """End the iteration's workers now (the next iteration starts new ones)."""
        shutdown = getattr(batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self._iterator = None


def _semaphore_finalizers() -> dict[tuple, mp_util.Finalize]:
    """This process's pending unlinks of named semaphores (multiprocessing registers one per
    semaphore a non-fork context creates), by their registry key. Python has no public handle on
    them: its registry and the unlink it registers are read where CPython has them (none found
    elsewhere: the names then go as Python lets them)."""
    cleanup = getattr(SemLock, "_cleanup", None)
    registry = getattr(mp_util, "_finalizer_registry", {})
    if cleanup is None:
        return {}
    return {key: f for key, f in list(registry.items()) if getattr(f, "_callback", None) is cleanup}


def _unlink(finalizers: list[mp_util.Finalize]) -> None:
    """Unlink the semaphores' names now (and tell the resource tracker), emptying the list."""
    while finalizers:
        finalizers.pop()()


def _end_with_owner(owner: int, worker_id: int) -> None:
    """A worker's ``worker_init_fn``: end the worker once the process that owns the loader has ended,
    however it ended. PyTorch's workers watch their parent, which for a worker a fork server started
    is the fork server, and that lives as long as its children: without this, a rank ending with
    ``os._exit`` (or killed) would leave them, the fork server and the resource tracker running."""

    def watch() -> None:
        while _running(owner):
            time.sleep(OWNER_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-owner", daemon=True).start()


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited process its parent has not reaped yet does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc, or the process has just gone: the next look tells
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _worker_message(message: str) -> str:
    """The original message of an exception PyTorch re-raised from a loader worker (its traceback's
    last line, less the exception's name); other messages as they are."""
    if not message.startswith("Caught "):
        return message
    last = message.strip().splitlines()[-1]
    return last.split(": ", 1)[1] if ": " in last else last


def make_window_loader(
    store: Store,
    windows: Sequence[int],
    cfg: BenchmarkConfig,
    start_batch: int = 0,
    drop_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
    worker_start: str | None = None,
    dedup_ids: bool = False,
    persistent_workers: bool = False,
) -> WindowLoader:
    """A DataLoader over ``windows`` (in the given order) that starts at batch ``start_batch`` (resume)
    and yields rank ``rank``'s slice of every batch. ``worker_start``: how its worker processes start
    (a multiprocessing start method; None: the platform's, fork on Linux). A process holding pinned
    host memory passes "forkserver": Linux copies pinned pages into a forked child at once, so forked
    workers of a rank with tables in host memory would each copy them. ``dedup_ids``: the workers
    also pack each history feature's distinct ids for the lookup (``JaggedBatch.to_torch``).
    ``persistent_workers``: the workers outlive an iteration, so a loader iterated again (the
    holdout, scored at every eval) starts no new processes. The workers end with the process that
    makes the loader, however it ends (``_end_with_owner``)."""
    dataset = WindowDataset(
        store,
        windows,
        cfg.sampler,
        batch_size=cfg.loader.batch_size,
        shuffle=cfg.loader.shuffle_within_window,
        seed=cfg.seed,
        drop_last=drop_last,
        start_batch=start_batch,
        rank=rank,
        world_size=world_size,
        order=cfg.loader.window_order,
        slicing=cfg.loader.rank_slicing,
        dedup_ids=dedup_ids,
    )
    workers = cfg.loader.num_workers
    # An own generator: creating an iterator draws a worker base seed, which must not consume the
    # global torch RNG (dropout draws from it, and a resumed run must see the same stream).
    return WindowLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        generator=torch.Generator().manual_seed(cfg.seed),
        prefetch_factor=cfg.loader.prefetch_batches if workers else None,
        pin_memory=torch.cuda.is_available(),
        multiprocessing_context=worker_start if workers else None,
        worker_init_fn=functools.partial(_end_with_owner, os.getpid()) if workers else None,
        persistent_workers=persistent_workers and workers > 0,
    )
