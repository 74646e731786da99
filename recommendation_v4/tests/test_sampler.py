"""The fast sampler against a plain-Python reference of docs/data.md, on random stores."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from reference_sampler import reference_sample
from store_factory import random_store

from dlrmv4.config import SamplerConfig
from dlrmv4.data.batch import BATCH_DTYPES, JaggedBatch, TorchJaggedBatch
from dlrmv4.data.sampler import build_batch, history_lengths, pack_item_sides
from dlrmv4.data.store import open_store
from dlrmv4.errors import UserError


def assert_same(a: JaggedBatch, b: JaggedBatch) -> None:
    for name in BATCH_DTYPES:
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def assert_matches_reference(store, batch: JaggedBatch, anchors: np.ndarray, cfg: SamplerConfig) -> None:
    batch.validate()
    assert_same(batch, build_batch(store, anchors, cfg, item_sides=pack_item_sides(store)))
    assert batch.anchor_index.tolist() == anchors.tolist()
    for b, g in enumerate(anchors.tolist()):
        ref = reference_sample(store, g, cfg)
        s, e = batch.history_offsets[b], batch.history_offsets[b + 1]
        assert batch.history_item_id[s:e].tolist() == ref["items"], g
        assert batch.history_artist_id[s:e].tolist() == ref["artists"], g
        assert batch.history_album_id[s:e].tolist() == ref["albums"], g
        assert batch.history_action[s:e].tolist() == ref["actions"], g
        assert batch.history_timestamp[s:e].tolist() == ref["stamps"], g
        assert batch.contextual_ids[b].tolist() == ref["ctx"], g
        got = (
            batch.candidate_item_id[b],
            batch.candidate_artist_id[b],
            batch.candidate_album_id[b],
            batch.candidate_timestamp[b],
            batch.query_time[b],
            batch.label[b],
        )
        want = (ref["cand"], ref["cand_artist"], ref["cand_album"], ref["cand_ts"], ref["query_time"], ref["label"])
        assert [float(x) for x in got] == [float(x) for x in want], g


# (lengths, per_pool, scan_window, action_probs): cover tiny users, scan windows cut by the user
# start, like-heavy mixes, pools that under-fill and pools that overflow the window.
CASES = [
    ([1, 2, 3, 50, 0, 400, 7], 4, 30, (0.6, 0.02, 0.36, 0.02)),
    ([300, 5, 900], 40, 200, (0.3, 0.3, 0.3, 0.1)),
    ([120, 60], 100, 1_000, (0.61, 0.02, 0.36, 0.01)),
    ([1_000, 1_500], 7, 25, (0.0, 0.0, 0.5, 0.5)),
    ([2_000], 1, 1, (0.5, 0.2, 0.2, 0.1)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fast_equals_reference(tmp_path, case):
    lengths, per_pool, scan_window, probs = CASES[case]
    store = open_store(
        random_store(tmp_path / "s", seed=case, lengths=lengths, num_items=500, item_table_size=400, action_probs=probs)
    )
    cfg = SamplerConfig(max_seq_len=3 * per_pool + 9, scan_window=scan_window)
    assert cfg.per_pool_length == per_pool
    rng = np.random.default_rng(100 + case)
    offsets = np.asarray(store.train.user_offsets)
    nonempty = np.diff(offsets) > 0
    starts, ends = offsets[:-1][nonempty], offsets[1:][nonempty]
    # Random events, every user's first event (empty history) and events near the user start.
    near_start = np.minimum(starts + rng.integers(0, 5, len(starts)), ends - 1)
    anchors = np.concatenate([rng.integers(0, offsets[-1], 60), starts, near_start])
    batch = build_batch(store, anchors, cfg)
    assert (batch.history_lengths[np.isin(anchors, starts)] == 0).all()
    assert_matches_reference(store, batch, anchors, cfg)
    # The counts alone (balanced rank slicing): equal to the batch's, for random and user-major runs.
    assert history_lengths(store, anchors, cfg).tolist() == batch.history_lengths.tolist()
    runs = np.arange(offsets[-1])[rng.integers(0, offsets[-1]) :][:50]
    assert history_lengths(store, runs, cfg).tolist() == build_batch(store, runs, cfg).history_lengths.tolist()


def test_store_anchors_and_pool_caps(tmp_path):
    store = open_store(random_store(tmp_path / "s", seed=7, lengths=[3_000, 2_500], min_history=1_000))
    cfg = SamplerConfig(max_seq_len=3 * 200 + 9, scan_window=2_000)
    anchors = np.asarray(store.window_anchors(2))[:40]
    batch = build_batch(store, anchors, cfg)
    assert_matches_reference(store, batch, anchors, cfg)
    assert (store.train.event_code[anchors] == 0).all()
    for b in range(batch.num_samples):
        acts = batch.history_action[batch.history_offsets[b] : batch.history_offsets[b + 1]]
        counts = {bit: int((acts == bit).sum()) for bit in (1, 2, 4)}
        assert counts[1] == counts[4] == 200 and counts[2] < 200  # likes (2 %) under-fill
        assert set(np.unique(acts).tolist()) <= {1, 2, 4}
    assert batch.max_history_length <= cfg.history_length


def test_wide_ids_round_trip(tmp_path):
    # uid, artist and album ids use all 32 bits (the crosses hash them as int64, nothing is packed).
    store = open_store(
        random_store(
            tmp_path / "s", seed=5, lengths=[300, 400], num_artists=2**32 - 1, num_albums=2**32 - 1, uid_limit=2**32 - 1
        )
    )
    cfg = SamplerConfig(max_seq_len=90, scan_window=150, uid_rows=2**32)
    anchors = np.asarray(store.anchor_event_index)[::23]
    assert_matches_reference(store, build_batch(store, anchors, cfg), anchors, cfg)


def test_history_is_strictly_causal_and_in_time_order(tmp_path):
    store = open_store(random_store(tmp_path / "s", seed=3, lengths=[500, 800]))
    cfg = SamplerConfig(max_seq_len=129, scan_window=300)
    anchors = np.asarray(store.anchor_event_index)[::17]
    batch = build_batch(store, anchors, cfg)
    for b in range(batch.num_samples):
        stamps = batch.history_timestamp[batch.history_offsets[b] : batch.history_offsets[b + 1]]
        assert (np.diff(stamps) >= 0).all()
        assert (stamps <= batch.candidate_timestamp[b]).all()


def test_empty_batch_and_bad_anchor(tmp_path):
    store = open_store(random_store(tmp_path / "s", seed=0, lengths=[10]))
    cfg = SamplerConfig(max_seq_len=30, scan_window=5)
    batch = build_batch(store, np.zeros(0, dtype=np.int64), cfg)
    batch.validate()
    assert batch.num_samples == 0 and batch.total_tokens == 0 and batch.max_history_length == 0
    with pytest.raises(ValueError, match="anchor indices"):
        build_batch(store, np.array([10]), cfg)


def test_to_torch_twin(tmp_path):
    store = open_store(random_store(tmp_path / "s", seed=0, lengths=[200, 300]))
    cfg = SamplerConfig(max_seq_len=60, scan_window=100)
    batch = build_batch(store, np.asarray(store.anchor_event_index)[:9], cfg)
    tb = batch.to_torch()
    assert isinstance(tb, TorchJaggedBatch)
    names = list(BATCH_DTYPES)
    assert [f.name for f in dataclasses.fields(JaggedBatch)] == names
    assert [f.name for f in dataclasses.fields(TorchJaggedBatch)][: len(names)] == names
    for name, dtype in BATCH_DTYPES.items():
        t = getattr(tb, name)
        assert t.dtype == torch.from_numpy(np.zeros(1, dtype)).dtype
        assert np.array_equal(t.numpy(), getattr(batch, name))
    assert (tb.num_samples, tb.max_history_length, tb.total_tokens) == (
        batch.num_samples,
        batch.max_history_length,
        batch.total_tokens,
    )
    assert int(tb.history_offsets[-1]) == tb.total_tokens == int(tb.history_lengths.sum())


def test_raw_uid_at_the_table_edge(tmp_path):
    store = open_store(random_store(tmp_path / "s", seed=4, lengths=[200, 300, 250]))
    uids = np.asarray(store.train.user_ids)  # sorted: the last user has the largest uid
    last_start = int(store.train.user_offsets[-2])
    all_anchors = np.asarray(store.anchor_event_index)
    anchors = np.concatenate([all_anchors[::19], all_anchors[all_anchors >= last_start][:3]])
    edge = SamplerConfig(max_seq_len=39, scan_window=100)
    edge = dataclasses.replace(edge, uid_rows=int(uids.max()) + 1)  # the largest uid is the last row
    batch = build_batch(store, anchors, edge)
    assert_matches_reference(store, batch, anchors, edge)
    assert batch.contextual_ids[:, 0].max() == uids.max()
    small = dataclasses.replace(edge, uid_rows=int(uids.max()))
    top = int(uids.max())
    with pytest.raises(UserError, match=rf"uid {top} does not fit the uid table of {top:,} rows"):
        build_batch(store, anchors, small)
    with pytest.raises(UserError):
        reference_sample(store, int(anchors[-1]), small)
    earlier = anchors[anchors < last_start]  # the other users' uids still fit
    assert build_batch(store, earlier, small).num_samples == len(earlier)
