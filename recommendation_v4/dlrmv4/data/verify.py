"""Check a processed store: every md5 in its list, then the invariants of the layout in store.py.

Checks run in chunks of users so memory stays bounded at the 5b size. ``verify_store`` returns
the problems found (empty = the store is good); the CLI turns them into one line and exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from dlrmv4.data import store as st
from dlrmv4.data.yambda_schema import ACTION_LIKE, ACTION_LISTEN_PLUS, ACTION_SKIP, EVENT_TYPES, LIKE, LISTEN
from dlrmv4.errors import UserError

EVENTS_PER_CHECK = 8_000_000


def check_md5s(path: Path, progress: bool = True) -> list[str]:
    expected = st.read_md5s(path)
    problems = []
    listed = set(expected)
    present = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != st.MD5_FILE}
    for rel in sorted(present - listed):
        problems.append(f"{path / rel}: file is not in {st.MD5_FILE}")
    for rel in tqdm(sorted(expected), desc="md5", unit="file", disable=not progress):
        full = path / rel
        if not full.exists():
            problems.append(f"{full}: file is missing")
        elif st.file_md5(full) != expected[rel]:
            problems.append(f"{full}: md5 mismatch (file changed or damaged; re-run preprocessing)")
    return problems


def _check_split(name: str, split: st.EventSplit, lo: int, hi: int, session_gap: int, problems: list[str]) -> None:
    off = np.asarray(split.user_offsets)
    if len(off) != split.num_users + 1 or off[0] != 0 or np.any(np.diff(off) <= 0):
        problems.append(f"{name}: user_offsets must start at 0 and rise strictly (no empty users)")
        return
    for col in st.EVENT_COLUMNS:
        if len(getattr(split, col)) != off[-1]:
            problems.append(f"{name}/{col}: length {len(getattr(split, col))} != user_offsets[-1] {off[-1]}")
            return
    if split.num_users > 1 and np.any(np.diff(split.user_ids.astype(np.int64)) <= 0):
        problems.append(f"{name}: user_ids must rise strictly")
    user_starts = off[:-1]
    for start in range(0, int(off[-1]), EVENTS_PER_CHECK):
        stop = min(int(off[-1]), start + EVENTS_PER_CHECK)
        ts = np.asarray(split.timestamp[start:stop]).astype(np.int64)
        code = np.asarray(split.event_code[start:stop])
        action = np.asarray(split.action[start:stop])
        if ts.min() < lo or ts.max() >= hi:
            problems.append(f"{name}: timestamps outside [{lo}, {hi}) in events {start}..{stop}")
        if code.max() >= len(EVENT_TYPES):
            problems.append(f"{name}: event_code >= {len(EVENT_TYPES)} in events {start}..{stop}")
        bad_action = np.where(code == LISTEN, (action != ACTION_LISTEN_PLUS) & (action != ACTION_SKIP),
                              np.where(code == LIKE, action != ACTION_LIKE, action != 0))
        if bad_action.any():
            problems.append(f"{name}: action bit disagrees with event_code at event {start + np.flatnonzero(bad_action)[0]}")
        # Time order inside each user: a decrease is allowed only where a new user starts.
        drops = np.flatnonzero(np.diff(ts) < 0) + start + 1
        if len(drops) and not np.all(np.isin(drops, user_starts)):
            problems.append(f"{name}: timestamps decrease inside a user near event {drops[0]}")
        bad_session = _session_breaks(split, user_starts, start, stop, ts, session_gap)
        if bad_session is not None:
            problems.append(f"{name}: session_id does not follow the {session_gap} s gap rule at event {bad_session}")
        if problems:
            return


def _session_breaks(split: st.EventSplit, user_starts: np.ndarray, start: int, stop: int, ts: np.ndarray,
                    gap: int) -> int | None:
    """First event of [start, stop) whose session_id is not 0 at a user's start, else the previous
    event's plus (gap to it > ``gap``); None when all agree."""
    session = np.asarray(split.session_id[start:stop]).astype(np.int64)
    first = np.zeros(stop - start, bool)
    first[user_starts[(user_starts >= start) & (user_starts < stop)] - start] = True
    # The event before the chunk joins it, so the chunk's first step is checked too.
    prev_ts = np.concatenate([[int(split.timestamp[start - 1])] if start else [0], ts[:-1]])
    prev_session = np.concatenate([[int(split.session_id[start - 1])] if start else [0], session[:-1]])
    expected = np.where(first, 0, prev_session + ((ts - prev_ts) > gap))
    bad = np.flatnonzero(session != expected)
    return int(start + bad[0]) if len(bad) else None


