"""Triton STU output block: y = Dropout([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)]) in one pass.

One program holds a block of rows of u and attn in registers, applies SiLU to u and normalises attn
in fp32, and writes the three column segments of y. u arrives before its SiLU and the backward
re-reads that pre-activation (SiLU' needs it), so no activated copy of u is ever stored.

Dropout: the keep decisions are a pure function of (seed, global row, column), so a chunk of rows
run with ``row_offset`` = its first row's index draws the rows' masks of the whole batch. Row r =
row_offset + local row: segment s in {0, 1, 2} of its HD columns is counter row 3r + s of the draw
of ``dropout_draw.py`` (one Philox call, all four of its words, per 8 columns; an element is kept iff
its 16-bit number is >= round(p * 2^16), so the drop probability is p rounded to a multiple of
2^-16; kept elements are scaled by 1 / (1 - p)). Philox is the forward's cost beyond its loads and
stores (``benchmarks/kernels/bench_ops.py`` times the block with and without dropout), so the forward
stores the decisions, three bits a byte, for the backward, which reads them (one byte per (row,
column)) instead of drawing again. ``keep_mask`` here and the reference's ``draw_keep_mask`` (torch
only, ``reference/philox.py``) draw the same decisions from (seed, row_offset) alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlrmv4.ops.reference.philox import dropout_threshold
from dlrmv4.ops.triton.dropout_draw import keep8
from dlrmv4.ops.triton.layer_norm import (
    normalize_rows,
    row_tile,
    sum_weight_grads,
    warp_lanes,
    weight_grad_partials,
)
from dlrmv4.ops.triton.occupancy import launch_persistent


@triton.jit
def _keep(seed, rows, HD, threshold, BLOCK_H: tl.constexpr):
    """Keep decisions [rows, BLOCK_H] of the three segments at global ``rows``: segment s of row r is
    counter row 3r + s of the draw (one Philox call per 8 columns)."""
    base = rows.to(tl.int64)[:, None] * 3
    groups = (HD + 7) // 8
    return (
        keep8(seed, base, groups, 0, threshold, BLOCK_H),
        keep8(seed, base + 1, groups, 0, threshold, BLOCK_H),
        keep8(seed, base + 2, groups, 0, threshold, BLOCK_H),
    )


# Kernels take the seed, row offset, row count and trip count unspecialised: they change every step
# (chunk), and each new value's divisibility by 16 would otherwise be compiled as a variant of its own.
@triton.jit(do_not_specialize=["seed", "row_offset", "T"])
def _output_block_fwd(
    U,
    A,
    W,
    B,
    Y,
    Mean,
    Rstd,
    KEEP,
    T,
    HD,
    stride_u,
    stride_a,
    stride_y,
    eps,
    threshold,
    scale,
    seed,
    row_offset,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < T
    cmask = cols < HD
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    # With dropout, u stays in its dtype until the norm's reductions are done: fewer live registers
    # (62 against 74 on sm_90: four blocks of 8 warps an SM, not three); without, converted at its load
    # (40 registers either way; the second conversion below is then a no-op).
    u = tl.load(U + r64 * stride_u + cols[None, :], mask=mask, other=0.0)
    if not DROPOUT:
        u = u.to(tl.float32)
    a = tl.load(A + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ln, mean, rstd = normalize_rows(a, W, B, cols, mask, cmask, HD, eps, HAS_W, HAS_B)
    u = u.to(tl.float32)
    su = u * tl.sigmoid(u)
    y0 = su
    y1 = a
    y2 = su * ln
    if DROPOUT:
        k0, k1, k2 = _keep(seed, rows.to(tl.int64) + row_offset, HD, threshold, BLOCK_H)
        y0 = tl.where(k0, y0 * scale, 0.0)
        y1 = tl.where(k1, y1 * scale, 0.0)
        y2 = tl.where(k2, y2 * scale, 0.0)
    out = Y + r64 * stride_y + cols[None, :]
    tl.store(out, y0.to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HD, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(out + 2 * HD, y2.to(Y.dtype.element_ty), mask=mask)
    if DROPOUT:
        bits = k0.to(tl.uint8) | (k1.to(tl.uint8) << 1) | (k2.to(tl.uint8) << 2)
        tl.store(KEEP + r64 * HD + cols[None, :], bits, mask=mask)
    tl.store(Mean + rows, mean, mask=rmask)
    tl.store(Rstd + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["T", "n_iters", "n_progs"])
def _output_block_bwd(
    U,
    A,
    W,
    B,
    DY,
    DU,
    DA,
    DWp,
    DBp,
    DUSp,
    Mean,
    Rstd,
    KEEP,
    T,
    HD,
    stride_u,
    stride_a,
    stride_dy,
    stride_du,
    stride_da,
    scale,
    n_iters,
    n_progs,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    DROPOUT: tl.constexpr,
    DU_SUMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < HD
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_W else tl.full([BLOCK_H], 1.0, tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_B else tl.zeros([BLOCK_H], tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    du_acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    it = 0  # grid-stride loop (see layer_norm's backward for why a while loop)
    while it < n_iters:
        rows = (pid + it * n_progs) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < T
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        u = tl.load(U + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        a = tl.load(A + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = DY + r64 * stride_dy + cols[None, :]
        g0 = tl.load(dy, mask=mask, other=0.0).to(tl.float32)
        g1 = tl.load(dy + HD, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(dy + 2 * HD, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            bits = tl.load(KEEP + r64 * HD + cols[None, :], mask=mask, other=0)
            k0, k1, k2 = (bits & 1) != 0, (bits & 2) != 0, (bits & 4) != 0
            g0 = tl.where(k0, g0 * scale, 0.0)
            g1 = tl.where(k1, g1 * scale, 0.0)
            g2 = tl.where(k2, g2 * scale, 0.0)
        mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        ahat = tl.where(mask, (a - mean[:, None]) * rstd[:, None], 0.0)
        sig = tl.sigmoid(u)
        su = u * sig
        # Through SiLU: SiLU'(u) = s (1 + u (1 - s)), s = sigmoid(u).
        du = (g0 + g2 * (ahat * w[None, :] + b[None, :])) * (sig * (1.0 + u * (1.0 - sig)))
        dln = g2 * su
        dhat = dln * w[None, :]
        c1 = tl.sum(dhat * ahat, axis=1) / HD
        c2 = tl.sum(dhat, axis=1) / HD
        da = g1 + (dhat - ahat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DU + r64 * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)
        tl.store(DA + r64 * stride_da + cols[None, :], da.to(DA.dtype.element_ty), mask=mask)
        dw_acc += dln * ahat
        db_acc += dln
        if DU_SUMS:  # rows and columns past the ends have du = 0
            du_acc += du
        it += 1
    if HAS_W:
        tl.store(DWp + pid * HD + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_B:
        tl.store(DBp + pid * HD + cols, tl.sum(db_acc, axis=0), mask=cmask)
    if DU_SUMS:
        tl.store(DUSp + pid * HD + cols, tl.sum(du_acc, axis=0), mask=cmask)


@triton.jit(do_not_specialize=["seed", "row_offset"])
def _output_block_mask(M, T, HD, threshold, seed, row_offset, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < HD)[None, :]
    k0, k1, k2 = _keep(seed, rows.to(tl.int64) + row_offset, HD, threshold, BLOCK_H)
    out = M + rows.to(tl.int64)[:, None] * (3 * HD) + cols[None, :]
    tl.store(out, k0.to(tl.uint8), mask=mask)
    tl.store(out + HD, k1.to(tl.uint8), mask=mask)
    tl.store(out + 2 * HD, k2.to(tl.uint8), mask=mask)


def _dropout_args(dropout_p: float, training: bool) -> tuple[bool, float]:
    active = training and dropout_p > 0.0
    if active and not 0.0 < dropout_p < 1.0:
        raise ValueError(f"output_block: dropout_p={dropout_p} must be in [0, 1)")
    return active, (1.0 / (1.0 - dropout_p) if active else 1.0)


# Launch shapes (elements per program, per thread[, programs per SM]): the fastest of
# benchmarks/kernels/bench_ops.py --sweep --batch 256 on an H200 at [733k, 512] bf16 (results/ops_sweep.md); the
# programs per SM are a cap: a persistent grid takes no more than the SMs hold (occupancy.py).
FWD_TILE, BWD_TILE = (2048, 8), (2048, 16, 16)


def forward(
    u: torch.Tensor,
    attn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    dropout_p: float,
    seed: int,
    training: bool,
    row_offset: int = 0,
    tile: tuple[int, int] = FWD_TILE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y [T, 3·HD] in u's dtype, mean [T] fp32, rstd [T] fp32, keep) from u before its SiLU; u and
    attn need unit column stride. ``keep``: uint8 [T, HD], the three segments' keep decisions in
    bits 0-2, for the backward (None without dropout); the masks are drawn for the global rows
    row_offset .. row_offset + T - 1."""
    t, hd = u.shape
    dropout, scale = _dropout_args(dropout_p, training)
    y = torch.empty((t, 3 * hd), device=u.device, dtype=u.dtype)
    mean = torch.empty(t, device=u.device, dtype=torch.float32)
    rstd = torch.empty(t, device=u.device, dtype=torch.float32)
    keep = torch.empty((t, hd), device=u.device, dtype=torch.uint8) if dropout else None
    if t == 0:
        return y, mean, rstd, keep
    block_m, block_h, warps = row_tile(hd, *tile, warp_lanes())
    _output_block_fwd[(triton.cdiv(t, block_m),)](
        u,
        attn,
        weight,
        bias,
        y,
        mean,
        rstd,
        keep,
        t,
        hd,
        u.stride(0),
        attn.stride(0),
        y.stride(0),
        eps,
        dropout_threshold(dropout_p),
        scale,
        seed,
        row_offset,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        DROPOUT=dropout,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
        num_warps=warps,
    )
    return y, mean, rstd, keep


