"""Triton jagged copy: each sequence's last row (the candidate), and its gradient back.

Rows are copied in column chunks of at most 1,024; the width D is a compile-time constant (one
model has one or two widths).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _tile(d: int, rows_hint: int = 4096) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(max(d, 16)), 1024)
    return max(1, rows_hint // block_d), block_d


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
