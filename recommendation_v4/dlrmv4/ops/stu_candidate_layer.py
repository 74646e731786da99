"""The last STU layer for the candidate rows only: the same function as ``stu_layer`` followed by
taking each sequence's last row, without the rows nobody reads.

Only the candidate row (each sequence's last) of the last layer reaches the loss, so:

    n = LayerNorm(x)                          every row (K and V need it)
    [v | k] = n W_vk^T + b_vk                 every row
    [u | q] = n_c W_uq^T + b_uq               candidate rows only
    attn_c = candidate_attention(q_c, v, k)   one query per sequence over its whole prefix
    y_c = Dropout([SiLU(u_c) ‖ attn_c ‖ SiLU(u_c) ⊙ LayerNorm(attn_c)])
    out_c = x_c + y_c W_out^T                 [B, D]

The backward follows through autograd: dK and dV for every row from the candidate queries, dU
and dQ for the candidates. The dropout mask of a candidate row is the one ``stu_layer`` draws for
that global row (same counters), so the result equals ``take_last(stu_layer(x))`` up to rounding.
The output block runs on B rows only, so it is the PyTorch reference on every device (a kernel
launch would cost more than its work). ``recompute`` other than none keeps only x: the layer runs
again in the backward (most of its work is the K/V projection either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dlrmv4.ops.candidate_attention import candidate_attention
from dlrmv4.ops.layer_norm import layer_norm_and_input
from dlrmv4.ops.reference.output_block import keep_mask_of_rows, output_block
from dlrmv4.ops.reference.philox import check_dropout
from dlrmv4.ops.stu_layer import RECOMPUTE_MODES


def _uq_vk(weight: torch.Tensor, num_heads: int, qk_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of a [u | v | q | k] projection (weight or bias) regrouped as ([u | q], [v | k])."""
    hv, hqk = num_heads * v_dim, num_heads * qk_dim
    u, v, q, k = torch.split(weight, [hv, hv, hqk, hqk], dim=0)
    return torch.cat([u, q]), torch.cat([v, k])


class _ProjectionFn(torch.autograd.Function):
    """[v | k] = n W_vk^T + b_vk for every row and [u | q] = n_c W_uq^T + b_uq for the rows ``rows``
    of one normalised input. The backward adds the rows' gradient into n's in place: no [N, D]
    of zeros for the gathered rows and no second [N, D] gradient for autograd to sum."""

    @staticmethod
    def forward(ctx, n, rows, w_vk, b_vk, w_uq, b_uq):
        n_rows = n.index_select(0, rows)
        vk = F.linear(n, w_vk, b_vk)  # under autocast, in its dtype
        uq = F.linear(n_rows, w_uq, b_uq)
        dt = vk.dtype
        ctx.save_for_backward(n, rows, n_rows, w_vk.to(dt), w_uq.to(dt))
        ctx.dtypes = (w_vk.dtype, b_vk.dtype, w_uq.dtype, b_uq.dtype)
        return vk, uq

    @staticmethod
    def backward(ctx, dvk, duq):
        n, rows, n_rows, w_vk, w_uq = ctx.saved_tensors
        dvk = dvk if dvk is not None else torch.zeros(n.shape[0], w_vk.shape[0], dtype=w_vk.dtype, device=n.device)
        duq = duq if duq is not None else torch.zeros(rows.shape[0], w_uq.shape[0], dtype=w_uq.dtype, device=n.device)
        dvk, duq = dvk.to(w_vk.dtype), duq.to(w_uq.dtype)
        dn = dvk.mm(w_vk)
        dn.index_add_(0, rows, duq.mm(w_uq))
        grads = (dvk.t().mm(n.to(dvk.dtype)), dvk.sum(0), duq.t().mm(n_rows.to(duq.dtype)), duq.sum(0))
        return dn.to(n.dtype), None, *(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes))


def stu_candidate_layer(
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
    """x [T, D] (jagged by seq_offsets, every sequence non-empty) -> [B, D]: the last row of each
    sequence of ``stu_layer(x, ...)`` with the same arguments (see the module docstring)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"stu_candidate_layer: recompute={recompute!r} is not one of {', '.join(RECOMPUTE_MODES)}")
    if x.dim() != 2 or x.shape[1] != uvqk_weight.shape[1]:
        raise ValueError(f"stu_candidate_layer: x must be [T, {uvqk_weight.shape[1]}], got {tuple(x.shape)}")
    seed, row_offset = check_dropout("stu_candidate_layer", dropout_p, seed, row_offset)
    hv = num_heads * v_dim

    def layer(x: torch.Tensor) -> torch.Tensor:
        last = seq_offsets[1:].to(torch.int64) - 1
        # The norm hands back the candidate rows of x (the residual); both gathers add their rows'
        # gradients into the full one in place.
        n, x_last = layer_norm_and_input(x, norm_weight, norm_bias, norm_eps, rows=last, kernels=kernels)
        w_uq, w_vk = _uq_vk(uvqk_weight, num_heads, qk_dim, v_dim)
        b_uq, b_vk = _uq_vk(uvqk_bias, num_heads, qk_dim, v_dim)
        vk, uq = _ProjectionFn.apply(n, last, w_vk, b_vk, w_uq, b_uq)
        u, q = uq[:, :hv], uq[:, hv:].unflatten(1, (num_heads, qk_dim))
        attn = candidate_attention(
            q,
            vk,
            seq_offsets,
            max_seq_len,
            num_heads=num_heads,
            qk_dim=qk_dim,
            v_dim=v_dim,
            alpha=alpha,
            kernels=kernels,
        ).flatten(1)
        keep = keep_mask_of_rows(last + row_offset, hv, dropout_p, seed) if training and dropout_p > 0 else None
        y = output_block(u, attn, attn_norm_weight, attn_norm_bias, attn_eps, dropout_p, training, keep)
        return torch.addmm(x_last, y, out_weight.t())

    grads = torch.is_grad_enabled() and (x.requires_grad or uvqk_weight.requires_grad)
    if recompute == "none" or not grads:
        return layer(x)
    return checkpoint(layer, x, use_reentrant=False)
