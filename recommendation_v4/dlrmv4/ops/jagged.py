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
from dlrmv4.ops.strides import unit_cols

__all__ = ["concat_sequences", "take_last", "concat_sequence_timestamps"]


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _ConcatFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, contextual, tokens, history_offsets, max_history_len):
        from dlrmv4.ops.triton import jagged as tri

        tokens = unit_cols(tokens)
        values = tri.concat_forward(
            unit_cols(contextual),
            *_history_and_candidate(tokens, contextual.shape[0]),
            history_offsets,
            max_history_len,
        )
        ctx.save_for_backward(history_offsets)
        ctx.shapes = (contextual.shape, tokens.shape)
        ctx.max_history_len = max_history_len
        return values

    @staticmethod
    def backward(ctx, grad):
        from dlrmv4.ops.triton import jagged as tri

        (history_offsets,) = ctx.saved_tensors
        # One gradient buffer for the tokens: the kernel writes its history and candidate rows.
        dctx, dtokens = (torch.empty(s, device=grad.device, dtype=grad.dtype) for s in ctx.shapes)
        tri.concat_backward(
            unit_cols(grad),
            history_offsets,
            dctx,
            *_history_and_candidate(dtokens, dctx.shape[0]),
            ctx.max_history_len,
        )
        return dctx, dtokens, None, None


def _history_and_candidate(tokens: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens[: tokens.shape[0] - b], tokens[tokens.shape[0] - b :]


def concat_sequences(
    contextual: torch.Tensor,
    tokens: torch.Tensor,
    history_offsets: torch.Tensor,
    max_history_len: int,
    kernels: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """contextual [B, C, D], tokens [T + B, D] (the T history rows, jagged by history_offsets, then
    one candidate row per sequence) -> (values [T + B·(C+1), D], seq_offsets int64 [B+1]).

    The tokens come as one tensor, as the model's token towers produce them: their gradient is
    one buffer too, not two slices that autograd would add into a zero-filled one.
    ``max_history_len`` must be at least the longest history (it sizes the kernel's grid; rows
    past it would not be copied).
    """
    b, c, d = contextual.shape
    if tokens.dim() != 2 or tokens.shape[1] != d or tokens.shape[0] < b:
        raise ValueError(
            f"concat_sequences: expected tokens [T + {b}, {d}] (history rows, then {b} candidate "
            f"rows), got {tuple(tokens.shape)}"
        )
    if history_offsets.dtype != torch.int64 or history_offsets.numel() != b + 1:
        raise ValueError(
            f"concat_sequences: history_offsets must be int64 [{b + 1}], got "
            f"{history_offsets.dtype} {tuple(history_offsets.shape)}"
        )
    if resolve(kernels, tokens.device) == "pytorch":
        return ref.concat_sequences(contextual, *_history_and_candidate(tokens, b), history_offsets)
    values = _ConcatFn.apply(contextual, tokens, history_offsets, max_history_len)
    return values, ref.sequence_offsets(history_offsets, c)


class _TakeLastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, seq_offsets):
        from dlrmv4.ops.triton import jagged as tri

        ctx.save_for_backward(seq_offsets)
        ctx.num_rows = values.shape[0]
        return tri.take_last_forward(unit_cols(values), seq_offsets)

    @staticmethod
    def backward(ctx, grad):
        from dlrmv4.ops.triton import jagged as tri

        (seq_offsets,) = ctx.saved_tensors
        return tri.take_last_backward(unit_cols(grad), seq_offsets, ctx.num_rows), None


def take_last(values: torch.Tensor, seq_offsets: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """values [T', D] -> [B, D], the last row of each sequence (every sequence must be non-empty)."""
    if values.dim() != 2:
        raise ValueError(f"take_last: values must be [T', D], got {tuple(values.shape)}")
    if resolve(kernels, values.device) == "pytorch":
        return ref.take_last(values, seq_offsets)
    return _TakeLastFn.apply(values, seq_offsets)
