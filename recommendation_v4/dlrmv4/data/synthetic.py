"""Synthetic Yambda: the three raw files, same schema and layout, with a learnable signal.

The generative story (docs/synthetic_data.md says it in full):

* Catalog. Items belong to one album, albums to one artist (ids start at 0; 0 is a real id).
  Item popularity is Zipf over a random ranking; each item has a hidden quality and a track
  length. About 1 % of items get no row in each mapping file ("missing -> 0" path), and about
  3 % get two earlier rows with other ids (one smaller, one larger): the last row in file order
  is the item's real artist/album, as the reference reads it.
* Users. Sparse uids in [0, uid_rows) with 0 and uid_rows - 1 always present (the uid table's
  edges). A lognormal number of listens (heavy tail); a few affine artists with Dirichlet
  weights; an exploration rate; a skip bias. Each user starts at a random time and listens in
  sessions: events every 5-60 s (some in the same 5-s bin), sessions at least an hour apart.
  A launch ramp runs the first days of the span slowly, so users need days to build up a
  history after the train start.
* A listen picks its item from a mixture of: a repeat of one of the user's recent listens, an
  item of an affine artist (by popularity within the artist), or global popularity.
  Recommendation-driven listens (is_organic = 0) come mostly from the popularity branch.
* listen_plus (played_ratio_pct >= 50) follows a logistic model: much more likely for affine
  artists and repeats, more likely for organic listens, shifted by item quality and user bias.
  Full listens sit at 100, some replays go up to 300; skips are skewed towards 0. About 0.5 % of
  listens have a null played_ratio_pct (the reference reads them as skips).
* Likes follow some listen_plus (same or next 5-s bin), dislikes follow some skips, and a few
  likes/dislikes are undone later (unlike/undislike at a later listen of the same user).
* The truth beside the data: ``listen_plus_probability.parquet`` (next to the events file, one
  float32 row per event row, NaN for non-listens) holds each listen's true probability of
  listen_plus, from which ``prepare`` computes the holdout's best possible AUC (quality_bounds.py).

Randomness: one ``SeedSequence`` per user (spawn key ``(_USER_STREAM, user index)``), one for the
catalog and one for the uids, so the output depends on the seed only, never on the block size or
the number of worker processes. The work is vectorized per block of users; worker processes (one
per usable core) make blocks in parallel, and the parent streams them, in user order, into a
``ParquetWriter`` with ~1M-row groups.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from dlrmv4.config import SYNTHETIC_SIZES
from dlrmv4.data.yambda_schema import (
    DISLIKE,
    EVENT_TYPES,
    LIKE,
    LISTEN,
    MULTI_EVENT_SCHEMA,
    TIMESTAMP_BIN_SECONDS,
    UNDISLIKE,
    UNLIKE,
    RawFiles,
)
from dlrmv4.errors import UserError
from dlrmv4.files import check_free_space, check_writable, write_atomically
from dlrmv4.parallel import exit_with_parent, in_order, usable_cores


@dataclass(frozen=True)
class SyntheticSpec:
    users: int
    items: int
    artists: int
    albums: int
    mean_listens: int  # per user, before the cap that keeps a user's sessions inside the span
    days: int
    uid_rows: int = 100_000  # the preset's sampler.uid_rows: uids lie in [0, uid_rows), both ends used


SPECS: dict[str, SyntheticSpec] = {
    "tiny": SyntheticSpec(users=300, items=20_000, artists=1_000, albums=4_000, mean_listens=650, days=20),
    "small": SyntheticSpec(users=1_000, items=50_000, artists=2_500, albums=10_000, mean_listens=1_000, days=40),
    "medium": SyntheticSpec(users=2_500, items=200_000, artists=10_000, albums=40_000, mean_listens=2_000, days=100),
    "50m": SyntheticSpec(users=10_000, items=934_057, artists=50_000, albums=200_000, mean_listens=4_750, days=300),
    # Yambda-5B's users, catalog and span at a fifth of its events (the data path at scale).
    "1b": SyntheticSpec(
        users=1_000_000,
        items=9_390_624,
        artists=1_293_395,
        albums=3_367_692,
        mean_listens=1_000,
        days=300,
        uid_rows=1_000_001,
    ),
    # Yambda-5B's size whole: its users, catalog, span and about 4.79 B events (4.65 B listens; more
    # rows than a 32-bit index holds). 4,665 listens a user on average give 4.65 B listens at the default seed.
    "5b": SyntheticSpec(
        users=1_000_000,
        items=9_390_624,
        artists=1_293_395,
        albums=3_367_692,
        mean_listens=4_665,
        days=300,
        uid_rows=1_000_001,
    ),
}
assert tuple(SPECS) == SYNTHETIC_SIZES

ROW_GROUP_ROWS = 1 << 20
BLOCK_LISTENS = 500_000  # listens per user block: bounds memory, not the output
# Disk per listen, at most: the events and their truth take about 11 bytes a row (8 + 3 at the medium
# size), and likes, dislikes and undos add about 3 % rows to the listens.
_RAW_BYTES_PER_LISTEN_AT_MOST = 13

_CATALOG_STREAM, _USER_STREAM, _UID_STREAM = 0, 1, 2
_ZIPF_EXPONENT = 1.0
_UNMAPPED_FRACTION = 0.01
_MULTI_MAPPED_FRACTION = 0.03  # of mapped items: two earlier rows with other ids before the real one
_P_NULL_RATIO = 0.005  # listens whose played_ratio_pct is null
_P_SAME_BIN = 0.03  # a listen in the same 5-s bin as the previous one (a timestamp tie)
# Launch ramp: the span's first days run this many times slower (every gap is stretched). A day of it
# holds half an hour of listening, far fewer than 100 events, so no user builds up a tiny-preset
# history within a day of the train start (which lies inside the ramp).
_RAMP_DAYS, _RAMP_STRETCH = 3, 48
_LISTENS_SIGMA = 1.0  # lognormal sigma: Yambda's per-user p95/median ~ 5.5
_MIN_LISTENS = 5
_MAX_AFFINE = 8
_P_REPEAT = 0.3
_REPEAT_WINDOW = 30  # a repeat copies one of the user's last 30 listens
_SESSION_MEAN_LISTENS = 25
_INTRA_GAP_BINS = 12  # 1..12 bins = 5..60 s between events of a session
_MIN_SESSION_GAP_BINS = 3_600 // TIMESTAMP_BIN_SECONDS  # an hour, so a 1,800 s gap rule splits them
_SPAN_FILL = 0.6  # a user's sessions with minimal gaps fill at most this share of the span
# listen_plus logit = base + affine + repeat + organic + item quality + user bias
_PLUS_BASE, _PLUS_AFFINE, _PLUS_REPEAT, _PLUS_ORGANIC = -1.3, 1.9, 0.9, 0.6
_QUALITY_SD, _USER_BIAS_SD = 0.5, 0.5
_P_ORGANIC_CHOSEN, _P_ORGANIC_POPULAR = 0.8, 0.25
_P_LIKE_AFFINE, _P_LIKE_OTHER = 0.04, 0.013  # given listen_plus
_P_DISLIKE_AFFINE, _P_DISLIKE_OTHER = 0.003, 0.012  # given a skip
_P_UNDO = 0.1
_UNDO_MEAN_LISTENS = 200
_P_FULL, _P_REPLAY = 0.55, 0.08  # of listen_plus: exactly 100 %, or a replay 101..300 %

# Per-listen uniform columns, one row each in the (N_COLS, n) matrix a user draws.
# New columns go last: a user's earlier columns then keep their values.
(
    _C_CHOICE,
    _C_PICK_A,
    _C_PICK_B,
    _C_ORGANIC,
    _C_PLUS,
    _C_RATIO_A,
    _C_RATIO_B,
    _C_FEEDBACK,
    _C_FEEDBACK_BIN,
    _C_UNDO,
    _C_UNDO_DELAY,
    _C_BREAK,
    _C_INTRA,
    _C_INTER,
    _C_TIE,
    _C_NULL_RATIO,
    _N_COLS,
) = range(17)


TRUTH_FILE = "listen_plus_probability.parquet"
TRUTH_COLUMN = "listen_plus_probability"
TRUTH_SCHEMA = pa.schema([pa.field(TRUTH_COLUMN, pa.float32(), nullable=False)])
# The probability is of played_ratio_pct >= 50: the generator's listen_plus boundary.
TRUTH_THRESHOLD_PCT = 50


def truth_path(files: RawFiles) -> Path:
    """Where the generator's per-event listen_plus probabilities lie: beside the events file."""
    return files.multi_event.parent / TRUTH_FILE


