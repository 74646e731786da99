"""PyTorch reference of the sparse row-wise Adagrad update (FBGEMM's EXACT_ROWWISE_ADAGRAD)."""

from __future__ import annotations

import torch


def rowwise_adagrad_(
    weight: torch.Tensor, momentum: torch.Tensor, ids: torch.Tensor, values: torch.Tensor, lr: torch.Tensor, eps: float
) -> None:
    """Update for gradient rows ``values`` of rows ``ids`` (duplicates summed), in place.

    Static shapes and no host sync: the sorted ids are cut into segments, segment s sums into slot
    s (``segment_reduce``: a fixed order, so replicas on several ranks compute identical bits);
    slots past the last segment hold zero-length segments, id 0, a zero gradient and a zero
    multiplier (with eps 0 an untouched row 0 would otherwise give 0 * inf = NaN).
    """
    dim = weight.shape[1]
    sorted_ids, order = torch.sort(ids, stable=True)
    new = torch.ones_like(sorted_ids, dtype=torch.bool)
    new[1:] = sorted_ids[1:] != sorted_ids[:-1]
    segment = torch.cumsum(new, 0) - 1
    lengths = torch.zeros_like(sorted_ids).index_add_(0, segment, torch.ones_like(sorted_ids))
    rows = torch.zeros_like(sorted_ids).scatter_(0, segment, sorted_ids)
    g = torch.segment_reduce(values[order].to(weight.dtype), "sum", lengths=lengths, unsafe=True, initial=0.0)
    momentum.index_add_(0, rows, (g * g).sum(1) / dim)
    multiplier = lr / (torch.sqrt(momentum[rows]) + eps)
    multiplier = torch.where(lengths > 0, multiplier, 0.0)
    weight.index_add_(0, rows, -(g * multiplier[:, None]))
