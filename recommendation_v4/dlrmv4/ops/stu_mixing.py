"""The middle of an STU layer as one op: from the projection output uvqk to y, the input of the
output projection.

    [u | v | q | k] = uvqk              column blocks: u, v H·Dv wide, q, k H·Dqk wide
    attn = HSTU attention(q, k, v)      SiLU(alpha q k^T) / N, causal (ops/attention.py)
    y = Dropout([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)])       [T, 3·H·Dv] (ops/output_block.py)

``stu_mixing(uvqk, seq_offsets, max_seq_len, *, num_heads, qk_dim, v_dim, alpha, norm_weight,
norm_bias, eps, dropout_p, seed, training, kernels="auto", keep_mask=None, row_offset=0)``. With ``pytorch`` it
composes the reference ops under autograd. With ``triton`` it is one autograd function: the
kernels read u, v, q, k as strided views of uvqk, SiLU(u) happens inside the output block, and the
backward writes du, dv, dq, dk straight into their columns of one gradient buffer, so there is no
activation pass and no concatenation of the four gradients. Dropout is the output block's, the
same in both paths: a pure function of (seed, row_offset + local row, column), so a chunk of
sequences passed with ``row_offset`` = its first row draws the unchunked call's mask for its rows
(``output_block_keep_mask`` gives it). Nothing reads device values on the host.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.attention import check_attention_inputs, check_triton_attention_inputs
from dlrmv4.ops.attention_kernels import attention_kernels
from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import stu_mixing as ref
from dlrmv4.ops.reference.philox import check_dropout
from dlrmv4.ops.reference.stu_mixing import split_uvqk
from dlrmv4.ops.strides import unit_cols


def _bias_grad_slices(
    bias_grad: torch.Tensor | None, dims: tuple[int, int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The u, v, q, k slices of a uvqk bias gradient [W] (contiguous views), or None."""
    if bias_grad is None:
        return None
    num_heads, qk_dim, v_dim = dims
    hv, hqk = num_heads * v_dim, num_heads * qk_dim
    u, v, q, k = torch.split(bias_grad, [hv, hv, hqk, hqk])
    return u, v, q, k