def check_invariants(store: st.Store) -> list[str]:
    problems: list[str] = []
    meta, split = store.meta, store.meta["split"]
    gap = meta["constants"]["session_gap_seconds"]
    _check_split("train", store.train, split["train_start"], split["train_end"], gap, problems)
    _check_split("test", store.test, split["test_start"], split["t_end"], gap, problems)
    counts = meta["counts"]
    per_window = np.diff(np.asarray(store.window_offsets))
    for key, value in (("train_events", store.train.num_events), ("test_events", store.test.num_events),
                       ("train_users", store.train.num_users), ("test_users", store.test.num_users),
                       ("anchors", len(store.anchor_event_index)), ("num_items", len(store.artist_id)),
                       ("train_samples", int(per_window[:-1].sum())),
                       ("eval_samples", int(per_window[-1]) if len(per_window) else 0)):
        if counts.get(key) != value:
            problems.append(f"meta.json counts.{key}={counts.get(key)} but the arrays hold {value}")
    if not np.all(np.isin(store.test.user_ids, store.train.user_ids)):
        problems.append("test: holds users that have no train events")
    if len(store.album_id) != len(store.artist_id) or len(store.popularity) != len(store.artist_id):
        problems.append("items: artist_id, album_id and popularity differ in length")
    elif int(store.popularity.sum()) != store.train.num_events:
        problems.append("items/popularity does not sum to the number of train events")
    problems.extend(_check_anchors(store))
    return problems


def _check_anchors(store: st.Store) -> list[str]:
    offs = np.asarray(store.window_offsets)
    meta, split = store.meta, store.meta["split"]
    if len(offs) != split["num_windows"] + 1 or offs[0] != 0 or np.any(np.diff(offs) < 0):
        return ["anchors/window_offsets: wrong length (meta.json split.num_windows + 1) or not rising from 0"]
    if offs[-1] != len(store.anchor_event_index):
        return ["anchors/window_offsets[-1] differs from the number of anchors"]
    min_history = meta["constants"]["min_history"]
    start, width = store.window_start_ts, store.window_seconds
    user_offsets = np.asarray(store.train.user_offsets)
    expected = _count_anchor_candidates(store.train, min_history)
    if expected != len(store.anchor_event_index):
        return [f"anchors: {len(store.anchor_event_index)} stored but {expected} listens have at least "
                f"{min_history} earlier events"]
    t_min = t_last = None
    for w in range(store.num_windows):
        idx = np.asarray(store.window_anchors(w))
        if len(idx) == 0:
            continue
        if idx.min() < 0 or idx.max() >= store.train.num_events:
            return [f"anchors: window {w} points outside the train events"]
        ts = np.asarray(store.train.timestamp[idx]).astype(np.int64)
        t_min = int(ts.min()) if t_min is None else min(t_min, int(ts.min()))
        t_last = int(ts.max()) if t_last is None else max(t_last, int(ts.max()))
        if np.any((ts - start) // width != w):
            return [f"anchors: window {w} holds anchors from another window"]
        if len(idx) > 1 and np.any(np.diff(idx) <= 0):
            return [f"anchors: window {w} is not in ascending event index order"]
        if np.any(store.train.event_code[idx] != LISTEN):
            return [f"anchors: window {w} holds an anchor that is not a listen"]
        user = np.searchsorted(user_offsets, idx, side="right") - 1
        if np.any(idx - user_offsets[user] < min_history):
            return [f"anchors: window {w} holds an anchor with fewer than {min_history} earlier events"]
    if (split["t_min"], split["t_last"]) != (t_min, t_last):
        return [f"meta.json split t_min/t_last = {split['t_min']}/{split['t_last']} but the anchors span "
                f"{t_min}/{t_last}"]
    spanned = 0 if t_min is None or t_last is None else (t_last - t_min) // width + 1
    if store.num_windows != spanned:
        return [f"anchors: {store.num_windows} windows but the anchors span {spanned}"]
    return []


def _count_anchor_candidates(split: st.EventSplit, min_history: int) -> int:
    offsets = np.asarray(split.user_offsets)
    total = 0
    for start in range(0, split.num_events, EVENTS_PER_CHECK):
        stop = min(split.num_events, start + EVENTS_PER_CHECK)
        pos = np.arange(start, stop)
        user = np.searchsorted(offsets, pos, side="right") - 1
        listen = np.asarray(split.event_code[start:stop]) == LISTEN
        total += int(np.count_nonzero(listen & (pos - offsets[user] >= min_history)))
    return total


def read_reference_md5s(path: Path, dataset_name: str) -> dict[str, str]:
    """Sums recorded for one dataset in the repository's ``md5sums`` (lines ``<md5>  <name>/<rel>``)."""
    if not path.exists():
        raise UserError(f"{path}: reference checksum file is missing")
    prefix = dataset_name + "/"
    sums = {}
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        md5, _, rel = line.partition("  ")
        if rel.startswith(prefix):
            sums[rel[len(prefix):]] = md5
    return sums


def check_reference_md5s(store_path: Path, reference: dict[str, str]) -> list[str]:
    """The store's own md5 list must equal the published one for its dataset."""
    own = st.read_md5s(store_path)
    problems = [f"{store_path / rel}: md5 {own.get(rel, 'missing')} differs from the published {md5}"
                for rel, md5 in sorted(reference.items()) if own.get(rel) != md5]
    problems += [f"{store_path / rel}: not in the published sums" for rel in sorted(set(own) - set(reference))]
    return problems


def verify_store(path: Path, *, progress: bool = True, on_step: Callable[[str], None] = lambda _: None) -> list[str]:
    if not path.exists():
        raise UserError(f"{path}: no processed store here (run download_dataset.sh first)")
    on_step("checking md5 sums")
    problems = check_md5s(path, progress)
    if problems:
        return problems
    on_step("checking store invariants")
    return check_invariants(st.open_store(path))
