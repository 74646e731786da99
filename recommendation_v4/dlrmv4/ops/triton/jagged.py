"""Triton jagged copies: build the [contextual, history, candidate] sequences and take their last rows.

concat: program (b, block) moves rows [block·M, (block+1)·M) of sequence b; the grid's second
dimension comes from the host's max_history_len, so no offsets are read back to the host. Each
output row takes one of three masked loads (contextual, history or candidate); the backward runs
the same mapping with three masked stores. Rows are copied in column chunks of at most 1,024;
the width D is a compile-time constant (one model has one or two widths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _tile(d: int, rows_hint: int = 4096) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(max(d, 16)), 1024)
    return max(1, rows_hint // block_d), block_d


@triton.jit
def _jagged_concat(
    CTX,
    HIST,
    CAND,
    HOFF,
    OUT,
    C,
    D: tl.constexpr,
    s_ctx_b,
    s_ctx_c,
    s_hist,
    s_cand,
    s_out,
    BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h0 = tl.load(HOFF + b)
    length = tl.load(HOFF + b + 1) - h0
    p = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = C + length + 1
    is_ctx = p < C
    is_hist = (p >= C) & (p < C + length)
    is_cand = p == C + length
    out_row = h0 + b * (C + 1) + p
    ctx_ptr = CTX + b * s_ctx_b + p.to(tl.int64)[:, None] * s_ctx_c
    hist_ptr = HIST + (h0 + p - C)[:, None] * s_hist
    cand_ptr = CAND + b * s_cand + tl.zeros([BLOCK_M, 1], tl.int64)
    out_ptr = OUT + out_row[:, None] * s_out
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        cmask = (cols < D)[None, :]
        if BACKWARD:
            g = tl.load(out_ptr + cols[None, :], mask=(p < n)[:, None] & cmask)
            tl.store(ctx_ptr + cols[None, :], g, mask=is_ctx[:, None] & cmask)
            tl.store(hist_ptr + cols[None, :], g, mask=is_hist[:, None] & cmask)
            tl.store(cand_ptr + cols[None, :], g, mask=is_cand[:, None] & cmask)
        else:
            v = tl.load(ctx_ptr + cols[None, :], mask=is_ctx[:, None] & cmask)
            v = tl.where(is_hist[:, None], tl.load(hist_ptr + cols[None, :], mask=is_hist[:, None] & cmask), v)
            v = tl.where(is_cand[:, None], tl.load(cand_ptr + cols[None, :], mask=is_cand[:, None] & cmask), v)
            tl.store(out_ptr + cols[None, :], v, mask=(p < n)[:, None] & cmask)


def _launch_concat(ctx, hist, cand, history_offsets, out, max_history_len: int, backward: bool) -> None:
    b, c, d = ctx.shape
    if b == 0:
        return
    block_m, block_d = _tile(d)
    grid = (b, triton.cdiv(c + max_history_len + 1, block_m))
    _jagged_concat[grid](
        ctx,
        hist,
        cand,
        history_offsets,
        out,
        c,
        d,
        ctx.stride(0),
        ctx.stride(1),
        hist.stride(0),
        cand.stride(0),
        out.stride(0),
        BACKWARD=backward,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=4,
    )


def concat_forward(
    contextual: torch.Tensor,
    history: torch.Tensor,
    candidate: torch.Tensor,
    history_offsets: torch.Tensor,
    max_history_len: int,
) -> torch.Tensor:
    """values [T + B(C+1), D]; inputs need unit column stride, history_offsets int64 [B+1]."""
    b, c, d = contextual.shape
    out = torch.empty((history.shape[0] + b * (c + 1), d), device=history.device, dtype=history.dtype)
    _launch_concat(contextual, history, candidate, history_offsets, out, max_history_len, backward=False)
    return out


def concat_backward(
    grad: torch.Tensor,
    history_offsets: torch.Tensor,
    dcontextual: torch.Tensor,
    dhistory: torch.Tensor,
    dcandidate: torch.Tensor,
    max_history_len: int,
) -> None:
    """Scatter the gradient of the values back into the given (contextual, history, candidate)
    buffers (any row strides, unit column stride); each of their rows is written once."""
    _launch_concat(dcontextual, dhistory, dcandidate, history_offsets, grad, max_history_len, backward=True)


@triton.jit
def _jagged_take_last(
    SRC,
    DST,
    SOFF,
    B,
    D: tl.constexpr,
    s_src,
    s_dst,
    BACKWARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    smask = seq < B
    last = tl.load(SOFF + seq + 1, mask=smask, other=1) - 1
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = smask[:, None] & (cols < D)[None, :]
        if BACKWARD:  # SRC: grad [B, D] -> DST: grad of the values at each last row
            g = tl.load(SRC + seq.to(tl.int64)[:, None] * s_src + cols[None, :], mask=mask)
            tl.store(DST + last[:, None] * s_dst + cols[None, :], g, mask=mask)
        else:
            v = tl.load(SRC + last[:, None] * s_src + cols[None, :], mask=mask)
            tl.store(DST + seq.to(tl.int64)[:, None] * s_dst + cols[None, :], v, mask=mask)


def _launch_last(src, dst, seq_offsets, backward: bool) -> None:
    b = seq_offsets.numel() - 1
    d = src.shape[1]
    if b == 0:
        return
    block_m, block_d = _tile(d, rows_hint=2048)
    _jagged_take_last[(triton.cdiv(b, block_m),)](
        src,
        dst,
        seq_offsets,
        b,
        d,
        src.stride(0),
        dst.stride(0),
        BACKWARD=backward,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=4,
    )


def take_last_forward(values: torch.Tensor, seq_offsets: torch.Tensor) -> torch.Tensor:
    out = torch.empty((seq_offsets.numel() - 1, values.shape[1]), device=values.device, dtype=values.dtype)
    _launch_last(values, out, seq_offsets, backward=False)
    return out


def take_last_backward(grad: torch.Tensor, seq_offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    dvalues = torch.zeros((num_rows, grad.shape[1]), device=grad.device, dtype=grad.dtype)
    _launch_last(grad, dvalues, seq_offsets, backward=True)
    return dvalues
