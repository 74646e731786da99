"""PyTorch reference: LayerNorm and SwishLayerNorm over the last dim, statistics in fp32 (or wider)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 at least; float64 inputs stay float64 so tests get an exact-enough yardstick.
    return torch.promote_types(dtype, torch.float32)


def _input(x: torch.Tensor, input_bias: torch.Tensor | None) -> torch.Tensor:
    """x (+ input_bias) in the compute dtype."""
    acc = compute_dtype(x.dtype)
    return x.to(acc) if input_bias is None else x.to(acc) + input_bias.to(acc)


def _ln(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    acc = x.dtype
    w = weight.to(acc) if weight is not None else None
    b = bias.to(acc) if bias is not None else None
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm(x + input_bias) (input_bias: optional [D])."""
    return _ln(_input(x, input_bias), weight, bias, eps).to(x.dtype)


def swish_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """z * sigmoid(LayerNorm(z)) with z = x + input_bias (input_bias: optional [D])."""
    z = _input(x, input_bias)
    return (z * torch.sigmoid(_ln(z, weight, bias, eps))).to(x.dtype)
