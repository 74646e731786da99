"""A batch's id features, named as the embedding lookup names them.

``history_<name>_id`` (one id per history token, jagged by the batch's history lengths) and
``candidate_<name>_id`` (one per sample) for each id the history and the candidate share, and one
feature per contextual column (one id per sample, ``hashing.CONTEXTUAL_FEATURES`` order).
``keyed_jagged_features`` lays them out as TorchRec's KeyedJaggedTensor.
"""

from __future__ import annotations

import torch

from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES

# Ids that both the history and the candidate carry (each indexes one table for both).
SHARED_IDS = ("item", "artist", "album")


def feature_ids(batch: TorchJaggedBatch) -> dict[str, torch.Tensor]:
    """Every id feature of a batch: history/candidate per shared id, one column per contextual feature."""
    ids = {}
    for name in SHARED_IDS:
        ids[f"history_{name}_id"] = getattr(batch, f"history_{name}_id")
        ids[f"candidate_{name}_id"] = getattr(batch, f"candidate_{name}_id")
    for c, name in enumerate(CONTEXTUAL_FEATURES):
        ids[name] = batch.contextual_ids[:, c]
    return ids


def keyed_jagged_features(batch: TorchJaggedBatch, keys: list[str]):
    """The features ``keys`` of a batch as one KeyedJaggedTensor, in that order: a history feature
    has the history lengths, every other one id per sample."""
    from torchrec import KeyedJaggedTensor

    ids = feature_ids(batch)
    b, t = batch.num_samples, batch.total_tokens
    # int64 lengths: TorchRec's row-wise sequence all-to-all permutes the looked-up rows by lengths x
    # embedding dim (FBGEMM's permute_2D_sparse_data), which overflows int32 past 2**31 elements: at
    # 1,024 samples per rank and D = 512 a rank's rows hold several times that.
    ones = torch.ones(b, dtype=torch.int64, device=batch.history_lengths.device)
    lengths = [batch.history_lengths.to(torch.int64) if k.startswith("history_") else ones for k in keys]
    # Host-side sizes per key spare TorchRec a device-to-host sync.
    per_key = [t if k.startswith("history_") else b for k in keys]
    return KeyedJaggedTensor(keys=keys, values=torch.cat([ids[k] for k in keys]),
                             lengths=torch.cat(lengths), stride=b, length_per_key=per_key)
