"""PyTorch reference of the STU output block: Dropout([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)]).

The dropout mask is the Triton kernel's, drawn here with torch integer ops (``reference/philox.py``'s
``keep_decisions``): segment s in {0, 1, 2} (HD columns each) of row r = row_offset + local row is
counter row 3r + s of the draw, kept iff its 16-bit number is >= round(p * 2^16); kept values are
scaled by 1 / (1 - p).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlrmv4.ops.reference.layer_norm import compute_dtype
from dlrmv4.ops.reference.philox import COUNTERS_PER_CHUNK, check_dropout, dropout_threshold, keep_decisions


def draw_keep_mask(
    t: int, hd: int, dropout_p: float, seed: int, device: torch.device | str, row_offset: int = 0
) -> torch.Tensor:
    """bool [t, 3·hd]: the keep decisions of the Triton output block for the global rows
    row_offset .. row_offset + t - 1 (see the module docstring)."""
    seed, row_offset = check_dropout("output_block_keep_mask", dropout_p, seed, row_offset)
    device = torch.device(device)
    if dropout_threshold(dropout_p) == 0 or t == 0 or hd == 0:
        return torch.ones((t, 3 * hd), dtype=torch.bool, device=device)
    out = torch.empty((t, 3 * hd), dtype=torch.bool, device=device)
    step = max(1, COUNTERS_PER_CHUNK // (3 * ((hd + 7) // 8)))
    for r0 in range(0, t, step):
        rows = torch.arange(row_offset + r0, row_offset + min(t, r0 + step), device=device)
        out[r0 : r0 + rows.numel()] = keep_mask_of_rows(rows, hd, dropout_p, seed)
    return out


def keep_mask_of_rows(rows: torch.Tensor, hd: int, dropout_p: float, seed: int) -> torch.Tensor:
    """bool [len(rows), 3·hd]: the keep decisions of the global rows ``rows`` (int64, any order, on
    the device the mask is wanted on): what the kernel draws for those rows in a call over all rows."""
    threshold = dropout_threshold(dropout_p)
    if threshold == 0:
        return torch.ones((rows.numel(), 3 * hd), dtype=torch.bool, device=rows.device)
    segments = rows.to(torch.int64)[:, None] * 3 + torch.arange(3, device=rows.device)  # counter row 3r + s
    return keep_decisions(seed, segments.flatten(), hd, threshold).view(rows.numel(), 3 * hd)


def output_block(
    u: torch.Tensor,
    attn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    training: bool,
    keep_mask: torch.Tensor | None = None,
    *,
    seed: int = 0,
    row_offset: int = 0,
) -> torch.Tensor:
    """u (before its SiLU), attn [T, HD] -> [T, 3·HD] in u's dtype; SiLU and the LayerNorm over the
    HD columns of attn in fp32 (or wider).

    Dropout (training, p > 0) uses the kernel's mask for (seed, row_offset); ``keep_mask`` (bool
    [T, 3·HD]), when given, replaces it (tests use masks of their own).
    """
    acc = compute_dtype(u.dtype)
    uf, af = F.silu(u.to(acc)), attn.to(acc)
    w = weight.to(acc) if weight is not None else None
    b = bias.to(acc) if bias is not None else None
    ln = F.layer_norm(af, (af.shape[-1],), w, b, eps)
    y = torch.cat([uf, af, uf * ln], dim=-1)
    if training and dropout_p > 0.0:
        if keep_mask is None:
            keep_mask = draw_keep_mask(u.shape[0], u.shape[1], dropout_p, seed, u.device, row_offset)
        y = y * keep_mask.to(acc) * (1.0 / (1.0 - dropout_p))
    return y.to(u.dtype)
