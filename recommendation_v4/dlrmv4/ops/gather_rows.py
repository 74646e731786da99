"""Row gather with a fast deterministic backward: ``out[i] = rows[index[i]]``.

The looked-up rows of a batch's distinct ids are spread to its tokens this way; the backward sums
each distinct row's token gradients. autograd's embedding backward does that in about 2.4 ms per
[730k, 512] bf16 gradient on an H100; the Triton segment sum (``triton/gather_rows.py``) reads the
gradient once. Both sum in fp32 and are deterministic.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import gather_rows as ref
from dlrmv4.ops.strides import unit_cols

__all__ = ["gather_rows", "segment_sum"]


class _GatherRowsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, index):
        ctx.save_for_backward(index)
        ctx.num_rows = rows.shape[0]
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        from dlrmv4.ops.triton import gather_rows as tri

        (index,) = ctx.saved_tensors
        return tri.segment_sum(unit_cols(grad), index, ctx.num_rows), None


def gather_rows(rows: torch.Tensor, index: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """rows [N, E], index [M] (int32/int64, in [0, N)) -> [M, E]."""
    if rows.dim() != 2 or index.dim() != 1:
        raise ValueError(
            f"gather_rows: rows must be [N, E] and index [M], got {tuple(rows.shape)}, {tuple(index.shape)}"
        )
    if resolve(kernels, rows.device) == "pytorch":
        return ref.gather_rows(rows, index)
    return _GatherRowsFn.apply(rows, index)


def segment_sum(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """grad [M, E], index [M] (in [0, num_rows)) -> [num_rows, E] in grad's dtype: row r the fp32 sum
    of grad's rows i with index[i] == r, in the same order on every run. On a GPU the Triton segment
    sum (``index_add_`` there adds with atomics, in an order that changes from run to run); on the CPU
    ``index_add_``, which adds in index order."""
    if resolve("auto", grad.device) == "pytorch":
        return ref.segment_sum(grad, index, num_rows)
    from dlrmv4.ops.triton import gather_rows as tri

    return tri.segment_sum(unit_cols(grad), index, num_rows)
