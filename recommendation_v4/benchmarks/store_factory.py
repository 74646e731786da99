"""Small processed stores from random arrays, laid out exactly as ``dlrmv4.data.store`` reads them.

Tests (and the sampler benchmark) use this instead of the preprocessor, so they depend only on
the store layout. ``random_store`` draws users, events and item tables from one seed;
``write_store`` takes explicit train arrays and derives sessions, anchors and meta.json.

Unlike the preprocessor, whose windows start at the earliest anchor, the factory's windows start
at ``train_start`` (recorded as the store's ``t_min``), so a test sets the window count itself; the
reader needs only ``t_min`` and ``window_offsets``. Everything else follows the store's rules:
sessions break on gaps > the session gap, anchors are in ascending event index inside a window.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dlrmv4.data.store import EVENT_COLUMNS, META_FILE, STORE_SCHEMA_VERSION, save_array, write_md5s
from dlrmv4.data.yambda_schema import ACTION_LIKE, ACTION_LISTEN_PLUS, ACTION_SKIP, DISLIKE, LIKE, LISTEN
from dlrmv4.files import atomic_directory, write_json

# Event kinds the factory draws: (event_code, action); "none" uses a random non-history code.
KINDS = ((LISTEN, ACTION_LISTEN_PLUS), (LIKE, ACTION_LIKE), (LISTEN, ACTION_SKIP), (DISLIKE, 0))
# Yambda 5b mix after labelling: listen_plus, like, skip, other.
YAMBDA_ACTION_PROBS = (0.613, 0.019, 0.359, 0.009)
SESSION_GAP_SECONDS = 1_800


def random_items(rng: np.random.Generator, size: int, num_items: int, zipf: float | None) -> np.ndarray:
    """Uniform item ids, or popularity rank r drawn with weight ~ r**-zipf (bounded, inverse CDF of the
    continuous law; zipf != 1) and mapped onto a shuffled id space."""
    if zipf is None:
        return rng.integers(0, num_items, size=size, dtype=np.uint32)
    e = 1.0 - zipf
    x = (1.0 + rng.random(size) * ((num_items + 1.0) ** e - 1.0)) ** (1.0 / e)
    rank = np.clip(np.floor(x).astype(np.int64) - 1, 0, num_items - 1)
    return rng.permutation(num_items).astype(np.uint32)[rank]


def random_events(
    rng: np.random.Generator,
    lengths: np.ndarray,
    *,
    num_items: int,
    train_start: int,
    train_end: int,
    action_probs=YAMBDA_ACTION_PROBS,
    item_zipf: float | None = None,
) -> dict[str, np.ndarray]:
    """Event columns for users with the given event counts, time-sorted inside each user."""
    total = int(lengths.sum())
    kind = rng.choice(len(KINDS), size=total, p=np.asarray(action_probs) / np.sum(action_probs))
    codes = np.array([k[0] for k in KINDS], dtype=np.uint8)[kind]
    # "Other" events spread over dislike / unlike / undislike.
    other = kind == len(KINDS) - 1
    codes[other] = rng.integers(DISLIKE, DISLIKE + 3, size=int(other.sum()), dtype=np.uint8)
    user = np.repeat(np.arange(len(lengths)), lengths)
    stamps = rng.integers(train_start, train_end, size=total, dtype=np.int64)
    order = np.lexsort((stamps, user))  # time order inside each user
    return {
        "item_id": random_items(rng, total, num_items, item_zipf),
        "timestamp": stamps[order].astype(np.uint32),
        "event_code": codes,
        "action": np.array([k[1] for k in KINDS], dtype=np.uint8)[kind],
        "is_organic": rng.integers(0, 2, size=total, dtype=np.uint8),
    }


def session_ids(user_offsets: np.ndarray, timestamp: np.ndarray, gap: int = SESSION_GAP_SECONDS) -> np.ndarray:
    """Per-user session number: a new session after more than ``gap`` seconds of inactivity."""
    new = np.zeros(len(timestamp), dtype=np.int64)
    new[1:] = np.diff(timestamp.astype(np.int64)) > gap
    lengths = np.diff(user_offsets)
    starts = user_offsets[:-1][lengths > 0]
    new[starts] = 0
    running = np.cumsum(new)
    return (running - np.repeat(running[starts], lengths[lengths > 0])).astype(np.uint32)


def anchor_index(
    user_offsets: np.ndarray,
    timestamp: np.ndarray,
    event_code: np.ndarray,
    *,
    min_history: int,
    train_start: int,
    window_seconds: int,
    num_windows: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(event_index, window_offsets): listens at user-local index >= min_history, by (window, index)."""
    total = len(timestamp)
    user = np.repeat(np.arange(len(user_offsets) - 1), np.diff(user_offsets))
    local = np.arange(total) - user_offsets[:-1][user]
    window = (timestamp.astype(np.int64) - train_start) // window_seconds
    keep = (event_code == LISTEN) & (local >= min_history) & (window >= 0) & (window < num_windows)
    idx = np.flatnonzero(keep)  # ascending: user-major
    idx = idx[np.argsort(window[idx], kind="stable")]
    window_offsets = np.searchsorted(window[idx], np.arange(num_windows + 1), side="left").astype(np.int64)
    return idx.astype(np.int64), window_offsets