def backward(
    u: torch.Tensor,
    attn: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    dy: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    keep: torch.Tensor | None,
    dropout_p: float,
    tile: tuple[int, int, int] = BWD_TILE,
    *,
    du_out: torch.Tensor | None = None,
    du_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(du, dattn, dweight or None, dbias or None), du with respect to u before its SiLU; ``keep``
    is the forward's mask (None: no dropout). ``du_out`` ([T, HD], unit column stride; e.g. the u
    columns of a wider gradient) receives du instead of a new tensor, and is returned as du.
    ``du_sum`` (contiguous fp32 [HD]; e.g. the u slice of a projection's bias gradient) receives
    du's sum over its rows, added up before rounding."""
    t, hd = u.shape
    _, scale = _dropout_args(dropout_p, keep is not None)
    if du_out is None:
        du = torch.empty((t, hd), device=u.device, dtype=u.dtype)
    elif tuple(du_out.shape) != (t, hd) or (t > 0 and du_out.stride(1) != 1):
        raise ValueError(
            f"output_block: du_out must be [{t}, {hd}] with unit column stride; got "
            f"{tuple(du_out.shape)}, strides {du_out.stride()}"
        )
    else:
        du = du_out
    if du_sum is not None and (
        tuple(du_sum.shape) != (hd,) or du_sum.dtype != torch.float32 or not du_sum.is_contiguous()
    ):
        raise ValueError(
            f"output_block: du_sum must be contiguous fp32 [{hd}], got {du_sum.dtype} {tuple(du_sum.shape)}"
        )
    da = torch.empty((t, hd), device=u.device, dtype=attn.dtype)
    block_m, block_h, warps = row_tile(hd, tile[0], tile[1], warp_lanes())
    n_blocks = triton.cdiv(t, block_m)
    meta = dict(
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        DROPOUT=keep is not None,
        DU_SUMS=du_sum is not None,
        BLOCK_M=block_m,
        BLOCK_H=block_h,
        num_warps=warps,
    )

    def args(progs: int, dw_part, db_part, du_part) -> tuple:
        strides = (u.stride(0), attn.stride(0), dy.stride(0), du.stride(0), da.stride(0))
        pointers = (u, attn, weight, bias, dy, du, da, dw_part, db_part, du_part, mean, rstd, keep)
        return (*pointers, t, hd, *strides, scale, triton.cdiv(n_blocks, progs), progs)

    def partials(progs: int) -> tuple[torch.Tensor | None, ...]:
        return weight_grad_partials(u.device, progs, hd, t, weight, bias, du_sum)

    dw_part, db_part, du_part = launch_persistent(
        _output_block_bwd, u.device, u.dtype, n_blocks, tile[2], meta, partials, args
    )
    dw, db = sum_weight_grads(dw_part, db_part, weight, bias)
    if du_sum is not None:
        torch.sum(du_part, dim=0, out=du_sum)
    return du, da, dw, db


def keep_mask(t: int, hd: int, dropout_p: float, seed: int, device: torch.device, row_offset: int = 0) -> torch.Tensor:
    """bool [t, 3·hd]: the keep decisions the kernels make for (dropout_p, seed) at the global rows
    row_offset .. row_offset + t - 1 (the reference's ``keep_mask`` draws the same without Triton;
    this one lets tests compare the two)."""
    m = torch.empty((t, 3 * hd), device=device, dtype=torch.uint8)
    if t > 0:
        block_m, block_h, warps = row_tile(hd, *FWD_TILE, warp_lanes())
        _output_block_mask[(triton.cdiv(t, block_m),)](
            m, t, hd, dropout_threshold(dropout_p), seed, row_offset, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps
        )
    return m.view(torch.bool)
