"""Triton position/time encoding: out = Dropout(x·scale + P[pos] + T[bucket]), one row block per program.

x is a tensor laid out as the sequences, or the sequences' parts (``PARTS``): the contextual rows
[B, C, D] and the tokens [history rows; B candidate rows]. With parts the kernel reads each row
from its part and the backward writes each part's gradient rows, so the concatenated sequence is
never built: a row p of sequence b is contextual slot p when p < C, the candidate (token row
T_hist + b) when it is the last, else history token row - b·(C + 1) - C.

Each row finds its sequence by a branch-free binary search over seq_offsets (log2 B steps over
a tiny array in L1), so no per-token index tensors are built. Time buckets are computed as the
reference model's are, in fp32 (the int64 gap converted, divided and square-rooted with correct
rounding: ``div_rn``, ``sqrt_rn``), so the kernel and reference/position.py agree exactly. The
backward adds the gradient into the two fp32 tables with atomics (a position row is shared by
at most B tokens; a time bucket by many, hence the per-block pre-sum there). Atomics add in
whatever order the blocks run, so under ``torch.use_deterministic_algorithms(True)`` the kernel
writes each token's gradient and row numbers instead and torch's deterministic ``index_add_``
(a sort, then a fixed order) sums them.

Dropout (the model's input dropout, fused): the draw of ``dropout_draw.py`` with counter row r =
row_offset + local row over the D columns; kept values scaled by 1 / (1 - p). One Philox call per
8 columns is cheap next to the loads, so the backward draws the mask again instead of the forward
storing it; the tables' gradients are the masked, scaled gradient. ``reference/position.py`` draws the same mask in torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlrmv4.ops.reference.philox import dropout_threshold
from dlrmv4.ops.triton.dropout_draw import keep8


@triton.jit
def _token_rows(SOFF, TS, QT, rows, rmask, B, C, P, NT, n_search, bucket_seconds):
    """(position row, time-bucket row, sequence, place in it, sequence length) of each token, int64."""
    lo = tl.zeros_like(rows)
    hi = lo + (B - 1)
    step = 0  # a while loop: the interpreter cannot take range() over a run-time argument
    while step < n_search:
        mid = (lo + hi + 1) // 2
        ok = tl.load(SOFF + mid) <= rows
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
        step += 1
    start = tl.load(SOFF + lo)
    n = tl.load(SOFF + lo + 1) - start
    p = rows - start
    # Contextual slot i -> i; history counts backwards from its end (newest C+1); candidate -> C.
    pos = tl.minimum(tl.where(p < C, p, C + n - 1 - p), P - 1)
    gap = (tl.load(QT + lo) - tl.load(TS + rows, mask=rmask, other=0)).to(tl.float32)
    # A float argument arrives in fp32 (rounded to nearest on the host, as torch rounds it).
    bucket = tl.sqrt_rn(tl.div_rn(tl.maximum(gap, 1e-6), bucket_seconds)).to(tl.int64)
    return pos.to(tl.int64), tl.minimum(tl.maximum(bucket, 0), NT - 1), lo.to(tl.int64), p.to(tl.int64), n


@triton.jit
def _part_rows(rows, seq, p, n, C, cand_row0):
    """With the sequences in parts: (is a contextual row, its token row where it is not), int64 [M, 1]."""
    is_ctx = p < C
    token_row = tl.where(p == n - 1, cand_row0 + seq, rows.to(tl.int64) - seq * (C + 1) - C)
    return is_ctx[:, None], token_row[:, None]


# The seed and row offset change every step (chunk), and the row, sample and search counts every batch:
# unspecialised, so they compile no variants (a new divisibility of a count would compile one inside the
# timed run, after the warm-up).
_PER_BATCH = ["seed", "row_offset", "N", "B", "n_search", "cand_row0"]


@triton.jit(do_not_specialize=_PER_BATCH)
def _position_time_fwd(
    X,
    CTX,
    SOFF,
    TS,
    QT,
    PT,
    TT,
    OUT,
    N,
    B,
    C,
    P,
    NT,
    n_search,
    bucket_seconds,
    x_scale,
    s_x,
    s_ctx_b,
    s_ctx_c,
    s_pt,
    s_tt,
    s_out,
    cand_row0,
    seed,
    row_offset,
    threshold,
    drop_scale,
    D: tl.constexpr,
    PARTS: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    pos, bucket, seq, p, n = _token_rows(SOFF, TS, QT, rows, rmask, B, C, P, NT, n_search, bucket_seconds)
    r64 = rows.to(tl.int64)[:, None]
    # A select between the two parts' pointers would not compile for AMD targets (its pointer
    # canonicalization wants one base): each row is read by one of two masked accesses instead.
    if PARTS:
        is_ctx, token_row = _part_rows(rows, seq, p, n, C, cand_row0)
        x_rows = X + token_row * s_x
        ctx_rows = CTX + seq[:, None] * s_ctx_b + p[:, None] * s_ctx_c
    else:
        x_rows = X + r64 * s_x
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + tl.arange(0, BLOCK_D))[None, :]
        mask = rmask[:, None] & (cols < D)
        if PARTS:  # the token rows' load fills in the contextual rows' values
            x = tl.load(ctx_rows + cols, mask=mask & is_ctx, other=0.0)
            x = tl.load(x_rows + cols, mask=mask & ~is_ctx, other=x).to(tl.float32)
        else:
            x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        pt = tl.load(PT + pos[:, None] * s_pt + cols, mask=mask, other=0.0).to(tl.float32)
        tt = tl.load(TT + bucket[:, None] * s_tt + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * x_scale + pt + tt
        if DROPOUT:
            y = tl.where(keep8(seed, r64 + row_offset, (D + 7) // 8, d0, threshold, BLOCK_D), y * drop_scale, 0.0)
        tl.store(OUT + r64 * s_out + cols, y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=_PER_BATCH)
def _position_time_bwd(
    G,
    SOFF,
    TS,
    QT,
    DX,
    DCTX,
    DPT,
    DTT,
    G_ROWS,
    POS_ROWS,
    BUCKET_ROWS,
    N,
    B,
    C,
    P,
    NT,
    n_search,
    bucket_seconds,
    x_scale,
    s_g,
    s_dx,
    s_dctx_b,
    s_dctx_c,
    cand_row0,
    seed,
    row_offset,
    threshold,
    drop_scale,
    D: tl.constexpr,
    PARTS: tl.constexpr,
    DROPOUT: tl.constexpr,
    DETERMINISTIC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    pos, bucket, seq, p, n = _token_rows(SOFF, TS, QT, rows, rmask, B, C, P, NT, n_search, bucket_seconds)
    r64 = rows.to(tl.int64)[:, None]
    if PARTS:  # each row's gradient goes to its part (two masked stores, as the forward's loads)
        is_ctx, token_row = _part_rows(rows, seq, p, n, C, cand_row0)
        dx_rows = DX + token_row * s_dx
        dctx_rows = DCTX + seq[:, None] * s_dctx_b + p[:, None] * s_dctx_c
    else:
        dx_rows = DX + r64 * s_dx
    if DETERMINISTIC:
        tl.store(POS_ROWS + rows, pos, mask=rmask)
        tl.store(BUCKET_ROWS + rows, bucket, mask=rmask)
    # Timestamps are sorted within a sequence, so neighbouring tokens often share a time bucket:
    # such a block adds its row sum with one atomic per column instead of one per row.
    first = tl.min(tl.where(rmask, bucket, NT))
    one_bucket = first == tl.max(tl.where(rmask, bucket, -1))
    for d0 in range(0, D, BLOCK_D):
        cols = (d0 + tl.arange(0, BLOCK_D))[None, :]
        mask = rmask[:, None] & (cols < D)
        g = tl.load(G + r64 * s_g + cols, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:  # the forward's mask, drawn again
            g = tl.where(keep8(seed, r64 + row_offset, (D + 7) // 8, d0, threshold, BLOCK_D), g * drop_scale, 0.0)
        dx = (g * x_scale).to(DX.dtype.element_ty)
        if PARTS:
            tl.store(dctx_rows + cols, dx, mask=mask & is_ctx)
            tl.store(dx_rows + cols, dx, mask=mask & ~is_ctx)
        else:
            tl.store(dx_rows + cols, dx, mask=mask)
        if DETERMINISTIC:
            tl.store(G_ROWS + r64 * D + cols, g, mask=mask)
        else:
            tl.atomic_add(DPT + pos[:, None] * D + cols, g, mask=mask, sem="relaxed")
            if one_bucket:
                tl.atomic_add(DTT + first * D + cols, tl.sum(g, axis=0)[None, :], mask=cols < D, sem="relaxed")
            else:
                tl.atomic_add(DTT + bucket[:, None] * D + cols, g, mask=mask, sem="relaxed")


def _common(seq_offsets: torch.Tensor, d: int, time_bucket_seconds: float) -> tuple:
    b = seq_offsets.numel() - 1
    block_d = min(triton.next_power_of_2(max(d, 16)), 1024)  # a multiple of 8: whole Philox groups
    return b, (b - 1).bit_length(), float(time_bucket_seconds), max(1, 4096 // block_d), block_d


def dropout_args(dropout: tuple[float, int, int] | None) -> tuple:
    """Kernel arguments (seed, row_offset, threshold, scale) and DROPOUT for ``dropout`` = (p, seed,
    row_offset), or None for no dropout."""
    if dropout is None:
        return (0, 0, 0, 1.0), False
    p, seed, row_offset = dropout
    return (seed, row_offset, dropout_threshold(p), 1.0 / (1.0 - p)), True


def forward(
    x: torch.Tensor,
    seq_offsets: torch.Tensor,
    timestamps: torch.Tensor,
    query_time: torch.Tensor,
    num_contextual: int,
    pos_table: torch.Tensor,
    time_table: torch.Tensor,
    x_scale: float,
    time_bucket_seconds: float,
    dropout: tuple[float, int, int] | None = None,
    contextual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T', D] with unit column stride, or with ``contextual`` ([B, C, D], unit column stride) the
    tokens [T + B, D] (history rows, then the candidates) of the sequences' parts; tables [rows, D]
    with unit column stride; ``dropout`` (p > 0, seed, row_offset) or None. Returns [T', D]."""
    n, d = timestamps.numel(), x.shape[1]
    out = torch.empty((n, d), device=x.device, dtype=x.dtype)
    b, n_search, bits, block_m, block_d = _common(seq_offsets, d, time_bucket_seconds)
    drop_args, active = dropout_args(dropout)
    parts = contextual is not None
    ctx = contextual if contextual is not None else x
    if n > 0:
        _position_time_fwd[(triton.cdiv(n, block_m),)](
            x,
            ctx,
            seq_offsets,
            timestamps,
            query_time,
            pos_table,
            time_table,
            out,
            n,
            b,
            num_contextual,
            pos_table.shape[0],
            time_table.shape[0],
            n_search,
            bits,
            x_scale,
            x.stride(0),
            ctx.stride(0),
            ctx.stride(1) if parts else 0,
            pos_table.stride(0),
            time_table.stride(0),
            out.stride(0),
            x.shape[0] - b,
            *drop_args,
            D=d,
            PARTS=parts,
            DROPOUT=active,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def backward(
    grad: torch.Tensor,
    seq_offsets: torch.Tensor,
    timestamps: torch.Tensor,
    query_time: torch.Tensor,
    num_contextual: int,
    num_positions: int,
    num_buckets: int,
    x_scale: float,
    time_bucket_seconds: float,
    x_dtype: torch.dtype,
    dropout: tuple[float, int, int] | None = None,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx in x's dtype, dpos_table fp32, dtime_table fp32, None); ``dropout`` as in the forward.
    ``num_tokens``: x came in parts with that many tokens: (dtokens, dpos_table, dtime_table,
    dcontextual [B, C, D]), every row of both written once."""
    n, d = grad.shape
    b, n_search, bits, block_m, block_d = _common(seq_offsets, d, time_bucket_seconds)
    parts = num_tokens is not None
    dx = torch.empty((num_tokens if num_tokens is not None else n, d), device=grad.device, dtype=x_dtype)
    dctx = torch.empty((b, num_contextual, d), device=grad.device, dtype=x_dtype) if parts else None
    dpt = torch.zeros((num_positions, d), device=grad.device, dtype=torch.float32)
    dtt = torch.zeros((num_buckets, d), device=grad.device, dtype=torch.float32)
    drop_args, active = dropout_args(dropout)
    deterministic = torch.are_deterministic_algorithms_enabled()
    # Per-token gradients and rows for torch's ordered sums; one-element stand-ins otherwise. The
    # rows start at 0, valid indices even where a launch only compiles (ops/triton/cross_compile.py).
    token_rows = n if deterministic else 1
    g_rows = torch.empty((token_rows, d), device=grad.device, dtype=torch.float32)
    pos_rows = torch.zeros(token_rows, device=grad.device, dtype=torch.int64)
    bucket_rows = torch.zeros(token_rows, device=grad.device, dtype=torch.int64)
    dctx_arg = dctx if dctx is not None else dx
    if n > 0:
        _position_time_bwd[(triton.cdiv(n, block_m),)](
            grad,
            seq_offsets,
            timestamps,
            query_time,
            dx,
            dctx_arg,
            dpt,
            dtt,
            g_rows,
            pos_rows,
            bucket_rows,
            n,
            b,
            num_contextual,
            num_positions,
            num_buckets,
            n_search,
            bits,
            x_scale,
            grad.stride(0),
            dx.stride(0),
            dctx_arg.stride(0),
            dctx_arg.stride(1) if parts else 0,
            dx.shape[0] - b,
            *drop_args,
            D=d,
            PARTS=parts,
            DROPOUT=active,
            DETERMINISTIC=deterministic,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            num_warps=4,
        )
        if deterministic:
            dpt.index_add_(0, pos_rows, g_rows)
            dtt.index_add_(0, bucket_rows, g_rows)
    return dx, dpt, dtt, dctx
