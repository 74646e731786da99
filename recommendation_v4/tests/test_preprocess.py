"""Preprocessing against a plain-Python reference of SPEC §2, chunking, and event_type encodings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from dlrmv4.config import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.store import open_store, read_md5s
from dlrmv4.data.verify import verify_store
from dlrmv4.data.yambda_schema import EVENT_TYPES
from raw_factory import RawEvents, random_events, write_raw

SEED = np.random.SeedSequence().entropy % 2**32  # fresh data every run; printed on failure


def _cfg(**pre):
    values = {("preprocess", "last_timestamp"): 0, ("preprocess", "num_train_days"): 9,
              ("preprocess", "min_history"): 40, ("preprocess", "rows_per_chunk"): 1_000}
    values.update({("preprocess", k): v for k, v in pre.items()})
    return load_config(None, None, values)


def _run(tmp_path: Path, ev: RawEvents, cfg, name: str = "store", **kw):
    raw = write_raw(tmp_path / f"raw-{name}", ev, **kw)
    out = tmp_path / name
    meta = preprocess(raw, out, cfg.dataset, cfg.preprocess, progress=False)
    return out, meta


def _reference(ev: RawEvents, cfg) -> dict:
    """SPEC §2 written the slow, obvious way, one user at a time."""
    p = cfg.preprocess
    t_end = p.last_timestamp or int(ev.timestamp.max()) + 1
    test_start = t_end - p.test_span_seconds
    train_end = test_start - p.split_gap_seconds
    train_start = train_end - p.num_train_days * p.window_seconds
    out = {"train": [], "test": [], "anchors": [[] for _ in range(p.num_train_days)]}
    train_base = 0
    for u in np.unique(ev.uid):
        rows = [i for i in np.flatnonzero(ev.uid == u)
                if not (ev.event_type[i] == 0 and ev.played_ratio_pct[i] is None)]
        session, prev = -1, None
        train_rows, test_rows = [], []
        for i in rows:
            t = int(ev.timestamp[i])
            if prev is None or t - prev >= p.session_gap_seconds:
                session += 1
            prev = t
            code = int(ev.event_type[i])
            if code == 0:
                action = 1 if ev.played_ratio_pct[i] >= p.listen_threshold_pct else 4
            else:
                action = 2 if code == 1 else 0
            row = (int(u), int(ev.item_id[i]), t, code, action, int(ev.is_organic[i]), session)
            if train_start <= t < train_end:
                train_rows.append(row)
            elif test_start <= t < t_end:
                test_rows.append(row)
        for local, row in enumerate(train_rows):
            if row[3] == 0 and local >= p.min_history:
                out["anchors"][(row[2] - train_start) // p.window_seconds].append((row[2], train_base + local))
        train_base += len(train_rows)
        out["train"] += train_rows
        if train_rows:
            out["test"] += test_rows
    out["anchors"] = [[i for _, i in sorted(w)] for w in out["anchors"]]
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
    assert meta["counts"]["raw_events"] == len(ev.uid)
    assert sum(meta["event_type_counts"].values()) == len(ev.uid)
    # Items: smallest mapped id per item, 0 where unmapped; popularity = train counts.
    train_items = np.array([r[1] for r in ref["train"]])
    assert np.array_equal(store.popularity[:300], np.bincount(train_items, minlength=300)[:300])
    items = np.arange(300)
    mapped = items % 17 != 5
    assert np.array_equal(store.artist_id[:300], np.where(mapped, items // 7 + 1, 0))
    assert np.array_equal(store.album_id[:300], np.where(mapped, items // 3 + 2, 0))
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


def test_null_ratio_listens_are_dropped_and_counted(tmp_path):
    ev = random_events(SEED, num_users=10)
    listens = np.flatnonzero(ev.event_type == 0)
    ratio = ev.played_ratio_pct.astype(object)
    ratio[listens[::7]] = None
    ev = dataclasses.replace(ev, played_ratio_pct=ratio)
    cfg = _cfg()
    import pyarrow as pa
    from raw_factory import events_table
    table = events_table(dataclasses.replace(ev, played_ratio_pct=np.zeros(len(ev.uid), np.uint16)))
    listen = ev.event_type == 0
    table = table.set_column(table.schema.get_field_index("played_ratio_pct"), "played_ratio_pct",
                             pa.array([r if ok else None for r, ok in zip(ratio, listen)], pa.uint16()))
    out, meta = _run(tmp_path, ev, cfg, table=table)
    assert meta["counts"]["dropped_null_ratio_listens"] == len(listens[::7])
    assert _rows(open_store(out).train) == _reference(ev, cfg)["train"]


def test_meta_records_constants_and_split(tmp_path):
    ev = random_events(SEED, num_users=5)
    cfg = _cfg()
    out, meta = _run(tmp_path, ev, cfg)
    t_end = int(ev.timestamp.max()) + 1
    assert meta["split"]["t_end"] == t_end
    assert meta["split"]["test_start"] == t_end - 86_400
    assert meta["split"]["train_end"] == t_end - 86_400 - 1_800
    assert meta["constants"]["min_history"] == 40
    assert meta["schema_version"] == 1
    assert set(EVENT_TYPES) == set(meta["event_type_counts"])
    assert len(meta["counts"]["anchors_per_window"]) == 9
