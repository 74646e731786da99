"""Random model inputs: a jagged batch with chosen history lengths and random embeddings (the model's
tests and ``kernels/bench_stu.py``'s parity check share them), and a batch at a config's table sizes
with uniform or Zipf-skewed ids (the step benchmarks and ``scale/bench_hot_ids.py``)."""

from __future__ import annotations

import numpy as np
import torch

from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import NUM_CONTEXTUAL
from dlrmv4.data.synthetic_batch import synthetic_batch
from dlrmv4.model.embeddings import TABLE_NAMES, SequenceEmbeddings


def random_batch(lengths, seed: int, dedup_ids: bool = False) -> TorchJaggedBatch:
    """A batch with the given history lengths (0 allowed), every id below 100."""
    return synthetic_batch(
        np.asarray(lengths, np.int32), dict.fromkeys(TABLE_NAMES, 100), np.random.default_rng(seed), dedup_ids=dedup_ids
    )


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
