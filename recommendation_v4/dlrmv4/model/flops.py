"""FLOP counts for MFU (docs/model.md): the reference's yardstick for the STU layers, and the rest of the
model's matmuls, per sample (dense at one length) or exactly on a batch's real lengths.

Per STU layer, fwd+bwd, S tokens:  UVQK 2·S·D·4·H·d·3 + attention 2·(S²/2)·H·2d·3.5 + output
2·S·3·H·d·D·3 (at S = 4,096 with the reference shape: 315.7 GFLOP per sample for 3 layers).

The yardstick counts every layer in full, as the benchmark's work. ``executed=True`` counts what a
model with ``last_layer = "candidates"`` runs: its last layer projects V and K for all S rows, U
and Q, the output block and the output projection for one row, and its attention is one query
over S keys (2·S·H·2d forward, twice that backward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dlrmv4.config import ModelConfig

FWD_BWD_MATMUL = 3  # forward + two backward products
FWD_BWD_ATTENTION = 3.5  # the reference's factor for attention (recomputation in the backward)


@dataclass(frozen=True)
class FlopCount:
    uvqk: float
    attention: float
    output: float
    other: float  # preprocessor, contextual projections, postprocessor, item tower, head (fwd+bwd)

    @property
    def stu(self) -> float:
        """The yardstick: what MFU is reported on."""
        return self.uvqk + self.attention + self.output

    @property
    def total(self) -> float:
        return self.stu + self.other


def _tower(in_dim: int, hidden: int, out_dim: int) -> float:
    """Forward FLOPs of one Tower (two linears) per row."""
    return 2 * (in_dim * hidden + hidden * out_dim)


def _count(cfg: ModelConfig, lengths: np.ndarray, num_contextual: int, executed: bool = False) -> FlopCount:
    s = lengths.astype(np.float64)
    d, h = cfg.d_model, cfg.num_heads
    full = cfg.num_layers - 1 if executed and cfg.last_layer == "candidates" else cfg.num_layers
    uvqk = full * float(np.sum(2 * s * d * h * (2 * cfg.v_dim + 2 * cfg.qk_dim))) * FWD_BWD_MATMUL
    attention = full * float(np.sum(2 * (s * s / 2) * h * (cfg.qk_dim + cfg.v_dim))) * FWD_BWD_ATTENTION
    output = full * float(np.sum(2 * s * 3 * h * cfg.v_dim * d)) * FWD_BWD_MATMUL
    if full < cfg.num_layers:  # the last layer, candidate rows only
        rows = len(s)
        uvqk += (
            float(np.sum(2 * s * d * h * (cfg.v_dim + cfg.qk_dim)) + 2 * rows * d * h * (cfg.v_dim + cfg.qk_dim))
            * FWD_BWD_MATMUL
        )
        attention += float(np.sum(2 * s * h * (cfg.qk_dim + cfg.v_dim))) * FWD_BWD_MATMUL
        output += 2 * rows * 3 * h * cfg.v_dim * d * FWD_BWD_MATMUL
    e, ph = cfg.embedding_dim, cfg.preprocessor_hidden
    history_tokens = np.maximum(s - num_contextual, 0)  # history + candidate
    per_token = _tower(e, ph, d) + _tower(2 * e, ph, d) + _tower(3 * cfg.action_dim, ph, d)
    per_sample = (
        num_contextual * 2 * e * d
        + 2 * (d + 4) * d
        + _tower(3 * e, cfg.item_tower_hidden, d)
        + 2 * (d * cfg.head_hidden + cfg.head_hidden)
    )
    other = (float(np.sum(history_tokens)) * per_token + len(s) * per_sample) * FWD_BWD_MATMUL
    return FlopCount(uvqk=uvqk, attention=attention, output=output, other=other)


def dense_flops_per_sample(
    cfg: ModelConfig, seq_len: int, num_contextual: int = 8, executed: bool = False
) -> FlopCount:
    """One sample at ``seq_len`` tokens (the reference's per-sample figure at max_seq_len)."""
    return _count(cfg, np.array([seq_len]), num_contextual, executed)


def batch_flops(
    cfg: ModelConfig, seq_lengths: Sequence[int] | np.ndarray, num_contextual: int = 8, executed: bool = False
) -> FlopCount:
    """A batch on its real sequence lengths (history + contextual + candidate per sample); the
    yardstick, or with ``executed`` what the model runs (see the module docstring)."""
    return _count(cfg, np.asarray(seq_lengths), num_contextual, executed)


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    return flops / seconds / (peak_tflops * 1e12)
