"""The holdout's best possible AUC on synthetic data: the AUC of the generator's true listen_plus
probabilities over the holdout window's anchors.

No model can beat it on average: the true probability of each label, given everything the generator
drew, is the Bayes-optimal score. The generator writes the probabilities row for row beside the
events (``synthetic.TRUTH_FILE``); a store's train events are the raw rows inside the train span (and
not dropped by the null-ratio policy), in file order, so one pass over the raw timestamps finds the
raw row of each holdout anchor (its item and time are checked against the store's). Memory is one
row group at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dlrmv4.config import PreprocessConfig
from dlrmv4.data.rank_auc import rank_auc
from dlrmv4.data.store import Store
from dlrmv4.data.synthetic import TRUTH_COLUMN, TRUTH_THRESHOLD_PCT
from dlrmv4.data.yambda_schema import ACTION_LISTEN_PLUS, EVENT_TYPES, LISTEN, open_parquet
from dlrmv4.errors import UserError


def ceiling_unavailable(cfg: PreprocessConfig) -> str | None:
    """Why the generator's probabilities do not score this store's labels, or None when they do."""
    if cfg.listen_threshold_pct != TRUTH_THRESHOLD_PCT:
        return (
            f"the generator's probabilities are of played_ratio_pct >= {TRUTH_THRESHOLD_PCT}, the store's labels "
            f"of >= {cfg.listen_threshold_pct}"
        )
    return None


def holdout_truth(store: Store, events: Path, truth: Path, cfg: PreprocessConfig) -> np.ndarray:
    """The true listen_plus probability of each holdout anchor, in the window's order."""
    pf, tf = open_parquet(events), open_parquet(truth)
    groups = [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
    if groups != [tf.metadata.row_group(i).num_rows for i in range(tf.num_row_groups)]:
        raise UserError(f"{truth}: its row groups do not match {events}'s (regenerate the synthetic data)")
    anchors = np.asarray(store.window_anchors(store.num_windows - 1))
    split = store.meta["split"]
    drop_null = cfg.null_ratio_policy == "drop"
    columns = ["timestamp", "event_type", "played_ratio_pct"] if drop_null else ["timestamp"]
    found = np.empty(len(anchors), np.float64)
    raw_item = np.empty(len(anchors), np.int64)  # the raw rows' own item and time: checked against the store's
    raw_ts = np.empty(len(anchors), np.int64)
    base = done = 0  # train events before this row group; anchors placed so far
    for group in range(len(groups)):
        table = pf.read_row_group(group, columns=columns)
        ts = table.column("timestamp").to_numpy()
        keep = (ts >= split["train_start"]) & (ts < split["train_end"])
        if drop_null:
            listen = pc.equal(table.column("event_type").cast(pa.string()), EVENT_TYPES[LISTEN])
            keep &= ~(
                listen.to_numpy(zero_copy_only=False)
                & table.column("played_ratio_pct").is_null().to_numpy(zero_copy_only=False)
            )
        rows = np.flatnonzero(keep)
        upto = int(np.searchsorted(anchors, base + len(rows)))
        if upto > done:
            probability = tf.read_row_group(group, columns=[TRUTH_COLUMN]).column(0).to_numpy()
            at = rows[anchors[done:upto] - base]
            found[done:upto] = probability[at]
            raw_item[done:upto] = pf.read_row_group(group, columns=["item_id"]).column(0).to_numpy()[at]
            raw_ts[done:upto] = ts[at]
            done = upto
        base += len(rows)
    lined_up = (
        done == len(anchors)
        and base == store.train.num_events
        and np.isfinite(found).all()
        and np.array_equal(raw_item, np.asarray(store.train.item_id[anchors]))
        and np.array_equal(raw_ts, np.asarray(store.train.timestamp[anchors]))
    )
    if not lined_up:
        raise UserError(
            f"{truth} does not line up with the store's train events (regenerate the synthetic data "
            "and preprocess it again)"
        )
    return found


def holdout_ceiling(store: Store, events: Path, truth: Path, cfg: PreprocessConfig) -> float | None:
    """AUC of the true probabilities over the holdout's anchors (None: the holdout has one class only)."""
    anchors = np.asarray(store.window_anchors(store.num_windows - 1))
    labels = np.asarray(store.train.action[anchors]) == ACTION_LISTEN_PLUS
    return rank_auc(holdout_truth(store, events, truth, cfg), labels)
