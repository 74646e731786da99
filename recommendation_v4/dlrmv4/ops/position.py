"""Position and time encoding of the concatenated sequences, with the model's input dropout fused:
Dropout_p(x·x_scale + P[pos] + T[bucket]).

Per sequence of length n = C + L + 1 ([C contextual, L history, 1 candidate]) and token p:
pos = p for contextual tokens, C for the candidate, C + (n − 1 − p) for history tokens (counting
backwards from the end of the history), clamped to the table; bucket = clamp(int(sqrt(max(
query_time − t, 1e-6) / time_bucket_seconds)), 0, rows − 1), in fp32 as the reference model
computes it (the contextual tokens' t is 0: their bucket is sqrt(query_time / unit)). Tables are
fp32 (their gradients too); the output is in x's dtype.

Dropout (when ``training`` and p > 0) is a pure function of (seed, row_offset + local row, column),
the same in the Triton kernel and the reference (layout: triton/position.py; torch's copy of
Philox: reference/philox.py): a chunk of rows passed with ``row_offset`` = its first row's index
draws exactly the unchunked call's mask for those rows. ``input_dropout_keep_mask`` returns it.

``encode_sequences`` is the model's form: the sequences' parts (contextual rows, tokens) in, the
encoded sequences out, as ``concat_sequences`` then ``position_time_encode`` would give them; the
Triton kernel reads each row from its part (and writes each part's gradient), so the concatenated
sequences, a copy of every token row, are never built.
"""

from __future__ import annotations

import math

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.jagged import check_sequence_parts, concat_sequence_timestamps, concat_sequences
from dlrmv4.ops.reference import position as ref
from dlrmv4.ops.reference.jagged import sequence_offsets
from dlrmv4.ops.reference.philox import check_dropout
from dlrmv4.ops.reference.position import input_dropout_keep_mask  # noqa: F401  (re-exported for tests)
from dlrmv4.ops.strides import unit_cols


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _PositionTimeFn(torch.autograd.Function):
    """x: the sequences [T', D], or with ``contextual`` [B, C, D] the tokens [T + B, D] of their parts."""

    @staticmethod
    def forward(
        ctx,
        x,
        contextual,
        seq_offsets,
        timestamps,
        query_time,
        num_contextual,
        pos_table,
        time_table,
        x_scale,
        time_bucket_seconds,
        dropout,
    ):
        from dlrmv4.ops.triton import position as tri

        out = tri.forward(
            unit_cols(x),
            seq_offsets,
            timestamps,
            query_time,
            num_contextual,
            unit_cols(pos_table),
            unit_cols(time_table),
            x_scale,
            time_bucket_seconds,
            dropout,
            contextual=unit_cols(contextual) if contextual is not None else None,
        )
        ctx.save_for_backward(seq_offsets, timestamps, query_time)
        ctx.args = (
            num_contextual,
            pos_table.shape[0],
            time_table.shape[0],
            x_scale,
            time_bucket_seconds,
            x.dtype,
            dropout,
            x.shape[0] if contextual is not None else None,
        )
        ctx.table_dtypes = (pos_table.dtype, time_table.dtype)
        return out

    @staticmethod
    def backward(ctx, grad):
        from dlrmv4.ops.triton import position as tri

        seq_offsets, timestamps, query_time = ctx.saved_tensors
        dx, dpt, dtt, dctx = tri.backward(unit_cols(grad), seq_offsets, timestamps, query_time, *ctx.args)
        pt_dtype, tt_dtype = ctx.table_dtypes
        return dx, dctx, None, None, None, None, dpt.to(pt_dtype), dtt.to(tt_dtype), None, None, None


