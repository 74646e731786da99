"""PyTorch reference of the position/time encoding: Dropout(x·scale + P[pos] + T[time bucket]).

The dropout mask is the Triton kernel's (layout in triton/position.py), drawn with torch integer
ops (reference/philox.py): row r = row_offset + local row, column c of D, group g = c // 8 takes
``randint4x(seed, r * ceil(D / 8) + g)`` = n0..n3; column 8g + 2i is the low, 8g + 2i + 1 the high
16 bits of n_i; kept iff >= round(p * 2^16), kept values scaled by 1 / (1 - p).
"""

from __future__ import annotations

import torch

from dlrmv4.ops.reference.layer_norm import compute_dtype
from dlrmv4.ops.reference.philox import COUNTERS_PER_CHUNK, check_dropout, dropout_threshold, keep_decisions


def positions_and_buckets(
    seq_offsets: torch.Tensor,
    timestamps: torch.Tensor,
    query_time: torch.Tensor,
    num_contextual: int,
    num_positions: int,
    num_buckets: int,
    time_bucket_seconds: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the position index and the time bucket (int64 [T'])."""
    c = num_contextual
    rows = torch.arange(timestamps.numel(), device=timestamps.device)
    seq = torch.searchsorted(seq_offsets, rows, right=True) - 1  # see reference/jagged.py on the slice
    p = rows - seq_offsets[seq]
    n = seq_offsets[seq + 1] - seq_offsets[seq]
    # History counts backwards from its end: the newest history token gets C+1, the candidate C.
    pos = torch.where(p < c, p, c + n - 1 - p).clamp(0, num_positions - 1)
    # The reference model's arithmetic: the int64 gap in fp32, at least 1e-6, divided by the unit
    # in fp32, its square root, truncated, at most the last row. Division and square root are the
    # IEEE fp32 ones (the Triton kernel's div_rn and sqrt_rn): done in fp64 and rounded to fp32,
    # which is exact for these two operations (torch's fp32 division by a scalar multiplies by its
    # reciprocal, which can move a bucket edge).
    gap = (query_time[seq] - timestamps).to(torch.float32).clamp_min(1e-6)
    unit = float(torch.tensor(time_bucket_seconds, dtype=torch.float32))
    ratio = (gap.to(torch.float64) / unit).to(torch.float32)
    bucket = ratio.to(torch.float64).sqrt().to(torch.float32).to(torch.int64).clamp(0, num_buckets - 1)
    return pos, bucket


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
    dropout_p: float = 0.0,
    seed: int = 0,
    training: bool = False,
    row_offset: int = 0,
) -> torch.Tensor:
    """Dropout applies when ``training`` and p > 0, with the mask of ``input_dropout_keep_mask``."""
    pos, bucket = positions_and_buckets(
        seq_offsets,
        timestamps,
        query_time,
        num_contextual,
        pos_table.shape[0],
        time_table.shape[0],
        time_bucket_seconds,
    )
    acc = compute_dtype(x.dtype)
    # index_select, not [idx]: its backward (index_add_) adds the rows in order, where indexing's
    # (index_put_ with accumulate) adds them with atomics across CPU threads, so a run's bits
    # would change with the thread schedule.
    out = x.to(acc) * x_scale + pos_table.to(acc).index_select(0, pos) + time_table.to(acc).index_select(0, bucket)
    if training and dropout_p > 0.0:
        keep = input_dropout_keep_mask(x.shape[0], x.shape[1], dropout_p, seed, x.device, row_offset)
        out = out * keep.to(acc) * (1.0 / (1.0 - dropout_p))
    return out.to(x.dtype)


def input_dropout_keep_mask(
    num_rows: int, d: int, dropout_p: float, seed: int, device: torch.device | str, row_offset: int = 0
) -> torch.Tensor:
    """bool [num_rows, d]: the input dropout's keep decisions for the global rows row_offset ..
    row_offset + num_rows - 1 (see the module docstring), as the Triton kernel draws them."""
    seed, row_offset = check_dropout("input_dropout_keep_mask", dropout_p, seed, row_offset)
    device = torch.device(device)
    threshold, groups = dropout_threshold(dropout_p), (d + 7) // 8
    if threshold == 0 or num_rows == 0 or d == 0:
        return torch.ones((num_rows, d), dtype=torch.bool, device=device)
    out = torch.empty((num_rows, d), dtype=torch.bool, device=device)
    step = max(1, COUNTERS_PER_CHUNK // groups)
    for r0 in range(0, num_rows, step):
        rows = torch.arange(row_offset + r0, row_offset + min(num_rows, r0 + step), device=device)
        out[r0 : r0 + rows.numel()] = keep_decisions(seed, rows, d, threshold)
    return out
