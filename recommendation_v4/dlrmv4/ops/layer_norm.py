"""LayerNorm and SwishLayerNorm (x · sigmoid(LayerNorm(x))) over the last dim.

Statistics in fp32, output in x's dtype; weight and bias may be None. ``kernels`` picks the
Triton kernel or the PyTorch reference (see ``dispatch.resolve``).
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import layer_norm as ref


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, swish):
        from dlrmv4.ops.triton import layer_norm as tri

        x2d = tri.rows_2d(x)
        y, mean, rstd = tri.forward(x2d, weight, bias, eps, swish)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.swish = swish
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from dlrmv4.ops.triton import layer_norm as tri

        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = tri.backward(x2d, weight, bias, tri.rows_2d(dy), mean, rstd, ctx.swish)
        return dx.view(dy.shape), dw, db, None, None


def _check(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (d,):
            raise ValueError(
                f"layer_norm: {name} has shape {tuple(t.shape)}, expected ({d},) for x of shape {tuple(x.shape)}"
            )


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, kernels: str = "auto"
) -> torch.Tensor:
    return _norm(x, weight, bias, eps, kernels, swish=False)


def swish_layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, kernels: str = "auto"
) -> torch.Tensor:
    return _norm(x, weight, bias, eps, kernels, swish=True)


def _norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, kernels: str, swish: bool
) -> torch.Tensor:
    _check(x, weight, bias)
    if resolve(kernels, x.device) == "pytorch":
        return (ref.swish_layer_norm if swish else ref.layer_norm)(x, weight, bias, eps)
    return _LayerNormFn.apply(x, weight, bias, eps, swish)
