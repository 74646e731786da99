"""Triton backward of a row gather: each row's gradient is the sum of the gradients of the output rows
that copied it (``out[i] = rows[index[i]]``), in fp32, deterministic, without atomics.

The indices are sorted (stable) once; the sorted positions fall into pieces: a piece never crosses a
segment (a run of one index) nor a chunk boundary (every ``CHUNK`` positions), so no program sums
more than ``CHUNK`` rows however popular a row is. Pass 1 sums each piece; a piece that is a whole
segment writes its row's gradient, the others write an fp32 partial. Pass 2 adds the partials of
each segment of several pieces, in order. Everything the passes need (the pieces' starts, which are
whole, where their partials go) comes from sorts, cumulative sums and binary searches on the
device: no count is read back to the host. Segments: at most min(``num_rows``, M); pieces: at most
that plus ceil(M / CHUNK); partials: at most two per chunk boundary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 512  # most rows one pass-1 program sums
_BLOCK_R = 16  # rows a program loads at once


def _block_e(e: int) -> int:
    return min(triton.next_power_of_2(max(e, 16)), 512)


@triton.jit
def _piece_sums(
    GRAD,
    ORDER,
    SORTED,
    PIECE_START,
    WHOLE,
    SLOT,
    OUT,
    PARTIAL,
    M,
    E,
    stride_g,
    stride_o,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    start = tl.load(PIECE_START + p)
    if start < M:
        end = tl.load(PIECE_START + p + 1)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < end
            token = tl.load(ORDER + rows, mask=rmask, other=0).to(tl.int64)
            g = tl.load(
                GRAD + token[:, None] * stride_g + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
            )
            acc += tl.sum(g.to(tl.float32), axis=0)
        if tl.load(WHOLE + p) != 0:
            row = tl.load(SORTED + start).to(tl.int64)
            tl.store(OUT + row * stride_o + cols, acc.to(OUT.dtype.element_ty), mask=cmask)
        else:
            slot = tl.load(SLOT + p).to(tl.int64)
            tl.store(PARTIAL + slot * E + cols, acc, mask=cmask)


@triton.jit
def _join_partials(
    PIECE_START,
    SORTED,
    JOIN,
    SLOT,
    PIECES,
    OUT,
    PARTIAL,
    E,
    stride_o,
    BLOCK_E: tl.constexpr,
):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    if tl.load(JOIN + p) != 0:  # the first piece of a segment of several
        slot = tl.load(SLOT + p).to(tl.int64)
        acc = tl.zeros([BLOCK_E], dtype=tl.float32)
        for k in range(0, tl.load(PIECES + p)):
            acc += tl.load(PARTIAL + (slot + k) * E + cols, mask=cmask, other=0.0)
        row = tl.load(SORTED + tl.load(PIECE_START + p)).to(tl.int64)
        tl.store(OUT + row * stride_o + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


def segment_sum(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """grad [M, E], index [M] (int32/int64, each in [0, num_rows)) -> [num_rows, E] in grad's dtype:
    row r is the fp32 sum of grad's rows i with index[i] == r (zeros for a row no index names)."""
    m, e = grad.shape
    out = torch.zeros((num_rows, e), device=grad.device, dtype=grad.dtype)
    if m == 0 or e == 0 or num_rows == 0:
        return out
    device = grad.device
    sorted_rows, order = torch.sort(index, stable=True)
    positions = torch.arange(m, device=device)
    # is_start[i]: sorted position i begins a segment; position m closes the last one.
    is_start = torch.ones(m + 1, device=device, dtype=torch.bool)
    is_start[1:m] = sorted_rows[1:] != sorted_rows[:-1]
    cut = is_start[:m] | (positions % CHUNK == 0)
    piece_of = torch.cumsum(cut, 0) - 1
    max_pieces = min(num_rows, m) + triton.cdiv(m, CHUNK)
    # The first sorted position of each piece; m for the pieces past the last.
    piece_start = torch.searchsorted(piece_of, torch.arange(max_pieces + 1, device=device))
    valid = piece_start[:-1] < m
    first = is_start[piece_start[:-1]] & valid
    whole = first & is_start[piece_start[1:]]
    split = valid & ~whole
    slot = torch.cumsum(split, 0) - 1
    # A segment's pieces run from its first piece to the next first piece (or the first invalid one).
    boundary = torch.cumsum(first | ~valid, 0)
    pieces = torch.searchsorted(boundary, boundary + 1) - torch.arange(max_pieces, device=device)
    partial = torch.empty((max(1, 2 * triton.cdiv(m, CHUNK)), e), device=device, dtype=torch.float32)
    block_e = _block_e(e)
    grid = (max_pieces, triton.cdiv(e, block_e))
    order = order.to(torch.int32) if m < 2**31 else order
    _piece_sums[grid](
        grad,
        order,
        sorted_rows,
        piece_start,
        whole.to(torch.int8),
        slot,
        out,
        partial,
        m,
        e,
        grad.stride(0),
        out.stride(0),
        BLOCK_R=_BLOCK_R,
        BLOCK_E=block_e,
        num_warps=4,
    )
    _join_partials[grid](
        piece_start,
        sorted_rows,
        (first & ~whole).to(torch.int8),
        slot,
        pieces,
        out,
        partial,
        e,
        out.stride(0),
        BLOCK_E=block_e,
        num_warps=4,
    )
    return out
