"""The sparse row-wise Adagrad update of the embedding tables (FBGEMM's EXACT_ROWWISE_ADAGRAD,
weight decay 0). For the rows a batch touched, with duplicates summed:

    g      = sum of the row's gradient rows
    state += sum_d(g_d**2) / D
    w     -= lr / (sqrt(state) + eps) * g

``kernels`` picks the Triton kernel (one pass, no atomics) or the PyTorch reference (sort,
segment_reduce, index_add); both sum each row's gradients in a fixed order, so replicas of a table
on several ranks stay bit-identical. Nothing reads device values on the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import rowwise_adagrad as ref
from dlrmv4.ops.strides import unit_cols


def rowwise_adagrad_(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor | Sequence[torch.Tensor],
    lr: torch.Tensor,
    eps: float,
    kernels: str = "auto",
) -> None:
    """weight [R, D] fp32 and momentum [R] fp32 updated in place from gradient rows ``values`` [n, D]
    of rows ``ids`` [n] (int64, each in [0, R)); ``lr`` a one-element device tensor. ``values`` may
    be a list of pieces (fp32 or 16-bit) whose rows, concatenated, are the n rows: the kernel reads
    up to two pieces in place, so the gradient of each lookup is never copied into one tensor."""
    pieces = [values] if isinstance(values, torch.Tensor) else list(values)
    if weight.dim() != 2 or momentum.shape != weight.shape[:1]:
        raise ValueError(
            f"rowwise_adagrad_: weight must be [R, D] and momentum [R]; got {tuple(weight.shape)} "
            f"and {tuple(momentum.shape)}"
        )
    dim = weight.shape[1]
    if (
        ids.dim() != 1
        or ids.dtype != torch.int64
        or not pieces
        or any(v.dim() != 2 or v.shape[1] != dim for v in pieces)
        or sum(len(v) for v in pieces) != len(ids)
    ):
        raise ValueError(
            f"rowwise_adagrad_: ids must be int64 [n] and values [n, {dim}] (in pieces of {dim} "
            f"columns); got ids {tuple(ids.shape)} {ids.dtype}, values "
            f"{[tuple(v.shape) for v in pieces]}"
        )
    if ids.numel() == 0:
        return
    if resolve(kernels, weight.device) == "pytorch":
        ref.rowwise_adagrad_(weight, momentum, ids, torch.cat([v.to(weight.dtype) for v in pieces]), lr, eps)
        return
    from dlrmv4.ops.triton import rowwise_adagrad as tri

    if len(pieces) > 2:
        pieces = [torch.cat([v.to(weight.dtype) for v in pieces])]
    tri.rowwise_adagrad_(weight, momentum, ids, [unit_cols(v) for v in pieces], lr, eps)
