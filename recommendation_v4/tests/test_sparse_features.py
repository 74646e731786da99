"""A batch's id features and their KeyedJaggedTensor layout (what the TorchRec lookup reads): the
loader's packed batch hands its own memory over as the KeyedJaggedTensor, a batch cut from another
gets the same features gathered."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_embeddings import batch

from dlrmv4.data.batch import unique_with_inverse
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.data.sparse_features import (
    HISTORY_KEYS,
    SHARED_IDS,
    SPARSE_KEYS,
    feature_ids,
    lookup_size,
    packed_ids,
    sequence_rows,
    sparse_features,
)


def test_feature_ids_name_every_id_of_the_batch():
    b = batch(3)
    ids = feature_ids(b)
    assert (
        list(ids)
        == list(SPARSE_KEYS)
        == [
            "history_item_id",
            "candidate_item_id",
            "history_artist_id",
            "candidate_artist_id",
            "history_album_id",
            "candidate_album_id",
            *CONTEXTUAL_FEATURES,
        ]
    )
    assert torch.equal(ids["history_artist_id"], b.history_artist_id)
    assert torch.equal(ids[CONTEXTUAL_FEATURES[2]], b.contextual_ids[:, 2])


def _expected(b):
    ids = feature_ids(b)
    lengths = {k: (b.history_lengths if k.startswith("history_") else torch.ones(b.num_samples)) for k in ids}
    return ids, lengths


def _check(kjt, b):
    ids, lengths = _expected(b)
    assert kjt.keys() == list(SPARSE_KEYS) and kjt.stride() == b.num_samples
    assert kjt.length_per_key() == [b.total_tokens if k.startswith("history_") else b.num_samples for k in ids]
    assert kjt.lengths().dtype == torch.int64
    for key, jt in kjt.to_dict().items():
        assert torch.equal(jt.values(), ids[key]), key
        assert torch.equal(jt.lengths(), lengths[key].to(torch.int64)), key


def test_the_packed_batch_is_its_own_keyed_jagged_tensor():
    """The worker's batch: the KeyedJaggedTensor's values and lengths are views of the batch's one
    buffer (no gather), and its features are the batch's ids."""
    pytest.importorskip("torchrec")
    b = batch(5)
    packed = b._packed()
    assert packed is not None and b.id_lengths is not None
    kjt = sparse_features(b)
    storage = packed.untyped_storage().data_ptr()
    assert kjt.values().untyped_storage().data_ptr() == storage
    assert kjt.lengths().untyped_storage().data_ptr() == storage
    assert kjt.values().data_ptr() == b.history_item_id.data_ptr()
    _check(kjt, b)
    # The same after the copy that pinning or the device transfer makes of the one buffer.
    moved = b._on(packed.clone())
    assert packed_ids(moved) is not None and packed_ids(moved).data_ptr() == moved.history_item_id.data_ptr()
    _check(sparse_features(moved), b)


def test_a_cut_or_edited_batch_gets_its_features_gathered():
    pytest.importorskip("torchrec")
    b = batch(6)
    part = b.samples(1, 4)
    assert packed_ids(part) is None and part.id_lengths is None
    _check(sparse_features(part), part)
    edited = b.__class__(**{**b.__dict__, "contextual_ids": b.contextual_ids + 1})
    assert packed_ids(edited) is None  # a replaced field is no longer the region: never stale ids
    _check(sparse_features(edited), edited)
    assert np.array_equal(b.contextual_ids.t().reshape(-1).numpy(), packed_ids(b)[-8 * b.num_samples :].numpy())


@pytest.mark.parametrize("top", [50, 1 << 27])  # a flag per possible id; sorting (ids far apart)
def test_unique_with_inverse(top):
    ids = np.random.default_rng(top).integers(0, top, 5_000).astype(np.int64)
    ids[::7] = ids[0]  # repeats
    unique, inverse = unique_with_inverse(ids)
    assert np.array_equal(unique, np.unique(ids)) and unique.dtype == np.int64
    assert inverse.dtype == np.int32 and np.array_equal(unique[inverse], ids)
    empty, none = unique_with_inverse(ids[:0])
    assert len(empty) == len(none) == 0


def test_a_deduplicated_batch_asks_for_each_distinct_history_id_once():
    """``to_torch(dedup_ids=True)``: the KeyedJaggedTensor holds each history feature's distinct ids
    (its lengths count them, spread evenly over the samples), the candidates and contextual ids as they
    are, views of the batch's one buffer; every token's id is its distinct id at ``history_inverse``.
    A cut batch drops the deduplicated layout and gathers."""
    pytest.importorskip("torchrec")
    full, b = batch(5), batch(5, dedup_ids=True)
    assert b._packed() is not None and b.unique_counts is not None
    kjt = sparse_features(b)
    assert kjt.values().untyped_storage().data_ptr() == b._packed().untyped_storage().data_ptr()
    features, ids = kjt.to_dict(), feature_ids(full)
    for i, key in enumerate(HISTORY_KEYS):
        values = features[key].values()
        assert torch.equal(values, torch.unique(ids[key])) and len(values) == b.unique_counts[i]
        lengths = features[key].lengths().tolist()
        assert sum(lengths) == len(values) and max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths)[::-1]
        assert torch.equal(values[b.history_inverse[i].long()], ids[key])
    for key in SPARSE_KEYS:
        if key not in HISTORY_KEYS:
            assert torch.equal(features[key].values(), ids[key]), key
    assert kjt.length_per_key() == [
        b.unique_counts[HISTORY_KEYS.index(k)] if k in HISTORY_KEYS else b.num_samples for k in SPARSE_KEYS
    ]
    assert lookup_size(b) == len(kjt.values()) < lookup_size(full) == len(sparse_features(full).values())
    rows = {key: torch.randn(len(jt.values()), 4) for key, jt in features.items()}
    full_rows = {key: rows[key][b.history_inverse[i].long()] for i, key in enumerate(HISTORY_KEYS)}
    for name in SHARED_IDS:
        want = torch.cat([full_rows[f"history_{name}_id"], rows[f"candidate_{name}_id"]])
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(sequence_rows(b, rows, name, dtype), want.to(dtype)), (name, dtype)
            assert torch.equal(sequence_rows(full, {**rows, **full_rows}, name, dtype), want.to(dtype)), (name, dtype)
    assert sequence_rows(b, rows, "uid", torch.bfloat16).equal(rows["uid"].to(torch.bfloat16))
    # The gradient: a distinct row gets the sum of its tokens', a candidate's row its own.
    leaves = {key: t.clone().requires_grad_() for key, t in rows.items()}
    weight = torch.randn(b.total_tokens + b.num_samples, 4)
    (sequence_rows(b, leaves, "item", torch.float32) * weight).sum().backward()
    inverse = b.history_inverse[0].long()
    want_grad = torch.zeros_like(rows["history_item_id"]).index_add_(0, inverse, weight[: b.total_tokens])
    assert torch.allclose(leaves["history_item_id"].grad, want_grad, atol=1e-6)
    assert torch.equal(leaves["candidate_item_id"].grad, weight[b.total_tokens :])
    moved = b.to("cpu")  # the field views move with the one buffer
    assert torch.equal(sparse_features(moved).values(), kjt.values())
    part = b.samples(1, 3)
    assert part.lookup_ids is None and part.history_inverse is None
    _check(sparse_features(part), part)
