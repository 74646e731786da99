"""A jagged batch made from shapes alone, never from the dataset: chosen history lengths, and each
table's ids below its row count (uniform, or Zipf-skewed). The kernels' warm-up before RUN_START
(``train/warm_up.py``) and the step benchmarks build their batches with it.
"""

from __future__ import annotations

import numpy as np

from dlrmv4.data.batch import JaggedBatch, TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES


def synthetic_batch(
    history_lengths: np.ndarray,
    rows: dict[str, int],
    rng: np.random.Generator,
    skew: float = 0.0,
    dedup_ids: bool = False,
) -> TorchJaggedBatch:
    """A batch whose samples have ``history_lengths`` history tokens, each table's ids below its row
    count in ``rows`` (by table name): uniform, or Zipf-distributed with exponent ``skew`` (> 1: a few
    very popular rows, as in real listening data); ``dedup_ids``: with the lookup's distinct ids packed,
    as the loader packs them for TorchRec."""
    hist = np.asarray(history_lengths, np.int32)
    b, t = len(hist), int(hist.sum())
    offsets = np.zeros(b + 1, np.int64)
    np.cumsum(hist, out=offsets[1:])
    ts = np.concatenate([np.sort(rng.integers(0, 10**7, n)) for n in hist]).astype(np.int64)
    # The query time is the last history event's (a sample without history gets a random one).
    query = ts[np.maximum(offsets[1:] - 1, 0)] if t else np.zeros(b, np.int64)
    if (hist == 0).any():
        query = np.where(hist > 0, query, rng.integers(0, 10**7, b)).astype(np.int64)

    def ids(table: str, n: int) -> np.ndarray:
        r = rows[table]
        return ((rng.zipf(skew, n) - 1) % r if skew else rng.integers(0, r, n)).astype(np.int64)

    batch = JaggedBatch(
        history_lengths=hist,
        history_offsets=offsets,
        history_item_id=ids("item", t),
        history_artist_id=ids("artist", t),
        history_album_id=ids("album", t),
        history_action=rng.choice([1, 2, 4], t).astype(np.int64),
        history_timestamp=ts,
        contextual_ids=np.stack([ids(name, b) for name in CONTEXTUAL_FEATURES], 1),
        candidate_item_id=ids("item", b),
        candidate_artist_id=ids("artist", b),
        candidate_album_id=ids("album", b),
        candidate_timestamp=query + rng.integers(0, 600, b),
        query_time=query,
        label=rng.integers(0, 2, b).astype(np.float32),
        anchor_index=np.arange(b, dtype=np.int64),
    )
    batch.validate()
    return batch.to_torch(dedup_ids=dedup_ids)
