"""A faster backward for TorchRec's row-wise sequence lookup.

TorchRec puts the rows of a row-wise sharded sequence lookup back into the batch's order with
``torch.index_select(rows, 0, unbucketize_permute)`` (``dist_data.SequenceEmbeddingsAwaitable``).
Autograd's backward of ``index_select`` is ``index_add_``, a scatter with atomic adds: 9.9 ms of a
164 ms step at batch 256 on an H200 (benchmarks/results/end_to_end_backends_h200.md), for a
[2.2 M, 512] bf16 gradient. The index is a permutation (every looked-up row lands in exactly one
place), so the gradient is a gather by the inverse permutation: the same numbers (one term per
row, added to nothing), without atomics. ``compat.install`` makes TorchRec's awaitable use that op; it
changes nothing else.
"""

from __future__ import annotations

import torch


class _PermuteRows(torch.autograd.Function):
    """rows[permutation] for a permutation of the rows; the backward gathers by its inverse."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(permutation)
        return rows.index_select(0, permutation)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (permutation,) = ctx.saved_tensors
        inverse = torch.empty_like(permutation)
        inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device, dtype=permutation.dtype)
        return grad.index_select(0, inverse), None


def permute_rows(rows: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
    """``rows.index_select(0, permutation)`` where ``permutation`` is a permutation of the rows."""
    if permutation.numel() != rows.shape[0]:
        raise ValueError(f"permute_rows: {permutation.numel()} indices for {rows.shape[0]} rows: not a permutation")
    return _PermuteRows.apply(rows, permutation)
