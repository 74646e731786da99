"""One sample at a time with plain Python loops, straight from the rules: the sampler (docs/data.md) and
the contextual crosses (docs/data.md), with no numpy and none of the code they check.

The tests hold ``dlrmv4.data.sampler`` and ``dlrmv4.data.hashing`` to these; the sampler benchmark
times ``build_batch`` against ``reference_sample``.
"""

from __future__ import annotations

import struct

import xxhash

from dlrmv4.config import SamplerConfig
from dlrmv4.errors import UserError


def py_cross(keys, rows: int) -> int:
    """The reference's formula, one key tuple at a time."""
    return xxhash.xxh64(struct.pack(f"<{len(keys)}q", *keys), seed=0).intdigest() % rows


def py_contextual(uid: int, item: int, artist: int, album: int, ts: int, organic: int, cfg: SamplerConfig) -> list[int]:
    """The reference's crosses (docs/data.md) written out with Python integers and struct (no numpy, no code under test)."""
    hour = (ts // 3600) % 24
    crosses = [
        ((uid, artist), cfg.user_artist_rows),
        ((uid, album), cfg.user_album_rows),
        ((uid, hour), cfg.user_hour_rows),
        ((item, hour), cfg.item_hour_rows),
        ((artist, hour), cfg.artist_hour_rows),
        ((uid, organic), cfg.user_organic_rows),
        ((uid, artist, hour), cfg.user_artist_hour_rows),
    ]
    return [uid] + [py_cross(keys, rows) for keys, rows in crosses]


def reference_sample(store, g: int, cfg: SamplerConfig) -> dict:
    """One sample, written with loops straight from the rules (docs/data.md)."""
    offsets = [int(x) for x in store.train.user_offsets]
    u = 0
    while offsets[u + 1] <= g:
        u += 1
    lo = max(offsets[u], g - cfg.scan_window)
    action = store.train.action
    pools = {1: [], 2: [], 4: []}
    for i in range(g - 1, lo - 1, -1):  # newest first, so each pool keeps its latest events
        a = int(action[i])
        if a in pools and len(pools[a]) < cfg.per_pool_length:
            pools[a].append(i)
    picked = sorted(pools[1] + pools[2] + pools[4])

    def side(item: int, table) -> int:
        return int(table[item]) if item < len(table) else 0

    items = [int(store.train.item_id[i]) for i in picked]
    stamps = [int(store.train.timestamp[i]) for i in picked]
    cand = int(store.train.item_id[g])
    cand_ts = int(store.train.timestamp[g])
    uid = int(store.train.user_ids[u])
    if uid >= cfg.uid_rows:  # the raw uid is its row: the reference has no row for it
        raise UserError(f"uid {uid} beyond {cfg.uid_rows}")
    ctx = py_contextual(
        uid, cand, side(cand, store.artist_id), side(cand, store.album_id), cand_ts, int(store.train.is_organic[g]), cfg
    )
    return dict(
        items=items,
        artists=[side(i, store.artist_id) for i in items],
        albums=[side(i, store.album_id) for i in items],
        actions=[int(action[i]) for i in picked],
        stamps=stamps,
        ctx=ctx,
        cand=cand,
        cand_artist=side(cand, store.artist_id),
        cand_album=side(cand, store.album_id),
        cand_ts=cand_ts,
        query_time=stamps[-1] if stamps else cand_ts,
        label=1.0 if int(action[g]) == 1 else 0.0,
    )
