"""PyTorch reference for candidate attention: the HSTU attention of one query per sequence, its last
row (the candidate), over every key of the sequence (the test oracle and the slow path).

Per sequence b with rows start_b .. end_b - 1 and candidate query q_b:
``A_bj = SiLU(alpha q_b.k_j) / N`` for every row j of b (causality lets the last row see them all),
``out_b = sum_j A_bj v_j``; N = max_seq_len. This is row end_b - 1 of ``hstu_attention`` with no
targets, computed without the other rows' queries. Scores in fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def split_vk(vk: torch.Tensor, num_heads: int, qk_dim: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the column blocks of vk [T, H·Dv + H·Dqk]: v [T, H, Dv], k [T, H, Dqk]."""
    v, k = torch.split(vk, [num_heads * v_dim, num_heads * qk_dim], dim=-1)
    return v.unflatten(-1, (num_heads, v_dim)), k.unflatten(-1, (num_heads, qk_dim))


def candidate_attention(
    q: torch.Tensor,
    vk: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
) -> torch.Tensor:
    """q [B, H, Dqk] (the candidates' queries), vk [T, H·Dv + H·Dqk] -> [B, H, Dv] in q's dtype;
    differentiable through autograd."""
    v, k = split_vk(vk, num_heads, qk_dim, v_dim)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    offsets = seq_offsets.to(device=q.device, dtype=torch.int64)
    token = torch.arange(vk.shape[0], device=q.device)
    seq = torch.searchsorted(offsets, token, right=True) - 1  # [T]
    scores = (q.to(cdt).index_select(0, seq) * k.to(cdt)).sum(-1) * alpha  # [T, H]
    weights = F.silu(scores) / max(int(max_seq_len), 1)
    out = torch.zeros(q.shape[0], num_heads, v_dim, dtype=cdt, device=q.device)
    return out.index_add(0, seq, weights[..., None] * v.to(cdt)).to(q.dtype)
