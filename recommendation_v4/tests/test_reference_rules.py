"""The MLPerf reference's preprocessing rules (docs/data.md) on a hand-built raw file.

Every expected value below is worked out by hand from the events listed in ``EVENTS`` (the
comments show the arithmetic), not computed by the code under test. Constants: window and test
span 86,400 s, split gap 1,800 s, session gap 1,800 s, listen threshold 50, min_history 3,
num_train_days 5. The data's largest timestamp is 864,000, so:
  t_end 864,000 (exclusive), test [777,600, 864,000), train_end 777,600 - 1,800 = 775,800,
  train_start 775,800 - 5 * 86,400 = 343,800.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from raw_factory import RawEvents, write_mapping, write_raw

from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.sampler import build_batch
from dlrmv4.data.store import open_store
from dlrmv4.data.verify import verify_store
from dlrmv4.errors import UserError

L, LIKE, DISLIKE = 0, 1, 2
NULL = None

# (uid, timestamp, event_type, played_ratio_pct, item_id), sorted by (uid, timestamp) as Yambda is.
EVENTS = [
    # user 7 (raw rows 0..15)
    (7, 100_000, L, 90, 5),  # before the train start: dropped
    (7, 430_200, L, 90, 1),  # train 0 (local 0), session 0
    (7, 432_000, LIKE, 0, 2),  # train 1, gap 1,800 (not > 1,800): session 0
    (7, 433_801, DISLIKE, 0, 3),  # train 2, gap 1,801: session 1
    (7, 480_200, L, 70, 1),  # train 3, anchor (local 3): the earliest anchor = t_min; session 2
    (7, 482_000, L, NULL, 4),  # train 4 (raw row 5), anchor; null ratio -> skip, label 0; session 2
    (7, 600_000, L, 50, 1),  # train 5, anchor; ratio = threshold -> label 1; session 3
    (7, 739_399, L, 10, 2),  # train 6, anchor; 259,199 s after t_min: last second of window 2
    (7, 739_400, L, 100, 3),  # train 7, anchor; 259,200 s after t_min: first second of window 3
    (7, 775_799, L, 60, 1),  # train 8, anchor; the train span's last second; window 3
    (7, 775_800, L, 60, 5),  # = train_end: in the gap, dropped
    (7, 777_599, L, 60, 5),  # gap, dropped
    (7, 777_600, L, 20, 2),  # = test start: test, test session 0
    (7, 779_400, LIKE, 0, 3),  # test, gap 1,800: test session 0
    (7, 781_201, L, 80, 4),  # test, gap 1,801: test session 1
    (7, 864_000, L, 80, 5),  # = the data's largest timestamp: excluded, dropped
    # user 9 (raw rows 16..22)
    (9, 470_000, L, 60, 1),  # train 9 (local 0), session 0
    (9, 475_000, LIKE, 0, 2),  # train 10, session 1
    (9, 476_000, L, 40, 3),  # train 11 (local 2: not an anchor), session 1
    (9, 481_000, L, 55, 4),  # train 12, anchor; earlier than user 7's 482,000 but after it in its window
    (9, 500_000, L, 90, 1),  # train 13, anchor; window 0
    (9, 760_000, L, 30, 2),  # train 14, anchor; 279,800 s after t_min: window 3
    (9, 800_000, LIKE, 0, 5),  # test, test session 0
    # user 12 (raw rows 23..25)
    (12, 343_799, LIKE, 0, 5),  # one second before the train start: dropped
    (12, 343_800, LIKE, 0, 5),  # = train start: train 15
    (12, 790_000, L, 50, 5),  # test (the user has a train event)
    # user 20 (raw row 26): only a test-day event, never seen in train: dropped
    (20, 790_000, L, 70, 4),
]
NULL_ROW = 5

# Mapping rows in file order. Item 1's artist rows are 20 then 50: the last (50) wins, not the
# smallest; item 3's album rows are 2 then 11: 11 wins. Items without rows map to 0.
# Item 5 (the largest with events) has rows: the reference refuses items past a mapping's largest.
ARTIST_ROWS = [(1, 20), (2, 7), (1, 50), (5, 33)]
ALBUM_ROWS = [(3, 2), (1, 900), (3, 11), (5, 44)]


def _cfg(policy: str = "skip"):
    return load_config(
        None,
        None,
        {
            ("preprocess", "last_timestamp"): 0,
            ("preprocess", "num_train_days"): 5,
            ("preprocess", "min_history"): 3,
            ("preprocess", "null_ratio_policy"): policy,
            ("preprocess", "rows_per_chunk"): 1_000,
        },
    )


def _raw(root: Path):
    uid, ts, code, ratio, item = zip(*EVENTS)
    ev = RawEvents(
        uid=np.array(uid, np.uint32),
        item_id=np.array(item, np.uint32),
        timestamp=np.array(ts, np.uint32),
        is_organic=np.array([i % 2 for i in range(len(EVENTS))], np.uint8),
        event_type=np.array(code, np.int8),
        played_ratio_pct=np.array(ratio, dtype=object),
    )
    files = write_raw(root, ev)
    write_mapping(files.artist_mapping, "artist_id", ARTIST_ROWS)
    write_mapping(files.album_mapping, "album_id", ALBUM_ROWS)
    return files


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_rules")
    cfg = _cfg()
    meta = preprocess(_raw(root / "raw"), root / "store", cfg.dataset, cfg.preprocess, progress=False)
    return root / "store", meta


def _split_rows(split) -> list[tuple[int, int, int, int]]:
    uid = np.repeat(np.asarray(split.user_ids), np.diff(split.user_offsets))
    return list(
        zip(
            uid.tolist(),
            np.asarray(split.timestamp).tolist(),
            np.asarray(split.action).tolist(),
            np.asarray(split.session_id).tolist(),
        )
    )


def test_split_edges(built):
    path, meta = built
    assert meta["split"] == {
        "t_end": 864_000,
        "test_start": 777_600,
        "train_end": 775_800,
        "train_start": 343_800,
        "t_min": 480_200,
        "t_last": 775_799,
        "num_windows": 4,
    }
    c = meta["counts"]
    assert (c["raw_events"], c["train_events"], c["test_events"]) == (27, 16, 5)
    assert c["dropped_before_train_start"] == 2  # 100,000 and 343,799
    assert c["dropped_in_gap"] == 2  # 775,800 and 777,599
    assert c["dropped_at_or_after_end"] == 1  # 864,000 itself
    assert c["dropped_test_unseen_user"] == 1  # user 20
    assert (c["train_users"], c["test_users"]) == (3, 3)
    assert meta["event_type_counts"] == {"listen": 20, "like": 6, "dislike": 1, "unlike": 0, "undislike": 0}
    store = open_store(path)
    assert np.asarray(store.train.user_ids).tolist() == [7, 9, 12]
    assert np.asarray(store.train.user_offsets).tolist() == [0, 9, 15, 16]
    assert np.asarray(store.test.user_offsets).tolist() == [0, 3, 4, 5]
    assert verify_store(path, progress=False) == []


def test_sessions_and_actions(built):
    store = open_store(built[0])
    # (uid, timestamp, action bit, session): 1 listen_plus, 2 like, 4 skip, 0 none.
    assert _split_rows(store.train) == [
        (7, 430_200, 1, 0),
        (7, 432_000, 2, 0),
        (7, 433_801, 0, 1),
        (7, 480_200, 1, 2),
        (7, 482_000, 4, 2),
        (7, 600_000, 1, 3),
        (7, 739_399, 4, 4),
        (7, 739_400, 1, 4),
        (7, 775_799, 1, 5),
        (9, 470_000, 1, 0),
        (9, 475_000, 2, 1),
        (9, 476_000, 4, 1),
        (9, 481_000, 1, 2),
        (9, 500_000, 1, 3),
        (9, 760_000, 4, 4),
        (12, 343_800, 2, 0),
    ]
    # The test day numbers its own sessions from 0 per user.
    assert _split_rows(store.test) == [
        (7, 777_600, 4, 0),
        (7, 779_400, 2, 0),
        (7, 781_201, 1, 1),
        (9, 800_000, 2, 0),
        (12, 790_000, 1, 0),
    ]


def test_windows_and_anchor_order(built):
    path, meta = built
    store = open_store(path)
    # t_min 480,200; N = ceil((775,799 - 480,200 + 1) / 86,400) = ceil(3.42) = 4.
    assert store.num_windows == 4
    assert [store.window_anchors(w).tolist() for w in range(4)] == [
        [3, 4, 12, 13],  # user-major: user 9's 481,000 (index 12) after user 7's 482,000 (index 4)
        [5],  # 600,000: 119,800 s after t_min
        [6],  # 739,399: 259,199 s
        [7, 8, 14],  # the holdout: 739,400 .. 775,799, a partial day (36,400 of 86,400 s)
    ]
    assert np.asarray(store.window_offsets).tolist() == [0, 4, 5, 6, 9]
    c = meta["counts"]
    assert (c["anchors"], c["train_samples"], c["eval_samples"]) == (9, 6, 3)
    assert c["anchors_per_window"] == [4, 1, 1, 3]
    from dlrmv4.data.windows import sample_counts, split_windows

    assert sample_counts(store) == (6, 3) and split_windows(store) == ([0, 1, 2], 3)
    assert json.loads((path / "meta.json").read_text())["counts"]["train_samples"] == 6


def test_labels_null_ratio_is_a_skip(built):
    store = open_store(built[0])
    batch = build_batch(store, np.asarray(store.window_anchors(0)), _cfg().sampler)
    assert batch.label.tolist() == [1.0, 0.0, 1.0, 1.0]  # ratios 70, null, 55, 90
    assert build_batch(store, np.array([5]), _cfg().sampler).label.tolist() == [1.0]  # ratio 50 = threshold
    c = built[1]["counts"]
    assert (c["null_ratio_listens"], c["dropped_null_ratio_listens"]) == (1, 0)


def test_items_take_the_last_mapping_row(built):
    store = open_store(built[0])
    assert np.asarray(store.artist_id).tolist() == [0, 50, 7, 0, 0, 33]  # items 0, 3, 4: no row
    assert np.asarray(store.album_id).tolist() == [0, 900, 0, 11, 0, 44]
    # Train events per item: user 7: 1,2,3,1,4,1,2,3,1; user 9: 1,2,3,4,1,2; user 12: 5.
    assert np.asarray(store.popularity).tolist() == [0, 6, 4, 3, 2, 1]


def test_drop_policy_removes_the_null_listen(tmp_path):
    cfg = _cfg("drop")
    meta = preprocess(_raw(tmp_path / "raw"), tmp_path / "store", cfg.dataset, cfg.preprocess, progress=False)
    store = open_store(tmp_path / "store")
    c = meta["counts"]
    assert (c["null_ratio_listens"], c["dropped_null_ratio_listens"], c["train_events"]) == (1, 1, 15)
    # User 7 loses 482,000: its anchors are now 480,200 (3), 600,000 (4), 739,399 (5), 739,400 (6),
    # 775,799 (7); user 9's move to 11, 12, 13. t_min is still 480,200.
    assert [store.window_anchors(w).tolist() for w in range(store.num_windows)] == [[3, 11, 12], [4], [5], [6, 7, 13]]
    assert (c["train_samples"], c["eval_samples"]) == (5, 3)


def test_error_policy_refuses_the_null_listen(tmp_path):
    cfg = _cfg("error")
    with pytest.raises(UserError) as info:
        preprocess(_raw(tmp_path / "raw"), tmp_path / "store", cfg.dataset, cfg.preprocess, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and f"listen with null played_ratio_pct at row {NULL_ROW}" in msg
    assert not (tmp_path / "store").exists()


def test_explicit_last_timestamp_sets_the_end(tmp_path):
    """A nonzero last_timestamp is the exclusive end: 864,001 keeps the event at 864,000 in the test day,
    and every bound moves by one second."""
    cfg = load_config(
        None,
        None,
        {**{("preprocess", k): v for k, v in (("last_timestamp", 864_001), ("num_train_days", 5), ("min_history", 3))}},
    )
    meta = preprocess(_raw(tmp_path / "raw"), tmp_path / "store", cfg.dataset, cfg.preprocess, progress=False)
    assert (meta["split"]["t_end"], meta["split"]["test_start"], meta["split"]["train_start"]) == (
        864_001,
        777_601,
        343_801,
    )
    c = meta["counts"]
    # train [343,801, 775,801): 775,800 joins user 7's train events, 343,800 is now before the start, so
    # user 12 has no train event and its test event drops with user 20's. Gap: 777,599 and 777,600.
    # Test day: user 7's 779,400, 781,201 and 864,000, user 9's 800,000.
    assert (c["dropped_at_or_after_end"], c["dropped_in_gap"], c["dropped_before_train_start"]) == (0, 2, 3)
    assert (c["train_events"], c["test_events"], c["dropped_test_unseen_user"]) == (16, 4, 2)


def test_an_older_store_schema_is_refused_with_one_line(built, tmp_path, capsys):
    import shutil

    from dlrmv4.cli import main as cli_main

    store = tmp_path / "data" / "processed" / "synthetic-tiny"
    shutil.copytree(built[0], store)
    meta = json.loads((store / "meta.json").read_text())
    meta["schema_version"] = 1
    (store / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError) as info:
        open_store(store)
    msg = str(info.value)
    assert "\n" not in msg and "store schema version 1 was written by an older preprocessing" in msg
    assert "re-run the preprocessing (python -m dlrmv4 prepare" in msg and "download_dataset.sh" in msg
    capsys.readouterr()
    assert cli_main(["sample", "--data-path", str(tmp_path / "data"), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("[dlrmv4] error: ") and "re-run the preprocessing" in err
