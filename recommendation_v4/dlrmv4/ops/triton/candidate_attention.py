"""Triton kernels for candidate attention (``ops/reference/candidate_attention.py``): one query per
sequence, its last row, over all of the sequence's keys.

One query row gives a matrix-vector product, not a matrix product: the kernels are bound by
reading K and V once (no tensor cores; fp32 accumulation in registers). Grid (B, H): each program
walks its sequence's rows in blocks. The backward recomputes the scores and writes dK and dV of
every row (each row belongs to one sequence, so there are no atomics) and dq of the candidate,
straight into one gradient buffer shaped like vk. Plain Triton (no inline PTX): the same on CUDA,
ROCm and the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import interpreting
from ..strides import unit_cols


@triton.jit
def _query(Q, SEQ_OFFSETS, s_qb, s_qh, DQK: tl.constexpr):
    """(first row, length, fp32 query [DQK]) of this program's sequence b and head h."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.load(SEQ_OFFSETS + b).to(tl.int64)
    seq_len = (tl.load(SEQ_OFFSETS + b + 1) - start).to(tl.int32)
    q = tl.load(Q + b * s_qb + h * s_qh + tl.arange(0, DQK)).to(tl.float32)
    return start, seq_len, q


@triton.jit
def _keys_values(VK, start, row0, seq_len, s_vk, v_cols, h, DQK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr):
    """Rows row0 .. row0 + BLOCK - 1 of the sequence: (row index, live mask, fp32 k [BLOCK, DQK],
    fp32 v [BLOCK, DV]); rows past its end read as 0."""
    local = row0 + tl.arange(0, BLOCK)
    live = local < seq_len
    rows = start + local
    k = tl.load(
        VK + rows[:, None] * s_vk + v_cols + h * DQK + tl.arange(0, DQK)[None, :], mask=live[:, None], other=0.0
    ).to(tl.float32)
    v = tl.load(VK + rows[:, None] * s_vk + h * DV + tl.arange(0, DV)[None, :], mask=live[:, None], other=0.0).to(
        tl.float32
    )
    return rows, live, k, v


@triton.jit
def _candidate_attention_fwd(
    Q,
    VK,
    OUT,
    SEQ_OFFSETS,
    alpha,
    inv_n,
    s_qb,
    s_qh,
    s_vk,
    s_ob,
    s_oh,
    v_cols,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    h = tl.program_id(1)
    start, seq_len, q = _query(Q, SEQ_OFFSETS, s_qb, s_qh, DQK)
    acc = tl.zeros([DV], dtype=tl.float32)
    for row0 in range(0, seq_len, BLOCK):
        _, _, k, v = _keys_values(VK, start, row0, seq_len, s_vk, v_cols, h, DQK, DV, BLOCK)
        x = tl.sum(k * q[None, :], axis=1) * alpha
        acc += tl.sum((x * tl.sigmoid(x))[:, None] * v, axis=0)
    out = OUT + tl.program_id(0) * s_ob + h * s_oh + tl.arange(0, DV)
    tl.store(out, (acc * inv_n).to(OUT.dtype.element_ty))


@triton.jit
def _candidate_attention_bwd(
    Q,
    VK,
    DOUT,
    DQ,
    DVK,
    SEQ_OFFSETS,
    alpha,
    inv_n,
    s_qb,
    s_qh,
    s_vk,
    s_db,
    s_dh,
    s_dqb,
    s_dqh,
    s_dvk,
    v_cols,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    start, seq_len, q = _query(Q, SEQ_OFFSETS, s_qb, s_qh, DQK)
    dq_cols = tl.arange(0, DQK)
    dv_cols = tl.arange(0, DV)
    dout = tl.load(DOUT + b * s_db + h * s_dh + dv_cols).to(tl.float32) * inv_n  # d(sum_j A_j v_j) with 1/N
    dq = tl.zeros([DQK], dtype=tl.float32)
    for row0 in range(0, seq_len, BLOCK):
        rows, live, k, v = _keys_values(VK, start, row0, seq_len, s_vk, v_cols, h, DQK, DV, BLOCK)
        x = tl.sum(k * q[None, :], axis=1) * alpha
        sig = tl.sigmoid(x)
        da = tl.sum(v * dout[None, :], axis=1)
        ds = da * sig * (1.0 + x * (1.0 - sig)) * alpha  # SiLU'(x) = sig (1 + x (1 - sig))
        tl.store(
            DVK + rows[:, None] * s_dvk + h * DV + dv_cols[None, :],
            ((x * sig)[:, None] * dout[None, :]).to(DVK.dtype.element_ty),
            mask=live[:, None],
        )
        tl.store(
            DVK + rows[:, None] * s_dvk + v_cols + h * DQK + dq_cols[None, :],
            (ds[:, None] * q[None, :]).to(DVK.dtype.element_ty),
            mask=live[:, None],
        )
        dq += tl.sum(ds[:, None] * k, axis=0)
    tl.store(DQ + b * s_dqb + h * s_dqh + dq_cols, dq.to(DQ.dtype.element_ty))


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output buffers (tests fill them with NaN to see that every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block(dqk: int, dv: int) -> int:
    # Registers: two [BLOCK, D] fp32 tiles in flight; 32 rows keeps them small at D = 128-256.
    return 16 if interpreting() else (64 if max(dqk, dv) <= 64 else 32)


def forward(
    q: torch.Tensor,
    vk: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
) -> torch.Tensor:
    """q [B, H, Dqk] (unit column stride), vk [T, H·Dv + H·Dqk] (unit column stride) -> [B, H, Dv]."""
    batch = q.shape[0]
    out = _empty((batch, num_heads, v_dim), q.dtype, q.device)
    if batch == 0:
        return out
    _candidate_attention_fwd[(batch, num_heads)](
        q,
        vk,
        out,
        seq_offsets,
        float(alpha),
        1.0 / max(int(max_seq_len), 1),
        q.stride(0),
        q.stride(1),
        vk.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads * v_dim,
        DQK=qk_dim,
        DV=v_dim,
        BLOCK=_block(qk_dim, v_dim),
    )
    return out


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    vk: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq [B, H, Dqk], dvk [T, H·Dv + H·Dqk]); every row of vk must lie in a sequence
    (seq_offsets runs from 0 to T), since each is written once and never zeroed."""
    dq = _empty(q.shape, q.dtype, q.device)
    dvk = _empty(vk.shape, vk.dtype, vk.device)
    batch = q.shape[0]
    if batch == 0:
        return dq, dvk.zero_()
    dout = unit_cols(dout)
    _candidate_attention_bwd[(batch, num_heads)](
        q,
        vk,
        dout,
        dq,
        dvk,
        seq_offsets,
        float(alpha),
        1.0 / max(int(max_seq_len), 1),
        q.stride(0),
        q.stride(1),
        vk.stride(0),
        dout.stride(0),
        dout.stride(1),
        dq.stride(0),
        dq.stride(1),
        dvk.stride(0),
        num_heads * v_dim,
        DQK=qk_dim,
        DV=v_dim,
        BLOCK=_block(qk_dim, v_dim),
    )
    return dq, dvk
