"""Activation memory of one chunk of the dense model (``train/chunks.py``), for the memory plan.

What the forward of one chunk keeps for its backward, per sequence token and per sample, and the
backward's transient peak inside one STU layer, for each recompute mode (``ModelConfig.recompute``).
The numbers are analytic: counted from the tensors the GPU (Triton) path saves, not measured.
Worst case throughout: every sample has ``sampler.max_seq_len`` tokens.

A measured value for a named shape replaces the analytic bytes per token
(``MEASURED_BYTES_PER_TOKEN``); on the CPU the PyTorch reference ops keep more than this (its
attention keeps padded copies), so there the plan is a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlrmv4.config import ModelConfig

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
LN_STATS_BYTES = 8  # one layer norm's mean and rstd per row, fp32
TOWERS = 3  # the preprocessor's content, extra-id and action branches
FP32 = 4

# Measured bytes per sequence token that one chunk's forward keeps for its backward (the STU stack
# and the preprocessor together: what ``stu_kept_bytes_per_token`` x layers + the preprocessor's
# share estimate), keyed by ``ActivationShape.key(mode)``. A value comes from
# ``benchmarks/step/bench_end_to_end.py --recompute none cheap layer`` (its "kept KiB/token" column:
# saved-tensor hooks over one training forward, the tables' rows and the weights left out) at that
# exact shape, dtype and mode; results/end_to_end_recompute.md names the GPU and the commit.
_REFERENCE = (512, 4, 128, 128, 3, 512, 256, 2, True)  # the reference model (docs/model.md) in bf16 with dropout
MEASURED_BYTES_PER_TOKEN: dict[tuple, float] = {
    (*_REFERENCE, "none"): 37.71 * 1024,
    (*_REFERENCE, "cheap"): 12.17 * 1024,
    (*_REFERENCE, "layer"): 9.15 * 1024,
}


@dataclass(frozen=True)
class ActivationShape:
    """The model dimensions the activation memory depends on."""

    d_model: int
    num_heads: int
    qk_dim: int
    v_dim: int
    num_layers: int
    embedding_dim: int
    preprocessor_hidden: int
    item_tower_hidden: int
    head_hidden: int
    dtype_bytes: int  # the sequence model's autocast dtype
    linear_dropout: bool  # STU output dropout on: its keep bits are kept

    @classmethod
    def from_config(cls, model: ModelConfig) -> ActivationShape:
        return cls(
            model.d_model,
            model.num_heads,
            model.qk_dim,
            model.v_dim,
            model.num_layers,
            model.embedding_dim,
            model.preprocessor_hidden,
            model.item_tower_hidden,
            model.head_hidden,
            DTYPE_BYTES[model.sequence_dtype],
            model.linear_dropout > 0,
        )

    def key(self, mode: str) -> tuple:
        return (
            self.d_model,
            self.num_heads,
            self.qk_dim,
            self.v_dim,
            self.num_layers,
            self.embedding_dim,
            self.preprocessor_hidden,
            self.dtype_bytes,
            self.linear_dropout,
            mode,
        )


def stu_kept_bytes_per_token(shape: ActivationShape, mode: str) -> int:
    """Bytes one STU layer keeps per token for its backward, on the GPU (Triton) path.

    s = dtype bytes, D = d_model, H heads, dqk / dv head dims:

    - ``none``:  x (D·s, the layer norm's input) + n (D·s, the normed input the uvqk GEMM keeps)
      + uvqk (H·(2·dv + 2·dqk)·s; u, v, q, k are views of it) + attn (H·dv·s) + y (3·H·dv·s, kept
      by the output GEMM) + keep bits (H·dv bytes, uint8, when linear_dropout > 0) + 2 layer-norm
      statistics pairs (16 B: the input norm's and the attention norm's);
    - ``cheap``: x + attn + the input norm's statistics (8 B): n, uvqk and y are recomputed in the
      backward, and so is the dropout mask (drawn again from its seed);
    - ``layer``: x only (the whole layer runs again in the backward).
    """
    s, d, h = shape.dtype_bytes, shape.d_model, shape.num_heads
    x = d * s
    attn = h * shape.v_dim * s
    keep = h * shape.v_dim if shape.linear_dropout else 0
    stats = 2 * LN_STATS_BYTES
    if mode == "layer":
        return x
    if mode == "cheap":
        return x + attn + LN_STATS_BYTES
    if mode == "none":
        return x + _recomputed_per_token(shape) + attn + keep + stats
    raise ValueError(f"unknown recompute mode {mode!r}")


def _recomputed_per_token(shape: ActivationShape) -> int:
    """n + uvqk + y of one layer: what ``cheap`` recomputes (and ``none`` keeps)."""
    s, d, h = shape.dtype_bytes, shape.d_model, shape.num_heads
    return d * s + h * (2 * shape.v_dim + 2 * shape.qk_dim) * s + 3 * h * shape.v_dim * s


def stu_backward_transient_per_token(shape: ActivationShape, mode: str) -> int:
    """The backward's extra peak inside one STU layer, per token: the uvqk gradient
    (H·(2dv+2dqk)·s) + dy (3·H·dv·s) + the attention gradient (H·dv·s) + the residual stream's
    gradient (D·s); ``cheap`` and ``layer`` also hold that layer's recomputed n, uvqk, y, keep bits
    and statistics, and ``layer`` its recomputed attn too."""
    s, d, h = shape.dtype_bytes, shape.d_model, shape.num_heads
    grads = h * (2 * shape.v_dim + 2 * shape.qk_dim) * s + 3 * h * shape.v_dim * s + h * shape.v_dim * s + d * s
    if mode == "none":
        return grads
    if mode == "cheap":
        return grads + stu_kept_bytes_per_token(shape, "none") - stu_kept_bytes_per_token(shape, "cheap")
    if mode == "layer":
        return grads + stu_kept_bytes_per_token(shape, "none") - d * s
    raise ValueError(f"unknown recompute mode {mode!r}")


def preprocessor_bytes_per_row(shape: ActivationShape) -> int:
    """Per history/candidate row: each of the 3 token towers keeps its hidden activation twice
    (preprocessor_hidden·s before and after the SwishLayerNorm), its output (D·s) and 2 statistics
    pairs. Its input is the looked-up rows, counted with the lookup."""
    s = shape.dtype_bytes
    return TOWERS * (2 * shape.preprocessor_hidden * s + shape.d_model * s + 2 * LN_STATS_BYTES)


def sequence_row_bytes(shape: ActivationShape) -> int:
    """Per sequence row: the summed tokens and the encoded sequence (D·s each; counted for every
    row, contextual ones included; the encoding reads the tokens in place, no concatenated copy) +
    its timestamp and position (16 B)."""
    return 2 * shape.d_model * shape.dtype_bytes + 16


def per_sample_bytes(shape: ActivationShape, num_contextual: int, candidate_copy: bool) -> int:
    """Per sample, fp32 outside autocast unless stated: the contextual projections (C·D·s), the
    item tower (its fp32 input copy 3·E when the rows arrive in a narrower dtype, hidden twice,
    output twice), the postprocessor (input D+4, output twice), the head (user ⊙ item, hidden
    twice, logit) and their layer-norm statistics."""
    s, d, e = shape.dtype_bytes, shape.d_model, shape.embedding_dim
    contextual = num_contextual * d * s
    item_tower = (3 * e * FP32 if candidate_copy else 0) + 2 * shape.item_tower_hidden * FP32 + 2 * d * FP32
    post = (d + 4) * FP32 + d * s + 2 * d * FP32
    head = d * FP32 + 2 * shape.head_hidden * FP32 + FP32
    return contextual + item_tower + post + head + 6 * LN_STATS_BYTES


def kept_bytes_per_token(shape: ActivationShape, mode: str, max_seq_len: int, num_contextual: int) -> float:
    """The chunk's kept bytes per sequence token (all STU layers + the preprocessor), measured where
    ``MEASURED_BYTES_PER_TOKEN`` has the shape, else analytic."""
    measured = MEASURED_BYTES_PER_TOKEN.get(shape.key(mode))
    if measured is not None:
        return measured
    rows_share = (max_seq_len - num_contextual) / max_seq_len  # history + candidate rows per token
    return (
        shape.num_layers * stu_kept_bytes_per_token(shape, mode)
        + rows_share * preprocessor_bytes_per_row(shape)
        + sequence_row_bytes(shape)
    )


@dataclass(frozen=True)
class ChunkActivations:
    """Bytes of one chunk's activations (worst case: every sample at max_seq_len tokens)."""

    samples: int
    tokens: int
    kept: int  # what the forward keeps for the backward
    transient: int  # the backward's extra peak in one STU layer
    per_sample: int  # head, towers, contextual projections
    lookup_copy: int  # chunks > 1: the chunk's own copy of its looked-up rows and that copy's gradient

    @property
    def total(self) -> int:
        return self.kept + self.transient + self.per_sample + self.lookup_copy


def chunk_activations(
    shape: ActivationShape,
    mode: str,
    chunk_samples: int,
    max_seq_len: int,
    num_contextual: int,
    chunked: bool,
    candidate_copy: bool,
) -> ChunkActivations:
    tokens = chunk_samples * max_seq_len
    kept = math.ceil(tokens * kept_bytes_per_token(shape, mode, max_seq_len, num_contextual))
    transient = tokens * stu_backward_transient_per_token(shape, mode)
    per_sample = chunk_samples * per_sample_bytes(shape, num_contextual, candidate_copy)
    copy = 0
    if chunked:
        # 3 shared-table rows per history/candidate row + the contextual rows, and their gradient.
        rows = chunk_samples * ((max_seq_len - num_contextual) * 3 + num_contextual)
        copy = 2 * rows * shape.embedding_dim * shape.dtype_bytes
    return ChunkActivations(chunk_samples, tokens, kept, transient, per_sample, copy)
