"""Small building blocks shared by the model's parts, routed through the op dispatchers."""

from __future__ import annotations

import torch
from torch import nn

from dlrmv4.ops.layer_norm import layer_norm, swish_layer_norm


def init_linear(linear: nn.Linear) -> nn.Linear:
    """Xavier-uniform weights and zero biases everywhere (the reference's STU init, used model-wide)."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, kernels=self.kernels)


class SwishLayerNorm(LayerNorm):
    """x * sigmoid(LayerNorm(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swish_layer_norm(x, self.weight, self.bias, self.eps, kernels=self.kernels)


class Tower(nn.Sequential):
    """Linear(in -> hidden) -> SwishLayerNorm -> Linear(hidden -> out) -> LayerNorm: every MLP of SPEC §5."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int, eps: float, kernels: str) -> None:
        super().__init__(init_linear(nn.Linear(in_dim, hidden)), SwishLayerNorm(hidden, eps, kernels),
                         init_linear(nn.Linear(hidden, out_dim)), LayerNorm(out_dim, eps, kernels))
