"""PyTorch reference of the jagged sequence ops, built from index arithmetic (no host syncs).

A batch of B sequences is laid out as [C contextual rows, L_b history rows, 1 candidate row]
per sequence, all sequences concatenated; ``seq_offsets`` [B+1] delimits them.
"""

from __future__ import annotations

import torch


def sequence_offsets(history_offsets: torch.Tensor, num_contextual: int) -> torch.Tensor:
    """Offsets of the concatenated sequences: each sequence adds C contextual rows and a candidate."""
    steps = torch.arange(history_offsets.numel(), device=history_offsets.device, dtype=torch.int64)
    return history_offsets.to(torch.int64) + steps * (num_contextual + 1)


def _source_rows(history_offsets: torch.Tensor, num_contextual: int, num_history: int) -> torch.Tensor:
    """For each output row, its row in cat([contextual.flatten(0, 1), history, candidate])."""
    c = num_contextual
    dev = history_offsets.device
    b = history_offsets.numel() - 1
    seq_offsets = sequence_offsets(history_offsets, c)
    total = num_history + b * (c + 1)
    rows = torch.arange(total, device=dev)
    # The sequence of each output row: searchsorted on the device, no host round trip. (Searching
    # the whole offsets, not a [1:] slice: inductor mis-indexes a sliced boundaries tensor.)
    seq = torch.searchsorted(seq_offsets, rows, right=True) - 1
    pos = rows - seq_offsets[seq]
    length = seq_offsets[seq + 1] - seq_offsets[seq]
    ctx_src = seq * c + pos
    hist_src = b * c + history_offsets[seq] + (pos - c)
    cand_src = b * c + num_history + seq
    return torch.where(pos < c, ctx_src, torch.where(pos == length - 1, cand_src, hist_src))


def concat_sequences(
    contextual: torch.Tensor, history: torch.Tensor, candidate: torch.Tensor, history_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """contextual [B, C, D], history [T, D] (jagged), candidate [B, D] -> (values [T + B(C+1), D], offsets)."""
    b, c, d = contextual.shape
    src = torch.cat([contextual.reshape(b * c, d), history, candidate])
    values = src[_source_rows(history_offsets, c, history.shape[0])]
    return values, sequence_offsets(history_offsets, c)


def take_last(values: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
    """The last row of each (non-empty) sequence: [B, D]."""
    return values[seq_offsets[1:] - 1]


def concat_sequence_timestamps(
    history_timestamp: torch.Tensor, history_offsets: torch.Tensor, query_time: torch.Tensor, num_contextual: int
) -> torch.Tensor:
    """Timestamps laid out like ``concat_sequences``: the candidate row carries query_time, the
    contextual rows 0, as the reference's (so their time bucket is sqrt(query_time / unit), a coarse
    absolute date, and their time-table rows learn)."""
    c = num_contextual
    src = torch.cat(
        [
            torch.zeros(query_time.numel() * c, dtype=history_timestamp.dtype, device=history_timestamp.device),
            history_timestamp,
            query_time.to(history_timestamp.dtype),
        ]
    )
    return src[_source_rows(history_offsets, c, history_timestamp.numel())]
