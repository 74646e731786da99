"""PyTorch reference: LayerNorm and SwishLayerNorm over the last dim, statistics in fp32 (or wider)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 at least; float64 inputs stay float64 so tests get an exact-enough yardstick.
    return torch.promote_types(dtype, torch.float32)


def _ln(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    acc = compute_dtype(x.dtype)
    w = weight.to(acc) if weight is not None else None
    b = bias.to(acc) if bias is not None else None
    return F.layer_norm(x.to(acc), (x.shape[-1],), w, b, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _ln(x, weight, bias, eps).to(x.dtype)


def swish_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """x * sigmoid(LayerNorm(x))."""
    return (x.to(compute_dtype(x.dtype)) * torch.sigmoid(_ln(x, weight, bias, eps))).to(x.dtype)
