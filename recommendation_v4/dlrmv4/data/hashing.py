"""The 8 contextual features of an anchor: the uid and 7 hashed crosses (docs/data.md).

The reference's definition (``datasets/utils.py`` ``xxhash_cross`` of the MLPerf reference)::

    row(keys, rows) = xxh64(struct.pack(f"<{len(keys)}q", *keys), seed=0).intdigest() % rows

i.e. XXH64 with seed 0 over the keys as little-endian signed int64, back to back, no separator.
Keys, in ``CROSSES`` order (table sizes are the config fields ``<name>_rows``)::

    user_artist       (uid, artist)          user_album        (uid, album)
    user_hour         (uid, hour)            item_hour         (item, hour)
    artist_hour       (artist, hour)         user_organic      (uid, is_organic)
    user_artist_hour  (uid, artist, hour)

with hour = (candidate timestamp // 3600) % 24 and artist, album, is_organic those of the anchor
(candidate) event. Column 0 is not hashed: the raw uid is the row of the uid table; a uid that
does not fit the table is refused.

A batch packs each cross's keys into one contiguous int64 buffer and hashes fixed-size slices of
it (one C call per key, no per-key ``struct.pack``).
"""

from __future__ import annotations

import numpy as np

from dlrmv4.config import SamplerConfig
from dlrmv4.errors import UserError

# (cross, its keys in hashing order), columns 1..7 of ``contextual_ids``.
CROSSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("user_artist", ("uid", "artist")),
    ("user_album", ("uid", "album")),
    ("user_hour", ("uid", "hour")),
    ("item_hour", ("item", "hour")),
    ("artist_hour", ("artist", "hour")),
    ("user_organic", ("uid", "is_organic")),
    ("user_artist_hour", ("uid", "artist", "hour")),
)
# Column order of ``contextual_ids``; table sizes are the config fields ``<name>_rows``.
CONTEXTUAL_FEATURES: tuple[str, ...] = ("uid",) + tuple(name for name, _ in CROSSES)
NUM_CONTEXTUAL = len(CONTEXTUAL_FEATURES)

XXH_SEED = 0
KEY_BYTES = 8  # one little-endian int64 per key
SECONDS_PER_HOUR = 3600
HOURS_PER_DAY = 24


def table_rows(cfg: SamplerConfig) -> tuple[int, ...]:
    """Rows of each contextual table, in ``CONTEXTUAL_FEATURES`` order."""
    return tuple(int(getattr(cfg, f"{name}_rows")) for name in CONTEXTUAL_FEATURES)


def _xxh64_intdigest():
    # Imported here so the feature constants stay importable where xxhash is not installed (the
    # model code on a GPU box that never builds batches).
    try:
        from xxhash import xxh64_intdigest
    except ImportError:
        raise UserError("the contextual crosses need the xxhash package: pip install xxhash==3.5.0") from None
    return xxh64_intdigest


def _int64(x) -> np.ndarray:
    return np.atleast_1d(np.asarray(x)).astype(np.int64, copy=False).reshape(-1)


def hash_rows(keys: np.ndarray, rows: int) -> np.ndarray:
    """int64[n] rows of ``keys`` [n, k] (one key tuple per row): xxh64(seed 0) of the packed keys % rows."""
    keys = np.asarray(keys)
    if keys.ndim != 2:
        raise ValueError(f"keys must be [n, k], got shape {keys.shape}")
    n, width = len(keys), keys.shape[1] * KEY_BYTES
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # Contiguous little-endian int64, viewed as bytes: slice i is exactly struct.pack("<kq", *keys[i]).
    packed = np.ascontiguousarray(keys, dtype="<i8").view(np.uint8).reshape(-1).data
    digest = _xxh64_intdigest()
    hashes = np.array([digest(packed[s : s + width], XXH_SEED) for s in range(0, n * width, width)], dtype=np.uint64)
    return (hashes % np.uint64(rows)).astype(np.int64)


def hour_of_day(timestamp: np.ndarray) -> np.ndarray:
    return (_int64(timestamp) // SECONDS_PER_HOUR) % HOURS_PER_DAY


def check_uids(uid: np.ndarray, uid_rows: int) -> None:
    """Refuse a uid that is not a row of the uid table (the raw uid is the row, no modulo)."""
    if not uid.size:
        return
    lo, hi = int(uid.min()), int(uid.max())
    if lo < 0 or hi >= uid_rows:
        bad = lo if lo < 0 else hi
        raise UserError(
            f"uid {bad} does not fit the uid table of {uid_rows:,} rows (the raw uid is its row); "
            "set sampler.uid_rows above the data's largest uid"
        )


def contextual_ids(
    uid: np.ndarray,
    item: np.ndarray,
    artist: np.ndarray,
    album: np.ndarray,
    timestamp: np.ndarray,
    is_organic: np.ndarray,
    cfg: SamplerConfig,
) -> np.ndarray:
    """int64 [B, 8] table rows of the anchors' contextual features (``CONTEXTUAL_FEATURES`` order)."""
    rows = table_rows(cfg)
    keys = {
        "uid": _int64(uid),
        "item": _int64(item),
        "artist": _int64(artist),
        "album": _int64(album),
        "hour": hour_of_day(timestamp),
        "is_organic": _int64(is_organic),
    }
    check_uids(keys["uid"], rows[0])
    out = np.empty((len(keys["uid"]), NUM_CONTEXTUAL), dtype=np.int64)
    out[:, 0] = keys["uid"]
    for c, (_, names) in enumerate(CROSSES, start=1):
        out[:, c] = hash_rows(np.stack([keys[k] for k in names], axis=1), rows[c])
    return out
