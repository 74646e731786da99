"""PyTorch reference for jagged HSTU attention (the test oracle and the slow path).

Per sequence b with L tokens and n_t = num_targets[b] (0 when None), token i attends to j iff
``(j <= i and j < L - n_t) or j == i``; ``A_ij = SiLU(alpha * q_i.k_j) / N`` (no softmax) and
``out_i = sum_j A_ij v_j``, with N = max_seq_len.

The jagged batch is gathered into padded [b, N, H, D] chunks with device-side index maths only
(no host sync); scores are computed in fp32 (fp64 for fp64 inputs) one chunk of sequences at a
time, so bf16 inputs never overflow and no B x N x N tensor exists for the whole batch. When the
batch needs several chunks, each is checkpointed under autograd: backward recomputes it instead of
keeping every chunk's scores alive. Two elementwise passes touch the score tensor (SiLU, then one
multiply by the mask scaled by 1/N): on the CPU those passes are most of the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Elements of one chunk's score tensor (chunk x H x N x N); 2**26 fp32 is 256 MiB.
SCORE_BUDGET = 1 << 26


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk(q, k, v, starts, lengths, prefix, alpha: float, n: int):
    """Outputs [b, N, H, Dv] (compute dtype) for the sequences starting at ``starts``."""
    pos = torch.arange(n, device=q.device)
    valid = pos[None, :] < lengths[:, None]  # [b, N]
    idx = torch.where(valid, starts[:, None] + pos[None, :], 0)
    cdt = _compute_dtype(q.dtype)
    # index_select, not t[idx]: its backward is index_add_, which the CPU runs far faster than
    # the accumulating index_put_ behind advanced indexing.
    qp, kp, vp = (t.index_select(0, idx.flatten()).unflatten(0, idx.shape).to(cdt) for t in (q, k, v))
    s = torch.einsum("bihd,bjhd->bhij", qp * alpha, kp)
    i, j = pos[:, None], pos[None, :]
    allowed = ((j <= i)[None] & (j[None] < prefix[:, None, None])) | (j == i)[None]  # [b, N, N]
    allowed = allowed & valid[:, None, :]
    a = F.silu(s) * (allowed[:, None].to(cdt) / n)
    return torch.einsum("bhij,bjhd->bihd", a, vp)


def hstu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None,
    alpha: float,
) -> torch.Tensor:
    """[T, H, Dv] in q's dtype; differentiable through autograd."""
    total, heads, dv = v.shape
    batch = seq_offsets.numel() - 1
    n = int(max_seq_len)
    if total == 0 or batch == 0 or n == 0:  # nothing to attend; keep q, k, v in the graph
        return v.new_zeros(total, heads, dv) + (q.sum() + k.sum() + v.sum()) * 0
    offsets = seq_offsets.to(device=q.device, dtype=torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    targets = torch.zeros_like(lengths) if num_targets is None else num_targets.to(q.device, torch.int64)
    prefix = (lengths - targets).clamp_min(0)
    step = max(1, SCORE_BUDGET // (heads * n * n))
    track = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    recompute = track and batch > step
    outs = []
    for lo in range(0, batch, step):
        args = (q, k, v, offsets[:-1][lo : lo + step], lengths[lo : lo + step], prefix[lo : lo + step], alpha, n)
        outs.append(checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args))
    padded = torch.cat(outs) if len(outs) > 1 else outs[0]  # [B, N, H, Dv]
    token = torch.arange(total, device=q.device)
    seq = torch.searchsorted(offsets, token, right=True) - 1
    return padded.flatten(0, 1).index_select(0, seq * n + token - offsets[seq]).to(q.dtype)
