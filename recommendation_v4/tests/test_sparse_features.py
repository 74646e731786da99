"""A batch's id features and their KeyedJaggedTensor layout (what the TorchRec lookup reads): the
loader's packed batch hands its own memory over as the KeyedJaggedTensor, a batch cut from another
gets the same features gathered."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_embeddings import batch

from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.data.sparse_features import SPARSE_KEYS, feature_ids, packed_ids, sparse_features


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
