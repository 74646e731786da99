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

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.layer_norm import layer_norm, layer_norm_and_input
from dlrmv4.ops.reference.stu_mixing import split_uvqk
from dlrmv4.ops.stu_mixing import stu_mixing

RECOMPUTE_MODES = ("none", "cheap", "layer")


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
        from dlrmv4.ops.triton.attention import attention_fwd

        dims, max_seq_len, alpha, norm_eps, attn_eps, dropout = args
        n, mean, rstd = tln.forward(x, norm_weight, norm_bias, norm_eps, swish=False)
        uvqk = F.linear(n, uvqk_weight.to(x.dtype), uvqk_bias.to(x.dtype))
        u, v, q, k = split_uvqk(uvqk, *dims)
        attn = attention_fwd(q, k, v, seq_offsets, None, max_seq_len, alpha).flatten(1)
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
        from dlrmv4.ops.triton.attention import attention_bwd

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
        dims, max_seq_len, alpha, norm_eps, attn_eps, dropout = ctx.args
        dt = x.dtype
        dout = dout.contiguous()
        # Recompute n, uvqk and y (the same kernels on the same inputs: the same values and mask).
        n = tln.forward(x, norm_weight, norm_bias, norm_eps, swish=False)[0]
        w_uvqk = uvqk_weight.to(dt)
        uvqk = F.linear(n, w_uvqk, uvqk_bias.to(dt))
        u, v, q, k = split_uvqk(uvqk, *dims)
        y, attn_mean, attn_rstd, keep = tob.forward(u, attn, attn_norm_weight, attn_norm_bias, attn_eps, *dropout)
        w_out = out_weight.to(dt)
        d_out_weight = dout.t().mm(y)
        dy = dout.mm(w_out)
        del y
        grad = torch.empty(uvqk.shape, dtype=dt, device=uvqk.device)
        du, dv, dq, dk = split_uvqk(grad, *dims)
        _, dattn, d_attn_w, d_attn_b = tob.backward(
            u, attn, attn_norm_weight, attn_norm_bias, dy, attn_mean, attn_rstd, keep, dropout[0], du_out=du
        )
        del dy, keep
        attention_bwd(
            dattn.unflatten(1, (dims[0], dims[2])), q, k, v, seq_offsets, None, max_seq_len, alpha, out=(dq, dk, dv)
        )
        del uvqk, dattn
        d_uvqk_weight = grad.t().mm(n)
        d_uvqk_bias = grad.sum(0, dtype=torch.float32)
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
) -> torch.Tensor:
    """x [T, D] (jagged by seq_offsets) -> x + STU(x), in x's dtype; ``max_seq_len`` is the
    attention's N; dropout masks from (``seed``, ``row_offset`` + row); ``recompute`` as in the
    module docstring."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"stu_layer: recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if x.dim() != 2 or x.shape[1] != uvqk_weight.shape[1]:
        raise ValueError(f"stu_layer: x must be [T, {uvqk_weight.shape[1]}], got {tuple(x.shape)}")

    def project(x: torch.Tensor) -> torch.Tensor:
        return F.linear(layer_norm(x, norm_weight, norm_bias, norm_eps, kernels=kernels), uvqk_weight, uvqk_bias)

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
        )
        # x + y W_out^T in one GEMM: the residual is the GEMM's C operand, not a separate pass.
        return torch.addmm(residual, y, out_weight.t())

    def whole(x: torch.Tensor) -> torch.Tensor:
        # The norm hands x back for the residual, so x's two gradients meet inside its backward.
        n, residual = layer_norm_and_input(x, norm_weight, norm_bias, norm_eps, kernels=kernels)
        return mix_and_project(residual, F.linear(n, uvqk_weight, uvqk_bias))

    grads = torch.is_grad_enabled() and (x.requires_grad or uvqk_weight.requires_grad)
    if recompute == "none" or not grads:
        return whole(x)
    if recompute == "layer":
        return checkpoint(whole, x, use_reentrant=False)
    if resolve(kernels, x.device) == "pytorch":
        return mix_and_project(x, checkpoint(project, x, use_reentrant=False))
    dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
    x = x.to(dtype)
    dropout = (dropout_p, seed, training, row_offset)
    args = ((num_heads, qk_dim, v_dim), int(max_seq_len), float(alpha), norm_eps, attn_eps, dropout)
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
