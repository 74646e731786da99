"""Raw Yambda parquet -> the processed store (docs/data.md: the reference's rules), in one
streaming pass with bounded memory.

The raw file is sorted by (uid, timestamp), so it is read in chunks of ``rows_per_chunk`` rows
that are cut at user boundaries (the last user of a chunk is carried into the next). Each chunk
is decoded and checked with polars, split and labelled with numpy, and appended to output
columns sized by the raw row count; the columns are cut to their real length at the end.
Anchors go to per-day side files during the pass (the windows depend on the earliest anchor,
known only at the end) and are cut into windows day by day afterwards. Memory is
O(rows_per_chunk + largest user + two days' anchors + users), not O(events).

Choices (the MLPerf reference's, documented in docs/data.md):
- Global temporal split: ``t_end`` = the data's largest timestamp (or ``last_timestamp`` when
  nonzero), exclusive: events at ``t_end`` itself are dropped. Test = [t_end - test_span, t_end);
  train = [train_end - num_train_days * window, train_end) with train_end = test start - gap.
  Events in the gap, before the train span or at/after ``t_end`` are dropped (counted).
  Test keeps only users with at least one train event.
- Listens with a null ``played_ratio_pct``: ``null_ratio_policy`` "skip" (default) keeps them
  with the ratio read as 0, so they are skips (action bit 4) and, as anchors, label 0; "drop"
  drops them; "error" refuses the data. meta.json counts them under any policy.
- Sessions: a new session when the gap to the user's previous event of the same split is
  strictly greater than ``session_gap_seconds``. Train sessions are numbered from 0 per user over
  the user's train events; test sessions get their own numbering from 0 over the test events.
- An item's artist (album) is the one on its LAST mapping row in file order; an item without a row
  gets 0. Events whose items run past a mapping's largest item id are refused (as the reference does).
- Anchors are listens whose user-local index among the user's train-span events (all five
  types) is >= ``min_history``. Windows start at t_min = the earliest anchor's timestamp:
  window = (ts - t_min) // window_seconds, N = ceil((t_last - t_min + 1) / window_seconds)
  windows with t_last the latest anchor's timestamp; windows 0..N-2 train, window N-1 (usually
  a partial day) is the eval holdout. ``num_train_days`` sets only the train span. Inside a
  window, anchors are in ascending train event index (user-major).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generator

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dlrmv4.config import DatasetConfig, PreprocessConfig
from dlrmv4.data import store as st
from dlrmv4.data.holdout_quality import holdout_quality
from dlrmv4.data.raw_chunks import (
    Chunk,
    check_items_mapped,
    column_max,
    decode_event_types,
    item_table,
    local_index,
    owned_rows,
    plan_chunks,
    read_item_table,
    resolve_t_end,
    session_numbers,
    user_starts,
)
from dlrmv4.data.yambda_schema import (
    ACTION_LIKE,
    ACTION_LISTEN_PLUS,
    ACTION_SKIP,
    EVENT_TYPES,
    LIKE,
    LISTEN,
    RawFiles,
    check_multi_event_schema,
    open_parquet,
)
from dlrmv4.errors import UserError
from dlrmv4.files import atomic_directory, check_free_space, check_writable, write_errors_in_one_line, write_json
from dlrmv4.parallel import exit_with_parent, in_order, usable_cores


@dataclass(frozen=True)
class SplitBounds:
    t_end: int
    test_start: int
    train_end: int
    train_start: int  # may be negative: the span is anchored to train_end, not to the data's start

    @staticmethod
    def from_config(t_end: int, cfg: PreprocessConfig) -> "SplitBounds":
        test_start = t_end - cfg.test_span_seconds
        train_end = test_start - cfg.split_gap_seconds
        return SplitBounds(
            t_end=t_end,
            test_start=test_start,
            train_end=train_end,
            train_start=train_end - cfg.num_train_days * cfg.window_seconds,
        )


@dataclass
class _Counts:
    raw_events: int = 0
    null_ratio_listens: int = 0
    dropped_null_ratio_listens: int = 0
    dropped_before_train_start: int = 0
    dropped_in_gap: int = 0
    dropped_at_or_after_end: int = 0
    dropped_test_unseen_user: int = 0
    event_types: dict[str, int] = field(default_factory=lambda: {t: 0 for t in EVENT_TYPES})

    def add(self, other: "_Counts") -> None:
        for f in dataclasses.fields(self):
            if f.name == "event_types":
                for name, n in other.event_types.items():
                    self.event_types[name] += n
            else:
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# Disk a raw row can take at most: one event's columns (train or test) and, were it an anchor, its
# day-bucket entry (int64 index + uint32 time) and its final int64 index.
STORE_BYTES_PER_ROW_AT_MOST = sum(dtype.itemsize for dtype in st.EVENT_COLUMNS.values()) + 8 + 4 + 8


class _SplitWriter:
    """Appends one split's CSR columns into upper-bound-sized files."""

    def __init__(self, root: Path, split: str, capacity: int) -> None:
        self.root, self.split = root, split
        self.columns = {
            name: st.ArrayAppender(root / split / f"{name}.npy", dtype, capacity)
            for name, dtype in st.EVENT_COLUMNS.items()
        }
        self.user_ids: list[np.ndarray] = []
        self.user_counts: list[np.ndarray] = []
        self.size = 0

    def append(self, uids: np.ndarray, counts: np.ndarray, cols: dict[str, np.ndarray]) -> int:
        base = self.size
        n = len(cols["item_id"])
        for name, arr in cols.items():
            self.columns[name].append(arr)
        self.user_ids.append(uids.astype(np.uint32))
        self.user_counts.append(counts.astype(np.int64))
        self.size += n
        return base

    def finish(self) -> tuple[int, int]:
        for appender in self.columns.values():
            appender.close()
        uids = np.concatenate(self.user_ids) if self.user_ids else np.zeros(0, np.uint32)
        counts = np.concatenate(self.user_counts) if self.user_counts else np.zeros(0, np.int64)
        offsets = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        st.save_array(self.root / self.split / "user_ids.npy", uids)
        st.save_array(self.root / self.split / "user_offsets.npy", offsets)
        return len(uids), self.size


