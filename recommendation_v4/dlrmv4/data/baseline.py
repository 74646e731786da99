"""A simple baseline for a store's holdout: logistic regression on seven counts of the anchor and the
user's recent events, fitted on the train windows.

It says how much of the holdout's signal needs no sequence model, on any store (real or synthetic).
The features of an anchor (a listen at train event index ``e``) look only at the events
before it, or at counts over the train windows with the anchor's own label left out:

  user_rate     log-odds of listen_plus among the user's last ``HISTORY`` listens (smoothed)
  artist_count  log(1 + listens of the anchor's artist among them)
  artist_rate   log-odds of listen_plus among those (smoothed)
  repeat        the anchor's item among the user's last ``REPEAT_WINDOW`` listens
  organic       the anchor's is_organic
  item_rate     log-odds of listen_plus over the item's listens before the holdout (smoothed)
  item_count    log(1 + those listens)

Fitted by Newton's method on up to ``FIT_SAMPLES`` anchors drawn from the train windows (seed 0), then
scored on every holdout anchor. Deterministic; memory is a few arrays of the anchors sampled.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from dlrmv4.data.rank_auc import rank_auc
from dlrmv4.data.store import Store
from dlrmv4.data.yambda_schema import ACTION_LISTEN_PLUS, LISTEN
from dlrmv4.parallel import parallel_map, usable_cores

HISTORY = 200
REPEAT_WINDOW = 30
FIT_SAMPLES = 300_000
ITEM_PRIOR_LISTENS = 10.0  # pseudo-listens at the train windows' mean rate in an item's rate
L2 = 1e-4
FEATURES = ("user_rate", "artist_count", "artist_rate", "repeat", "organic", "item_rate", "item_count")
EVENTS_PER_PASS = 4_000_000


@dataclass(frozen=True)
class BaselineResult:
    auc: float | None
    fitted_on: int


def _log_odds(hits: np.ndarray, total: np.ndarray) -> np.ndarray:
    return np.log((hits + 1.0) / (total - hits + 1.0))


def _item_listens(store: Store, before_ts: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """(listens, listen_plus) per item over the train events before ``before_ts``.

    Each pass's counts are added into the totals as soon as it ends: held until all had ended, the
    per-pass arrays (two of the item count each) would grow with the events (at synthetic-1b, 257
    passes of 2 x 9.4 M int64, 38 GB). Integer sums: the same totals in any order.
    """
    train, num_items = store.train, len(store.popularity)
    total = train.num_events
    listens, plus = np.zeros(num_items, np.int64), np.zeros(num_items, np.int64)
    lock = threading.Lock()

    def count(start: int) -> None:
        stop = min(total, start + EVENTS_PER_PASS)
        listen = (np.asarray(train.event_code[start:stop]) == LISTEN) & (
            np.asarray(train.timestamp[start:stop]) < before_ts
        )
        items = np.asarray(train.item_id[start:stop])[listen]
        hit = np.asarray(train.action[start:stop])[listen] == ACTION_LISTEN_PLUS
        part_listens, part_plus = np.bincount(items, minlength=num_items), np.bincount(items[hit], minlength=num_items)
        with lock:  # in place: the totals are the enclosing function's
            np.add(listens, part_listens, out=listens)
            np.add(plus, part_plus, out=plus)

    parallel_map(count, range(0, total, EVENTS_PER_PASS), workers)
    return listens, plus


def anchor_features(
    store: Store, anchors: np.ndarray, item_listens: np.ndarray, item_plus: np.ndarray, leave_out: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(features [n, 7] in ``FEATURES`` order, labels [n]) of the anchors at train event indices ``anchors``;
    ``leave_out``: the anchors' own listens are inside the item counts and are taken out."""
    train = store.train
    offsets = np.asarray(train.user_offsets)
    start = offsets[np.searchsorted(offsets, anchors, side="right") - 1]
    item = np.asarray(train.item_id[anchors]).astype(np.int64)
    label = np.asarray(train.action[anchors]) == ACTION_LISTEN_PLUS
    artist_of = np.asarray(store.artist_id)
    artist = artist_of[item]
    n = len(anchors)
    listens, plus, same, same_plus = (np.zeros(n, np.int64) for _ in range(4))
    repeat = np.zeros(n, bool)
    for lag in range(1, HISTORY + 1):
        valid = anchors - lag >= start
        at = np.where(valid, anchors - lag, anchors)
        listen = valid & (np.asarray(train.event_code[at]) == LISTEN)
        hit = listen & (np.asarray(train.action[at]) == ACTION_LISTEN_PLUS)
        seen = np.asarray(train.item_id[at]).astype(np.int64)
        match = listen & (artist_of[seen] == artist)
        listens += listen
        plus += hit
        same += match
        same_plus += match & hit
        if lag <= REPEAT_WINDOW:
            repeat |= listen & (seen == item)
    own = np.ones(n) if leave_out else np.zeros(n)
    item_n = item_listens[item] - own
    item_hits = item_plus[item] - own * label
    mean_rate = item_plus.sum() / max(item_listens.sum(), 1)
    item_rate = (item_hits + ITEM_PRIOR_LISTENS * mean_rate) / (item_n + ITEM_PRIOR_LISTENS)
    features = np.stack(
        [
            _log_odds(plus, listens),
            np.log1p(same),
            _log_odds(same_plus, same),
            repeat.astype(np.float64),
            np.asarray(train.is_organic[anchors]).astype(np.float64),
            np.log(item_rate / (1.0 - item_rate)),
            np.log1p(item_n),
        ],
        axis=1,
    )
    return features, label


def fit_logistic(x: np.ndarray, y: np.ndarray, iterations: int = 50) -> np.ndarray:
    """Weights (intercept last) of an L2-regularised logistic regression, by Newton's method."""
    design = np.hstack([x, np.ones((len(x), 1))])
    w = np.zeros(design.shape[1])
    ridge = L2 * np.eye(len(w))
    ridge[-1, -1] = 0.0  # the intercept is not shrunk
    for _ in range(iterations):
        p = 1.0 / (1.0 + np.exp(-(design @ w)))
        gradient = design.T @ (p - y) / len(y) + ridge @ w
        hessian = (design.T * (p * (1.0 - p))) @ design / len(y) + ridge
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return w


def holdout_baseline(store: Store, workers: int = 0) -> BaselineResult:
    """The baseline fitted on the train windows and its AUC on the holdout window."""
    workers = workers or usable_cores()
    last = store.num_windows - 1
    holdout = np.asarray(store.window_anchors(last))
    train_anchors = np.asarray(store.anchor_event_index[: store.window_offsets[last]])
    holdout_start = store.window_start_ts + last * store.window_seconds
    item_listens, item_plus = _item_listens(store, holdout_start, workers)
    rng = np.random.default_rng(0)
    fit_rows = np.sort(rng.choice(len(train_anchors), size=min(FIT_SAMPLES, len(train_anchors)), replace=False))
    x_fit, y_fit = anchor_features(store, train_anchors[fit_rows], item_listens, item_plus, leave_out=True)
    mean, scale = x_fit.mean(axis=0), x_fit.std(axis=0)
    scale[scale == 0] = 1.0
    w = fit_logistic((x_fit - mean) / scale, y_fit.astype(np.float64))
    x_eval, y_eval = anchor_features(store, holdout, item_listens, item_plus, leave_out=False)
    auc = rank_auc(((x_eval - mean) / scale) @ w[:-1], y_eval) if len(holdout) else None
    return BaselineResult(auc=auc, fitted_on=len(fit_rows))
