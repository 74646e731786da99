"""Preprocessing against a plain-Python reference of docs/data.md, chunking, and event_type encodings."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from raw_factory import RawEvents, events_table, random_events, write_raw

from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.store import open_store, read_md5s
from dlrmv4.data.verify import verify_store
from dlrmv4.data.yambda_schema import EVENT_TYPES

SEED = np.random.SeedSequence().entropy % 2**32  # fresh data every run; printed on failure


def _cfg(**pre):
    values = {
        ("preprocess", "last_timestamp"): 0,
        ("preprocess", "num_train_days"): 9,
        ("preprocess", "min_history"): 40,
        ("preprocess", "rows_per_chunk"): 1_000,
    }
    values.update({("preprocess", k): v for k, v in pre.items()})
    return load_config(None, None, values)


def _run(tmp_path: Path, ev: RawEvents, cfg, name: str = "store", **kw):
    raw = write_raw(tmp_path / f"raw-{name}", ev, **kw)
    out = tmp_path / name
    meta = preprocess(raw, out, cfg.dataset, cfg.preprocess, progress=False)
    return out, meta


def _mapping_last_row(path: Path, id_column: str) -> dict[int, int]:
    """item -> id, walking the mapping file's rows in order: a later row overwrites an earlier one."""
    table = pq.read_table(path).to_pydict()
    out: dict[int, int] = {}
    for item, value in zip(table["item_id"], table[id_column]):
        out[item] = value
    return out


