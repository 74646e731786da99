"""Check a processed store: every md5 in its list, then the invariants of the layout in store.py.

Checks run in chunks of events so memory stays bounded at the 5b size, on a pool of threads (one
per core by default: hashlib and numpy let go of the GIL), files hashed in parallel and chunks and
windows checked in parallel. ``verify_store`` returns the problems found (empty = the store is
good); the CLI turns them into one line and exit 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import numpy as np
from tqdm import tqdm

from dlrmv4.data import store as st
from dlrmv4.data.verified_stamp import clear_stamp, snapshot, unverified_reason, write_stamp
from dlrmv4.data.yambda_schema import ACTION_LIKE, ACTION_LISTEN_PLUS, ACTION_SKIP, EVENT_TYPES, LIKE, LISTEN
from dlrmv4.errors import UserError
from dlrmv4.parallel import parallel_map, usable_cores

EVENTS_PER_CHECK = 4_000_000  # per thread: a chunk's temporaries take about 60 bytes an event


def check_md5s(path: Path, progress: bool = True, workers: int = 0) -> list[str]:
    expected = st.read_md5s(path)
    problems = []
    listed = set(expected)
    present = {p.relative_to(path).as_posix() for p in st.store_files(path)}
    for rel in sorted(present - listed):
        problems.append(f"{path / rel}: file is not in {st.MD5_FILE}")
    missing = sorted(rel for rel in expected if not (path / rel).is_file())
    problems += [f"{path / rel}: file is missing" for rel in missing]
    rels = sorted(set(expected) - set(missing))
    files = [path / rel for rel in rels]
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, desc="md5", unit="B", unit_scale=True, disable=not progress) as bar:
        sums = st.file_md5s(files, workers, on_file=bar.update)
    for rel, full, md5 in zip(rels, files, sums):
        if md5 != expected[rel]:
            problems.append(f"{full}: md5 mismatch (file changed or damaged; re-run preprocessing)")
    return problems


def _check_split(
    name: str, split: st.EventSplit, lo: int, hi: int, session_gap: int, problems: list[str], workers: int
) -> None:
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

    def check(start: int) -> list[str]:
        found: list[str] = []
        _check_events(
            name, split, user_starts, start, min(int(off[-1]), start + EVENTS_PER_CHECK), lo, hi, session_gap, found
        )
        return found

    for found in parallel_map(check, range(0, int(off[-1]), EVENTS_PER_CHECK), workers):
        if found:  # the first chunk with a problem
            problems.extend(found)
            return


def _check_events(
    name: str,
    split: st.EventSplit,
    user_starts: np.ndarray,
    start: int,
    stop: int,
    lo: int,
    hi: int,
    session_gap: int,
    problems: list[str],
) -> None:
    """The per-event invariants of events [start, stop) of ``split``, appended to ``problems``."""
    ts = np.asarray(split.timestamp[start:stop]).astype(np.int64)
    code = np.asarray(split.event_code[start:stop])
    action = np.asarray(split.action[start:stop])
    if ts.min() < lo or ts.max() >= hi:
        problems.append(f"{name}: timestamps outside [{lo}, {hi}) in events {start}..{stop}")
    if code.max() >= len(EVENT_TYPES):
        problems.append(f"{name}: event_code >= {len(EVENT_TYPES)} in events {start}..{stop}")
    bad_action = np.where(
        code == LISTEN,
        (action != ACTION_LISTEN_PLUS) & (action != ACTION_SKIP),
        np.where(code == LIKE, action != ACTION_LIKE, action != 0),
    )
    if bad_action.any():
        problems.append(
            f"{name}: action bit disagrees with event_code at event {start + np.flatnonzero(bad_action)[0]}"
        )
    # Time order inside each user: a decrease is allowed only where a new user starts.
    drops = np.flatnonzero(np.diff(ts) < 0) + start + 1
    if len(drops) and not np.all(np.isin(drops, user_starts)):
        problems.append(f"{name}: timestamps decrease inside a user near event {drops[0]}")
    bad_session = _session_breaks(split, user_starts, start, stop, ts, session_gap)
    if bad_session is not None:
        problems.append(f"{name}: session_id does not follow the {session_gap} s gap rule at event {bad_session}")


def _session_breaks(
    split: st.EventSplit, user_starts: np.ndarray, start: int, stop: int, ts: np.ndarray, gap: int
) -> int | None:
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


def check_invariants(store: st.Store, workers: int = 0) -> list[str]:
    workers = workers or usable_cores()
    problems: list[str] = []
    meta, split = store.meta, store.meta["split"]
    gap = meta["constants"]["session_gap_seconds"]
    _check_split("train", store.train, split["train_start"], split["train_end"], gap, problems, workers)
    _check_split("test", store.test, split["test_start"], split["t_end"], gap, problems, workers)
    counts = meta["counts"]
    per_window = np.diff(np.asarray(store.window_offsets))
    for key, value in (
        ("train_events", store.train.num_events),
        ("test_events", store.test.num_events),
        ("train_users", store.train.num_users),
        ("test_users", store.test.num_users),
        ("anchors", len(store.anchor_event_index)),
        ("num_items", len(store.artist_id)),
        ("train_samples", int(per_window[:-1].sum())),
        ("eval_samples", int(per_window[-1]) if len(per_window) else 0),
    ):
        if counts.get(key) != value:
            problems.append(f"meta.json counts.{key}={counts.get(key)} but the arrays hold {value}")
    if not np.all(np.isin(store.test.user_ids, store.train.user_ids)):
        problems.append("test: holds users that have no train events")
    if len(store.album_id) != len(store.artist_id) or len(store.popularity) != len(store.artist_id):
        problems.append("items: artist_id, album_id and popularity differ in length")
    elif int(store.popularity.sum()) != store.train.num_events:
        problems.append("items/popularity does not sum to the number of train events")
    problems.extend(_check_anchors(store, workers))
    return problems


def _check_anchors(store: st.Store, workers: int) -> list[str]:
    offs = np.asarray(store.window_offsets)
    meta, split = store.meta, store.meta["split"]
    if len(offs) != split["num_windows"] + 1 or offs[0] != 0 or np.any(np.diff(offs) < 0):
        return ["anchors/window_offsets: wrong length (meta.json split.num_windows + 1) or not rising from 0"]
    if offs[-1] != len(store.anchor_event_index):
        return ["anchors/window_offsets[-1] differs from the number of anchors"]
    min_history = meta["constants"]["min_history"]
    start, width = store.window_start_ts, store.window_seconds
    user_offsets = np.asarray(store.train.user_offsets)
    expected = _count_anchor_candidates(store.train, min_history, workers)
    if expected != len(store.anchor_event_index):
        return [
            f"anchors: {len(store.anchor_event_index)} stored but {expected} listens have at least "
            f"{min_history} earlier events"
        ]

    def check(w: int) -> tuple[str | None, int | None, int | None]:
        """(the window's problem, or None; its earliest and latest anchor time, None when empty)."""
        idx = np.asarray(store.window_anchors(w))
        if len(idx) == 0:
            return None, None, None
        if idx.min() < 0 or idx.max() >= store.train.num_events:
            return f"anchors: window {w} points outside the train events", None, None
        ts = np.asarray(store.train.timestamp[idx]).astype(np.int64)
        if np.any((ts - start) // width != w):
            return f"anchors: window {w} holds anchors from another window", None, None
        if len(idx) > 1 and np.any(np.diff(idx) <= 0):
            return f"anchors: window {w} is not in ascending event index order", None, None
        if np.any(store.train.event_code[idx] != LISTEN):
            return f"anchors: window {w} holds an anchor that is not a listen", None, None
        user = np.searchsorted(user_offsets, idx, side="right") - 1
        if np.any(idx - user_offsets[user] < min_history):
            return f"anchors: window {w} holds an anchor with fewer than {min_history} earlier events", None, None
        return None, int(ts.min()), int(ts.max())

    windows = parallel_map(check, range(store.num_windows), workers)
    for problem, _, _ in windows:
        if problem is not None:
            return [problem]
    firsts = [first for _, first, _ in windows if first is not None]
    lasts = [last for _, _, last in windows if last is not None]
    t_min, t_last = (min(firsts), max(lasts)) if firsts else (None, None)
    if (split["t_min"], split["t_last"]) != (t_min, t_last):
        return [
            f"meta.json split t_min/t_last = {split['t_min']}/{split['t_last']} but the anchors span {t_min}/{t_last}"
        ]
    spanned = 0 if t_min is None or t_last is None else (t_last - t_min) // width + 1
    if store.num_windows != spanned:
        return [f"anchors: {store.num_windows} windows but the anchors span {spanned}"]
    return []


def _count_anchor_candidates(split: st.EventSplit, min_history: int, workers: int) -> int:
    offsets = np.asarray(split.user_offsets)

    def count(start: int) -> int:
        stop = min(split.num_events, start + EVENTS_PER_CHECK)
        pos = np.arange(start, stop)
        user = np.searchsorted(offsets, pos, side="right") - 1
        listen = np.asarray(split.event_code[start:stop]) == LISTEN
        return int(np.count_nonzero(listen & (pos - offsets[user] >= min_history)))

    return sum(parallel_map(count, range(0, split.num_events, EVENTS_PER_CHECK), workers))


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
            sums[rel[len(prefix) :]] = md5
    return sums


def check_reference_md5s(store_path: Path, reference: dict[str, str]) -> list[str]:
    """The store's own md5 list must equal the published one for its dataset."""
    own = st.read_md5s(store_path)
    problems = [
        f"{store_path / rel}: md5 {own.get(rel, 'missing')} differs from the published {md5}"
        for rel, md5 in sorted(reference.items())
        if own.get(rel) != md5
    ]
    problems += [f"{store_path / rel}: not in the published sums" for rel in sorted(set(own) - set(reference))]
    return problems


def verify_and_stamp(
    path: Path, *, progress: bool = True, on_step: Callable[[str], None] = lambda _: None, workers: int = 0
) -> list[str]:
    """``verify_store``, recording the outcome beside the store (``verified_stamp.py``): a stamp of
    the files as verified when no problem was found, none otherwise."""
    started, files = time.time(), snapshot(path) if path.exists() else {}
    clear_stamp(path)
    problems = verify_store(path, progress=progress, on_step=on_step, workers=workers)
    if not problems:
        write_stamp(path, files, started)
    return problems


def check_verified(path: Path, world_size: int, log: Callable[[str], None], progress: bool) -> None:
    """Before a run trains on the store: unchanged since its last successful verification, or
    verified now (one process; several refuse in one line, since the other ranks would wait on a
    collective while one hashes the store). A store that fails stops the run in one line."""
    reason = unverified_reason(path)
    if reason is None:
        return
    if world_size > 1:
        raise UserError(
            f"the store at {path} {reason}: verify it before a multi-process run (python -m dlrmv4 "
            "verify, or prepare --if-missing, with the same flags; run_and_time.sh does it)"
        )
    log(f"the store at {path} {reason}: verifying it before training")
    problems = verify_and_stamp(path, progress=progress, on_step=log)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise UserError(
            f"the store at {path} fails verification: {problems[0]}{more}; prepare it again "
            "(python -m dlrmv4 prepare with the same flags)"
        )


def verify_store(
    path: Path, *, progress: bool = True, on_step: Callable[[str], None] = lambda _: None, workers: int = 0
) -> list[str]:
    """The store's problems (empty: good): its md5 sums, then its invariants, each step timed in
    ``on_step``; ``workers`` threads (0: one per usable core)."""
    if not path.exists():
        raise UserError(f"{path}: no processed store here (run download_dataset.sh first)")
    workers = workers or usable_cores()
    size = sum(f.stat().st_size for f in st.store_files(path))
    on_step(f"checking md5 sums ({size / 1e9:.2f} GB, {workers} threads)")
    started = time.perf_counter()
    problems = check_md5s(path, progress, workers)
    seconds = time.perf_counter() - started
    on_step(f"md5 sums checked in {seconds:.1f} s ({size / 1e9 / max(seconds, 1e-9):.2f} GB/s)")
    if problems:
        return problems
    on_step("checking store invariants")
    started = time.perf_counter()
    problems = check_invariants(st.open_store(path), workers)
    on_step(f"store invariants checked in {time.perf_counter() - started:.1f} s")
    return problems