def spec_for(size: str) -> SyntheticSpec:
    if size not in SPECS:
        raise UserError(f"unknown synthetic size {size!r}; choose one of {', '.join(SPECS)}")
    return SPECS[size]


@dataclass(frozen=True)
class _Catalog:
    item_artist: np.ndarray  # int64 per item
    item_album: np.ndarray  # int64 per item
    cum_pop: np.ndarray  # cumulative item popularity (sums to 1)
    by_artist: np.ndarray  # item ids ordered by artist
    cum_pop_by_artist: np.ndarray
    artist_lo: np.ndarray  # per artist: cumulative popularity before its first item
    artist_hi: np.ndarray
    artist_first: np.ndarray  # per artist: first/last index into by_artist
    artist_last: np.ndarray
    cum_artist_pref: np.ndarray  # how likely an artist is to be someone's favourite
    quality: np.ndarray
    track_length: np.ndarray
    artist_map: tuple[np.ndarray, np.ndarray]  # (artist_id, item_id) rows in file order
    album_map: tuple[np.ndarray, np.ndarray]


def _catalog(spec: SyntheticSpec, seed: int) -> _Catalog:
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_CATALOG_STREAM,)))
    n_items, n_albums, n_artists = spec.items, spec.albums, spec.artists
    # arange first so every album/artist is used; item 0 -> album 0 -> artist 0 keeps id 0 real.
    album_artist = np.concatenate([np.arange(n_artists), rng.integers(0, n_artists, n_albums - n_artists)])
    album_artist[1:] = rng.permutation(album_artist[1:])
    item_album = np.concatenate([np.arange(n_albums), rng.integers(0, n_albums, n_items - n_albums)])
    item_album[1:] = rng.permutation(item_album[1:])
    item_artist = album_artist[item_album]
    rank = np.concatenate([[0], 1 + rng.permutation(n_items - 1)])  # item 0 is the most popular
    pop = 1.0 / (rank + 1.0) ** _ZIPF_EXPONENT
    pop /= pop.sum()
    by_artist = np.argsort(item_artist, kind="stable")
    cum_by_artist = np.cumsum(pop[by_artist])
    counts = np.bincount(item_artist, minlength=n_artists)
    artist_last = np.cumsum(counts) - 1
    artist_first = artist_last - counts + 1
    artist_hi = cum_by_artist[artist_last]
    artist_lo = np.concatenate([[0.0], artist_hi[:-1]])
    # sqrt flattens the artist ranking so niche artists have fans too.
    pref = np.sqrt(np.bincount(item_artist, weights=pop, minlength=n_artists))
    cum_pref = np.cumsum(pref / pref.sum())
    quality = rng.normal(0.0, _QUALITY_SD, n_items)
    track_length = np.clip(rng.lognormal(np.log(200.0), 0.35, n_items), 30, 900).astype(np.uint32)
    keep = [np.flatnonzero((rng.random(n_items) >= _UNMAPPED_FRACTION) | (np.arange(n_items) == 0)) for _ in range(2)]
    artist_map = _with_last_item(_mapping_rows(rng, item_artist, keep[0], n_artists), item_artist)
    album_map = _with_last_item(_mapping_rows(rng, item_album, keep[1], n_albums), item_album)
    return _Catalog(
        item_artist,
        item_album,
        np.cumsum(pop),
        by_artist,
        cum_by_artist,
        artist_lo,
        artist_hi,
        artist_first,
        artist_last,
        cum_pref,
        quality,
        track_length,
        artist_map,
        album_map,
    )


