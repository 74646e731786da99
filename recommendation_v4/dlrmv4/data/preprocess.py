"""Raw Yambda parquet -> the processed store (SPEC §2), in one streaming pass with bounded memory.

The raw file is sorted by (uid, timestamp), so it is read in chunks of ``rows_per_chunk`` rows
that are cut at user boundaries (the last user of a chunk is carried into the next). Each chunk
is decoded and checked with polars, split and labelled with numpy, and appended to memory-mapped
output columns sized by the raw row count; the columns are cut to their real length at the end.
Anchors are bucketed per window in small side files and sorted window by window. Memory is
O(rows_per_chunk + largest user + largest window's anchors + users), not O(events).

Choices (documented in the README):
- Global temporal split: ``t_end`` = ``last_timestamp`` (or max timestamp + 1 when 0);
  test = [t_end - test_span, t_end); train = [train_end - num_train_days * window, train_end) with
  train_end = test start - gap. Events in the gap or before the train span are dropped (counted).
  Test keeps only users with at least one train event.
- Listens with a null ``played_ratio_pct`` cannot be labelled: ``null_ratio_policy`` "drop"
  (default: dropped and counted in meta.json) or "error".
- Sessions are numbered per user over all of the user's kept events, so test sessions continue
  the train numbering.
- An item's artist (album) is the smallest artist_id (album_id) mapped to it; unmapped items get 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dlrmv4.config import DatasetConfig, PreprocessConfig
from dlrmv4.data import store as st
from dlrmv4.data.yambda_schema import (ACTION_LIKE, ACTION_LISTEN_PLUS, ACTION_SKIP, EVENT_CODE, EVENT_TYPES, LIKE,
                                       LISTEN, RawFiles, check_mapping_schema, check_multi_event_schema,
                                       open_parquet)
from dlrmv4.errors import UserError, one_line

RAW_COLUMNS = ["uid", "item_id", "timestamp", "is_organic", "event_type", "played_ratio_pct"]


@dataclass(frozen=True)
class SplitBounds:
    t_end: int
    test_start: int
    train_end: int
    train_start: int  # may be negative: windows are anchored to train_end, not to the data's start

    @staticmethod
    def from_config(t_end: int, cfg: PreprocessConfig) -> "SplitBounds":
        test_start = t_end - cfg.test_span_seconds
        train_end = test_start - cfg.split_gap_seconds
        return SplitBounds(t_end=t_end, test_start=test_start, train_end=train_end,
                           train_start=train_end - cfg.num_train_days * cfg.window_seconds)


@dataclass
class _Counts:
    raw_events: int = 0
    dropped_null_ratio_listens: int = 0
    dropped_before_train_start: int = 0
    dropped_in_gap: int = 0
    dropped_at_or_after_end: int = 0
    dropped_test_unseen_user: int = 0
    event_types: dict[str, int] = field(default_factory=lambda: {t: 0 for t in EVENT_TYPES})


class _SplitWriter:
    """Appends one split's CSR columns into upper-bound-sized memmaps."""

    def __init__(self, root: Path, split: str, capacity: int) -> None:
        self.root, self.split = root, split
        self.columns = {name: st.ArrayAppender(root / split / f"{name}.npy", dtype, capacity)
                        for name, dtype in st.EVENT_COLUMNS.items()}
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


class _AnchorBuckets:
    """Per-window side files of (event index, timestamp), sorted per window at the end."""

    def __init__(self, root: Path, num_windows: int) -> None:
        self.dir = root / "_anchor_buckets"
        self.dir.mkdir()
        self.num_windows = num_windows
        self.counts = np.zeros(num_windows, np.int64)

    def add(self, window: np.ndarray, event_index: np.ndarray, timestamp: np.ndarray) -> None:
        order = np.argsort(window, kind="stable")
        window, event_index, timestamp = window[order], event_index[order], timestamp[order]
        bounds = np.searchsorted(window, np.arange(self.num_windows + 1))
        for w in np.flatnonzero(np.diff(bounds)):
            lo, hi = bounds[w], bounds[w + 1]
            with open(self.dir / f"{w}.idx", "ab") as fh:
                fh.write(event_index[lo:hi].astype(np.int64).tobytes())
            with open(self.dir / f"{w}.ts", "ab") as fh:
                fh.write(timestamp[lo:hi].astype(np.uint32).tobytes())
            self.counts[w] += hi - lo

    def finish(self, root: Path) -> np.ndarray:
        offsets = np.zeros(self.num_windows + 1, np.int64)
        np.cumsum(self.counts, out=offsets[1:])
        out = st.ArrayAppender(root / "anchors" / "event_index.npy", np.dtype(np.int64), int(offsets[-1]))
        for w in range(self.num_windows):
            if self.counts[w] == 0:
                continue
            idx = np.fromfile(self.dir / f"{w}.idx", dtype=np.int64)
            ts = np.fromfile(self.dir / f"{w}.ts", dtype=np.uint32)
            out.append(idx[np.lexsort((idx, ts))])  # time order, ties by index
        out.close()
        st.save_array(root / "anchors" / "window_offsets.npy", offsets)
        for f in self.dir.iterdir():
            f.unlink()
        self.dir.rmdir()
        return offsets


