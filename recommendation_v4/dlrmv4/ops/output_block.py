"""The STU output block: y = Dropout_p([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)]), [T, 3·HD] in u's dtype.

u is taken before its SiLU: the op applies it (and its derivative in the backward), so the model
needs no separate activation pass and keeps no activated copy of u for autograd. u and attn may be
column slices of wider tensors (a row stride, unit column stride). The Triton
kernel draws its dropout mask from ``seed`` (same seed, same mask); ``output_block_keep_mask``
reproduces that mask so the reference can be compared with the kernel at p > 0.
"""

from __future__ import annotations

import torch

from dlrmv4.ops.dispatch import resolve
from dlrmv4.ops.reference import output_block as ref


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# Triton is optional (the reference runs without it): kernel modules are imported on first use.
class _OutputBlockFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, u, attn, weight, bias, eps, dropout_p, seed, training):
        from dlrmv4.ops.triton import output_block as tri

        u, attn = _unit_cols(u), _unit_cols(attn)
        y, mean, rstd, keep = tri.forward(u, attn, weight, bias, eps, dropout_p, seed, training)
        ctx.save_for_backward(u, attn, weight, bias, mean, rstd, keep)
        ctx.dropout_p = dropout_p
        return y

    @staticmethod
    def backward(ctx, dy):
        from dlrmv4.ops.triton import output_block as tri

        u, attn, weight, bias, mean, rstd, keep = ctx.saved_tensors
        du, da, dw, db = tri.backward(u, attn, weight, bias, _unit_cols(dy), mean, rstd, keep, ctx.dropout_p)
        return du, da, dw, db, None, None, None, None


def output_block(u: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, dropout_p: float, seed: int, training: bool, kernels: str = "auto",
                 keep_mask: torch.Tensor | None = None) -> torch.Tensor:
    """u (before its SiLU), attn [T, HD]; weight, bias [HD] (or None); LayerNorm eps; dropout with probability
    ``dropout_p`` when ``training``. ``keep_mask`` (bool [T, 3·HD]) is used by the reference only."""
    if u.dim() != 2 or u.shape != attn.shape:
        raise ValueError(f"output_block: u {tuple(u.shape)} and attn {tuple(attn.shape)} must be the same [T, HD]")
    hd = u.shape[1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (hd,):
            raise ValueError(f"output_block: {name} has shape {tuple(t.shape)}, expected ({hd},)")
    if resolve(kernels, u.device) == "pytorch":
        return ref.output_block(u, attn, weight, bias, eps, dropout_p, training, keep_mask)
    return _OutputBlockFn.apply(u, attn, weight, bias, eps, dropout_p, seed, training)


def output_block_keep_mask(T: int, HD: int, dropout_p: float, seed: int, device: torch.device | str) -> torch.Tensor:
    """bool [T, 3·HD]: which elements the Triton kernel keeps for this (dropout_p, seed)."""
    from dlrmv4.ops.triton import output_block as tri

    return tri.keep_mask(T, HD, dropout_p, seed, torch.device(device))
