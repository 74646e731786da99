"""Triton LayerNorm / SwishLayerNorm over the last dim: one row block per program forward, a
persistent grid backward that keeps the weight/bias gradient partials in registers.

Statistics are fp32 and saved (8 bytes a row), so the backward re-reads only x and dy. The
backward can also sum dx over its rows (``dx_sum``): the gradient of a bias that a GEMM added into
x, taken from registers instead of in a reduction pass over dx of its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .occupancy import launch_persistent
from .targets import current_target

MAX_WIDTH = 16384  # one row lives in registers; wider rows would spill


def warp_lanes() -> int:
    """Lanes of a warp (32) or of an AMD wavefront (64) on the launch's target."""
    target = current_target()
    return 32 if target is None else target.warp_size


def row_tile(width: int, tile: int, per_thread: int, lanes: int = 32) -> tuple[int, int, int]:
    """(rows per program, padded width, warps) for a block of about ``tile`` elements held in
    registers, ``per_thread`` elements of each live tensor per thread (backward kernels keep more
    tensors live, so they take smaller tiles to stay clear of register spills); ``lanes`` per warp."""
    if width > MAX_WIDTH:
        raise ValueError(f"row width {width} is over the Triton kernels' limit of {MAX_WIDTH}; use kernels='pytorch'")
    block_d = triton.next_power_of_2(max(width, 16))
    block_m = max(1, min(16, tile // block_d))
    return block_m, block_d, max(1, min(16, block_m * block_d // (lanes * per_thread)))


def weight_grad_partials(
    device: torch.device, programs: int, width: int, rows: int, *sums: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """fp32 [programs, width] buffers for per-program partial column sums, one for each of ``sums``
    that is not None (a weight or bias gradient, or another column sum the caller wants). Every
    program stores its whole partial row, so they need a zero fill only when there are no rows (and
    no launch)."""
    alloc = torch.empty if rows > 0 else torch.zeros
    return tuple(
        alloc((programs, width), device=device, dtype=torch.float32) if target is not None else None for target in sums
    )


def sum_weight_grads(
    dw_part: torch.Tensor | None, db_part: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Sum the per-program partials into the parameters' gradients."""

    def total(part: torch.Tensor | None, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None:
            return None
        assert part is not None  # weight_grad_partials gives every present parameter a buffer
        return part.sum(0).to(param.dtype)

    return total(dw_part, weight), total(db_part, bias)


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with unit column stride; 2-D inputs keep their row stride (no copy)."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(1) == 1 else x.contiguous()


@triton.jit
def normalize_rows(x, W, B, cols, mask, cmask, D, eps, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """LayerNorm of fp32 rows held in registers: (normalised rows with weight/bias, mean, rstd)."""
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    return y, mean, rstd


# Row counts and the loop's trip count change with every batch: left unspecialised, so a count that
# happens to divide by 16 does not compile a variant of its own in the middle of training.
@triton.jit(do_not_specialize=["N"])
def _layer_norm_fwd(
    X,
    W,
    B,
    A,
    Y,
    Mean,
    Rstd,
    N,
    D,
    stride_x,
    stride_a,
    stride_y,
    eps,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_A: tl.constexpr,
    SWISH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    rmask = rows < N
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y, mean, rstd = normalize_rows(x, W, B, cols, mask, cmask, D, eps, HAS_W, HAS_B)
    if SWISH:
        y = x * tl.sigmoid(y)
    if HAS_A:  # + an addend, rounded as the norm and a separate add would round: norm first, then the sum
        a = tl.load(A + r64 * stride_a + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y.to(Y.dtype.element_ty).to(tl.float32) + a
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(Mean + rows, mean, mask=rmask)
    tl.store(Rstd + rows, rstd, mask=rmask)


@triton.jit(do_not_specialize=["N", "n_iters", "n_progs"])
def _layer_norm_bwd(
    X,
    W,
    B,
    DY,
    DR,
    DX,
    DWp,
    DBp,
    DXSp,
    Mean,
    Rstd,
    N,
    D,
    stride_x,
    stride_dy,
    stride_dr,
    stride_dx,
    n_iters,
    n_progs,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    HAS_DR: tl.constexpr,
    DX_SUMS: tl.constexpr,
    SWISH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_W else tl.full([BLOCK_D], 1.0, tl.float32)
    b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32) if HAS_B else tl.zeros([BLOCK_D], tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dxs_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Grid-stride over row blocks; a block past the end is fully masked. A while loop, because
    # the interpreter (numpy 2) cannot take range() over a run-time scalar argument.
    it = 0
    while it < n_iters:
        rows = (pid + it * n_progs) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < N
        mask = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(DY + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if SWISH:
            # y = x·s(z), z = LN(x): dL/dz = g·x·s·(1−s), plus the direct term g·s.
            s = tl.sigmoid(xhat * w[None, :] + b[None, :])
            dz = g * x * s * (1.0 - s)
        else:
            dz = g
        dxhat = dz * w[None, :]
        c1 = tl.sum(dxhat * xhat, axis=1) / D
        c2 = tl.sum(dxhat, axis=1) / D
        dx = (dxhat - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if SWISH:
            dx = dx + g * s
        if HAS_DR:  # the gradient x gets by another path (a residual), added here instead of in a pass of its own
            dx += tl.load(DR + r64 * stride_dr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + r64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dz * xhat
        db_acc += dz
        if DX_SUMS:  # rows past the end have dx = 0; the padding columns are never stored
            dxs_acc += dx
        it += 1
    if HAS_W:
        tl.store(DWp + pid * D + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_B:
        tl.store(DBp + pid * D + cols, tl.sum(db_acc, axis=0), mask=cmask)
    if DX_SUMS:
        tl.store(DXSp + pid * D + cols, tl.sum(dxs_acc, axis=0), mask=cmask)


# Launch shapes (elements per program, per thread[, programs per SM]): the fastest of
# benchmarks/kernels/bench_ops.py --sweep --batch 256 on an H200 at [733k, 512] bf16 (results/ops_sweep.md); the
# programs per SM are a cap: a persistent grid takes no more than the SMs hold (occupancy.py).
FWD_TILE, BWD_TILE = (4096, 16), (1024, 8, 16)


def forward(
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    swish: bool,
    tile: tuple[int, int] = FWD_TILE,
    addend: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [N, D] contiguous in x's dtype, mean [N] fp32, rstd [N] fp32). ``addend`` ([N, D] in x's
    dtype, unit column stride): y is the norm plus it, rounded as two ops would round."""
    n, d = x2d.shape
    y = torch.empty((n, d), device=x2d.device, dtype=x2d.dtype)
    mean = torch.empty(n, device=x2d.device, dtype=torch.float32)
    rstd = torch.empty(n, device=x2d.device, dtype=torch.float32)
    if n == 0:
        return y, mean, rstd
    block_m, block_d, warps = row_tile(d, *tile, warp_lanes())
    _layer_norm_fwd[(triton.cdiv(n, block_m),)](
        x2d,
        weight,
        bias,
        addend,
        y,
        mean,
        rstd,
        n,
        d,
        x2d.stride(0),
        addend.stride(0) if addend is not None else 0,
        y.stride(0),
        eps,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        HAS_A=addend is not None,
        SWISH=swish,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    return y, mean, rstd


def backward(
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    dy: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    swish: bool,
    tile: tuple[int, int, int] = BWD_TILE,
    residual_grad: torch.Tensor | None = None,
    dx_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx [N, D], dweight or None, dbias or None); weight/bias grads are summed in fp32.
    ``residual_grad`` ([N, D], unit column stride): a gradient of x from elsewhere, added into dx.
    ``dx_sum`` (contiguous fp32 [D]) receives dx's sum over its rows, added up before rounding."""
    n, d = x2d.shape
    if dx_sum is not None and (
        tuple(dx_sum.shape) != (d,) or dx_sum.dtype != torch.float32 or not dx_sum.is_contiguous()
    ):
        raise ValueError(f"layer_norm: dx_sum must be contiguous fp32 [{d}], got {dx_sum.dtype} {tuple(dx_sum.shape)}")
    dx = torch.empty((n, d), device=x2d.device, dtype=x2d.dtype)
    block_m, block_d, warps = row_tile(d, tile[0], tile[1], warp_lanes())
    n_blocks = triton.cdiv(n, block_m)
    meta = dict(
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        HAS_DR=residual_grad is not None,
        DX_SUMS=dx_sum is not None,
        SWISH=swish,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        num_warps=warps,
    )
    dr_stride = residual_grad.stride(0) if residual_grad is not None else 0

    def args(progs: int, dw_part: torch.Tensor | None, db_part: torch.Tensor | None, dxs_part) -> tuple:
        pointers = (x2d, weight, bias, dy, residual_grad, dx, dw_part, db_part, dxs_part, mean, rstd)
        strides = (x2d.stride(0), dy.stride(0), dr_stride, dx.stride(0))
        return (*pointers, n, d, *strides, triton.cdiv(n_blocks, progs), progs)

    def partials(progs: int) -> tuple[torch.Tensor | None, ...]:
        return weight_grad_partials(x2d.device, progs, d, n, weight, bias, dx_sum)

    dw_part, db_part, dxs_part = launch_persistent(
        _layer_norm_bwd, x2d.device, x2d.dtype, n_blocks, tile[2], meta, partials, args
    )
    dw, db = sum_weight_grads(dw_part, db_part, weight, bias)
    if dx_sum is not None:
        torch.sum(dxs_part, dim=0, out=dx_sum)
    return dx, dw, db
