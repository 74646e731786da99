"""Sequence-length mixes for the GPU benchmarks (tokens per sample, contextual and candidate included).

- ``full``: every sample at ``max_len`` (4,096 at the reference shape).
- ``jagged``: like the real data at the reference shape: most histories far from full because the
  like pool under-fills (docs/data.md: ~2.8k tokens on average, at most 4,095): 2,740 + 1,355 * Beta(0.3, 3.5),
  mean about 2,850, range 2,740-4,095 (scaled to ``max_len``).
- ``half``: every sample at ``max_len // 2`` (the L = 2,048 case).
"""

from __future__ import annotations

import numpy as np

JAGGED_LOW, JAGGED_HIGH = 2_740, 4_095
REFERENCE_MAX = 4_096


def jagged_lengths(mix: str, batch: int, rng: np.random.Generator, max_len: int = REFERENCE_MAX) -> np.ndarray:
    if mix == "full":
        return np.full(batch, max_len, np.int64)
    if mix == "half":
        return np.full(batch, max_len // 2, np.int64)
    if mix == "jagged":
        scale = max_len / REFERENCE_MAX
        low, high = JAGGED_LOW * scale, JAGGED_HIGH * scale
        return np.minimum(low + (high - low) * rng.beta(0.3, 3.5, batch), max_len - 1).astype(np.int64)
    raise ValueError(f"unknown length mix {mix!r}")
