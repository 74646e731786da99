"""Candidate attention: the HSTU attention of each sequence's last row (its candidate) over all of
the sequence's rows, as one op with its dispatcher (``ops/reference/candidate_attention.py`` is the
reference, ``ops/triton/candidate_attention.py`` the kernels).

``candidate_attention(q, vk, seq_offsets, max_seq_len, *, num_heads, qk_dim, v_dim, alpha,
kernels="auto")``: q [B, H, Dqk] the candidates' queries; vk [T, H·Dv + H·Dqk] the values then the
keys of every row (one projection's output), T = seq_offsets[-1]; returns [B, H, Dv] in q's dtype,
equal to the last row of each sequence of ``hstu_attention`` (no targets). The backward gives dq
and one dvk buffer. Nothing here reads device values on the host.
"""

from __future__ import annotations

import torch

from .attention import check_triton_attention_inputs
from .dispatch import resolve
from .reference import candidate_attention as ref
from .strides import unit_cols


class _TritonCandidateAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, vk, seq_offsets, dims: tuple[int, int, int], max_seq_len: int, alpha: float):
        from .triton import candidate_attention as tri

        ctx.save_for_backward(q, vk, seq_offsets)
        ctx.dims, ctx.max_seq_len, ctx.alpha = dims, max_seq_len, alpha
        return tri.forward(q, vk, seq_offsets, max_seq_len, *dims, alpha)

    @staticmethod
    def backward(ctx, grad_out):
        from .triton import candidate_attention as tri

        q, vk, seq_offsets = ctx.saved_tensors
        dq, dvk = tri.backward(grad_out, q, vk, seq_offsets, ctx.max_seq_len, *ctx.dims, ctx.alpha)
        return dq, dvk, None, None, None, None


def _check(q, vk, seq_offsets, max_seq_len, num_heads, qk_dim, v_dim) -> None:
    if q.dim() != 3 or tuple(q.shape[1:]) != (num_heads, qk_dim):
        raise ValueError(f"candidate_attention: q must be [B, {num_heads}, {qk_dim}], got {tuple(q.shape)}")
    width = num_heads * (v_dim + qk_dim)
    if vk.dim() != 2 or vk.shape[1] != width:
        raise ValueError(f"candidate_attention: vk must be [T, H·(Dv + Dqk)] = [T, {width}], got {tuple(vk.shape)}")
    if q.dtype != vk.dtype:
        raise ValueError(f"candidate_attention: q and vk must share a dtype; got {q.dtype}, {vk.dtype}")
    if seq_offsets.dim() != 1 or seq_offsets.numel() != q.shape[0] + 1 or seq_offsets.dtype.is_floating_point:
        raise ValueError(f"candidate_attention: seq_offsets must be a 1-D integer tensor [B+1] = [{q.shape[0] + 1}]")
    if isinstance(max_seq_len, torch.Tensor) or not hasattr(max_seq_len, "__index__") or max_seq_len < 1:
        raise ValueError(f"candidate_attention: max_seq_len must be a host int >= 1; got {max_seq_len!r}")
    if len({q.device, vk.device, seq_offsets.device}) != 1:
        raise ValueError("candidate_attention: q, vk and seq_offsets must be on one device")


def candidate_attention(
    q: torch.Tensor,
    vk: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    *,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
    kernels: str = "auto",
) -> torch.Tensor:
    """[B, H, Dv] in q's dtype (see the module docstring)."""
    _check(q, vk, seq_offsets, max_seq_len, num_heads, qk_dim, v_dim)
    if resolve(kernels, q.device) == "pytorch":
        return ref.candidate_attention(q, vk, seq_offsets, int(max_seq_len), num_heads, qk_dim, v_dim, alpha)
    v, _ = ref.split_vk(vk, num_heads, qk_dim, v_dim)
    check_triton_attention_inputs(q, v)
    return _TritonCandidateAttention.apply(
        unit_cols(q), unit_cols(vk), seq_offsets, (num_heads, qk_dim, v_dim), int(max_seq_len), float(alpha)
    )
