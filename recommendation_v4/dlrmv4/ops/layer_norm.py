"""LayerNorm and SwishLayerNorm (x · sigmoid(LayerNorm(x))) over the last dim.

Statistics in fp32, output in x's dtype; weight and bias may be None. ``kernels`` picks the
Triton kernel or the PyTorch reference (see ``dispatch.resolve``).

``layer_norm_plus`` adds a tensor to the norm inside the kernel (rounded as the two ops would
round): a sum of norms (the preprocessor's towers) takes no [N, D] add pass of its own.

``layer_norm_and_input`` also hands back x itself (or some of its rows), for a residual that adds
x back after the layer: x then has one use, and the backward adds the residual's gradient inside
the norm's backward (or into the rows it took) instead of autograd summing two [N, D] gradients
in a pass of their own.

``input_bias`` (of ``layer_norm``, ``layer_norm_plus``, ``swish_layer_norm``) names the bias a GEMM
already added into x (``F.linear(a, w, input_bias.detach())``): the norm adds nothing in the
forward, and its backward gives that bias its gradient, dx summed over the rows. The Triton
backward sums dx in registers, so the GEMM's backward has no [N, D] reduction pass for it.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import layer_norm as ref


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, swish, addend, input_bias):
        from dlrmv4.ops.triton import layer_norm as tri

        x2d = tri.rows_2d(x)
        plus = tri.rows_2d(addend) if addend is not None else None
        y, mean, rstd = tri.forward(x2d, weight, bias, eps, swish, addend=plus)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.swish = swish
        ctx.addend_shape = addend.shape if addend is not None else None
        ctx.input_bias_dtype = input_bias.dtype if input_bias is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from dlrmv4.ops.triton import layer_norm as tri

        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        dx_sum = None
        if ctx.needs_input_grad[6]:
            dx_sum = torch.empty(x2d.shape[1], device=x2d.device, dtype=torch.float32)
        dx, dw, db = tri.backward(x2d, weight, bias, tri.rows_2d(dy), mean, rstd, ctx.swish, dx_sum=dx_sum)
        d_addend = dy.view(ctx.addend_shape) if ctx.addend_shape is not None else None
        d_input_bias = dx_sum.to(ctx.input_bias_dtype) if dx_sum is not None else None
        return dx.view(dy.shape), dw, db, None, None, d_addend, d_input_bias


class _InputBiasGradFn(torch.autograd.Function):
    """x, unchanged; the backward gives ``input_bias`` x's gradient summed over the rows (the
    reference path's form of ``input_bias``: the reduction the GEMM's own backward would make)."""

    @staticmethod
    def forward(ctx, x, input_bias):
        ctx.input_bias_dtype = input_bias.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return dx, dx.reshape(-1, dx.shape[-1]).sum(0).to(ctx.input_bias_dtype)


class _LayerNormAndInputFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, rows):
        from dlrmv4.ops.triton import layer_norm as tri

        x2d = tri.rows_2d(x)
        y, mean, rstd = tri.forward(x2d, weight, bias, eps, False)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd, rows)
        ctx.all_rows = rows is None
        # x itself comes back as a view (autograd routes its gradient to this function's backward).
        return y, (x if rows is None else x.index_select(0, rows))

    @staticmethod
    def backward(ctx, dy, d_input):
        from dlrmv4.ops.triton import layer_norm as tri

        x2d, weight, bias, mean, rstd, rows = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x2d)
        if ctx.all_rows:
            residual = tri.rows_2d(d_input) if d_input is not None else None
            dx, dw, db = tri.backward(x2d, weight, bias, tri.rows_2d(dy), mean, rstd, False, residual_grad=residual)
        else:
            dx, dw, db = tri.backward(x2d, weight, bias, tri.rows_2d(dy), mean, rstd, False)
            if d_input is not None:
                dx.index_add_(0, rows, d_input.to(dx.dtype))
        return dx, dw, db, None, None


def layer_norm_and_input(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    rows: torch.Tensor | None = None,
    kernels: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(LayerNorm(x), x) for x [N, D], or (LayerNorm(x), x[rows]) with ``rows`` (int64 [R]): the
    norm and the residual a layer adds back (see the module docstring)."""
    _check(x, weight, bias)
    if x.dim() != 2:
        raise ValueError(f"layer_norm_and_input: x must be [N, D], got {tuple(x.shape)}")
    if resolve(kernels, x.device) == "pytorch":
        n = ref.layer_norm(x, weight, bias, eps)
        return n, (x if rows is None else x.index_select(0, rows))
    return _LayerNormAndInputFn.apply(x, weight, bias, eps, rows)


def _check(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, input_bias: torch.Tensor | None = None
) -> None:
    d = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias), ("input_bias", input_bias)):
        if t is not None and tuple(t.shape) != (d,):
            raise ValueError(
                f"layer_norm: {name} has shape {tuple(t.shape)}, expected ({d},) for x of shape {tuple(x.shape)}"
            )


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kernels: str = "auto",
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _norm(x, weight, bias, eps, kernels, swish=False, input_bias=input_bias)


def layer_norm_plus(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    addend: torch.Tensor,
    kernels: str = "auto",
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm(x) + addend (addend of x's shape), bit for bit as the two ops give it; one pass
    where both are in x's dtype (see the module docstring)."""
    if addend.shape != x.shape:
        raise ValueError(f"layer_norm_plus: addend has shape {tuple(addend.shape)}, x has {tuple(x.shape)}")
    if addend.dtype != x.dtype:  # the add's type promotion is the two ops' own
        return layer_norm(x, weight, bias, eps, kernels, input_bias) + addend
    return _norm(x, weight, bias, eps, kernels, swish=False, addend=addend, input_bias=input_bias)


def swish_layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kernels: str = "auto",
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    return _norm(x, weight, bias, eps, kernels, swish=True, input_bias=input_bias)


def _norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    kernels: str,
    swish: bool,
    addend: torch.Tensor | None = None,
    input_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    _check(x, weight, bias, input_bias)
    if resolve(kernels, x.device) == "pytorch":
        if input_bias is not None:
            x = _InputBiasGradFn.apply(x, input_bias)
        y = (ref.swish_layer_norm if swish else ref.layer_norm)(x, weight, bias, eps)
        return y if addend is None else y + addend
    return _LayerNormFn.apply(x, weight, bias, eps, swish, addend, input_bias)
