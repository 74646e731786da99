"""PyTorch reference of the row gather ``out[i] = rows[index[i]]`` and of its backward, the sum of
each row's copies' gradients (``index_add_``, in index order on the CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """rows [N, E], index [M] -> [M, E]; autograd's embedding backward sums the gradients."""
    return F.embedding(index, rows)


def segment_sum(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """grad [M, E] -> [num_rows, E] in grad's dtype: row r is the fp32 sum of grad's rows i with
    index[i] == r."""
    out = torch.zeros((num_rows, grad.shape[1]), device=grad.device, dtype=torch.float32)
    return out.index_add_(0, index.long(), grad.float()).to(grad.dtype)
