"""PyTorch reference of the position/time encoding: x·scale + P[pos] + T[time bucket]."""

from __future__ import annotations

import torch

from dlrmv4.ops.reference.layer_norm import compute_dtype


def positions_and_buckets(seq_offsets: torch.Tensor, timestamps: torch.Tensor, query_time: torch.Tensor,
                          num_contextual: int, num_positions: int, num_buckets: int,
                          time_bucket_seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the position index and the time bucket (int64 [T'])."""
    c = num_contextual
    rows = torch.arange(timestamps.numel(), device=timestamps.device)
    seq = torch.searchsorted(seq_offsets, rows, right=True) - 1  # see reference/jagged.py on the slice
    p = rows - seq_offsets[seq]
    n = seq_offsets[seq + 1] - seq_offsets[seq]
    # History counts backwards from its end: the newest history token gets C+1, the candidate C.
    pos = torch.where(p < c, p, c + n - 1 - p).clamp(0, num_positions - 1)
    # float64 keeps the bucket exact for any int64 time difference below 2**53.
    dt = (query_time[seq] - timestamps).to(torch.float64).clamp_min(1e-6) / time_bucket_seconds
    bucket = dt.sqrt().clamp_max(num_buckets - 1).to(torch.int64)
    return pos, bucket


def position_time_encode(x: torch.Tensor, seq_offsets: torch.Tensor, timestamps: torch.Tensor,
                         query_time: torch.Tensor, num_contextual: int, pos_table: torch.Tensor,
                         time_table: torch.Tensor, x_scale: float,
                         time_bucket_seconds: float = 60.0) -> torch.Tensor:
    pos, bucket = positions_and_buckets(seq_offsets, timestamps, query_time, num_contextual,
                                        pos_table.shape[0], time_table.shape[0], time_bucket_seconds)
    acc = compute_dtype(x.dtype)
    out = x.to(acc) * x_scale + pos_table.to(acc)[pos] + time_table.to(acc)[bucket]
    return out.to(x.dtype)