def _decode_event_types(df: pl.DataFrame, path: Path, row_base: int) -> np.ndarray:
    names = df.get_column("event_type").cast(pl.String)
    known = names.is_in(list(EVENT_TYPES))
    if not bool(known.all()):
        bad_row = int(np.flatnonzero(~known.to_numpy())[0])
        raise UserError(f"{path}: unknown event_type {names[bad_row]!r} at row {row_base + bad_row} "
                        f"(expected one of {', '.join(EVENT_TYPES)})")
    return names.replace_strict(EVENT_CODE, return_dtype=pl.UInt8).to_numpy()


def _check_order(uid: np.ndarray, ts: np.ndarray, prev: tuple[int, int] | None, path: Path, row_base: int) -> None:
    """Rows must be sorted by (uid, timestamp); the previous chunk's last row joins the check."""
    if prev is not None and len(uid):
        uid = np.concatenate([np.array([prev[0]], uid.dtype), uid])
        ts = np.concatenate([np.array([prev[1]], ts.dtype), ts])
        row_base -= 1
    if len(uid) < 2:
        return
    u = uid.astype(np.int64)
    t = ts.astype(np.int64)
    du, dt = np.diff(u), np.diff(t)
    bad = (du < 0) | ((du == 0) & (dt < 0))
    if bad.any():
        row = int(np.flatnonzero(bad)[0]) + 1
        raise UserError(f"{path}: rows are not sorted by (uid, timestamp) at row {row_base + row} "
                        f"(uid {u[row - 1]}->{u[row]}, timestamp {t[row - 1]}->{t[row]})")


def _user_starts(uid: np.ndarray) -> np.ndarray:
    """Index of the first row of each user run in a uid-sorted array, plus len at the end."""
    if len(uid) == 0:
        return np.zeros(1, np.int64)
    change = np.flatnonzero(uid[1:] != uid[:-1]) + 1
    return np.concatenate([[0], change, [len(uid)]]).astype(np.int64)


def _local_index(starts: np.ndarray, n: int) -> np.ndarray:
    """Position of each row inside its user run."""
    lengths = np.diff(starts)
    return np.arange(n, dtype=np.int64) - np.repeat(starts[:-1], lengths)


def resolve_t_end(path: Path, pf: pq.ParquetFile, cfg: PreprocessConfig) -> int:
    if cfg.last_timestamp:
        return cfg.last_timestamp
    # Row-group statistics give the maximum without a pass over the data.
    col = pf.schema_arrow.get_field_index("timestamp")
    best = -1
    for rg in range(pf.metadata.num_row_groups):
        stats = pf.metadata.row_group(rg).column(col).statistics
        if stats is None or not stats.has_min_max:
            best = int(pl.scan_parquet(path).select(pl.col("timestamp").max()).collect().item())
            break
        best = max(best, int(stats.max))
    return best + 1


def _read_item_table(path: Path, id_column: str) -> tuple[np.ndarray, np.ndarray]:
    pf = open_parquet(path)
    check_mapping_schema(path, pf.schema_arrow, id_column)
    try:
        df = pl.read_parquet(path, columns=["item_id", id_column])
    except Exception as exc:  # polars raises several types for damaged files
        raise UserError(f"{path}: cannot read ({one_line(exc)})")
    df = df.group_by("item_id").agg(pl.col(id_column).min())
    items = df.get_column("item_id").to_numpy().astype(np.int64)
    ids = df.get_column(id_column).to_numpy().astype(np.int64)
    if len(items) and (items.min() < 0 or ids.min() < 0):
        raise UserError(f"{path}: negative ids")
    return items, ids


def _item_table(items: np.ndarray, ids: np.ndarray, num_items: int) -> np.ndarray:
    table = np.zeros(num_items, np.uint32)
    keep = items < num_items
    table[items[keep]] = ids[keep]
    return table


def _iter_chunks(pf: pq.ParquetFile, path: Path, rows_per_chunk: int):
    try:
        for batch in pf.iter_batches(batch_size=rows_per_chunk, columns=RAW_COLUMNS):
            yield pl.from_arrow(pa.Table.from_batches([batch]))
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError) as exc:
        raise UserError(f"{path}: read failed (truncated or corrupt parquet?): {one_line(exc)}")


