"""The layouts the kernels take for a tensor's rows: unit stride along the last dim, and rows a TMA
descriptor can read."""

from __future__ import annotations

import torch


def unit_cols(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim has unit stride (any row stride), else a contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def tma_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] itself when a TMA descriptor can read it as [T, H * D] rows (heads side by side,
    the row stride and the start multiples of 16 bytes), else a contiguous copy."""
    _, heads, dim = x.shape
    aligned = (x.stride(0) * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
    return x if (heads == 1 or x.stride(1) == dim) and aligned else x.clone(memory_format=torch.contiguous_format)