def _reference(ev: RawEvents, cfg) -> dict:
    """Preprocessing by the reference's rules (docs/data.md), written the slow, obvious way, one user at a time."""
    p = cfg.preprocess
    t_end = p.last_timestamp or int(max(ev.timestamp))  # exclusive: the last timestamp's own events drop
    test_start = t_end - p.test_span_seconds
    train_end = test_start - p.split_gap_seconds
    train_start = train_end - p.num_train_days * p.window_seconds
    out = {"train": [], "test": [], "anchors": []}
    anchors = []  # (timestamp, global train index)
    train_base = 0
    for u in np.unique(ev.uid):
        train_rows, test_rows = [], []
        for i in np.flatnonzero(ev.uid == u):
            code = int(ev.event_type[i])
            ratio = ev.played_ratio_pct[i]
            if code == 0 and ratio is None:
                if p.null_ratio_policy == "drop":
                    continue
                ratio = 0  # "skip": the reference reads a null ratio as 0
            t = int(ev.timestamp[i])
            if code == 0:
                action = 1 if ratio >= p.listen_threshold_pct else 4
            else:
                action = 2 if code == 1 else 0
            row = [int(u), int(ev.item_id[i]), t, code, action, int(ev.is_organic[i])]
            if train_start <= t < train_end:
                train_rows.append(row)
            elif test_start <= t < t_end:
                test_rows.append(row)
        for rows in (train_rows, test_rows):  # each split numbers its own sessions
            session, prev = -1, None
            for row in rows:
                if prev is None or row[2] - prev > p.session_gap_seconds:
                    session += 1
                prev = row[2]
                row.append(session)
        for local, row in enumerate(train_rows):
            if row[3] == 0 and local >= p.min_history:
                anchors.append((row[2], train_base + local))
        train_base += len(train_rows)
        out["train"] += [tuple(r) for r in train_rows]
        if train_rows:
            out["test"] += [tuple(r) for r in test_rows]
    if anchors:
        t_min = min(t for t, _ in anchors)
        t_last = max(t for t, _ in anchors)
        num_windows = math.ceil((t_last - t_min + 1) / p.window_seconds)
        out["anchors"] = [
            sorted(i for t, i in anchors if (t - t_min) // p.window_seconds == w) for w in range(num_windows)
        ]
        out["t_min"], out["t_last"] = t_min, t_last
    return out


def _rows(split) -> list[tuple]:
    uid = np.repeat(split.user_ids, np.diff(split.user_offsets))
    cols = [uid, split.item_id, split.timestamp, split.event_code, split.action, split.is_organic, split.session_id]
    return [tuple(int(c[i]) for c in cols) for i in range(split.num_events)]


def test_matches_reference_implementation(tmp_path):
    ev = random_events(SEED)
    cfg = _cfg()
    out, meta = _run(tmp_path, ev, cfg)
    store = open_store(out)
    ref = _reference(ev, cfg)
    assert _rows(store.train) == ref["train"], f"seed {SEED}"
    assert _rows(store.test) == ref["test"], f"seed {SEED}"
    got = [store.window_anchors(w).tolist() for w in range(store.num_windows)]
    assert got == ref["anchors"], f"seed {SEED}"
    assert sum(map(len, got)) > 0, "the test data should produce anchors"
    assert (meta["split"]["t_min"], meta["split"]["t_last"]) == (ref["t_min"], ref["t_last"]), f"seed {SEED}"
    assert meta["split"]["num_windows"] == len(ref["anchors"])
    assert meta["counts"]["train_samples"] == sum(map(len, ref["anchors"][:-1]))
    assert meta["counts"]["eval_samples"] == len(ref["anchors"][-1])
    assert meta["counts"]["raw_events"] == len(ev.uid)
    assert sum(meta["event_type_counts"].values()) == len(ev.uid)
    # Items: the last mapping row's id per item, 0 where unmapped; popularity = train counts.
    train_items = np.array([r[1] for r in ref["train"]])
    assert np.array_equal(store.popularity[:300], np.bincount(train_items, minlength=300)[:300])
    raw = tmp_path / "raw-store"
    for column, table in (("artist_id", store.artist_id), ("album_id", store.album_id)):
        last = _mapping_last_row(raw / f"{column.split('_')[0]}_item_mapping.parquet", column)
        assert table[:300].tolist() == [last.get(i, 0) for i in range(300)], column
    assert verify_store(out, progress=False) == []


def test_output_does_not_depend_on_chunk_size(tmp_path):
    ev = random_events(SEED, num_users=20)
    a, _ = _run(tmp_path, ev, _cfg(rows_per_chunk=1_000), "a")
    b, _ = _run(tmp_path, ev, _cfg(rows_per_chunk=10_000_000), "b")
    assert read_md5s(a) == read_md5s(b)


@pytest.mark.parametrize("kind", ["string", "large_string", "enum"])
def test_event_type_encodings_give_the_same_store(tmp_path, kind):
    ev = random_events(SEED, num_users=10)
    base, _ = _run(tmp_path, ev, _cfg(), "dictionary")
    other, _ = _run(tmp_path, ev, _cfg(), kind, event_type_kind=kind)
    assert read_md5s(base) == read_md5s(other)


def _with_null_ratios(ev: RawEvents) -> tuple[RawEvents, pa.Table, int]:
    """Every 7th listen gets a null played_ratio_pct: (events, their raw table, number of nulls)."""
    listens = np.flatnonzero(ev.event_type == 0)
    ratio = ev.played_ratio_pct.astype(object)
    ratio[listens[::7]] = None
    ev = dataclasses.replace(ev, played_ratio_pct=ratio)
    table = events_table(dataclasses.replace(ev, played_ratio_pct=np.zeros(len(ev.uid), np.uint16)))
    listen = ev.event_type == 0
    table = table.set_column(
        table.schema.get_field_index("played_ratio_pct"),
        "played_ratio_pct",
        pa.array([r if ok else None for r, ok in zip(ratio, listen)], pa.uint16()),
    )
    return ev, table, len(listens[::7])


@pytest.mark.parametrize("policy", ["skip", "drop"])
def test_null_ratio_listens_are_counted_and_kept_as_skips_or_dropped(tmp_path, policy):
    ev, table, nulls = _with_null_ratios(random_events(SEED, num_users=10))
    cfg = _cfg(null_ratio_policy=policy)
    out, meta = _run(tmp_path, ev, cfg, table=table)
    assert meta["counts"]["null_ratio_listens"] == nulls
    assert meta["counts"]["dropped_null_ratio_listens"] == (nulls if policy == "drop" else 0)
    store = open_store(out)
    ref = _reference(ev, cfg)
    assert _rows(store.train) == ref["train"], f"seed {SEED}"
    assert [store.window_anchors(w).tolist() for w in range(store.num_windows)] == ref["anchors"], f"seed {SEED}"
    assert verify_store(out, progress=False) == []


def test_default_policy_is_the_references_skip():
    assert _cfg().preprocess.null_ratio_policy == "skip"


def test_meta_records_constants_and_split(tmp_path):
    ev = random_events(SEED, num_users=5)
    cfg = _cfg()
    out, meta = _run(tmp_path, ev, cfg)
    t_end = int(ev.timestamp.max())  # exclusive: the last timestamp's events are dropped
    assert meta["split"]["t_end"] == t_end
    assert meta["split"]["test_start"] == t_end - 86_400
    assert meta["split"]["train_end"] == t_end - 86_400 - 1_800
    assert meta["counts"]["dropped_at_or_after_end"] == int(np.count_nonzero(ev.timestamp == t_end))
    assert meta["constants"]["min_history"] == 40
    assert meta["schema_version"] == 2
    assert set(EVENT_TYPES) == set(meta["event_type_counts"])
    n = meta["split"]["num_windows"]
    assert 0 < n <= 9 and len(meta["counts"]["anchors_per_window"]) == n
    assert meta["counts"]["train_samples"] + meta["counts"]["eval_samples"] == meta["counts"]["anchors"]
    assert meta["counts"]["eval_samples"] == meta["counts"]["anchors_per_window"][-1]


def test_explicit_last_timestamp_is_exclusive(tmp_path):
    ev = random_events(SEED, num_users=8)
    end = int(ev.timestamp.max()) - 3_600
    cfg = _cfg(last_timestamp=end)
    out, meta = _run(tmp_path, ev, cfg)
    assert meta["split"]["t_end"] == end
    assert meta["counts"]["dropped_at_or_after_end"] == int(np.count_nonzero(ev.timestamp >= end))
    assert _rows(open_store(out).test) == _reference(ev, cfg)["test"], f"seed {SEED}"


def test_too_little_disk_is_refused_before_any_work(tmp_path, monkeypatch):
    """Less free space than the store can take (35 bytes a raw row at most): one line naming both,
    and no store or temp directory left behind."""
    import shutil
    from types import SimpleNamespace

    from dlrmv4.data.preprocess import STORE_BYTES_PER_ROW_AT_MOST
    from dlrmv4.errors import UserError

    ev = random_events(SEED, num_users=5)
    raw = write_raw(tmp_path / "raw", ev)
    rows = len(ev.uid)
    need, free = rows * STORE_BYTES_PER_ROW_AT_MOST, rows * STORE_BYTES_PER_ROW_AT_MOST - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**12, used=0, free=free))
    out = tmp_path / "data" / "store"
    cfg = _cfg()
    with pytest.raises(UserError) as excinfo:
        preprocess(raw, out, cfg.dataset, cfg.preprocess, progress=False)
    assert str(excinfo.value) == (
        f"preprocessing {rows:,} events needs up to {need / 1e9:.2f} GB under {out.parent} but "
        f"{free / 1e9:.2f} GB are free; free some space or point --data-path at a larger disk"
    )
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("row_group_size", [37, 700])
def test_the_store_is_the_same_for_any_number_of_worker_processes(tmp_path, row_group_size):
    """Chunks of whole row groups on 1 or 3 processes: users longer than a chunk (some own no row of
    a chunk, some run on over several groups) end up whole, and the store's files are the same as
    one chunk's in one process."""
    ev = random_events(SEED, num_users=12, max_events=3_000)
    assert np.bincount(np.unique(ev.uid, return_inverse=True)[1]).max() > 2_000  # longer than a chunk
    stores = {}
    for name, workers, rows in (("one", 1, 10_000_000), ("w1", 1, 1_000), ("w3", 3, 1_000)):
        stores[name], _ = _run(
            tmp_path, ev, _cfg(workers=workers, rows_per_chunk=rows), name, row_group_size=row_group_size
        )
    assert read_md5s(stores["w1"]) == read_md5s(stores["one"]) == read_md5s(stores["w3"])
