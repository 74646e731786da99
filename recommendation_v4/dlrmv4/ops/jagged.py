"""Jagged sequence assembly for the HSTU model.

``concat_sequences`` lays each user's sequence out as [C contextual rows, L_b history rows,
1 candidate row], all users concatenated; ``take_last`` picks each sequence's last row (the
candidate); ``concat_sequence_timestamps`` lays timestamps out the same way (PyTorch only: pure
index arithmetic). Offsets are int64 [B+1] starting at 0; no op reads device values on the host.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import jagged as ref
from dlrmv4.ops.reference.jagged import concat_sequence_timestamps

__all__ = ["concat_sequences", "take_last", "concat_sequence_timestamps"]


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _ConcatFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, contextual, history, history_offsets, candidate, max_history_len):
        from dlrmv4.ops.triton import jagged as tri

        values = tri.concat_forward(_unit_cols(contextual), _unit_cols(history), history_offsets,
                                    _unit_cols(candidate), max_history_len)
        ctx.save_for_backward(history_offsets)
        ctx.shapes = (contextual.shape, history.shape, candidate.shape)
        ctx.max_history_len = max_history_len
        return values

    @staticmethod
    def backward(ctx, grad):
        from dlrmv4.ops.triton import jagged as tri

        (history_offsets,) = ctx.saved_tensors
        dctx, dhist, dcand = tri.concat_backward(_unit_cols(grad), history_offsets, ctx.shapes, ctx.max_history_len)
        return dctx, dhist, None, dcand, None


def concat_sequences(contextual: torch.Tensor, history: torch.Tensor, history_offsets: torch.Tensor,
                     candidate: torch.Tensor, max_history_len: int,
                     kernels: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """contextual [B, C, D], history [T, D] jagged by history_offsets, candidate [B, D] ->
    (values [T + B·(C+1), D], seq_offsets int64 [B+1]).

    ``max_history_len`` must be at least the longest history (it sizes the kernel's grid; rows
    past it would not be copied).
    """
    b, c, d = contextual.shape
    if history.dim() != 2 or history.shape[1] != d or tuple(candidate.shape) != (b, d):
        raise ValueError(f"concat_sequences: expected history [T, {d}] and candidate [{b}, {d}], got "
                         f"{tuple(history.shape)} and {tuple(candidate.shape)}")
    if history_offsets.dtype != torch.int64 or history_offsets.numel() != b + 1:
        raise ValueError(f"concat_sequences: history_offsets must be int64 [{b + 1}], got "
                         f"{history_offsets.dtype} {tuple(history_offsets.shape)}")
    if resolve(kernels, history.device) == "pytorch":
        return ref.concat_sequences(contextual, history, history_offsets, candidate)
    values = _ConcatFn.apply(contextual, history, history_offsets, candidate, max_history_len)
    return values, ref.sequence_offsets(history_offsets, c)


class _TakeLastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, seq_offsets):
        from dlrmv4.ops.triton import jagged as tri

        ctx.save_for_backward(seq_offsets)
        ctx.num_rows = values.shape[0]
        return tri.take_last_forward(_unit_cols(values), seq_offsets)

    @staticmethod
    def backward(ctx, grad):
        from dlrmv4.ops.triton import jagged as tri

        (seq_offsets,) = ctx.saved_tensors
        return tri.take_last_backward(_unit_cols(grad), seq_offsets, ctx.num_rows), None


def take_last(values: torch.Tensor, seq_offsets: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """values [T', D] -> [B, D], the last row of each sequence (every sequence must be non-empty)."""
    if values.dim() != 2:
        raise ValueError(f"take_last: values must be [T', D], got {tuple(values.shape)}")
    if resolve(kernels, values.device) == "pytorch":
        return ref.take_last(values, seq_offsets)
    return _TakeLastFn.apply(values, seq_offsets)
