"""One STU layer as one op, with a choice of what its backward recomputes instead of keeping:

    n = LayerNorm(x);  uvqk = n W_uvqk^T + b;  y = stu_mixing(uvqk);  out = x + y W_out^T

``recompute``:
- ``none``: every op keeps what its backward reads: x and n (the norm and the projection), uvqk,
  attn, the dropout keep bits and the norms' statistics (the mixing), y (the output projection).
- ``cheap``: only x, attn and the input norm's statistics are kept; the backward recomputes n,
  uvqk and y (one layer norm, the projection GEMM, one output-block pass that draws the same
  dropout mask again): the same three tensors the reference's fused STU recomputes. With the
  Triton kernels this is one autograd function; the PyTorch reference recomputes n and uvqk under
  ``torch.utils.checkpoint`` (its attention keeps padded copies of q, k and v of its own).
- ``layer``: only x is kept and the whole layer, attention included, runs again in the backward
  (``torch.utils.checkpoint``).
Every mode computes the same function of the same inputs; dropout masks come from (seed, row), so
a recomputation draws what the forward drew. Nothing reads device values on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dlrmv4.ops.attention_kernels import attention_kernels
from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.layer_norm import layer_norm, layer_norm_and_input
from dlrmv4.ops.reference.philox import check_dropout
from dlrmv4.ops.reference.stu_mixing import split_uvqk
from dlrmv4.ops.stu_mixing import (
    attention_backward,
    check_stu_mixing_inputs,
    mixing_backward,
    output_block_backward,
    stu_mixing,
)

RECOMPUTE_MODES = ("none", "cheap", "layer")


class _ProjectedMixingFn(torch.autograd.Function):
    """y = stu_mixing(n W_uvqk^T + b_uvqk) with the Triton kernels, keeping what autograd would (n,
    the weight in n's dtype, uvqk, attn, the mask bits, the attn norm's statistics). One function so
    that the bias gradient comes from the mixing kernels' own column sums: autograd's linear would
    read the [T, W] gradient once more to sum it."""

    @staticmethod
    def forward(ctx, n, uvqk_weight, uvqk_bias, attn_norm_weight, attn_norm_bias, seq_offsets, args):
        from dlrmv4.ops.triton import output_block as tob

        dims, max_seq_len, alpha, attn_eps, dropout, attention = args
        w = uvqk_weight.to(n.dtype)
        uvqk = F.linear(n, w, uvqk_bias.to(n.dtype))
        check_stu_mixing_inputs(uvqk, seq_offsets, max_seq_len, *dims, attn_norm_weight, attn_norm_bias)
        u, v, q, k = split_uvqk(uvqk, *dims)
        attn = attention_kernels(attention, q, v).fwd(q, k, v, seq_offsets, None, max_seq_len, alpha).flatten(1)
        y, mean, rstd, keep = tob.forward(u, attn, attn_norm_weight, attn_norm_bias, attn_eps, *dropout)
        ctx.save_for_backward(n, w, uvqk, attn, attn_norm_weight, attn_norm_bias, mean, rstd, keep, seq_offsets)
        ctx.args = args
        ctx.param_dtypes = (uvqk_weight.dtype, uvqk_bias.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        n, w, uvqk, attn, attn_norm_weight, attn_norm_bias, mean, rstd, keep, seq_offsets = ctx.saved_tensors
        dims, max_seq_len, alpha, _, dropout, attention = ctx.args
        d_bias = torch.empty(uvqk.shape[1], dtype=torch.float32, device=uvqk.device)
        grad, d_attn_w, d_attn_b = mixing_backward(
            dy,
            uvqk,
            attn,
            attn_norm_weight,
            attn_norm_bias,
            mean,
            rstd,
            keep,
            seq_offsets,
            dims,
            max_seq_len,
            alpha,
            dropout[0],
            uvqk_bias_grad=d_bias,
            attention=attention,
        )
        del uvqk
        d_weight = grad.t().mm(n)
        dn = grad.mm(w)
        weight_dtype, bias_dtype = ctx.param_dtypes
        return dn, d_weight.to(weight_dtype), d_bias.to(bias_dtype), d_attn_w, d_attn_b, None, None


class _CheapRecomputeFn(torch.autograd.Function):
    """The Triton layer keeping x, attn and the input norm's statistics only (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        x,
        norm_weight,
        norm_bias,
        uvqk_weight,
        uvqk_bias,
        attn_norm_weight,
        attn_norm_bias,
        out_weight,
        seq_offsets,
        args,
    ):
        from dlrmv4.ops.triton import layer_norm as tln
        from dlrmv4.ops.triton import output_block as tob

        dims, max_seq_len, alpha, norm_eps, attn_eps, dropout, attention = args
        n, mean, rstd = tln.forward(x, norm_weight, norm_bias, norm_eps, swish=False)
        uvqk = F.linear(n, uvqk_weight.to(x.dtype), uvqk_bias.to(x.dtype))
        u, v, q, k = split_uvqk(uvqk, *dims)
        attn = attention_kernels(attention, q, v).fwd(q, k, v, seq_offsets, None, max_seq_len, alpha).flatten(1)
        y = tob.forward(u, attn, attn_norm_weight, attn_norm_bias, attn_eps, *dropout)[0]
        ctx.save_for_backward(
            x,
            mean,
            rstd,
            attn,
            norm_weight,
            norm_bias,
            uvqk_weight,
            uvqk_bias,
            attn_norm_weight,
            attn_norm_bias,
            out_weight,
            seq_offsets,
        )
        ctx.args = args
        return torch.addmm(x, y, out_weight.to(x.dtype).t())

    @staticmethod
    def backward(ctx, dout):
        from dlrmv4.ops.triton import layer_norm as tln
        from dlrmv4.ops.triton import output_block as tob

        (
            x,
            mean,
            rstd,
            attn,
            norm_weight,
            norm_bias,
            uvqk_weight,
            uvqk_bias,
            attn_norm_weight,
            attn_norm_bias,
            out_weight,
            seq_offsets,
        ) = ctx.saved_tensors
        dims, max_seq_len, alpha, norm_eps, attn_eps, dropout, attention = ctx.args
        dt = x.dtype
        dout = dout.contiguous()
        # Recompute n, uvqk and y (the same kernels on the same inputs: the same values and mask).
        n = tln.forward(x, norm_weight, norm_bias, norm_eps, swish=False)[0]
        w_uvqk = uvqk_weight.to(dt)
        uvqk = F.linear(n, w_uvqk, uvqk_bias.to(dt))
        u = split_uvqk(uvqk, *dims)[0]
        y, attn_mean, attn_rstd, keep = tob.forward(u, attn, attn_norm_weight, attn_norm_bias, attn_eps, *dropout)
        w_out = out_weight.to(dt)
        d_out_weight = dout.t().mm(y)
        dy = dout.mm(w_out)
        del y
        # Every column of grad and of the bias gradient is written: u's by the output block, v, q,
        # k's by the attention (dy and the mask are freed before the attention's backward).
        grad = torch.empty(uvqk.shape, dtype=dt, device=uvqk.device)
        d_uvqk_bias = torch.empty(uvqk.shape[1], dtype=torch.float32, device=uvqk.device)
        dattn, d_attn_w, d_attn_b = output_block_backward(
            dy,
            uvqk,
            attn,
            attn_norm_weight,
            attn_norm_bias,
            attn_mean,
            attn_rstd,
            keep,
            dims,
            dropout[0],
            grad,
            d_uvqk_bias,
        )
        del dy, keep
        attention_backward(dattn, uvqk, seq_offsets, dims, max_seq_len, alpha, grad, d_uvqk_bias, attention)
        del uvqk, dattn
        d_uvqk_weight = grad.t().mm(n)
        dn = grad.mm(w_uvqk)
        del grad, n
        # The residual's gradient (dout) is added inside the norm's backward.
        dx, d_norm_w, d_norm_b = tln.backward(
            x, norm_weight, norm_bias, dn, mean, rstd, swish=False, residual_grad=dout
        )
        return (
            dx,
            d_norm_w,
            d_norm_b,
            d_uvqk_weight.to(uvqk_weight.dtype),
            d_uvqk_bias.to(uvqk_bias.dtype),
            d_attn_w,
            d_attn_b,
            d_out_weight.to(out_weight.dtype),
            None,
            None,
        )


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the layer's GEMMs and kernels run in: autocast's when it is on, else x's."""
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def stu_layer(
    x: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    *,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    norm_eps: float,
    uvqk_weight: torch.Tensor,
    uvqk_bias: torch.Tensor,
    attn_norm_weight: torch.Tensor,
    attn_norm_bias: torch.Tensor,
    out_weight: torch.Tensor,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
    attn_eps: float,
    dropout_p: float,
    seed: int,
    training: bool,
    row_offset: int = 0,
    recompute: str = "none",
    kernels: str = "auto",
    consume_input: bool = False,
    attention: str = "auto",
) -> torch.Tensor:
    """x [T, D] (jagged by seq_offsets) -> x + STU(x), in x's dtype; ``max_seq_len`` is the
    attention's N; dropout masks from (``seed``, ``row_offset`` + row); ``recompute`` as in the
    module docstring. ``consume_input``: without gradients (nothing keeps x for a backward) the
    output is written over x, the residual GEMM adding into x instead of into a copy of it (the
    same GEMM: torch.addmm copies its C operand into the output first). ``attention``: which
    kernels run the attention with the Triton path (``ops/attention_kernels.py``)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"stu_layer: recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if x.dim() != 2 or x.shape[1] != uvqk_weight.shape[1]:
        raise ValueError(f"stu_layer: x must be [T, {uvqk_weight.shape[1]}], got {tuple(x.shape)}")
    dims = (num_heads, qk_dim, v_dim)
    seed, row_offset = check_dropout("stu_layer", dropout_p, seed, row_offset)

    def project(x: torch.Tensor) -> torch.Tensor:
        return F.linear(layer_norm(x, norm_weight, norm_bias, norm_eps, kernels=kernels), uvqk_weight, uvqk_bias)

    grads = torch.is_grad_enabled() and (x.requires_grad or uvqk_weight.requires_grad)

    def mix_and_project(residual: torch.Tensor, uvqk: torch.Tensor) -> torch.Tensor:
        y = stu_mixing(
            uvqk,
            seq_offsets,
            max_seq_len,
            num_heads=num_heads,
            qk_dim=qk_dim,
            v_dim=v_dim,
            alpha=alpha,
            norm_weight=attn_norm_weight,
            norm_bias=attn_norm_bias,
            eps=attn_eps,
            dropout_p=dropout_p,
            seed=seed,
            training=training,
            kernels=kernels,
            row_offset=row_offset,
            attention=attention,
        )
        # x + y W_out^T in one GEMM: the residual is the GEMM's C operand, not a separate pass.
        same = residual.data_ptr() == x.data_ptr() and residual.dtype == _compute_dtype(x)
        if consume_input and not grads and same:
            # In place, operands in x's dtype as autocast gives them (it leaves in-place ops alone).
            return residual.addmm_(y.to(residual.dtype), out_weight.t().to(residual.dtype))
        return torch.addmm(residual, y, out_weight.t())

    def whole(x: torch.Tensor) -> torch.Tensor:
        # The norm hands x back for the residual, so x's two gradients meet inside its backward.
        n, residual = layer_norm_and_input(x, norm_weight, norm_bias, norm_eps, kernels=kernels)
        if resolve(kernels, x.device) == "pytorch" or not torch.is_grad_enabled():
            return mix_and_project(residual, F.linear(n, uvqk_weight, uvqk_bias))
        args = (dims, int(max_seq_len), float(alpha), attn_eps, (dropout_p, seed, training, row_offset), attention)
        n = n.to(_compute_dtype(x))
        y = _ProjectedMixingFn.apply(n, uvqk_weight, uvqk_bias, attn_norm_weight, attn_norm_bias, seq_offsets, args)
        return torch.addmm(residual, y, out_weight.t())

    if recompute == "none" or not grads:
        return whole(x)
    if recompute == "layer":
        return checkpoint(whole, x, use_reentrant=False)
    if resolve(kernels, x.device) == "pytorch":
        return mix_and_project(x, checkpoint(project, x, use_reentrant=False))
    x = x.to(_compute_dtype(x))
    dropout = (dropout_p, seed, training, row_offset)
    args = (dims, int(max_seq_len), float(alpha), norm_eps, attn_eps, dropout, attention)
    return _CheapRecomputeFn.apply(
        x.contiguous(),
        norm_weight,
        norm_bias,
        uvqk_weight,
        uvqk_bias,
        attn_norm_weight,
        attn_norm_bias,
        out_weight,
        seq_offsets,
        args,
    )
