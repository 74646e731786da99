"""Small building blocks shared by the model's parts, routed through the op dispatchers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlrmv4.ops.layer_norm import layer_norm, layer_norm_plus, swish_layer_norm


def init_linear(linear: nn.Linear, normal: bool = False) -> nn.Linear:
    """Xavier weights (uniform; ``normal``: the normal draw of the same variance) and zero biases.
    The reference draws its MLPs' weights Xavier-uniform and then re-draws every Linear of its
    sequence model outside the STU layers (the preprocessor's and the postprocessor's) Xavier-normal."""
    if normal:
        nn.init.xavier_normal_(linear.weight)
    else:
        nn.init.xavier_uniform_(linear.weight)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
    return linear


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps, self.kernels = eps, kernels

    def forward(self, x: torch.Tensor, input_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``input_bias``: the bias a GEMM added into x, whose gradient the norm gives (``ops/layer_norm.py``)."""
        return layer_norm(x, self.weight, self.bias, self.eps, kernels=self.kernels, input_bias=input_bias)

    def plus(self, x: torch.Tensor, addend: torch.Tensor, input_bias: torch.Tensor | None = None) -> torch.Tensor:
        """forward(x) + addend in one pass (``layer_norm_plus``)."""
        return layer_norm_plus(x, self.weight, self.bias, self.eps, addend, kernels=self.kernels, input_bias=input_bias)


class SwishLayerNorm(LayerNorm):
    """x * sigmoid(LayerNorm(x))."""

    def forward(self, x: torch.Tensor, input_bias: torch.Tensor | None = None) -> torch.Tensor:
        return swish_layer_norm(x, self.weight, self.bias, self.eps, kernels=self.kernels, input_bias=input_bias)


class Tower(nn.Sequential):
    """Linear(in -> hidden) -> SwishLayerNorm -> Linear(hidden -> out) -> LayerNorm: every MLP of the model (docs/model.md)

    ``tower(a, b, ...)`` takes its input in column blocks, as if ``torch.cat([a, b, ...], -1)``: the
    first Linear multiplies each block by its slice of the weight and accumulates in the GEMM
    (``addmm``), so the concatenation (a full copy of the token rows) is never built.
    ``tower(..., plus=t)`` is ``tower(...) + t``, the sum taken inside the last norm.
    Each Linear's bias is added in its GEMM and gets its gradient from the norm after it
    (``input_bias``: the norm's backward sums the rows it writes), not from a reduction of its own.
    """

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float, kernels: str, normal: bool = False) -> None:
        super().__init__(
            init_linear(nn.Linear(in_dim, hidden), normal),
            SwishLayerNorm(hidden, eps, kernels),
            init_linear(nn.Linear(hidden, out_dim), normal),
            LayerNorm(out_dim, eps, kernels),
        )

    def forward(self, *blocks: torch.Tensor, plus: torch.Tensor | None = None) -> torch.Tensor:
        first, swish_norm, second, norm = self
        # as __init__ lays them out
        assert isinstance(first, nn.Linear) and isinstance(second, nn.Linear) and isinstance(norm, LayerNorm)
        widths = [x.shape[-1] for x in blocks]
        if sum(widths) != first.in_features:
            raise ValueError(f"Tower: input blocks of widths {widths} do not add up to {first.in_features}")
        weights = first.weight.split(widths, dim=1)
        h = F.linear(blocks[0], weights[0], _detached(first.bias))
        for x, w in zip(blocks[1:], weights[1:]):
            # In place, so h is not copied first (the GEMM's backward needs only x and w); autocast
            # leaves in-place ops alone, so the operands take h's dtype here as it would give them.
            h = h.addmm_(x.to(h.dtype), w.t().to(h.dtype))
        h = F.linear(swish_norm(h, input_bias=first.bias), second.weight, _detached(second.bias))
        return norm(h, input_bias=second.bias) if plus is None else norm.plus(h, plus, input_bias=second.bias)


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias for the GEMM's forward alone: its gradient comes from the norm after the GEMM."""
    return None if bias is None else bias.detach()
