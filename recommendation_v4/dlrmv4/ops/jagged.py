"""Jagged sequence assembly for the HSTU model.

``concat_sequences`` lays each user's sequence out as [C contextual rows, L_b history rows,
1 candidate row], all users concatenated (PyTorch only: the model's Triton path reads the parts
in place, ``position.encode_sequences``); ``take_last`` picks each sequence's last row (the
candidate); ``concat_sequence_timestamps`` lays timestamps out the same way (PyTorch only: pure
index arithmetic). Offsets are int64 [B+1] starting at 0; no op reads device values on the host.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import jagged as ref
from dlrmv4.ops.reference.jagged import concat_sequence_timestamps
from dlrmv4.ops.strides import unit_cols

__all__ = ["check_sequence_parts", "concat_sequences", "take_last", "concat_sequence_timestamps"]


def check_sequence_parts(
    op: str, contextual: torch.Tensor, tokens: torch.Tensor, history_offsets: torch.Tensor
) -> None:
    """The sequences' parts as ``concat_sequences`` takes them, or a ValueError naming ``op``."""
    if contextual.dim() != 3:
        raise ValueError(f"{op}: contextual must be [B, C, D], got {tuple(contextual.shape)}")
    b, _, d = contextual.shape
    if tokens.dim() != 2 or tokens.shape[1] != d or tokens.shape[0] < b:
        raise ValueError(
            f"{op}: expected tokens [T + {b}, {d}] (history rows, then {b} candidate rows), got {tuple(tokens.shape)}"
        )
    if history_offsets.dtype != torch.int64 or history_offsets.numel() != b + 1:
        raise ValueError(
            f"{op}: history_offsets must be int64 [{b + 1}], got {history_offsets.dtype} {tuple(history_offsets.shape)}"
        )


def concat_sequences(
    contextual: torch.Tensor, tokens: torch.Tensor, history_offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """contextual [B, C, D], tokens [T + B, D] (the T history rows, jagged by history_offsets, then
    one candidate row per sequence) -> (values [T + B·(C+1), D], seq_offsets int64 [B+1]). The
    layout, in PyTorch: the model reads its sequences through ``position.encode_sequences``, whose
    kernel reads each row from its part instead of from this copy."""
    check_sequence_parts("concat_sequences", contextual, tokens, history_offsets)
    b = contextual.shape[0]
    return ref.concat_sequences(
        contextual, tokens[: tokens.shape[0] - b], tokens[tokens.shape[0] - b :], history_offsets
    )


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
