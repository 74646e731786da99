"""The 8 contextual features of an anchor: the uid and 7 hashed crosses (SPEC §3).

Hash (fixed; changing any constant changes every embedding row a run touches)::

    mix(z)   = splitmix64 finalizer over uint64, wrapping arithmetic:
               z ^= z >> 30; z *= 0xBF58476D1CE4E5B9
               z ^= z >> 27; z *= 0x94D049BB133111EB
               z ^= z >> 31
    row(key, c) = mix(key + salt(c)) mod rows[c]      (+ wraps mod 2**64)
    salt(c)     = c * 0x9E3779B97F4A7C15 mod 2**64      (the splitmix64 "golden gamma"),
                  c = 1..7 the cross's column in ``CONTEXTUAL_FEATURES`` (``CROSS_SALTS[c - 1]``)

Key packing (uid, item, artist, album are uint32 in the store, so nothing overlaps)::

    user_artist       uid    << 32 | artist
    user_album        uid    << 32 | album
    user_hour         uid    << 32 | hour
    item_hour         item   << 32 | hour
    artist_hour       artist << 32 | hour
    user_organic      uid    << 32 | is_organic
    user_artist_hour  uid    << 32 | artist << 5 | hour     (needs artist < 2**27)

with hour = (timestamp // 3600) % 24. Column 0 is not hashed: uid % uid_rows.
"""

from __future__ import annotations

import numpy as np

from dlrmv4.config import SamplerConfig

# Column order of ``contextual_ids``; table sizes are the config fields ``<name>_rows``.
CONTEXTUAL_FEATURES: tuple[str, ...] = (
    "uid", "user_artist", "user_album", "user_hour", "item_hour", "artist_hour", "user_organic",
    "user_artist_hour",
)
NUM_CONTEXTUAL = len(CONTEXTUAL_FEATURES)

MIX_MUL_1 = 0xBF58476D1CE4E5B9
MIX_MUL_2 = 0x94D049BB133111EB
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
CROSS_SALTS: tuple[int, ...] = tuple((c * GOLDEN_GAMMA) % 2**64 for c in range(1, NUM_CONTEXTUAL))
ARTIST_BITS_IN_TRIPLE = 27
SECONDS_PER_HOUR = 3600
HOURS_PER_DAY = 24


def table_rows(cfg: SamplerConfig) -> tuple[int, ...]:
    """Rows of each contextual table, in ``CONTEXTUAL_FEATURES`` order."""
    return tuple(int(getattr(cfg, f"{name}_rows")) for name in CONTEXTUAL_FEATURES)


def _u64(x: np.ndarray) -> np.ndarray:
    # At least 1-D: numpy warns on uint64 overflow for scalars but wraps silently for arrays.
    return np.atleast_1d(np.asarray(x)).astype(np.uint64, copy=False)


def mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer of a uint64 array (a new array)."""
    z = _u64(z).copy()
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX_MUL_1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX_MUL_2)
    z ^= z >> np.uint64(31)
    return z


def hash_rows(keys: np.ndarray, salt: int, rows: int) -> np.ndarray:
    """mix64(keys + salt) mod rows, as int64 row indices."""
    return (mix64(_u64(keys) + np.uint64(salt)) % np.uint64(rows)).astype(np.int64)


def hour_of_day(timestamp: np.ndarray) -> np.ndarray:
    return (_u64(timestamp) // np.uint64(SECONDS_PER_HOUR)) % np.uint64(HOURS_PER_DAY)


def cross_keys(uid: np.ndarray, item: np.ndarray, artist: np.ndarray, album: np.ndarray,
               timestamp: np.ndarray, is_organic: np.ndarray) -> list[np.ndarray]:
    """The 7 packed uint64 keys, in ``CONTEXTUAL_FEATURES[1:]`` order."""
    uid, item, artist, album, organic = (_u64(x) for x in (uid, item, artist, album, is_organic))
    hour = hour_of_day(timestamp)
    if artist.size and int(artist.max()) >= 1 << ARTIST_BITS_IN_TRIPLE:
        raise ValueError(f"artist id {int(artist.max())} does not fit the {ARTIST_BITS_IN_TRIPLE} bits "
                         "the user x artist x hour key packs it into")
    hi = np.uint64(32)
    user = uid << hi
    return [
        user | artist,
        user | album,
        user | hour,
        (item << hi) | hour,
        (artist << hi) | hour,
        user | organic,
        user | (artist << np.uint64(5)) | hour,
    ]


def contextual_ids(uid: np.ndarray, item: np.ndarray, artist: np.ndarray, album: np.ndarray,
                   timestamp: np.ndarray, is_organic: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """int64 [B, 8] table rows of the anchors' contextual features (``CONTEXTUAL_FEATURES`` order)."""
    rows = table_rows(cfg)
    keys = cross_keys(uid, item, artist, album, timestamp, is_organic)
    out = np.empty((len(keys[0]), NUM_CONTEXTUAL), dtype=np.int64)
    out[:, 0] = _u64(uid) % np.uint64(rows[0])
    for c, (key, salt) in enumerate(zip(keys, CROSS_SALTS), start=1):
        out[:, c] = hash_rows(key, salt, rows[c])
    return out