def _mapping_rows(
    rng: np.random.Generator, item_ids: np.ndarray, kept: np.ndarray, n_ids: int
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, items) of one mapping file in file order: the kept items ascending, one row each, except a
    few items that first get two rows with other ids, one smaller and one larger in random order.

    The item's real id comes last, so only the reference's rule (the last row wins) reads it back;
    the first row, the smallest and the largest id all differ from it.
    """
    real = item_ids[kept]
    n = len(kept)
    multi = (rng.random(n) < _MULTI_MAPPED_FRACTION) & (real > 0) & (real < n_ids - 1)
    lower = (rng.random(n) * real).astype(np.int64)  # in [0, real)
    upper = real + 1 + (rng.random(n) * (n_ids - 1 - real)).astype(np.int64)  # in (real, n_ids)
    upper_first = rng.random(n) < 0.5
    rows = 1 + 2 * multi
    items = np.repeat(kept, rows)
    ids = np.empty(len(items), np.int64)
    last = np.cumsum(rows) - 1
    ids[last] = real
    m = np.flatnonzero(multi)
    ids[last[m] - 2] = np.where(upper_first, upper, lower)[m]
    ids[last[m] - 1] = np.where(upper_first, lower, upper)[m]
    return ids, items


def _with_last_item(mapping: tuple[np.ndarray, np.ndarray], item_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mapping with a row for the catalog's last item where the draw left it out: the reference
    refuses events whose items run past a mapping's largest item. Added after the draws, so every
    other row (and the data of every seed whose last item was drawn) is unchanged."""
    ids, items = mapping
    last = len(item_ids) - 1
    if items[-1] == last:
        return mapping
    return np.append(ids, item_ids[last]), np.append(items, last)


