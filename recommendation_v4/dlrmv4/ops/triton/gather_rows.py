"""Triton backward of a row gather: each row's gradient is the sum of the gradients of the output rows
that copied it (``out[i] = rows[index[i]]``), in fp32, deterministic, without atomics.

The indices are sorted (stable) once; the sorted positions fall into pieces: a piece never crosses a
segment (a run of one index) nor a chunk boundary (every ``CHUNK`` positions), so no program sums
more than ``CHUNK`` rows however popular a row is. Pass 1 sums each piece; a piece that is a whole
segment writes its row's gradient, the others write an fp32 partial. Pass 2 adds the partials of
each segment of several pieces, ``_BLOCK_K`` at a time, so a row of a hundred thousand copies costs
its program a few dozen loads. Everything the passes need (the pieces' starts, which are whole,
where their partials go) comes from sorts, cumulative sums and binary searches on the device: no
count is read back to the host. Segments: at most min(``num_rows``, M); pieces: at most that plus
ceil(M / CHUNK); partials: at most two per chunk boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

CHUNK = 1024  # most rows one pass-1 program sums
_BLOCK_K = 8  # partials a pass-2 program loads at once
_BLOCK_E = 512  # most columns one program covers
# (rows a pass-1 program loads at once, warps) for segments of many rows and of a few: short
# segments leave most of a taller tile masked, and the many small programs want more of them
# resident (measured on an H100 over [730k, 512] bf16: 1.15 -> 0.46 ms at ~4 rows a segment).
_TILES_LONG, _TILES_SHORT = (8, 4), (2, 2)
_SHORT_SEGMENTS = 8  # mean rows per segment below which the short tiles run


@dataclass(frozen=True)
class Pieces:
    """Where each piece of the sorted positions starts, whether it is a whole segment, where its
    partial goes, and (for a segment's first piece) how many pieces the segment has."""

    sorted_rows: torch.Tensor  # [M] the indices, sorted
    order: torch.Tensor  # [M] int32 (int64 past 2**31): the position each sorted one came from
    start: torch.Tensor  # [P + 1] first sorted position of each piece; M past the last
    whole: torch.Tensor  # [P] int8: the piece is a whole segment
    join: torch.Tensor  # [P] int8: the first piece of a segment of several
    slot: torch.Tensor  # [P] a split piece's partial row
    count: torch.Tensor  # [P] from a segment's first piece: its pieces
    num_partials: int  # rows the partial buffer needs


def _plan_pieces(index: torch.Tensor, num_rows: int) -> Pieces:
    """Cut the stably sorted positions of ``index`` (M > 0) into pieces (module docstring)."""
    m, chunk = index.shape[0], CHUNK
    device = index.device
    sorted_rows, order = torch.sort(index, stable=True)
    positions = torch.arange(m, device=device)
    # is_start[i]: sorted position i begins a segment; position m closes the last one.
    is_start = torch.ones(m + 1, device=device, dtype=torch.bool)
    is_start[1:m] = sorted_rows[1:] != sorted_rows[:-1]
    cut = is_start[:m] | (positions % chunk == 0)
    piece_of = torch.cumsum(cut, 0) - 1
    max_pieces = min(num_rows, m) + triton.cdiv(m, chunk)
    start = torch.searchsorted(piece_of, torch.arange(max_pieces + 1, device=device))
    valid = start[:-1] < m
    first = is_start[start[:-1]] & valid
    whole = first & is_start[start[1:]]
    split = valid & ~whole
    # A segment's pieces run from its first piece to the next first piece (or the first invalid one).
    boundary = torch.cumsum(first | ~valid, 0)
    count = torch.searchsorted(boundary, boundary + 1) - torch.arange(max_pieces, device=device)
    return Pieces(
        sorted_rows=sorted_rows,
        order=order.to(torch.int32) if m < 2**31 else order,
        start=start,
        whole=whole.to(torch.int8),
        join=(first & ~whole).to(torch.int8),
        slot=torch.cumsum(split, 0) - 1,
        count=count,
        num_partials=max(1, 2 * triton.cdiv(m, chunk)),
    )


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
        acc = tl.zeros([BLOCK_R, BLOCK_E], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            rmask = rows < end
            token = tl.load(ORDER + rows, mask=rmask, other=0).to(tl.int64)
            g = tl.load(
                GRAD + token[:, None] * stride_g + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
            )
            acc += g.to(tl.float32)
        total = tl.sum(acc, axis=0)
        if tl.load(WHOLE + p) != 0:
            row = tl.load(SORTED + start).to(tl.int64)
            tl.store(OUT + row * stride_o + cols, total.to(OUT.dtype.element_ty), mask=cmask)
        else:
            slot = tl.load(SLOT + p).to(tl.int64)
            tl.store(PARTIAL + slot * E + cols, total, mask=cmask)


@triton.jit
def _join_partials(
    PIECE_START,
    SORTED,
    JOIN,
    SLOT,
    COUNT,
    OUT,
    PARTIAL,
    E,
    stride_o,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    cmask = cols < E
    if tl.load(JOIN + p) != 0:
        slot = tl.load(SLOT + p).to(tl.int64)
        count = tl.load(COUNT + p)
        acc = tl.zeros([BLOCK_K, BLOCK_E], dtype=tl.float32)
        for k0 in range(0, count, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            acc += tl.load(
                PARTIAL + (slot + ks)[:, None] * E + cols[None, :],
                mask=(ks < count)[:, None] & cmask[None, :],
                other=0.0,
            )
        row = tl.load(SORTED + tl.load(PIECE_START + p)).to(tl.int64)
        tl.store(OUT + row * stride_o + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=cmask)


def _sum_pieces(grad: torch.Tensor, pieces: Pieces, out: torch.Tensor, block_r: int, num_warps: int) -> None:
    """Write into ``out`` (zeros) every named row's sum of ``grad``'s rows (the two passes)."""
    m, e = grad.shape
    block_e = min(triton.next_power_of_2(max(e, 16)), _BLOCK_E)
    partial = torch.empty((pieces.num_partials, e), device=grad.device, dtype=torch.float32)
    grid = (pieces.whole.shape[0], triton.cdiv(e, block_e))
    _piece_sums[grid](
        grad,
        pieces.order,
        pieces.sorted_rows,
        pieces.start,
        pieces.whole,
        pieces.slot,
        out,
        partial,
        m,
        e,
        grad.stride(0),
        out.stride(0),
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        num_warps=num_warps,
    )
    _join_partials[grid](
        pieces.start,
        pieces.sorted_rows,
        pieces.join,
        pieces.slot,
        pieces.count,
        out,
        partial,
        e,
        out.stride(0),
        BLOCK_K=_BLOCK_K,
        BLOCK_E=block_e,
        num_warps=num_warps,
    )


def segment_sum(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """grad [M, E], index [M] (int32/int64, each in [0, num_rows)) -> [num_rows, E] in grad's dtype:
    row r is the fp32 sum of grad's rows i with index[i] == r (zeros for a row no index names)."""
    m, e = grad.shape
    out = torch.zeros((num_rows, e), device=grad.device, dtype=grad.dtype)
    if m == 0 or e == 0 or num_rows == 0:
        return out
    block_r, num_warps = _TILES_SHORT if num_rows * _SHORT_SEGMENTS > m else _TILES_LONG
    _sum_pieces(grad, _plan_pieces(index, num_rows), out, block_r, num_warps)
    return out
