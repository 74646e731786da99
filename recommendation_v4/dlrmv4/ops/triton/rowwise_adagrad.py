"""Triton sparse row-wise Adagrad: reads the gradient rows in place, no atomics, no hot-row stalls.

The ids are sorted; each run of equal ids is one table row to update. Runs are cut at every
``CHUNK``-th sorted position into segments, so no program sums more than ``CHUNK`` gradient rows
however popular its row is (with real, skewed ids one item can own a fifth of a batch):

- ``_segment_sums``: program p works if p starts a segment (a run start, or a chunk boundary inside
  a run). It sums the segment's rows (read through the sort order, from one or two pieces,
  ``BLOCK_J`` rows at a time). A run that ends inside its first segment, nearly every run, is
  updated right there; otherwise the sum is left in a per-chunk slot.
- ``_long_runs``: the start of each run that crosses a chunk boundary adds up its segments' sums,
  chunk by chunk, and updates the row.

Sums follow the sorted order in fixed blocks, so every rank and every run computes the same bits;
every row is written by one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on an H200 at 730k ids of 1M rows, D = 512, a bf16 and an fp32 piece: 1.49 ms with
# uniform ids, 1.14 ms with Zipf(1.2) ids (one row owns ~18% of them; a program per run took 24 ms
# there). CHUNK 128-512 time the same; BLOCK_J 1 is 3% faster on uniform ids, 2% slower on skewed.
CHUNK = 256  # most gradient rows one program sums
BLOCK_J = 2  # gradient rows per load
BLOCK_K = 8  # segment sums per load in _long_runs
NUM_WARPS = 2


@triton.jit
def _apply(W, M, LR, row, acc, cols, cmask, D, stride_w, eps):
    """state += mean(g^2); w -= lr / (sqrt(state) + eps) * g, for one row."""
    state = tl.load(M + row) + tl.sum(acc * acc, axis=0) / D
    tl.store(M + row, state)
    # Correctly rounded sqrt and division, as the reference's torch.sqrt and "/".
    multiplier = tl.div_rn(tl.load(LR), tl.sqrt_rn(state) + eps)
    w_row = W + row * stride_w + cols
    tl.store(w_row, tl.load(w_row, mask=cmask) - multiplier * acc, mask=cmask)


@triton.jit
def _run_start(IDS, p, row):
    return (p == 0) | (tl.load(IDS + tl.maximum(p - 1, 0)) != row)


@triton.jit
def _crosses(IDS, p, row, n, CHUNK: tl.constexpr):
    """The run holding position p goes on past p's chunk."""
    end = (p // CHUNK + 1) * CHUNK
    return (end < n) & (tl.load(IDS + tl.minimum(end, n - 1)) == row)


@triton.jit
def _segment_sums(
    IDS,
    ORDER,
    V1,
    V2,
    PART,
    W,
    M,
    LR,
    n,
    n1,
    D,
    stride_v1,
    stride_v2,
    stride_w,
    eps,
    CHUNK: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    p = tl.program_id(0)
    row = tl.load(IDS + p)
    start = _run_start(IDS, p, row)
    if (start | (p % CHUNK == 0)) == 0:
        return  # inside a segment
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    end = tl.minimum((p // CHUNK + 1) * CHUNK, n)
    acc = tl.zeros([BLOCK_D], tl.float32)
    j = p
    more = p >= 0  # a device boolean: the loop condition's type must not change
    while more:
        offs = j + tl.arange(0, BLOCK_J)
        hit = tl.load(IDS + offs, mask=offs < end, other=-1) == row  # sorted: hits are a prefix
        src = tl.load(ORDER + offs, mask=hit, other=0).to(tl.int64)
        # Gradient row src is row src of the first piece, or row src - n1 of the second.
        first = (src < n1)[:, None]
        live = hit[:, None] & cmask[None, :]
        g = tl.load(V1 + src[:, None] * stride_v1 + cols[None, :], mask=live & first, other=0.0).to(tl.float32)
        g += tl.load(V2 + (src - n1)[:, None] * stride_v2 + cols[None, :], mask=live & ~first, other=0.0).to(tl.float32)
        acc += tl.sum(g, axis=0)
        j += BLOCK_J
        more = tl.sum(hit.to(tl.int32), axis=0) == BLOCK_J
    if start & ~_crosses(IDS, p, row, n, CHUNK):
        _apply(W, M, LR, row, acc, cols, cmask, D, stride_w, eps)
    else:
        # Slot 0 of a chunk: the segment at its first position that continues an earlier run;
        # slot 1: the run that starts in the chunk and goes on past it (at most one of each).
        tl.store(PART + ((p // CHUNK) * 2 + start.to(tl.int64)) * D + cols, acc, mask=cmask)


@triton.jit
def _long_runs(
    IDS, PART, W, M, LR, n, D, stride_w, eps, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr
):
    p = tl.program_id(0)
    row = tl.load(IDS + p)
    if (_run_start(IDS, p, row) & _crosses(IDS, p, row, n, CHUNK)) == 0:
        return
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    acc = tl.load(PART + ((p // CHUNK) * 2 + 1) * D + cols, mask=cmask)
    chunk = p // CHUNK + 1
    more = p >= 0
    while more:
        chunks = chunk + tl.arange(0, BLOCK_K)
        first_pos = chunks * CHUNK
        hit = tl.load(IDS + first_pos, mask=first_pos < n, other=-1) == row  # the run goes on into it
        parts = tl.load(
            PART + (chunks * 2)[:, None].to(tl.int64) * D + cols[None, :], mask=hit[:, None] & cmask[None, :], other=0.0
        )
        acc += tl.sum(parts, axis=0)
        chunk += BLOCK_K
        more = tl.sum(hit.to(tl.int32), axis=0) == BLOCK_K
    _apply(W, M, LR, row, acc, cols, cmask, D, stride_w, eps)


def rowwise_adagrad_(
    weight: torch.Tensor,
    momentum: torch.Tensor,
    ids: torch.Tensor,
    pieces: list[torch.Tensor],
    lr: torch.Tensor,
    eps: float,
    block_j: int = BLOCK_J,
    num_warps: int = NUM_WARPS,
    chunk: int = CHUNK,
) -> None:
    """In place; ``pieces``: one or two [n_i, D] tensors (fp32 or 16-bit, unit column stride) whose
    rows, concatenated, are the gradient rows of ``ids`` (int64 [n])."""
    sorted_ids, order = torch.sort(ids, stable=True)
    n, dim = ids.numel(), weight.shape[1]
    first, second = pieces[0], pieces[-1]
    block_d = triton.next_power_of_2(dim)
    part = torch.empty((triton.cdiv(n, chunk), 2, dim), dtype=torch.float32, device=weight.device)
    _segment_sums[(n,)](
        sorted_ids,
        order,
        first,
        second,
        part,
        weight,
        momentum,
        lr,
        n,
        len(first) if len(pieces) == 2 else n,
        dim,
        first.stride(0),
        second.stride(0),
        weight.stride(0),
        float(eps),
        CHUNK=chunk,
        BLOCK_J=block_j,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    if n > chunk:
        _long_runs[(n,)](
            sorted_ids,
            part,
            weight,
            momentum,
            lr,
            n,
            dim,
            weight.stride(0),
            float(eps),
            CHUNK=chunk,
            BLOCK_K=BLOCK_K,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
