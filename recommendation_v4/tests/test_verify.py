"""verify_store: md5 list and invariants, on a real preprocessed store."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from raw_factory import random_events, write_raw

from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess
from dlrmv4.data.store import write_md5s
from dlrmv4.data.verified_stamp import unverified_reason
from dlrmv4.data.verify import check_verified, verify_and_stamp, verify_store
from dlrmv4.errors import UserError


@pytest.fixture(scope="module")
def good_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    cfg = load_config(
        None,
        None,
        {("preprocess", "last_timestamp"): 0, ("preprocess", "num_train_days"): 9, ("preprocess", "min_history"): 40},
    )
    raw = write_raw(root / "raw", random_events(5, num_users=15))
    out = root / "store"
    preprocess(raw, out, cfg.dataset, cfg.preprocess, progress=False)
    return out


@pytest.fixture
def store(good_store, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(good_store, copy)
    return copy


def test_good_store_passes(store):
    assert verify_store(store, progress=False) == []


def test_flipped_byte_is_an_md5_mismatch(store):
    path = store / "train" / "item_id.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_store(store, progress=False)
    assert problems == [f"{path}: md5 mismatch (file changed or damaged; re-run preprocessing)"]


def test_missing_and_extra_files(store):
    (store / "items" / "popularity.npy").unlink()
    (store / "stray.bin").write_bytes(b"x")
    problems = verify_store(store, progress=False)
    assert any("stray.bin: file is not in md5sums" in p for p in problems)
    assert any("popularity.npy: file is missing" in p for p in problems)


def test_missing_md5_list_and_missing_store(store, tmp_path):
    (store / "md5sums").unlink()
    with pytest.raises(UserError, match="checksum list is missing"):
        verify_store(store, progress=False)
    with pytest.raises(UserError, match="no processed store"):
        verify_store(tmp_path / "nowhere", progress=False)


def _tamper(store, rel, change):
    arr = np.load(store / rel)
    change(arr)
    np.save(store / rel, arr)
    write_md5s(store)  # sums agree again: only the invariants can catch it


@pytest.mark.parametrize(
    "rel,change,message",
    [
        ("anchors/event_index.npy", lambda a: a.__setitem__(slice(None), a[::-1].copy()), "anchors: window"),
        ("train/event_code.npy", lambda a: a.__setitem__(slice(None), np.where(a == 0, 3, a)), "train: action bit"),
        ("train/timestamp.npy", lambda a: a.__setitem__(1, a[0] - 5), "train: timestamps"),
        ("items/popularity.npy", lambda a: a.__setitem__(0, a[0] + 1), "popularity does not sum"),
        ("anchors/window_offsets.npy", lambda a: a.__setitem__(slice(1, None), a[1:] - 1), "anchors"),
        (
            "train/session_id.npy",
            lambda a: a.__setitem__(slice(None), a + (np.arange(len(a)) == len(a) // 2)),
            "session_id does not follow the 1800 s gap rule",
        ),
        ("test/session_id.npy", lambda a: a.__setitem__(slice(None), 0), "test: session_id"),
    ],
)
def test_invariant_violations_are_found(store, rel, change, message):
    _tamper(store, rel, change)
    problems = verify_store(store, progress=False)
    assert problems and any(message in p for p in problems), problems


def test_a_dropped_anchor_is_found(store):
    idx = np.load(store / "anchors" / "event_index.npy")
    offsets = np.load(store / "anchors" / "window_offsets.npy")
    w = int(np.flatnonzero(np.diff(offsets))[0])
    np.save(store / "anchors" / "event_index.npy", np.delete(idx, offsets[w]))
    offsets[w + 1 :] -= 1
    np.save(store / "anchors" / "window_offsets.npy", offsets)
    (store / "meta.json").write_text(
        (store / "meta.json").read_text().replace(f'"anchors": {len(idx)}', f'"anchors": {len(idx) - 1}')
    )
    write_md5s(store)
    problems = verify_store(store, progress=False)
    assert any("listens have at least" in p for p in problems), problems


def test_meta_counts_and_window_span_are_checked(store):
    import json

    meta = json.loads((store / "meta.json").read_text())
    meta["counts"]["eval_samples"] += 1
    (store / "meta.json").write_text(json.dumps(meta))
    write_md5s(store)
    assert any("counts.eval_samples" in p for p in verify_store(store, progress=False))
    meta["counts"]["eval_samples"] -= 1
    meta["split"]["t_min"] -= 5
    (store / "meta.json").write_text(json.dumps(meta))
    write_md5s(store)
    problems = verify_store(store, progress=False)
    assert any("t_min" in p or "another window" in p for p in problems), problems


def test_threads_check_chunks_and_files_like_one_thread(store, monkeypatch):
    """Many small chunks on 4 threads: a good store passes, a damaged one gets the same first problem
    as on one thread (the earliest chunk's), and the threads' md5 sums are the files' own."""
    from dlrmv4.data import store as st
    from dlrmv4.data import verify

    monkeypatch.setattr(verify, "EVENTS_PER_CHECK", 97)
    steps = []
    assert verify_store(store, progress=False, workers=4, on_step=steps.append) == []
    assert steps[0].startswith("checking md5 sums (") and "4 threads" in steps[0]
    assert any(s.startswith("store invariants checked in") for s in steps)
    files = st.store_files(store)
    assert st.file_md5s(files, workers=4) == [st.file_md5(f) for f in files]
    n = len(np.load(store / "train" / "session_id.npy"))
    _tamper(store, "train/session_id.npy", lambda a: a.__setitem__(slice(n // 3, None), a[n // 3 :] + 1))
    _tamper(store, "train/timestamp.npy", lambda a: a.__setitem__(2 * n // 3, a[2 * n // 3 - 1] - 5))
    one, four = (verify_store(store, progress=False, workers=w) for w in (1, 4))
    assert one == four and len(one) >= 1 and "session_id does not follow" in one[0], one


def _rewrite_same_size(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000_000))


def test_a_verified_store_is_stamped_and_any_change_shows(store):
    """verify_and_stamp records the files it verified; a file rewritten (same size), added or removed
    since shows by name, and a failed verification leaves no stamp."""
    assert unverified_reason(store) == "was never verified"
    assert verify_and_stamp(store, progress=False) == []
    assert unverified_reason(store) is None
    item = store / "train" / "item_id.npy"
    _rewrite_same_size(item)
    assert unverified_reason(store).startswith("changed train/item_id.npy since it was verified at")
    assert verify_and_stamp(store, progress=False) == [
        f"{item}: md5 mismatch (file changed or damaged; re-run preprocessing)"
    ]
    assert unverified_reason(store) == "was never verified"


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda s: (s / "stray.bin").write_bytes(b"x"), "gained stray.bin"),
        (lambda s: (s / "items" / "popularity.npy").unlink(), "lost items/popularity.npy"),
    ],
)
def test_added_and_removed_files_show(store, change, reason):
    assert verify_and_stamp(store, progress=False) == []
    change(store)
    assert unverified_reason(store).startswith(reason)


def test_a_run_verifies_a_changed_store_or_refuses_it(store):
    """check_verified (a run's start): nothing to do on an unchanged store; one process verifies a
    changed one and goes on, or stops in one line when it fails; several processes refuse."""
    said = []
    check_verified(store, 1, said.append, progress=False)
    assert said[0] == f"the store at {store} was never verified: verifying it before training"
    assert unverified_reason(store) is None
    said.clear()
    check_verified(store, 1, said.append, progress=False)
    assert said == []
    _rewrite_same_size(store / "train" / "timestamp.npy")
    with pytest.raises(UserError, match="verify it before a multi-process run") as multi:
        check_verified(store, 2, said.append, progress=False)
    with pytest.raises(UserError, match="fails verification: .*timestamp.npy: md5 mismatch") as one:
        check_verified(store, 1, said.append, progress=False)
    assert "\n" not in str(multi.value) + str(one.value)
