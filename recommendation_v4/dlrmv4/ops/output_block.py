"""The STU output block: y = Dropout_p([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)]), [T, 3·HD] in u's dtype.

u is taken before its SiLU: the op applies it (and its derivative in the backward), so the model
needs no separate activation pass and keeps no activated copy of u for autograd. u and attn may be
column slices of wider tensors (a row stride, unit column stride).

Dropout masks are a pure function of (seed, global row, column): a call on a chunk of rows passes
``row_offset`` = the index of its first row in the unchunked layout and draws exactly those rows'
masks. The Triton kernel and the reference draw the same mask (layout: triton/output_block.py;
torch's Philox copy: reference/philox.py); ``output_block_keep_mask`` returns it, without Triton.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import output_block as ref
from dlrmv4.ops.reference.philox import check_dropout
from dlrmv4.ops.strides import unit_cols


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _OutputBlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, attn, weight, bias, eps, dropout_p, seed, training, row_offset):
        from dlrmv4.ops.triton import output_block as tri

        u, attn = unit_cols(u), unit_cols(attn)
        y, mean, rstd, keep = tri.forward(u, attn, weight, bias, eps, dropout_p, seed, training, row_offset)
        ctx.save_for_backward(u, attn, weight, bias, mean, rstd, keep)
        ctx.dropout_p = dropout_p
        return y

    @staticmethod
    def backward(ctx, dy):
        from dlrmv4.ops.triton import output_block as tri

        u, attn, weight, bias, mean, rstd, keep = ctx.saved_tensors
        du, da, dw, db = tri.backward(u, attn, weight, bias, unit_cols(dy), mean, rstd, keep, ctx.dropout_p)
        return du, da, dw, db, None, None, None, None, None


def output_block(
    u: torch.Tensor,
    attn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    seed: int,
    training: bool,
    kernels: str = "auto",
    keep_mask: torch.Tensor | None = None,
    row_offset: int = 0,
) -> torch.Tensor:
    """u (before its SiLU), attn [T, HD]; weight, bias [HD] (or None); LayerNorm eps; dropout with probability
    ``dropout_p`` when ``training``, its mask drawn from ``seed`` for the global rows from ``row_offset``
    on. ``keep_mask`` (bool [T, 3·HD]) replaces that mask in the reference only (tests)."""
    if u.dim() != 2 or u.shape != attn.shape:
        raise ValueError(f"output_block: u {tuple(u.shape)} and attn {tuple(attn.shape)} must be the same [T, HD]")
    hd = u.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (hd,):
            raise ValueError(f"output_block: {name} has shape {tuple(t.shape)}, expected ({hd},)")
    seed, row_offset = check_dropout("output_block", dropout_p, seed, row_offset)
    if resolve(kernels, u.device) == "pytorch":
        return ref.output_block(
            u, attn, weight, bias, eps, dropout_p, training, keep_mask, seed=seed, row_offset=row_offset
        )
    return _OutputBlockFn.apply(u, attn, weight, bias, eps, dropout_p, seed, training, row_offset)


def output_block_keep_mask(
    T: int, HD: int, dropout_p: float, seed: int, device: torch.device | str, row_offset: int = 0
) -> torch.Tensor:
    """bool [T, 3·HD]: which elements both implementations keep for (dropout_p, seed) at the global
    rows row_offset .. row_offset + T - 1 (torch only: Triton is not needed)."""
    return ref.draw_keep_mask(T, HD, dropout_p, seed, device, row_offset)
