"""Samples (docs/data.md): one anchor -> a 3-pool causal history, its candidate and contextual features.

For an anchor at global train event index g of user u (CSR row u: events
``user_offsets[u]:user_offsets[u + 1]``), the history is gathered from the causal window
``[max(user_offsets[u], g - scan_window), g)``: the last ``per_pool_length`` events of each pool
(action bit 1 listen_plus, 2 like, 4 skip; action 0 never enters), merged back into time order.
A batch is built with one loop over samples that only finds positions inside the window, then
one concatenated gather per column for the whole batch. The contextual features are
``hashing.contextual_ids`` of the anchor (the reference's xxh64 crosses; the raw uid is its row, so
a batch with a uid at or beyond ``sampler.uid_rows`` is refused with a ``UserError``).
"""

from __future__ import annotations

import numpy as np

from dlrmv4.config import SamplerConfig
from dlrmv4.data.batch import JaggedBatch
from dlrmv4.data.hashing import contextual_ids
from dlrmv4.data.store import Store
from dlrmv4.data.yambda_schema import ACTION_BITS, ACTION_LISTEN_PLUS

SIDE_SHIFT = 32  # item_sides packs artist_id << 32 | album_id (both uint32)


def lookup_item_table(table: np.ndarray, items: np.ndarray) -> np.ndarray:
    """int64 per-item values; items beyond the table (unknown to the mappings) give 0."""
    table = np.asarray(table)
    if not items.size or items.max() < len(table):
        return table[items].astype(np.int64, copy=False)
    out = np.take(table, items, mode="clip").astype(np.int64, copy=False)
    out[items >= len(table)] = 0
    return out


def pack_item_sides(store: Store) -> np.ndarray:
    """int64[I] artist_id << 32 | album_id: one random read per history token instead of two.

    The per-item tables outgrow the CPU cache on real data (9.4M items, 38 MB each), so the two
    lookups per token are memory-bound; a loader builds this once per worker and passes it to
    ``build_batch``.
    """
    artist = np.asarray(store.artist_id).astype(np.int64)
    return (artist << SIDE_SHIFT) | np.asarray(store.album_id)


