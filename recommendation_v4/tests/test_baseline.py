"""The baseline's per-item listen counts (data/baseline.py): exact, and in memory that does not grow
with the number of passes over the train events."""

from __future__ import annotations

import tracemalloc

import numpy as np
from store_factory import random_store

from dlrmv4.data import baseline
from dlrmv4.data.store import open_store
from dlrmv4.data.yambda_schema import ACTION_LISTEN_PLUS, LISTEN


def test_item_listens_are_exact_and_do_not_hold_every_pass(tmp_path, monkeypatch):
    num_items = 200_000
    store = open_store(
        random_store(tmp_path / "store", seed=5, lengths=[2_000] * 50, num_items=num_items, num_windows=5)
    )
    train = store.train
    before = store.window_start_ts + 4 * store.window_seconds
    listen = (np.asarray(train.event_code) == LISTEN) & (np.asarray(train.timestamp) < before)
    items = np.asarray(train.item_id)[listen]
    plus = np.asarray(train.action)[listen] == ACTION_LISTEN_PLUS
    expected = np.bincount(items, minlength=num_items), np.bincount(items[plus], minlength=num_items)

    monkeypatch.setattr(baseline, "EVENTS_PER_PASS", 1_000)  # 100 passes, each with two item-sized counts
    passes = -(-train.num_events // baseline.EVENTS_PER_PASS)
    per_pass = 2 * num_items * 8
    for workers in (1, 2):
        tracemalloc.start()
        try:
            listens, hits = baseline._item_listens(store, before, workers)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        np.testing.assert_array_equal(listens, expected[0])
        np.testing.assert_array_equal(hits, expected[1])
        # The totals and a pass per thread at a time, not one per pass (which took passes x per_pass).
        assert peak < (2 + 2 * workers) * per_pass < passes * per_pass / 10, (workers, peak)