def position_time_encode(
    x: torch.Tensor,
    seq_offsets: torch.Tensor,
    timestamps: torch.Tensor,
    query_time: torch.Tensor,
    num_contextual: int,
    pos_table: torch.Tensor,
    time_table: torch.Tensor,
    x_scale: float,
    time_bucket_seconds: float = 60.0,
    kernels: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    training: bool = False,
    row_offset: int = 0,
) -> torch.Tensor:
    """x [T', D] (sequences laid out by seq_offsets int64 [B+1]), timestamps int64 [T'],
    query_time int64 [B], pos_table [P, D], time_table [NT, D] -> [T', D] in x's dtype. Dropout
    with probability ``dropout_p`` when ``training``, its mask drawn from ``seed`` for the global
    rows from ``row_offset`` on (no draws at all without dropout)."""
    n, d = x.shape
    if timestamps.shape != (n,):
        raise ValueError(f"position_time_encode: timestamps {tuple(timestamps.shape)} must be [{n}]")
    seed, row_offset = _checked(
        "position_time_encode",
        d,
        seq_offsets,
        query_time,
        pos_table,
        time_table,
        time_bucket_seconds,
        dropout_p,
        seed,
        row_offset,
    )
    if resolve(kernels, x.device) == "pytorch":
        return ref.position_time_encode(
            x,
            seq_offsets,
            timestamps,
            query_time,
            num_contextual,
            pos_table,
            time_table,
            x_scale,
            time_bucket_seconds,
            dropout_p,
            seed,
            training,
            row_offset,
        )
    dropout = (dropout_p, seed, row_offset) if training and dropout_p > 0.0 else None
    args = (seq_offsets, timestamps, query_time, num_contextual, pos_table, time_table, x_scale, time_bucket_seconds)
    return _PositionTimeFn.apply(x, None, *args, dropout)


def _checked(
    op: str,
    d: int,
    seq_offsets: torch.Tensor,
    query_time: torch.Tensor,
    pos_table: torch.Tensor,
    time_table: torch.Tensor,
    time_bucket_seconds: float,
    dropout_p: float,
    seed: int,
    row_offset: int,
) -> tuple[int, int]:
    """The encoding's arguments checked (a ValueError naming ``op``); the checked (seed, row_offset)."""
    if pos_table.shape[1:] != (d,) or time_table.shape[1:] != (d,):
        raise ValueError(
            f"{op}: tables {tuple(pos_table.shape)} and {tuple(time_table.shape)} must have {d} columns like x"
        )
    if not (math.isfinite(time_bucket_seconds) and time_bucket_seconds > 0):
        raise ValueError(f"{op}: time_bucket_seconds={time_bucket_seconds} must be positive")
    if query_time.shape != (seq_offsets.numel() - 1,):
        raise ValueError(f"{op}: query_time {tuple(query_time.shape)} must be [{seq_offsets.numel() - 1}]")
    return check_dropout(op, dropout_p, seed, row_offset)


def encode_sequences(
    contextual: torch.Tensor,
    tokens: torch.Tensor,
    history_offsets: torch.Tensor,
    history_timestamp: torch.Tensor,
    query_time: torch.Tensor,
    pos_table: torch.Tensor,
    time_table: torch.Tensor,
    x_scale: float,
    time_bucket_seconds: float = 60.0,
    kernels: str = "auto",
    dropout_p: float = 0.0,
    seed: int = 0,
    training: bool = False,
    row_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """contextual [B, C, D], tokens [T + B, D] (history rows jagged by history_offsets, then one
    candidate row per sequence), history_timestamp int64 [T], query_time int64 [B] -> (the encoded
    sequences [T + B·(C+1), D], seq_offsets int64 [B+1]): ``concat_sequences`` then
    ``position_time_encode`` (its arguments as there), with no concatenated copy in between."""
    check_sequence_parts("encode_sequences", contextual, tokens, history_offsets)
    if contextual.dtype != tokens.dtype:
        raise ValueError(f"encode_sequences: contextual is {contextual.dtype}, tokens {tokens.dtype}: one dtype")
    num_contextual = contextual.shape[1]
    timestamps = concat_sequence_timestamps(history_timestamp, history_offsets, query_time, num_contextual)
    if resolve(kernels, tokens.device) == "pytorch":
        values, seq_offsets = concat_sequences(contextual, tokens, history_offsets)
        encoded = position_time_encode(
            values,
            seq_offsets,
            timestamps,
            query_time,
            num_contextual,
            pos_table,
            time_table,
            x_scale,
            time_bucket_seconds,
            kernels,
            dropout_p,
            seed,
            training,
            row_offset,
        )
        return encoded, seq_offsets
    seq_offsets = sequence_offsets(history_offsets, num_contextual)
    seed, row_offset = _checked(
        "encode_sequences",
        tokens.shape[1],
        seq_offsets,
        query_time,
        pos_table,
        time_table,
        time_bucket_seconds,
        dropout_p,
        seed,
        row_offset,
    )
    dropout = (dropout_p, seed, row_offset) if training and dropout_p > 0.0 else None
    args = (seq_offsets, timestamps, query_time, num_contextual, pos_table, time_table, x_scale, time_bucket_seconds)
    return _PositionTimeFn.apply(tokens, contextual, *args, dropout), seq_offsets
