"""Random model inputs: a jagged batch with chosen history lengths and random embeddings (the model's
tests and ``kernels/bench_stu.py``'s parity check share them), and a batch at a config's table sizes
with uniform or Zipf-skewed ids (the step benchmarks and ``scale/bench_hot_ids.py``)."""

from __future__ import annotations

import numpy as np
import torch

from dlrmv4.data.batch import JaggedBatch, TorchJaggedBatch
from dlrmv4.data.hashing import NUM_CONTEXTUAL
from dlrmv4.data.synthetic_batch import synthetic_batch
from dlrmv4.model.embeddings import TABLE_NAMES, SequenceEmbeddings


def random_batch(lengths, seed: int, dedup_ids: bool = False) -> TorchJaggedBatch:
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    b, t = len(lengths), int(lengths.sum())
    offsets = np.zeros(b + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ts = (
        np.concatenate([np.sort(rng.integers(0, 10**7, n)) for n in lengths]).astype(np.int64)
        if t
        else np.zeros(0, np.int64)
    )
    query = np.array([ts[offsets[i + 1] - 1] if lengths[i] else rng.integers(0, 10**7) for i in range(b)], np.int64)
    batch = JaggedBatch(
        history_lengths=lengths,
        history_offsets=offsets,
        history_item_id=rng.integers(0, 100, t),
        history_artist_id=rng.integers(0, 100, t),
        history_album_id=rng.integers(0, 100, t),
        history_action=rng.choice([1, 2, 4], t).astype(np.int64),
        history_timestamp=ts,
        contextual_ids=rng.integers(0, 100, (b, NUM_CONTEXTUAL)),
        candidate_item_id=rng.integers(0, 100, b),
        candidate_artist_id=rng.integers(0, 100, b),
        candidate_album_id=rng.integers(0, 100, b),
        candidate_timestamp=query + rng.integers(0, 600, b),
        query_time=query,
        label=rng.integers(0, 2, b).astype(np.float32),
        anchor_index=np.arange(b, dtype=np.int64),
    )
    batch.validate()
    return batch.to_torch(dedup_ids=dedup_ids)


def random_embeddings(batch: TorchJaggedBatch, dim: int, seed: int, dtype=torch.float32) -> SequenceEmbeddings:
    g = torch.Generator().manual_seed(seed)
    t, b = batch.total_tokens, batch.num_samples
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()  # noqa: E731
    return SequenceEmbeddings(
        item=r(t + b, dim),
        artist=r(t + b, dim),
        album=r(t + b, dim),
        contextual=r(b, NUM_CONTEXTUAL, dim),
        candidate=r(b, 3 * dim),
    )


def random_table_batch(
    lengths: np.ndarray,
    rows: int | dict[str, int],
    rng: np.random.Generator,
    skew: float = 0.0,
    dedup_ids: bool = False,
):
    """A jagged batch with the given sequence lengths (history = length - 9) and each table's ids below
    its row count (``rows``: one count for every table, or one per table name): ``synthetic_batch``."""
    rows = rows if isinstance(rows, dict) else {name: rows for name in TABLE_NAMES}
    return synthetic_batch(np.maximum(np.asarray(lengths) - 9, 1), rows, rng, skew, dedup_ids)