def preprocess(raw: RawFiles, out_dir: Path, ds: DatasetConfig, cfg: PreprocessConfig, *,
               resolved_revision: str | None = None, progress: bool = True) -> dict[str, Any]:
    """Build the store at ``out_dir`` atomically; returns its meta.json content."""
    started = time.perf_counter()
    st.check_writable(out_dir.parent)
    pf = open_parquet(raw.multi_event)
    check_multi_event_schema(raw.multi_event, pf.schema_arrow)
    num_rows = pf.metadata.num_rows
    if num_rows == 0:
        raise UserError(f"{raw.multi_event}: the dataset is empty (0 rows)")
    artist_items, artist_ids = _read_item_table(raw.artist_mapping, "artist_id")
    album_items, album_ids = _read_item_table(raw.album_mapping, "album_id")
    bounds = SplitBounds.from_config(resolve_t_end(raw.multi_event, pf, cfg), cfg)

    with st.atomic_directory(out_dir) as tmp:
        meta = _stream(pf, raw.multi_event, tmp, num_rows, bounds, cfg, progress)
        num_items = max(meta.pop("_num_items"), int(artist_items.max(initial=-1)) + 1,
                        int(album_items.max(initial=-1)) + 1)
        popularity = np.zeros(num_items, np.int64)
        pop = meta.pop("_popularity")
        popularity[:len(pop)] = pop
        st.save_array(tmp / "items" / "artist_id.npy", _item_table(artist_items, artist_ids, num_items))
        st.save_array(tmp / "items" / "album_id.npy", _item_table(album_items, album_ids, num_items))
        st.save_array(tmp / "items" / "popularity.npy", popularity)
        meta["counts"]["num_items"] = num_items
        meta["dataset"] = {"source": ds.source, "size": ds.size, "hub_repo_id": ds.hub_repo_id,
                           "hub_revision": ds.hub_revision, "resolved_revision": resolved_revision,
                           "synthetic_seed": ds.synthetic_seed if ds.source == "synthetic" else None}
        meta["schema_version"] = st.STORE_SCHEMA_VERSION
        meta["constants"] = {k: getattr(cfg, k) for k in (
            "last_timestamp", "test_span_seconds", "split_gap_seconds", "num_train_days", "window_seconds",
            "session_gap_seconds", "listen_threshold_pct", "min_history", "null_ratio_policy")}
        meta["split"] = {"t_end": bounds.t_end, "test_start": bounds.test_start, "train_end": bounds.train_end,
                         "train_start": bounds.train_start}
        st.write_json(tmp / st.META_FILE, meta)
        st.write_md5s(tmp)
    meta["seconds"] = time.perf_counter() - started
    return meta


