"""PyTorch reference of the STU layer's middle: the projection uvqk in, the output block's y out,
as the reference attention and output block composed under autograd."""

from __future__ import annotations

import torch

from dlrmv4.ops.reference.attention import hstu_attention_reference
from dlrmv4.ops.reference.output_block import output_block


def split_uvqk(
    uvqk: torch.Tensor, num_heads: int, qk_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of the column blocks of uvqk [T, H·(2·Dv + 2·Dqk)]: u [T, H·Dv], v [T, H, Dv],
    q and k [T, H, Dqk]; nothing is copied."""
    hv, hqk = num_heads * v_dim, num_heads * qk_dim
    u, v, q, k = torch.split(uvqk, [hv, hv, hqk, hqk], dim=-1)
    return (
        u,
        v.unflatten(-1, (num_heads, v_dim)),
        q.unflatten(-1, (num_heads, qk_dim)),
        k.unflatten(-1, (num_heads, qk_dim)),
    )


def stu_mixing(
    uvqk: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    training: bool,
    keep_mask: torch.Tensor | None = None,
    *,
    seed: int = 0,
    row_offset: int = 0,
) -> torch.Tensor:
    """y [T, 3·H·Dv] in uvqk's dtype; causal attention (no candidate mask). Dropout draws the Triton
    kernel's mask for (seed, row_offset) unless ``keep_mask`` (bool [T, 3·H·Dv]) is given, as in
    the reference output block."""
    u, v, q, k = split_uvqk(uvqk, num_heads, qk_dim, v_dim)
    attn = hstu_attention_reference(q, k, v, seq_offsets, max_seq_len, None, alpha)
    return output_block(
        u,
        attn.flatten(1),
        norm_weight,
        norm_bias,
        eps,
        dropout_p,
        training,
        keep_mask,
        seed=seed,
        row_offset=row_offset,
    )
