"""Triton STU output block: y = Dropout([u ‖ attn ‖ u ⊙ LayerNorm(attn)]) in one pass.

One program holds a block of rows of u and attn in registers, normalises attn in fp32 and writes
the three column segments of y. Dropout draws Philox numbers from (seed, row·HD + col): one
``rand4x`` call gives the keep decisions of all three segments at that (row, col), so the
backward (and ``keep_mask``) regenerate the mask from the seed instead of storing it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dlrmv4.ops.triton.layer_norm import (normalize_rows, persistent_programs, row_tile, sum_weight_grads,
                                          weight_grad_partials)


@triton.jit
def _keep(seed, rows, cols, HD, p):
    """Keep decisions of the three segments at (rows, cols): each true with probability 1 − p."""
    offsets = rows.to(tl.int64)[:, None] * HD + cols[None, :]
    r0, r1, r2, _ = tl.rand4x(seed, offsets)
    return r0 >= p, r1 >= p, r2 >= p


# Kernels take the seed unspecialised: it changes every step, and each new value's divisibility
# by 16 would otherwise be compiled as a variant of its own.
@triton.jit(do_not_specialize=["seed"])
def _fwd_kernel(U, A, W, B, Y, Mean, Rstd, T, HD, stride_u, stride_a, stride_y, eps, p, scale, seed,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    rmask = rows < T
    cmask = cols < HD
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    u = tl.load(U + r64 * stride_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ln, mean, rstd = normalize_rows(a, W, B, cols, mask, cmask, HD, eps, HAS_W, HAS_B)
    y0 = u
    y1 = a
    y2 = u * ln
    if DROPOUT:
        k0, k1, k2 = _keep(seed, rows, cols, HD, p)
        y0 = tl.where(k0, y0 * scale, 0.0)
        y1 = tl.where(k1, y1 * scale, 0.0)
        y2 = tl.where(k2, y2 * scale, 0.0)
    out = Y + r64 * stride_y + cols[None, :]
    tl.store(out, y0.to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HD, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(out + 2 * HD, y2.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=rmask)
    tl.store(Rstd + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["seed"])
def _bwd_kernel(U, A, W, B, DY, DU, DA, DWp, DBp, Mean, Rstd, T, HD,
                stride_u, stride_a, stride_dy, stride_du, stride_da, p, scale, seed, n_iters, n_progs,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr, DROPOUT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < HD
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_W else tl.full([BLOCK_H], 1.0, tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_B else tl.zeros([BLOCK_H], tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
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
            k0, k1, k2 = _keep(seed, rows, cols, HD, p)
            g0 = tl.where(k0, g0 * scale, 0.0)
            g1 = tl.where(k1, g1 * scale, 0.0)
            g2 = tl.where(k2, g2 * scale, 0.0)
        mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        ahat = tl.where(mask, (a - mean[:, None]) * rstd[:, None], 0.0)
        du = g0 + g2 * (ahat * w[None, :] + b[None, :])
        dln = g2 * u
        dhat = dln * w[None, :]
        c1 = tl.sum(dhat * ahat, axis=1) / HD
        c2 = tl.sum(dhat, axis=1) / HD
        da = g1 + (dhat - ahat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DU + r64 * stride_du + cols[None, :], du.to(DU.dtype.element_ty), mask=mask)
        tl.store(DA + r64 * stride_da + cols[None, :], da.to(DA.dtype.element_ty), mask=mask)
        dw_acc += dln * ahat
        db_acc += dln
        it += 1
    if HAS_W:
        tl.store(DWp + pid * HD + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_B:
        tl.store(DBp + pid * HD + cols, tl.sum(db_acc, axis=0), mask=cmask)


@triton.jit(do_not_specialize=["seed"])
def _mask_kernel(M, T, HD, p, seed, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < HD)[None, :]
    k0, k1, k2 = _keep(seed, rows, cols, HD, p)
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
# benchmarks/bench_ops.py --sweep on an H200 at [91k, 512] bf16 (results/ops.md).
FWD_TILE, BWD_TILE = (2048, 8), (1024, 4, 8)


def forward(u: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
            eps: float, dropout_p: float, seed: int, training: bool,
            tile: tuple[int, int] = FWD_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [T, 3·HD] in u's dtype, mean [T] fp32, rstd [T] fp32); u and attn need unit column stride."""
    t, hd = u.shape
    dropout, scale = _dropout_args(dropout_p, training)
    y = torch.empty((t, 3 * hd), device=u.device, dtype=u.dtype)
    mean = torch.empty(t, device=u.device, dtype=torch.float32)
    rstd = torch.empty(t, device=u.device, dtype=torch.float32)
    if t == 0:
        return y, mean, rstd
    block_m, block_h, warps = row_tile(hd, *tile)
    _fwd_kernel[(triton.cdiv(t, block_m),)](
        u, attn, weight, bias, y, mean, rstd, t, hd, u.stride(0), attn.stride(0), y.stride(0), eps,
        dropout_p, scale, seed, HAS_W=weight is not None, HAS_B=bias is not None, DROPOUT=dropout,
        BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps)
    return y, mean, rstd


def backward(u: torch.Tensor, attn: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
             dy: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float, seed: int,
             training: bool, tile: tuple[int, int, int] = BWD_TILE
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(du, dattn, dweight or None, dbias or None); the dropout mask is regenerated from the seed."""
    t, hd = u.shape
    dropout, scale = _dropout_args(dropout_p, training)
    du = torch.empty((t, hd), device=u.device, dtype=u.dtype)
    da = torch.empty((t, hd), device=u.device, dtype=attn.dtype)
    block_m, block_h, warps = row_tile(hd, tile[0], tile[1])
    n_blocks = triton.cdiv(t, block_m)
    progs = persistent_programs(u.device, n_blocks, tile[2])
    dw_part, db_part = weight_grad_partials(u.device, progs, hd, t, weight, bias)
    if t > 0:
        _bwd_kernel[(progs,)](
            u, attn, weight, bias, dy, du, da, dw_part, db_part, mean, rstd, t, hd,
            u.stride(0), attn.stride(0), dy.stride(0), du.stride(0), da.stride(0), dropout_p, scale, seed,
            triton.cdiv(n_blocks, progs), progs, HAS_W=weight is not None, HAS_B=bias is not None,
            DROPOUT=dropout, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=warps)
    dw, db = sum_weight_grads(dw_part, db_part, weight, bias)
    return du, da, dw, db


def keep_mask(t: int, hd: int, dropout_p: float, seed: int, device: torch.device) -> torch.Tensor:
    """bool [t, 3·hd]: the keep decisions the kernels make for (dropout_p, seed)."""
    m = torch.empty((t, 3 * hd), device=device, dtype=torch.uint8)
    if t > 0:
        block_m, block_h, warps = row_tile(hd, *FWD_TILE)
        _mask_kernel[(triton.cdiv(t, block_m),)](m, t, hd, dropout_p, seed, BLOCK_M=block_m, BLOCK_H=block_h,
                                                 num_warps=warps)
    return m.view(torch.bool)