def _sample(cum: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Index drawn from a cumulative distribution; clipped against float round-off at the top."""
    return np.minimum(np.searchsorted(cum, u * cum[-1], side="right"), len(cum) - 1)


@dataclass
class _UserDraws:
    n: np.ndarray  # listens per user
    affine: np.ndarray  # (users, _MAX_AFFINE) artist ids, -1 where unused
    cum_weight: np.ndarray  # (users, _MAX_AFFINE) cumulative Dirichlet weights, 2.0 past the last used
    explore: np.ndarray
    bias: np.ndarray
    start_frac: np.ndarray
    tail_weight: np.ndarray
    u: np.ndarray  # (_N_COLS, total listens)


def _user_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_USER_STREAM, index)))


def _listen_count(rng: np.random.Generator, max_listens: int, mean_listens: int) -> int:
    """A user's listens: the first draw of the user's stream (lognormal, heavy-tailed, clipped)."""
    mu = np.log(mean_listens) - _LISTENS_SIGMA**2 / 2
    return int(np.clip(rng.lognormal(mu, _LISTENS_SIGMA), _MIN_LISTENS, max_listens))


def listen_counts(size: str, seed: int, users: range) -> np.ndarray:
    """The listens of the user indices ``users`` of a size, as ``generate`` draws them (without their events)."""
    spec = spec_for(size)
    max_listens = _max_listens(_virtual_span_bins(spec.days))
    return np.array([_listen_count(_user_rng(seed, i), max_listens, spec.mean_listens) for i in users], np.int64)


def _draw_users(users: range, seed: int, cat: _Catalog, max_listens: int, mean_listens: int) -> _UserDraws:
    m = len(users)
    n = np.empty(m, np.int64)
    affine = np.full((m, _MAX_AFFINE), -1, np.int64)
    cum_weight = np.full((m, _MAX_AFFINE), 2.0)
    explore, bias, start_frac, tail_weight = (np.empty(m) for _ in range(4))
    cols = []
    for j, index in enumerate(users):
        rng = _user_rng(seed, index)
        n[j] = _listen_count(rng, max_listens, mean_listens)
        k = int(rng.integers(1, _MAX_AFFINE + 1))
        affine[j, :k] = _sample(cat.cum_artist_pref, rng.random(k))
        cum_weight[j, : k - 1] = np.cumsum(rng.dirichlet(np.ones(k)))[:-1]
        explore[j] = rng.beta(2.0, 5.0)
        bias[j] = rng.normal(0.0, _USER_BIAS_SD)
        start_frac[j] = 0.0 if index == 0 else rng.random() ** 2  # user 0 starts the dataset at t = 0
        tail_weight[j] = rng.exponential()
        cols.append(rng.random((_N_COLS, n[j])))
    return _UserDraws(n, affine, cum_weight, explore, bias, start_frac, tail_weight, np.concatenate(cols, axis=1))


def _resolve_repeats(src: np.ndarray) -> np.ndarray:
    """Pointer jumping: follow repeat-of-a-repeat chains to the listen that chose the item."""
    while True:
        nxt = src[src]
        if np.array_equal(nxt, src):
            return src
        src = nxt


def user_ids(spec: SyntheticSpec, seed: int) -> np.ndarray:
    """uid of each user index, ascending: sparse in [0, uid_rows), with 0 and uid_rows - 1 present."""
    top = spec.uid_rows - 1
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(_UID_STREAM,)))
    inner = np.sort(rng.choice(top - 1, size=spec.users - 2, replace=False)) + 1  # in [1, top)
    return np.concatenate([[0], inner, [top]]).astype(np.int64)


def ramp_bins(span_bins: int) -> int:
    """Virtual bins of the launch ramp; it fills ``ramp_bins * _RAMP_STRETCH`` real bins (at most a quarter
    of the span)."""
    return min(_RAMP_DAYS * 86_400 // TIMESTAMP_BIN_SECONDS, span_bins // 4) // _RAMP_STRETCH


def launch_ramp_seconds(days: int) -> int:
    """Real length of the launch ramp of a span of ``days`` days."""
    return ramp_bins(days * 86_400 // TIMESTAMP_BIN_SECONDS) * _RAMP_STRETCH * TIMESTAMP_BIN_SECONDS


def _launch_time(ts: np.ndarray, ramp: int) -> np.ndarray:
    """Real bins of virtual bins ``ts``: the first ``ramp`` virtual bins are stretched ``_RAMP_STRETCH`` times.

    Monotone with slope >= 1, so no gap shrinks: ties stay ties and sessions stay an hour apart.
    """
    return np.where(ts < ramp, ts * _RAMP_STRETCH, ts + ramp * (_RAMP_STRETCH - 1))


def _block_events(
    users: range,
    uid_of: np.ndarray,
    seed: int,
    cat: _Catalog,
    span_bins: int,
    ramp: int,
    max_listens: int,
    mean_listens: int,
) -> dict[str, np.ndarray]:
    """Events of the users ``users`` (indices) as numpy columns (``_as_table`` makes the parquet
    table); ``span_bins`` is the virtual span (the ramp compressed)."""
    d = _draw_users(users, seed, cat, max_listens, mean_listens)
    u = d.u
    total = int(d.n.sum())
    user = np.repeat(np.arange(len(users)), d.n)
    first = np.cumsum(d.n) - d.n
    pos = np.arange(total) - first[user]

    # Item choice: repeat / affine artist / global popularity.
    choice = u[_C_CHOICE]
    popular = choice >= 1.0 - d.explore[user]
    repeat = (choice < _P_REPEAT * (1.0 - d.explore[user])) & (pos > 0)
    slot = (d.cum_weight[user] < u[_C_PICK_A][:, None]).sum(axis=1)
    artist = d.affine[user, slot]
    lo, hi = cat.artist_lo[artist], cat.artist_hi[artist]
    in_artist = np.searchsorted(cat.cum_pop_by_artist, lo + u[_C_PICK_B] * (hi - lo), side="right")
    item = cat.by_artist[np.clip(in_artist, cat.artist_first[artist], cat.artist_last[artist])]
    item[popular] = _sample(cat.cum_pop, u[_C_PICK_B][popular])
    back = 1 + (u[_C_PICK_A] * np.minimum(pos, _REPEAT_WINDOW)).astype(np.int64)
    src = _resolve_repeats(np.where(repeat, np.arange(total) - back, np.arange(total)))
    item = item[src]

    # Outcome of the listen.
    affine = (d.affine[user] == cat.item_artist[item][:, None]).any(axis=1)
    organic = u[_C_ORGANIC] < np.where(popular, _P_ORGANIC_POPULAR, _P_ORGANIC_CHOSEN)
    logit = (
        _PLUS_BASE
        + _PLUS_AFFINE * affine
        + _PLUS_REPEAT * repeat
        + _PLUS_ORGANIC * organic
        + cat.quality[item]
        + d.bias[user]
    )
    p_plus = 1.0 / (1.0 + np.exp(-logit))
    plus = u[_C_PLUS] < p_plus
    ra, rb = u[_C_RATIO_A], u[_C_RATIO_B]
    ratio = np.where(
        ra < _P_REPLAY,
        101 + (199 * rb**2).astype(np.int64),
        np.where(ra < _P_REPLAY + _P_FULL, 100, 50 + (50 * rb).astype(np.int64)),
    )
    ratio = np.where(plus, ratio, np.minimum(49, (50 * ra**1.5).astype(np.int64)))

    # Time: sessions of 5-60 s steps (a few 0: ties); the user's slack is spread over the session gaps,
    # in virtual time that the launch ramp then stretches.
    brk = (u[_C_BREAK] < 1.0 / _SESSION_MEAN_LISTENS) & (pos > 0)
    intra = np.where(u[_C_TIE] < _P_SAME_BIN, 0, 1 + (u[_C_INTRA] * _INTRA_GAP_BINS).astype(np.int64))
    gap = np.where(brk, _MIN_SESSION_GAP_BINS, np.where(pos > 0, intra, 0))
    weight = np.where(brk, -np.log1p(-u[_C_INTER]), 0.0)
    needed = np.bincount(user, weights=gap, minlength=len(users))
    slack = np.maximum(span_bins - 1 - needed, 0)
    start = np.floor(slack * d.start_frac)
    spread = (slack - start) / (np.bincount(user, weights=weight, minlength=len(users)) + d.tail_weight)
    gap = gap + np.floor(weight * spread[user]).astype(np.int64)
    gap[first] = start.astype(np.int64)
    cs = np.cumsum(gap)
    ts = _launch_time(cs - (cs[first] - gap[first])[user], ramp)

    # Feedback: likes after some listen_plus, dislikes after some skips, rare undo later on.
    fb = u[_C_FEEDBACK]
    like = plus & (fb < np.where(affine, _P_LIKE_AFFINE, _P_LIKE_OTHER))
    dislike = ~plus & (fb < np.where(affine, _P_DISLIKE_AFFINE, _P_DISLIKE_OTHER))
    fb_idx = np.flatnonzero(like | dislike)
    fb_ts = ts[fb_idx] + (u[_C_FEEDBACK_BIN][fb_idx] < 0.5)
    undo = u[_C_UNDO][fb_idx] < _P_UNDO
    undo_idx = fb_idx[undo]
    last = (first + d.n - 1)[user[undo_idx]]
    delay = 1 + np.floor(-np.log1p(-u[_C_UNDO_DELAY][undo_idx]) * _UNDO_MEAN_LISTENS).astype(np.int64)
    undo_at = np.minimum(undo_idx + delay, last)
    undo_ts = np.maximum(ts[undo_at], fb_ts[undo])

    listen_idx = np.arange(total)
    src_idx = np.concatenate([listen_idx, fb_idx, undo_idx])  # the listen each row is about
    etype = np.concatenate(
        [np.full(total, LISTEN), np.where(like[fb_idx], LIKE, DISLIKE), np.where(like[undo_idx], UNLIKE, UNDISLIKE)]
    )
    row_ts = np.concatenate([ts, fb_ts, undo_ts])
    # Ties at one timestamp keep generation order: a listen, then its like, then an undo.
    gen = np.concatenate([4 * listen_idx, 4 * fb_idx + 1, 4 * undo_at + 2])
    row_user = user[src_idx]
    order = np.lexsort((gen, row_ts, row_user))
    src_idx, etype, row_ts, row_user = src_idx[order], etype[order], row_ts[order], row_user[order]
    is_listen = etype == LISTEN
    row_item = item[src_idx]
    return {
        "uid": uid_of[users.start + row_user].astype(np.uint32),
        "item_id": row_item.astype(np.uint32),
        "timestamp": (row_ts * TIMESTAMP_BIN_SECONDS).astype(np.uint32),
        "is_organic": organic[src_idx].astype(np.uint8),
        "event_type": etype.astype(np.int8),
        "played_ratio_pct": ratio[src_idx].astype(np.uint16),
        "ratio_null": ~is_listen | (u[_C_NULL_RATIO][src_idx] < _P_NULL_RATIO),
        "track_length_seconds": cat.track_length[row_item],
        "length_null": ~is_listen,
        TRUTH_COLUMN: np.where(is_listen, p_plus[src_idx], np.nan).astype(np.float32),
    }


def _as_table(c: dict[str, np.ndarray]) -> pa.Table:
    return pa.Table.from_arrays(
        [
            pa.array(c["uid"]),
            pa.array(c["item_id"]),
            pa.array(c["timestamp"]),
            pa.array(c["is_organic"]),
            pa.DictionaryArray.from_arrays(pa.array(c["event_type"]), pa.array(EVENT_TYPES, pa.string())),
            pa.array(c["played_ratio_pct"], mask=c["ratio_null"]),
            pa.array(c["track_length_seconds"], mask=c["length_null"]),
        ],
        schema=MULTI_EVENT_SCHEMA,
    )


# A worker process's generation arguments, set once when it starts (``_start_worker``): forked, it
# shares the parent's catalog (hundreds of MB at the 1b size), which would cost a copy per task
# if it travelled with every block's request.
_WORKER_ARGS: tuple | None = None


def _start_worker(args: tuple, parent: int) -> None:
    global _WORKER_ARGS
    exit_with_parent(parent)
    _WORKER_ARGS = args


def _worker_block(users: range) -> dict[str, np.ndarray]:
    assert _WORKER_ARGS is not None
    uid_of, seed, cat, span_bins, ramp, max_listens, mean_listens = _WORKER_ARGS
    return _block_events(users, uid_of, seed, cat, span_bins, ramp, max_listens, mean_listens)


def _blocks_in_order(blocks: list[range], args: tuple, workers: int) -> Generator[dict[str, np.ndarray], None, None]:
    """Every block's events in block order, made by ``workers`` processes (in this one for 1), at
    most two blocks per worker ahead of the writer."""
    if workers <= 1 or len(blocks) <= 1:
        for users in blocks:
            yield _block_events(users, *args)
        return
    # fork: the workers share the catalog's pages with this process instead of rebuilding them.
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(args, os.getpid())
    ) as pool:
        yield from in_order(pool, _worker_block, blocks, 2 * workers)


def _write_mapping(path: Path, id_name: str, ids: np.ndarray, items: np.ndarray) -> None:
    table = pa.table(
        {id_name: pa.array(ids.astype(np.uint32)), "item_id": pa.array(items.astype(np.uint32))},
        schema=pa.schema(
            [pa.field(id_name, pa.uint32(), nullable=False), pa.field("item_id", pa.uint32(), nullable=False)]
        ),
    )
    write_atomically(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))


def _truth_table(c: dict[str, np.ndarray]) -> pa.Table:
    return pa.Table.from_arrays([pa.array(c[TRUTH_COLUMN])], schema=TRUTH_SCHEMA)


def _write_events(tmp: Path, tmp_truth: Path, blocks, bar: tqdm) -> None:
    """The events and, row for row in the same row groups, their truth."""
    pending: list[tuple[pa.Table, pa.Table]] = []
    buffered = 0
    with (
        pq.ParquetWriter(tmp, MULTI_EVENT_SCHEMA, compression="zstd") as writer,
        pq.ParquetWriter(tmp_truth, TRUTH_SCHEMA, compression="zstd") as truth_writer,
    ):

        def write(events: pa.Table, truth: pa.Table) -> None:
            writer.write_table(events, row_group_size=ROW_GROUP_ROWS)
            truth_writer.write_table(truth, row_group_size=ROW_GROUP_ROWS)

        # Row groups are cut from the concatenated stream, so they do not depend on the block size.
        for columns in blocks:
            pending.append((_as_table(columns), _truth_table(columns)))
            buffered += pending[-1][0].num_rows
            if buffered >= ROW_GROUP_ROWS:
                events, truth = (pa.concat_tables(part) for part in zip(*pending))
                full = buffered - buffered % ROW_GROUP_ROWS
                write(events.slice(0, full), truth.slice(0, full))
                pending, buffered = [(events.slice(full), truth.slice(full))], buffered - full
            bar.update(1)
        if buffered:
            write(*(pa.concat_tables(part) for part in zip(*pending)))


def _virtual_span_bins(days: int) -> int:
    """The span's bins in the users' virtual time: the launch ramp compressed (it stretches them back)."""
    span_bins = days * 86_400 // TIMESTAMP_BIN_SECONDS
    return span_bins - ramp_bins(span_bins) * (_RAMP_STRETCH - 1)


def _max_listens(span_bins: int) -> int:
    """The listen cap that keeps a user's sessions, at minimal gaps, inside ``_SPAN_FILL`` of the span."""
    per_listen = (1 + _INTRA_GAP_BINS) / 2 + _MIN_SESSION_GAP_BINS / _SESSION_MEAN_LISTENS
    return max(_MIN_LISTENS, int(_SPAN_FILL * span_bins / per_listen))


def _generation_args(spec: SyntheticSpec, seed: int, days: int) -> tuple:
    """What ``_block_events`` takes besides the users: (uids, seed, catalog, span, ramp, listen cap, mean listens)."""
    span_bins = _virtual_span_bins(days)
    ramp = ramp_bins(days * 86_400 // TIMESTAMP_BIN_SECONDS)
    return (
        user_ids(spec, seed),
        seed,
        _catalog(spec, seed),
        span_bins,
        ramp,
        _max_listens(span_bins),
        spec.mean_listens,
    )


def users_events(size: str, seed: int, users: range) -> dict[str, np.ndarray]:
    """The events (as numpy columns, ``TRUTH_COLUMN`` among them) of the user indices ``users`` of a size:
    the same rows ``generate`` writes for them, without writing the rest."""
    spec = spec_for(size)
    if not 0 <= users.start <= users.stop <= spec.users:
        raise UserError(f"users {users.start}..{users.stop} outside the {spec.users:,} users of synthetic {size}")
    return _block_events(users, *_generation_args(spec, seed, spec.days))


def generate(
    root: Path, size: str, seed: int, *, num_days: int | None = None, progress: bool = True, workers: int = 0
) -> RawFiles:
    """Write the synthetic raw files for ``size`` under ``root`` (hub layout) and return their paths;
    ``workers`` processes make the events (0: one per usable core; the files are the same for any)."""
    spec = spec_for(size)
    days = spec.days if num_days is None else num_days
    if days < 1:
        raise UserError(f"synthetic num_days must be at least 1, got {days}")
    files = RawFiles.under(Path(root), size)
    for path in (files.multi_event.parent, files.artist_mapping.parent, files.album_mapping.parent):
        check_writable(path, "synthetic data directory")
    check_free_space(
        files.multi_event.parent,
        spec.users * spec.mean_listens * _RAW_BYTES_PER_LISTEN_AT_MOST,
        f"generating synthetic {size} (about {spec.users * spec.mean_listens:,} listens)",
    )
    # A stale events file must not pair with freshly written mappings if this run fails.
    files.multi_event.unlink(missing_ok=True)
    truth = truth_path(files)
    truth.unlink(missing_ok=True)
    args = _generation_args(spec, seed, days)
    cat = args[2]
    _write_mapping(files.artist_mapping, "artist_id", *cat.artist_map)
    _write_mapping(files.album_mapping, "album_id", *cat.album_map)
    step = max(1, BLOCK_LISTENS // spec.mean_listens)
    users = [range(s, min(s + step, spec.users)) for s in range(0, spec.users, step)]
    # closing: a failed write stops the workers at once.
    with (
        contextlib.closing(_blocks_in_order(users, args, workers or usable_cores())) as blocks,
        tqdm(total=len(users), desc=f"synthetic {size}", unit="block", disable=not progress) as bar,
    ):
        # Both files get their names only once both are whole (a crash between the two renames leaves
        # the events without their truth: the store then records no ceiling, and says why).
        write_atomically(
            truth,
            lambda tmp_truth: write_atomically(
                files.multi_event, lambda tmp: _write_events(tmp, tmp_truth, blocks, bar)
            ),
        )
    return files