def _stream(pf: pq.ParquetFile, path: Path, root: Path, num_rows: int, bounds: SplitBounds,
            cfg: PreprocessConfig, progress: bool) -> dict[str, Any]:
    train = _SplitWriter(root, "train", num_rows)
    test = _SplitWriter(root, "test", num_rows)
    anchors = _AnchorBuckets(root, cfg.num_train_days)
    counts = _Counts()
    popularity = np.zeros(0, np.int64)
    max_item = -1
    carry: pl.DataFrame | None = None
    prev_row: tuple[int, int] | None = None
    rows_seen = 0
    bar = tqdm(total=num_rows, unit="ev", unit_scale=True, desc="preprocess", disable=not progress)

    def process(df: pl.DataFrame, row_base: int) -> None:
        nonlocal popularity, max_item
        n_raw = df.height
        code = _decode_event_types(df, path, row_base)
        ratio_null = df.get_column("played_ratio_pct").is_null().to_numpy()
        null_listen = (code == LISTEN) & ratio_null
        if null_listen.any():
            if cfg.null_ratio_policy == "error":
                row = row_base + int(np.flatnonzero(null_listen)[0])
                raise UserError(f"{path}: listen with null played_ratio_pct at row {row} "
                                "(use --null-ratio-policy drop to drop such rows)")
            keep = ~null_listen
            counts.dropped_null_ratio_listens += int(null_listen.sum())
            df, code = df.filter(pl.Series(keep)), code[keep]
        uid = df.get_column("uid").to_numpy()
        ts = df.get_column("timestamp").to_numpy().astype(np.int64)
        item = df.get_column("item_id").to_numpy()
        organic = df.get_column("is_organic").to_numpy()
        ratio = df.get_column("played_ratio_pct").fill_null(0).to_numpy()
        for i, name in enumerate(EVENT_TYPES):
            counts.event_types[name] += int(np.count_nonzero(code == i))
        counts.raw_events += n_raw

        # Sessions over all of the user's kept events (before the split).
        starts = _user_starts(uid)
        first = np.zeros(len(uid), bool)
        first[starts[:-1]] = True
        gap = np.diff(ts, prepend=ts[:1])
        new_session = first | (gap >= cfg.session_gap_seconds)
        cum = np.cumsum(new_session, dtype=np.int64)
        session = cum - np.repeat(cum[starts[:-1]], np.diff(starts))

        is_listen = code == LISTEN
        plus = ratio >= cfg.listen_threshold_pct
        action = np.where(is_listen & plus, ACTION_LISTEN_PLUS,
                          np.where(is_listen, ACTION_SKIP, np.where(code == LIKE, ACTION_LIKE, 0))).astype(np.uint8)

        in_train = (ts >= bounds.train_start) & (ts < bounds.train_end)
        in_test = (ts >= bounds.test_start) & (ts < bounds.t_end)
        counts.dropped_before_train_start += int(np.count_nonzero(ts < bounds.train_start))
        counts.dropped_in_gap += int(np.count_nonzero((ts >= bounds.train_end) & (ts < bounds.test_start)))
        counts.dropped_at_or_after_end += int(np.count_nonzero(ts >= bounds.t_end))

        cols = {"item_id": item, "timestamp": ts.astype(np.uint32), "event_code": code, "action": action,
                "is_organic": organic, "session_id": session.astype(np.uint32)}
        tr_uid = uid[in_train]
        tr_starts = _user_starts(tr_uid)
        tr_users = tr_uid[tr_starts[:-1]]
        base = train.append(tr_users, np.diff(tr_starts), {k: v[in_train] for k, v in cols.items()})
        if len(tr_uid):
            tr_item = item[in_train].astype(np.int64)
            max_item = max(max_item, int(tr_item.max()))
            hist = np.bincount(tr_item)
            if len(hist) > len(popularity):
                popularity = np.concatenate([popularity, np.zeros(len(hist) - len(popularity), np.int64)])
            popularity[:len(hist)] += hist
            local = _local_index(tr_starts, len(tr_uid))
            tr_ts = ts[in_train]
            is_anchor = (code[in_train] == LISTEN) & (local >= cfg.min_history)
            pos = np.flatnonzero(is_anchor)
            window = (tr_ts[pos] - bounds.train_start) // cfg.window_seconds
            anchors.add(window, base + pos, tr_ts[pos])

        # Test keeps only users seen in train; users are whole inside a chunk.
        seen = np.isin(uid, tr_users, assume_unique=False) & in_test
        counts.dropped_test_unseen_user += int(np.count_nonzero(in_test & ~seen))
        te_uid = uid[seen]
        if len(te_uid):
            max_item = max(max_item, int(item[seen].max()))
        te_starts = _user_starts(te_uid)
        test.append(te_uid[te_starts[:-1]], np.diff(te_starts), {k: v[seen] for k, v in cols.items()})

    for chunk in _iter_chunks(pf, path, cfg.rows_per_chunk):
        uid_np = chunk.get_column("uid").to_numpy()
        _check_order(uid_np, chunk.get_column("timestamp").to_numpy(), prev_row, path, rows_seen)
        prev_row = (int(uid_np[-1]), int(chunk.get_column("timestamp")[-1]))
        row_base = rows_seen - (carry.height if carry is not None else 0)
        rows_seen += chunk.height
        if carry is not None:
            chunk = pl.concat([carry, chunk], how="vertical_relaxed")
        # Hold back the last user: its rows may continue in the next chunk.
        last_uid = chunk.get_column("uid")[-1]
        cut = chunk.height - int((chunk.get_column("uid") == last_uid).sum())
        carry = chunk.slice(cut)
        if cut:
            process(chunk.slice(0, cut), row_base)
        bar.update(chunk.height - carry.height)
    if carry is not None and carry.height:
        process(carry, rows_seen - carry.height)
        bar.update(carry.height)
    bar.close()

    train_users, train_events = train.finish()
    test_users, test_events = test.finish()
    if train_events == 0:
        raise UserError(f"{path}: no events fall in the train span [{bounds.train_start}, {bounds.train_end}); "
                        "check last_timestamp / num_train_days against the data's timestamps")
    window_offsets = anchors.finish(root)
    return {
        "counts": {"raw_events": counts.raw_events, "train_events": train_events, "test_events": test_events,
                   "train_users": train_users, "test_users": test_users,
                   "dropped_null_ratio_listens": counts.dropped_null_ratio_listens,
                   "dropped_before_train_start": counts.dropped_before_train_start,
                   "dropped_in_gap": counts.dropped_in_gap,
                   "dropped_at_or_after_end": counts.dropped_at_or_after_end,
                   "dropped_test_unseen_user": counts.dropped_test_unseen_user,
                   "anchors": int(window_offsets[-1]),
                   "anchors_per_window": np.diff(window_offsets).tolist()},
        "event_type_counts": counts.event_types,
        "_num_items": max_item + 1,
        "_popularity": popularity,
    }