@dataclass(frozen=True)
class WindowLayout:
    """The windows of the anchors: t_min = the earliest anchor's timestamp, N windows of ``seconds``."""

    t_min: int | None
    t_last: int | None
    num_windows: int

    @staticmethod
    def of(t_min: int | None, t_last: int | None, seconds: int) -> "WindowLayout":
        if t_min is None or t_last is None:
            return WindowLayout(None, None, 0)
        return WindowLayout(t_min, t_last, (t_last - t_min) // seconds + 1)  # ceil((t_last - t_min + 1) / W)


class _AnchorBuckets:
    """Anchors (train event index, timestamp) in per-day side files during the pass.

    Days count from the train start; the final windows count from the earliest anchor, so a
    window spans at most two days and is cut from them at the end. Anchors arrive in ascending
    event index, which every side file keeps.
    """

    def __init__(self, root: Path, train_start: int, window_seconds: int, num_days: int) -> None:
        self.dir = root / "_anchor_buckets"
        self.dir.mkdir()
        self.train_start, self.width, self.num_days = train_start, window_seconds, num_days
        self.counts = np.zeros(num_days, np.int64)
        self.t_min: int | None = None
        self.t_last: int | None = None

    def add(self, event_index: np.ndarray, timestamp: np.ndarray) -> None:
        if not len(timestamp):
            return
        lo, hi = int(timestamp.min()), int(timestamp.max())
        self.t_min = lo if self.t_min is None else min(self.t_min, lo)
        self.t_last = hi if self.t_last is None else max(self.t_last, hi)
        day = (timestamp - self.train_start) // self.width
        order = np.argsort(day, kind="stable")  # stable: index order inside a day
        day, event_index, timestamp = day[order], event_index[order], timestamp[order]
        bounds = np.searchsorted(day, np.arange(self.num_days + 1))
        for d in np.flatnonzero(np.diff(bounds)):
            lo, hi = bounds[d], bounds[d + 1]
            with open(self.dir / f"{d}.idx", "ab") as fh:
                fh.write(event_index[lo:hi].astype(np.int64).tobytes())
            with open(self.dir / f"{d}.ts", "ab") as fh:
                fh.write(timestamp[lo:hi].astype(np.uint32).tobytes())
            self.counts[d] += hi - lo

    def _day(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        if not 0 <= d < self.num_days or self.counts[d] == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return (
            np.fromfile(self.dir / f"{d}.idx", dtype=np.int64),
            np.fromfile(self.dir / f"{d}.ts", dtype=np.uint32).astype(np.int64),
        )

    def finish(self, root: Path) -> tuple[WindowLayout, np.ndarray]:
        layout = WindowLayout.of(self.t_min, self.t_last, self.width)
        offsets = np.zeros(layout.num_windows + 1, np.int64)
        out = st.ArrayAppender(root / "anchors" / "event_index.npy", np.dtype(np.int64), int(self.counts.sum()))
        if layout.num_windows:
            assert layout.t_min is not None  # windows exist only when there are anchors
            first_day = (layout.t_min - self.train_start) // self.width
            days = {first_day: self._day(first_day)}
            for w in range(layout.num_windows):
                # Window w lies inside days first_day + w and first_day + w + 1.
                d = first_day + w
                days = {k: v for k, v in days.items() if k >= d}
                days.setdefault(d + 1, self._day(d + 1))
                parts = [idx[(ts - layout.t_min) // self.width == w] for idx, ts in (days[d], days[d + 1])]
                idx = np.sort(np.concatenate(parts))  # ascending event index: user-major
                out.append(idx)
                offsets[w + 1] = offsets[w] + len(idx)
        out.close()
        if offsets[-1] != self.counts.sum():
            raise AssertionError("anchors lost while cutting windows")  # a bug, not bad input
        st.save_array(root / "anchors" / "window_offsets.npy", offsets)
        for f in self.dir.iterdir():
            f.unlink()
        self.dir.rmdir()
        return layout, offsets


def preprocess(
    raw: RawFiles,
    out_dir: Path,
    ds: DatasetConfig,
    cfg: PreprocessConfig,
    *,
    resolved_revision: str | None = None,
    progress: bool = True,
    truth: Path | None = None,
) -> dict[str, Any]:
    """Build the store at ``out_dir`` atomically; returns its meta.json content. ``truth``: the synthetic
    generator's listen_plus probabilities, which give the holdout's ceiling (holdout_quality.py)."""
    started = time.perf_counter()
    check_writable(out_dir.parent, "data path")
    pf = open_parquet(raw.multi_event)
    check_multi_event_schema(raw.multi_event, pf.schema_arrow)
    num_rows = pf.metadata.num_rows
    if num_rows == 0:
        raise UserError(f"{raw.multi_event}: the dataset is empty (0 rows)")
    check_free_space(out_dir.parent, num_rows * STORE_BYTES_PER_ROW_AT_MOST, f"preprocessing {num_rows:,} events")
    artist_items, artist_ids = read_item_table(raw.artist_mapping, "artist_id")
    album_items, album_ids = read_item_table(raw.album_mapping, "album_id")
    mapped = {
        raw.artist_mapping: int(artist_items.max(initial=-1)),
        raw.album_mapping: int(album_items.max(initial=-1)),
    }
    check_items_mapped(raw, column_max(raw.multi_event, pf, "item_id"), mapped)
    bounds = SplitBounds.from_config(resolve_t_end(raw.multi_event, pf, cfg), cfg)

    # The raw reads turn their errors into UserErrors: what fails for an I/O cause here is the store's writing.
    with write_errors_in_one_line(out_dir), atomic_directory(out_dir) as tmp:
        meta = _stream(pf, raw.multi_event, tmp, num_rows, bounds, cfg, progress)
        append_seconds, workers = meta.pop("_append_seconds"), meta.pop("_workers")
        num_items = max(
            meta.pop("_num_items"), int(artist_items.max(initial=-1)) + 1, int(album_items.max(initial=-1)) + 1
        )
        popularity = np.zeros(num_items, np.int64)
        pop = meta.pop("_popularity")
        popularity[: len(pop)] = pop
        st.save_array(tmp / "items" / "artist_id.npy", item_table(artist_items, artist_ids, num_items))
        st.save_array(tmp / "items" / "album_id.npy", item_table(album_items, album_ids, num_items))
        st.save_array(tmp / "items" / "popularity.npy", popularity)
        meta["counts"]["num_items"] = num_items
        meta["dataset"] = {
            "source": ds.source,
            "size": ds.size,
            "hub_repo_id": ds.hub_repo_id,
            "hub_revision": ds.hub_revision,
            "resolved_revision": resolved_revision,
            "synthetic_seed": ds.synthetic_seed if ds.source == "synthetic" else None,
        }
        meta["schema_version"] = st.STORE_SCHEMA_VERSION
        meta["constants"] = {
            k: getattr(cfg, k)
            for k in (
                "last_timestamp",
                "test_span_seconds",
                "split_gap_seconds",
                "num_train_days",
                "window_seconds",
                "session_gap_seconds",
                "listen_threshold_pct",
                "min_history",
                "null_ratio_policy",
            )
        }
        layout: WindowLayout = meta.pop("_layout")
        meta["split"] = {
            "t_end": bounds.t_end,
            "test_start": bounds.test_start,
            "train_end": bounds.train_end,
            "train_start": bounds.train_start,
            "t_min": layout.t_min,
            "t_last": layout.t_last,
            "num_windows": layout.num_windows,
        }
        write_json(tmp / st.META_FILE, meta)
        quality_started = time.perf_counter()
        meta["quality"] = holdout_quality(st.open_store(tmp), cfg, raw.multi_event, truth, cfg.workers)
        quality_seconds = time.perf_counter() - quality_started
        write_json(tmp / st.META_FILE, meta)
        st.write_md5s(tmp)
    # Not in meta.json (the store must not depend on timing): what the run took, for the caller.
    meta["seconds"] = time.perf_counter() - started
    meta["append_seconds"], meta["workers"], meta["quality_seconds"] = append_seconds, workers, quality_seconds
    return meta


@dataclass
class _ChunkResult:
    """One chunk's users, split, labelled and counted: what the parent appends in file order."""

    train_users: np.ndarray
    train_counts: np.ndarray
    train_cols: dict[str, np.ndarray]
    anchor_pos: np.ndarray  # index among the chunk's train events
    anchor_ts: np.ndarray
    test_users: np.ndarray
    test_counts: np.ndarray
    test_cols: dict[str, np.ndarray]
    counts: _Counts
    items: np.ndarray  # distinct train items and their event counts
    item_counts: np.ndarray
    max_item: int
    rows: int  # raw rows read


def _process_chunk(
    df: pl.DataFrame, row_base: int, path: Path, bounds: SplitBounds, cfg: PreprocessConfig
) -> _ChunkResult:
    counts = _Counts()
    n_raw = df.height
    code = decode_event_types(df, path, row_base)
    ratio_null = df.get_column("played_ratio_pct").is_null().to_numpy()
    null_listen = (code == LISTEN) & ratio_null
    counts.null_ratio_listens = int(np.count_nonzero(null_listen))
    if null_listen.any() and cfg.null_ratio_policy == "error":
        row = row_base + int(np.flatnonzero(null_listen)[0])
        raise UserError(
            f"{path}: listen with null played_ratio_pct at row {row} "
            "(--null-ratio-policy skip keeps such listens as skips, drop drops them)"
        )
    if null_listen.any() and cfg.null_ratio_policy == "drop":
        keep = ~null_listen
        counts.dropped_null_ratio_listens = int(null_listen.sum())
        df, code = df.filter(pl.Series(keep)), code[keep]
    uid = df.get_column("uid").to_numpy()
    ts = df.get_column("timestamp").to_numpy().astype(np.int64)
    item = df.get_column("item_id").to_numpy()
    organic = df.get_column("is_organic").to_numpy()
    ratio = df.get_column("played_ratio_pct").fill_null(0).to_numpy()  # "skip": a null reads as 0
    for i, name in enumerate(EVENT_TYPES):
        counts.event_types[name] = int(np.count_nonzero(code == i))
    counts.raw_events = n_raw

    is_listen = code == LISTEN
    plus = ratio >= cfg.listen_threshold_pct
    action = np.where(
        is_listen & plus, ACTION_LISTEN_PLUS, np.where(is_listen, ACTION_SKIP, np.where(code == LIKE, ACTION_LIKE, 0))
    ).astype(np.uint8)

    in_train = (ts >= bounds.train_start) & (ts < bounds.train_end)
    in_test = (ts >= bounds.test_start) & (ts < bounds.t_end)
    counts.dropped_before_train_start = int(np.count_nonzero(ts < bounds.train_start))
    counts.dropped_in_gap = int(np.count_nonzero((ts >= bounds.train_end) & (ts < bounds.test_start)))
    counts.dropped_at_or_after_end = int(np.count_nonzero(ts >= bounds.t_end))

    cols = {
        "item_id": item,
        "timestamp": ts.astype(np.uint32),
        "event_code": code,
        "action": action,
        "is_organic": organic,
    }
    tr_uid = uid[in_train]
    tr_starts = user_starts(tr_uid)
    tr_users = tr_uid[tr_starts[:-1]]
    tr_ts = ts[in_train]
    tr_cols = {k: v[in_train] for k, v in cols.items()}
    tr_cols["session_id"] = session_numbers(tr_starts, tr_ts, cfg.session_gap_seconds)
    max_item = -1
    items, item_counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    anchor_pos = np.zeros(0, np.int64)
    if len(tr_uid):
        tr_item = item[in_train].astype(np.int64)
        max_item = int(tr_item.max())
        items, item_counts = np.unique(tr_item, return_counts=True)
        local = local_index(tr_starts, len(tr_uid))
        anchor_pos = np.flatnonzero((code[in_train] == LISTEN) & (local >= cfg.min_history))

    # Test keeps only users seen in train; a chunk holds its users whole.
    seen = np.isin(uid, tr_users, assume_unique=False) & in_test
    counts.dropped_test_unseen_user = int(np.count_nonzero(in_test & ~seen))
    te_uid = uid[seen]
    if len(te_uid):
        max_item = max(max_item, int(item[seen].max()))
    te_starts = user_starts(te_uid)
    te_cols = {k: v[seen] for k, v in cols.items()}
    te_cols["session_id"] = session_numbers(te_starts, ts[seen], cfg.session_gap_seconds)
    return _ChunkResult(
        tr_users,
        np.diff(tr_starts),
        tr_cols,
        anchor_pos,
        tr_ts[anchor_pos],
        te_uid[te_starts[:-1]],
        np.diff(te_starts),
        te_cols,
        counts,
        items,
        item_counts.astype(np.int64),
        max_item,
        n_raw,
    )


def _chunk_result(
    chunk: Chunk, path: Path, bounds: SplitBounds, cfg: PreprocessConfig, pf: pq.ParquetFile | None = None
) -> _ChunkResult:
    """Read, check and process one chunk (in a worker process, or in this one with its open file)."""
    df, row_base = owned_rows(pf if pf is not None else _worker_file(path), path, chunk)
    return _process_chunk(df, row_base, path, bounds, cfg)


# A worker process's open raw file (``_worker_file``): opened once, read by every chunk it processes.
_WORKER_FILES: dict[Path, pq.ParquetFile] = {}


def _worker_file(path: Path) -> pq.ParquetFile:
    if path not in _WORKER_FILES:
        _WORKER_FILES[path] = open_parquet(path)
    return _WORKER_FILES[path]


def _start_worker(parent: int) -> None:
    exit_with_parent(parent)
    pa.set_cpu_count(1)  # one core per worker process: the processes are the parallelism
    pa.set_io_thread_count(1)


def _results_in_order(
    pf: pq.ParquetFile, path: Path, chunks: list[Chunk], bounds: SplitBounds, cfg: PreprocessConfig, workers: int
) -> Generator[_ChunkResult, None, None]:
    """Every chunk's result in file order, processed by ``workers`` processes (this one for 1), at
    most two chunks per worker ahead of the writer."""
    if workers <= 1 or len(chunks) <= 1:
        for chunk in chunks:
            yield _chunk_result(chunk, path, bounds, cfg, pf)
        return
    # spawn: fresh interpreters (pyarrow's and polars' thread pools do not survive a fork), each
    # with one polars thread, set in the environment they start with.
    polars_threads = os.environ.get("POLARS_MAX_THREADS")
    os.environ["POLARS_MAX_THREADS"] = "1"
    try:
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker, initargs=(os.getpid(),)
        ) as pool:
            work = functools.partial(_chunk_result, path=path, bounds=bounds, cfg=cfg)
            yield from in_order(pool, work, chunks, 2 * workers)
    finally:
        if polars_threads is None:
            os.environ.pop("POLARS_MAX_THREADS", None)
        else:
            os.environ["POLARS_MAX_THREADS"] = polars_threads


def _stream(
    pf: pq.ParquetFile,
    path: Path,
    root: Path,
    num_rows: int,
    bounds: SplitBounds,
    cfg: PreprocessConfig,
    progress: bool,
) -> dict[str, Any]:
    train = _SplitWriter(root, "train", num_rows)
    test = _SplitWriter(root, "test", num_rows)
    anchors = _AnchorBuckets(root, bounds.train_start, cfg.window_seconds, cfg.num_train_days)
    counts = _Counts()
    popularity = np.zeros(0, np.int64)
    max_item = -1
    chunks = plan_chunks(pf, cfg.rows_per_chunk)
    workers = cfg.workers or usable_cores()
    with (
        tqdm(total=num_rows, unit="ev", unit_scale=True, desc="preprocess", disable=not progress) as bar,
        contextlib.closing(_results_in_order(pf, path, chunks, bounds, cfg, workers)) as results,
    ):
        append_seconds = 0.0  # the parent's own work: with many workers, the rate it caps
        for r in results:
            appending = time.perf_counter()
            base = train.append(r.train_users, r.train_counts, r.train_cols)
            anchors.add(base + r.anchor_pos, r.anchor_ts)
            test.append(r.test_users, r.test_counts, r.test_cols)
            counts.add(r.counts)
            if len(r.items):
                if r.items[-1] >= len(popularity):
                    popularity = np.concatenate([popularity, np.zeros(r.items[-1] + 1 - len(popularity), np.int64)])
                popularity[r.items] += r.item_counts
            max_item = max(max_item, r.max_item)
            append_seconds += time.perf_counter() - appending
            bar.update(r.rows)

    train_users, train_events = train.finish()
    test_users, test_events = test.finish()
    if train_events == 0:
        raise UserError(
            f"{path}: no events fall in the train span [{bounds.train_start}, {bounds.train_end}); "
            "check last_timestamp / num_train_days against the data's timestamps"
        )
    layout, window_offsets = anchors.finish(root)
    per_window = np.diff(window_offsets)
    return {
        "counts": {
            "raw_events": counts.raw_events,
            "train_events": train_events,
            "test_events": test_events,
            "train_users": train_users,
            "test_users": test_users,
            "null_ratio_listens": counts.null_ratio_listens,
            "dropped_null_ratio_listens": counts.dropped_null_ratio_listens,
            "dropped_before_train_start": counts.dropped_before_train_start,
            "dropped_in_gap": counts.dropped_in_gap,
            "dropped_at_or_after_end": counts.dropped_at_or_after_end,
            "dropped_test_unseen_user": counts.dropped_test_unseen_user,
            "anchors": int(window_offsets[-1]),
            "anchors_per_window": per_window.tolist(),
            # What the MLPerf log states: windows 0..N-2 train, window N-1 is the holdout.
            "train_samples": int(per_window[:-1].sum()),
            "eval_samples": int(per_window[-1]) if len(per_window) else 0,
        },
        "event_type_counts": counts.event_types,
        "_num_items": max_item + 1,
        "_append_seconds": append_seconds,
        "_workers": workers,
        "_popularity": popularity,
        "_layout": layout,
    }