def item_side_ids(store: Store, items: np.ndarray, item_sides: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(artist_id, album_id) as int64 per item, from ``item_sides`` when given, else the store's tables."""
    if item_sides is None:
        return lookup_item_table(store.artist_id, items), lookup_item_table(store.album_id, items)
    packed = lookup_item_table(item_sides, items)
    low = (1 << SIDE_SHIFT) - 1
    return (packed >> SIDE_SHIFT) & low, packed & low


def user_of(user_offsets: np.ndarray, events: np.ndarray) -> np.ndarray:
    """CSR row of each global event index."""
    return np.searchsorted(user_offsets, events, side="right") - 1


def last_of_pool(window: np.ndarray, bit: int, k: int) -> np.ndarray:
    """Sorted local positions of the last ``k`` events of pool ``bit`` in ``window``.

    The dense pools (listen_plus, skip) fill ``k`` within a short tail of the window, so
    ``flatnonzero`` runs only over a tail sized from the pool's frequency in the window (and
    doubled in the rare case it falls short); a sparse pool (like) is read whole.
    """
    mask = window == bit
    n = len(mask)
    count = int(np.count_nonzero(mask))
    if count <= k:
        return np.flatnonzero(mask)
    tail = min(n, n * k // count * 6 // 5 + 64)
    while True:
        local = np.flatnonzero(mask[n - tail :])
        if len(local) >= k:
            return local[-k:] + (n - tail)
        tail = min(n, 2 * tail)


def history_positions(
    action: np.ndarray, lo: np.ndarray, hi: np.ndarray, per_pool: int
) -> tuple[np.ndarray, np.ndarray]:
    """Global event positions of every sample's history (concatenated, time order) and their counts.

    Sample b scans ``action[lo[b]:hi[b]]``. Each pool's positions are sorted, so the merged
    history is three sorted runs; a stable sort (timsort) merges them in linear time.
    """
    parts: list[np.ndarray] = []
    counts = np.empty(len(lo), dtype=np.int64)
    for b, (start, stop) in enumerate(zip(lo.tolist(), hi.tolist())):
        window = action[start:stop]
        local = np.sort(np.concatenate([last_of_pool(window, bit, per_pool) for bit in ACTION_BITS]), kind="stable")
        counts[b] = len(local)
        parts.append(local)
    local_all = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return local_all + np.repeat(lo, counts), counts


def scan_ranges(store: Store, anchors: np.ndarray, scan_window: int) -> tuple[np.ndarray, np.ndarray]:
    """(user row, first scanned event) of each anchor: its history comes from ``[lo, anchor)``."""
    offsets = np.asarray(store.train.user_offsets)
    user = user_of(offsets, anchors)
    return user, np.maximum(offsets[user], anchors - scan_window)


def history_lengths(store: Store, anchor_indices: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """int64 history length of each anchor's sample, equal to ``build_batch``'s, without gathering.

    Each pool contributes min(its events in the scan range, per_pool_length). The ranges of a
    user's anchors overlap (a batch holds runs of one user's anchors), so the counts come from
    prefix sums over the union of the ranges: about one scan window per user, not per anchor.
    """
    anchors = np.asarray(anchor_indices, dtype=np.int64).reshape(-1)
    if not anchors.size:
        return np.zeros(0, dtype=np.int64)
    _, lo = scan_ranges(store, anchors, cfg.scan_window)
    by_start = np.argsort(lo, kind="stable")
    starts, stops = lo[by_start], np.maximum.accumulate(anchors[by_start])
    new_run = np.ones(len(starts), dtype=bool)
    new_run[1:] = starts[1:] > stops[:-1]  # a range that begins after every earlier one ended
    run_of = np.cumsum(new_run) - 1
    run_start = starts[new_run]
    run_stop = np.maximum.reduceat(stops, np.flatnonzero(new_run))
    action = np.asarray(store.train.action)
    scanned = np.concatenate([action[a:b] for a, b in zip(run_start.tolist(), run_stop.tolist())])
    # Position of global event e (inside run k) in ``scanned``: e - run_start[k] + base[k].
    base = np.concatenate([[0], np.cumsum(run_stop - run_start)[:-1]])
    shift = np.empty(len(anchors), dtype=np.int64)
    shift[by_start] = base[run_of] - run_start[run_of]
    lengths = np.zeros(len(anchors), dtype=np.int64)
    for bit in ACTION_BITS:
        prefix = np.zeros(len(scanned) + 1, dtype=np.int64)
        np.cumsum(scanned == bit, out=prefix[1:])
        lengths += np.minimum(prefix[anchors + shift] - prefix[lo + shift], cfg.per_pool_length)
    return lengths


def build_batch(
    store: Store, anchor_indices: np.ndarray, cfg: SamplerConfig, item_sides: np.ndarray | None = None
) -> JaggedBatch:
    """The jagged batch of the given anchors (global train event indices), in the given order.

    ``item_sides`` (from ``pack_item_sides(store)``) is optional and only makes it faster.
    """
    train = store.train
    num_events = int(np.asarray(train.user_offsets)[-1])
    anchors = np.array(anchor_indices, dtype=np.int64).reshape(-1)  # a copy: callers pass mmap slices
    if anchors.size and (anchors.min() < 0 or anchors.max() >= num_events):
        raise ValueError(
            f"anchor indices must lie in [0, {num_events}), got [{int(anchors.min())}, {int(anchors.max())}]"
        )
    user, lo = scan_ranges(store, anchors, cfg.scan_window)
    positions, lengths = history_positions(np.asarray(train.action), lo, anchors, cfg.per_pool_length)

    item_id, timestamp, action = (np.asarray(c) for c in (train.item_id, train.timestamp, train.action))
    hist_item = item_id[positions].astype(np.int64)
    hist_ts = timestamp[positions].astype(np.int64)
    hist_offsets = np.zeros(len(anchors) + 1, dtype=np.int64)
    np.cumsum(lengths, out=hist_offsets[1:])

    cand_item = item_id[anchors].astype(np.int64)
    cand_artist, cand_album = item_side_ids(store, cand_item, item_sides)
    hist_artist, hist_album = item_side_ids(store, hist_item, item_sides)
    cand_ts = timestamp[anchors].astype(np.int64)
    query_time = cand_ts.copy()
    has_history = lengths > 0
    query_time[has_history] = hist_ts[hist_offsets[1:][has_history] - 1]
    uid = np.asarray(train.user_ids)[user]  # checked against uid_rows by contextual_ids, once per batch
    ctx = contextual_ids(uid, cand_item, cand_artist, cand_album, cand_ts, np.asarray(train.is_organic)[anchors], cfg)

    return JaggedBatch(
        history_lengths=lengths.astype(np.int32),
        history_offsets=hist_offsets,
        history_item_id=hist_item,
        history_artist_id=hist_artist,
        history_album_id=hist_album,
        history_action=action[positions].astype(np.int64),
        history_timestamp=hist_ts,
        contextual_ids=ctx,
        candidate_item_id=cand_item,
        candidate_artist_id=cand_artist,
        candidate_album_id=cand_album,
        candidate_timestamp=cand_ts,
        query_time=query_time,
        label=(action[anchors] == ACTION_LISTEN_PLUS).astype(np.float32),
        anchor_index=anchors,
    )