def output_block_backward(
    dy: torch.Tensor,
    uvqk: torch.Tensor,
    attn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    keep: torch.Tensor | None,
    dims: tuple[int, int, int],
    dropout_p: float,
    grad: torch.Tensor,
    uvqk_bias_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The mixing backward's first half (Triton): du into the u columns of ``grad`` [T, W] (and its
    sum over rows into the u slice of ``uvqk_bias_grad``, contiguous fp32 [W], when given). Returns
    (dattn, the attn norm's weight and bias gradients); dy and keep are not needed after it."""
    from dlrmv4.ops.triton import output_block as tob

    sums = _bias_grad_slices(uvqk_bias_grad, dims)
    _, dattn, dw, db = tob.backward(
        split_uvqk(uvqk, *dims)[0],
        attn,
        weight,
        bias,
        unit_cols(dy),
        mean,
        rstd,
        keep,
        dropout_p,
        du_out=split_uvqk(grad, *dims)[0],
        du_sum=None if sums is None else sums[0],
    )
    return dattn, dw, db


def attention_backward(
    dattn: torch.Tensor,
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    dims: tuple[int, int, int],
    max_seq_len: int,
    alpha: float,
    grad: torch.Tensor,
    uvqk_bias_grad: torch.Tensor | None = None,
    attention: str = "auto",
) -> None:
    """The mixing backward's second half: dv, dq, dk into their columns of ``grad`` (and their sums
    over rows into the v, q, k slices of ``uvqk_bias_grad``, when given), by the attention kernels
    ``attention`` picks (``ops/attention_kernels.py``)."""
    num_heads, _, v_dim = dims
    _, v, q, k = split_uvqk(uvqk, *dims)
    _, dv, dq, dk = split_uvqk(grad, *dims)
    sums = _bias_grad_slices(uvqk_bias_grad, dims)
    attention_kernels(attention, q, v).bwd(
        dattn.unflatten(1, (num_heads, v_dim)),
        q,
        k,
        v,
        seq_offsets,
        None,
        max_seq_len,
        alpha,
        out=(dq, dk, dv),
        col_sums=None if sums is None else (sums[2], sums[3], sums[1]),
    )


def mixing_backward(
    dy: torch.Tensor,
    uvqk: torch.Tensor,
    attn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    keep: torch.Tensor | None,
    seq_offsets: torch.Tensor,
    dims: tuple[int, int, int],
    max_seq_len: int,
    alpha: float,
    dropout_p: float,
    uvqk_bias_grad: torch.Tensor | None = None,
    attention: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The Triton mixing's backward from the forward's saved values: (grad [T, W] of uvqk, the attn
    norm's weight and bias gradients). Every column of grad is written: du by the output block, dv,
    dq, dk by the attention. ``uvqk_bias_grad`` (contiguous fp32 [W]) receives grad's column sums,
    the gradient of a bias added to uvqk, from the same kernels (no pass over grad for it)."""
    grad = torch.empty(uvqk.shape, dtype=uvqk.dtype, device=uvqk.device)
    dattn, dw, db = output_block_backward(
        dy, uvqk, attn, weight, bias, mean, rstd, keep, dims, dropout_p, grad, uvqk_bias_grad
    )
    attention_backward(dattn, uvqk, seq_offsets, dims, max_seq_len, alpha, grad, uvqk_bias_grad, attention)
    return grad, dw, db


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _STUMixingFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, uvqk, weight, bias, seq_offsets, dims, max_seq_len, alpha, eps, dropout, attention):
        from dlrmv4.ops.triton import output_block as tob

        u, v, q, k = split_uvqk(uvqk, *dims)
        attn = attention_kernels(attention, q, v).fwd(q, k, v, seq_offsets, None, max_seq_len, alpha).flatten(1)
        y, mean, rstd, keep = tob.forward(u, attn, weight, bias, eps, *dropout)
        ctx.save_for_backward(uvqk, attn, weight, bias, mean, rstd, keep, seq_offsets)
        ctx.dims, ctx.max_seq_len, ctx.alpha, ctx.dropout_p = dims, max_seq_len, alpha, dropout[0]
        ctx.attention = attention
        return y

    @staticmethod
    def backward(ctx, dy):
        uvqk, attn, weight, bias, mean, rstd, keep, seq_offsets = ctx.saved_tensors
        grad, dw, db = mixing_backward(
            dy,
            uvqk,
            attn,
            weight,
            bias,
            mean,
            rstd,
            keep,
            seq_offsets,
            ctx.dims,
            ctx.max_seq_len,
            ctx.alpha,
            ctx.dropout_p,
            attention=ctx.attention,
        )
        return grad, dw, db, None, None, None, None, None, None, None


def _check(uvqk, seq_offsets, max_seq_len, num_heads, qk_dim, v_dim, weight, bias) -> None:
    for name, n in (("num_heads", num_heads), ("qk_dim", qk_dim), ("v_dim", v_dim)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"stu_mixing: {name} must be a positive int, got {n!r}")
    width = num_heads * (2 * v_dim + 2 * qk_dim)
    if uvqk.dim() != 2 or uvqk.shape[1] != width:
        raise ValueError(f"stu_mixing: uvqk must be [T, H·(2·Dv + 2·Dqk)] = [T, {width}], got {tuple(uvqk.shape)}")
    hd = num_heads * v_dim
    for name, t in (("norm_weight", weight), ("norm_bias", bias)):
        if t is not None and (tuple(t.shape) != (hd,) or t.device != uvqk.device):
            raise ValueError(f"stu_mixing: {name} must be [{hd}] on {uvqk.device}, got {tuple(t.shape)} on {t.device}")
    _, v, q, k = split_uvqk(uvqk, num_heads, qk_dim, v_dim)
    check_attention_inputs(q, k, v, seq_offsets, max_seq_len, None)


def check_stu_mixing_inputs(uvqk, seq_offsets, max_seq_len, num_heads, qk_dim, v_dim, weight, bias) -> None:
    """What ``stu_mixing`` checks of its tensors before the Triton kernels run (one ValueError line
    each), for a caller that runs them itself (the dropout arguments: ``check_dropout``)."""
    _check(uvqk, seq_offsets, max_seq_len, num_heads, qk_dim, v_dim, weight, bias)
    _, v, q, _ = split_uvqk(uvqk, num_heads, qk_dim, v_dim)
    check_triton_attention_inputs(q, v)


def stu_mixing(
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    *,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    seed: int,
    training: bool,
    kernels: str = "auto",
    keep_mask: torch.Tensor | None = None,
    row_offset: int = 0,
    attention: str = "auto",
) -> torch.Tensor:
    """uvqk [T, H·(2·Dv + 2·Dqk)] (columns u, v, q, k) -> y [T, 3·H·Dv] in uvqk's dtype (see the
    module docstring). seq_offsets [B+1] cumulative lengths; max_seq_len a host int (the longest
    sequence, also the attention's N); norm_weight, norm_bias [H·Dv] (or None) and eps of the
    LayerNorm of attn; dropout with probability ``dropout_p`` when ``training``, its mask drawn from
    ``seed`` for the global rows from ``row_offset`` on (both paths). ``keep_mask`` (bool
    [T, 3·H·Dv]) replaces that mask in the reference only (tests). ``attention``: which kernels
    run the attention with the Triton path (``ops/attention_kernels.py``)."""
    _check(uvqk, seq_offsets, max_seq_len, num_heads, qk_dim, v_dim, norm_weight, norm_bias)
    seed, row_offset = check_dropout("stu_mixing", dropout_p, seed, row_offset)
    max_seq_len = int(max_seq_len)
    if resolve(kernels, uvqk.device) == "pytorch":
        return ref.stu_mixing(
            uvqk,
            seq_offsets,
            max_seq_len,
            num_heads,
            qk_dim,
            v_dim,
            alpha,
            norm_weight,
            norm_bias,
            eps,
            dropout_p,
            training,
            keep_mask,
            seed=seed,
            row_offset=row_offset,
        )
    uvqk = unit_cols(uvqk)
    _, v, q, _ = split_uvqk(uvqk, num_heads, qk_dim, v_dim)
    check_triton_attention_inputs(q, v)
    return _STUMixingFn.apply(
        uvqk,
        norm_weight,
        norm_bias,
        seq_offsets,
        (num_heads, qk_dim, v_dim),
        max_seq_len,
        float(alpha),
        eps,
        (dropout_p, seed, training, row_offset),
        attention,
    )
