"""PyTorch reference of the STU output block: Dropout([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)])."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlrmv4.ops.reference.layer_norm import compute_dtype


def output_block(u: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 eps: float, dropout_p: float, training: bool,
                 keep_mask: torch.Tensor | None = None) -> torch.Tensor:
    """u (before its SiLU), attn [T, HD] -> [T, 3·HD] in u's dtype; SiLU and the LayerNorm over the
    HD columns of attn in fp32 (or wider).

    ``keep_mask`` (bool [T, 3·HD]) replaces torch's own dropout draw, so that the reference can
    reproduce the Triton kernel's mask exactly.
    """
    acc = compute_dtype(u.dtype)
    uf, af = F.silu(u.to(acc)), attn.to(acc)
    w = weight.to(acc) if weight is not None else None
    b = bias.to(acc) if bias is not None else None
    ln = F.layer_norm(af, (af.shape[-1],), w, b, eps)
    y = torch.cat([uf, af, uf * ln], dim=-1)
    if training and dropout_p > 0.0:
        if keep_mask is not None:
            y = y * keep_mask.to(acc) * (1.0 / (1.0 - dropout_p))
        else:
            y = F.dropout(y, dropout_p, training=True)
    return y.to(u.dtype)