def _write_split(
    root: Path, split: str, user_ids: np.ndarray, user_offsets: np.ndarray, events: dict[str, np.ndarray]
) -> None:
    save_array(root / split / "user_offsets.npy", user_offsets.astype(np.int64))
    save_array(root / split / "user_ids.npy", user_ids.astype(np.uint32))
    columns = dict(events)
    columns.setdefault("session_id", session_ids(user_offsets, events["timestamp"]))
    for name, dtype in EVENT_COLUMNS.items():
        save_array(root / split / f"{name}.npy", np.asarray(columns[name]).astype(dtype))


def write_store(
    path: Path,
    *,
    user_ids: np.ndarray,
    user_offsets: np.ndarray,
    events: dict[str, np.ndarray],
    artist_id: np.ndarray,
    album_id: np.ndarray,
    min_history: int,
    window_seconds: int,
    num_windows: int,
    train_start: int = 0,
) -> Path:
    """A complete store at ``path`` from train-span arrays (the test split is left empty)."""
    path = Path(path)
    user_offsets = np.asarray(user_offsets, dtype=np.int64)
    anchors, window_offsets = anchor_index(
        user_offsets,
        events["timestamp"],
        events["event_code"],
        min_history=min_history,
        train_start=train_start,
        window_seconds=window_seconds,
        num_windows=num_windows,
    )
    num_items = len(artist_id)
    popularity = np.bincount(events["item_id"].astype(np.int64), minlength=num_items)[:num_items]
    train_end = train_start + num_windows * window_seconds
    empty = {name: np.zeros(0, dtype=dtype) for name, dtype in EVENT_COLUMNS.items()}
    with atomic_directory(path) as tmp:
        _write_split(tmp, "train", user_ids, user_offsets, events)
        _write_split(tmp, "test", np.zeros(0, np.uint32), np.zeros(1, np.int64), empty)
        save_array(tmp / "items" / "artist_id.npy", np.asarray(artist_id, dtype=np.uint32))
        save_array(tmp / "items" / "album_id.npy", np.asarray(album_id, dtype=np.uint32))
        save_array(tmp / "items" / "popularity.npy", popularity.astype(np.int64))
        save_array(tmp / "anchors" / "event_index.npy", anchors)
        save_array(tmp / "anchors" / "window_offsets.npy", window_offsets)
        write_md5s(tmp)
        write_json(
            tmp / META_FILE,
            {
                "schema_version": STORE_SCHEMA_VERSION,
                "source": "benchmarks/store_factory",
                "constants": {
                    "window_seconds": window_seconds,
                    "min_history": min_history,
                    "num_train_days": num_windows,
                    "session_gap_seconds": SESSION_GAP_SECONDS,
                },
                "split": {
                    "train_start": train_start,
                    "train_end": train_end,
                    "test_start": train_end + SESSION_GAP_SECONDS,
                    "t_end": train_end + SESSION_GAP_SECONDS + window_seconds,
                    "t_min": train_start,
                    "num_windows": num_windows,
                    "t_last": int(events["timestamp"][anchors].max()) if len(anchors) else None,
                },
                "counts": {
                    "users": len(user_ids),
                    "train_events": int(user_offsets[-1]),
                    "test_events": 0,
                    "items": num_items,
                    "anchors": len(anchors),
                    "windows": num_windows,
                    "train_samples": int(window_offsets[-2]),
                    "eval_samples": int(window_offsets[-1] - window_offsets[-2]),
                },
            },
        )
    return path


def random_store(
    path: Path,
    *,
    seed: int,
    lengths: np.ndarray | list[int],
    num_items: int = 1_000,
    item_table_size: int | None = None,
    num_artists: int = 100,
    num_albums: int = 300,
    min_history: int = 0,
    window_seconds: int = 1_000,
    num_windows: int = 5,
    action_probs=YAMBDA_ACTION_PROBS,
    item_zipf: float | None = None,
    uid_limit: int = 1_000_001,
) -> Path:
    """A random store; users get ``lengths`` events each, spread over ``num_windows`` windows.

    Raw uids are drawn from ``[0, uid_limit)`` (default: Yambda's, which fit the reference's uid table).

    Item ids are drawn from ``[0, num_items)`` but the artist/album tables have
    ``item_table_size`` rows (default ``num_items``), so a smaller table leaves items unmapped.
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    events = random_events(
        rng,
        lengths,
        num_items=num_items,
        train_start=0,
        train_end=num_windows * window_seconds,
        action_probs=action_probs,
        item_zipf=item_zipf,
    )
    table = num_items if item_table_size is None else item_table_size
    user_ids = np.sort(rng.choice(uid_limit, size=len(lengths), replace=False)).astype(np.uint32)
    return write_store(
        path,
        user_ids=user_ids,
        user_offsets=offsets,
        events=events,
        artist_id=rng.integers(0, num_artists, size=table, dtype=np.uint32),
        album_id=rng.integers(0, num_albums, size=table, dtype=np.uint32),
        min_history=min_history,
        window_seconds=window_seconds,
        num_windows=num_windows,
    )


def prepared_store(preset: str, data_path: str):
    """(config, store) of a preset's prepared store under ``data_path``; exits in one line when it is missing."""
    from dlrmv4.config_loading import load_config
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.store import open_store

    cfg = load_config(preset, None, {("dataset", "data_path"): data_path})
    path = store_dir(cfg.dataset)
    if not (path / META_FILE).exists():
        raise SystemExit(f"no store at {path}: prepare it first (see this script's docstring)")
    return cfg, open_store(path)
