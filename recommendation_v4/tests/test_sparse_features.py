"""A batch's id features and their KeyedJaggedTensor layout (what the TorchRec lookup reads)."""

from __future__ import annotations

import pytest
import torch
from test_embeddings import batch

from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.data.sparse_features import feature_ids, keyed_jagged_features


def test_feature_ids_name_every_id_of_the_batch():
    b = batch(3)
    ids = feature_ids(b)
    assert list(ids) == [
        "history_item_id",
        "candidate_item_id",
        "history_artist_id",
        "candidate_artist_id",
        "history_album_id",
        "candidate_album_id",
        *CONTEXTUAL_FEATURES,
    ]
    assert torch.equal(ids["history_artist_id"], b.history_artist_id)
    assert torch.equal(ids[CONTEXTUAL_FEATURES[2]], b.contextual_ids[:, 2])


def test_keyed_jagged_features_lay_out_the_keys_in_order():
    pytest.importorskip("torchrec")
    b = batch(4)
    keys = ["history_item_id", "candidate_item_id", CONTEXTUAL_FEATURES[0]]
    kjt = keyed_jagged_features(b, keys)
    assert kjt.keys() == keys and kjt.stride() == b.num_samples
    assert kjt.length_per_key() == [b.total_tokens, b.num_samples, b.num_samples]
    features = kjt.to_dict()
    assert torch.equal(features["history_item_id"].lengths(), b.history_lengths)
    assert torch.equal(features["history_item_id"].values(), b.history_item_id)
    assert torch.equal(features["candidate_item_id"].lengths(), torch.ones(b.num_samples, dtype=torch.int32))
    assert torch.equal(features[CONTEXTUAL_FEATURES[0]].values(), b.contextual_ids[:, 0])
