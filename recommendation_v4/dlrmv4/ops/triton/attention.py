"""Triton kernels for jagged HSTU attention: ``out_i = sum_j SiLU(alpha q_i.k_j) / N * v_j`` under the
causal, target-aware mask ``(j <= i and j < L - n_t) or j == i`` (see ``ops/reference/attention.py``).

Design (FlashAttention-style tiling without softmax, so no running max or rescaling; N x N never
exists in memory):
- forward: grid (query blocks, B*H), heaviest (last) query blocks first. Each program walks the key
  blocks up to its causal limit in up to three spans: the unmasked prefix, the masked tiles around
  the diagonal / the prefix end, and, for candidate rows past the prefix, only the tiles holding
  their own diagonal. Tiles no row can see are never visited. 1/N is applied once at the end.
- backward: grid (key blocks, B*H); each program keeps dK, dV of its key block in registers and
  walks the query blocks that can see it (all rows >= the block for prefix keys, only the diagonal
  for candidate keys). dQ either comes from a second kernel over query blocks that recomputes the
  scores (``dq_mode="separate"``: 7 matmuls per tile pair, deterministic) or is accumulated in fp32
  with atomics from the dK/dV kernel (``"atomic"``: 5 matmuls). The default was chosen by
  measurement (benchmarks/kernels/notes_attention.md).
- q, k, v and dO tiles are read through tensor descriptors over each input's [T, H*D] rows (TMA
  on Hopper and Blackwell): no per-element addresses in registers, which took 254 of the forward's
  255 and made the dK/dV kernel spill. A tile may run past its sequence's end into the next
  sequence's rows (zeros past T): every span that can is masked, and the dK/dV kernel's masks also
  drop query rows past the end, so each sequence's outputs are the same bits as with masked loads.
- tiles, warps and stages are autotuned per (bucket of max_seq_len = next power of two, head dims,
  dtype), from small per-backend config lists pruned by the device's shared memory, so a new jagged
  maximum inside a bucket never re-tunes. max_seq_len only sizes the grid and gives 1/N: no host
  sync. Under ``torch.use_deterministic_algorithms(True)`` the first config that fits is taken
  instead (no timings) and atomic dQ is refused, so the same inputs give the same bits in every
  process.
- SiLU on 16-bit inputs: x*sigmoid(x) = t + t*tanh(t) with t = x/2, one ``tanh.approx`` per score
  instead of exp + reciprocal. The multi-function unit (16 ops/clock/SM) does not overlap the
  tensor cores here (Triton waits on each QK^T before the SiLU), so its time adds to the matmuls'.
  The dK/dV kernel evaluates SiLU and SiLU' in packed bf16x2 / f16x2 arithmetic (``_silu_form``).
  Masks zero the fp32 scores / dP before the SiLU (SiLU(0) = 0), so the conversions stay packed.
- fp32 inputs use 3xTF32 products (fp32-level error) and one small tile config: the accuracy
  path, not the speed path.

Portability: no warp specialization; ``tl.dot`` lowers to wgmma on sm_90, tcgen05 MMA on sm_100
(B200) and MFMA on gfx942 / gfx950 (MI300X / MI350X), and a descriptor's loads to TMA on NVIDIA and
to ordinary loads on gfx942 / gfx950. Every choice that depends on the hardware is made from the
launch's ``KernelTarget`` (targets.py): the inline PTX (``tanh.approx.f32``, sm_75+; the packed
forms, sm_90+) only on NVIDIA, AMD and fp32 take ``tl.sigmoid``; AMD's dot takes "ieee" precision;
each backend has its own config list (``CONFIGS``), and the configs a target keeps follow the
pruning rule in ``_pruner`` (estimated shared memory and registers against the target's), with
small-memory configs where none of the list passes. CI compiles every config each target keeps
and checks that no 16-bit kernel spills (tests/test_kernel_targets.py); the NVIDIA lists were timed
on an H200, the AMD lists chosen by registers alone (on MI350X, ``waves_per_eu`` /
``matrix_instr_nonkdim`` are the knobs to time).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..dispatch import interpreting
from ..strides import tma_rows, unit_cols
from .targets import KernelTarget, current_target

DQ_MODES = ("separate", "atomic")
SILU_FORMS = ("bf16x2", "f16x2", "tanh", "sigmoid")
KERNEL_KINDS = ("fwd", "dkdv", "dq")
# A SiLU form for every kernel, or one per kernel kind (kinds not named take their default).
SiluChoice = str | Mapping[str, str] | None
DQ_MODE = "separate"
# Interpreter tiles (CPU tests): small and unequal, so every span and alignment case is exercised.
INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}


@triton.jit
def _tanh(t):
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [t], dtype=tl.float32, is_pure=True, pack=1)


def _packed_silu_asm(fmt: str, half: str, one: str, two: str) -> tuple[tl.constexpr, tl.constexpr]:
    """PTX for SiLU, and SiLU with dP * SiLU', on a pair of 16-bit lanes (``fmt`` bf16x2 or f16x2;
    the constants are 0.5, 1 and 2 in that format, twice)."""
    weights = f"""{{
    .reg .b32 t, h;
    cvt.rn.{fmt}.f32 t, $2, $1;
    tanh.approx.{fmt} h, t;
    fma.rn.{fmt} $0, t, h, t;
    }}"""
    grads = f"""{{
    .reg .b32 t, h, a, sg, u, dp, half, one, two;
    mov.b32 half, {half};
    mov.b32 one, {one};
    mov.b32 two, {two};
    cvt.rn.{fmt}.f32 t, $3, $2;
    tanh.approx.{fmt} h, t;
    fma.rn.{fmt} a, t, h, t;
    fma.rn.{fmt} sg, h, half, half;
    fma.rn.{fmt} u, t, two, one;
    sub.rn.{fmt} u, u, a;
    mul.rn.{fmt} u, sg, u;
    cvt.rn.{fmt}.f32 dp, $5, $4;
    mul.rn.{fmt} $1, dp, u;
    mov.b32 $0, a;
    }}"""
    return tl.constexpr(weights), tl.constexpr(grads)


_BF16X2_WEIGHTS, _BF16X2_GRADS = _packed_silu_asm("bf16x2", "0x3F003F00", "0x3F803F80", "0x40004000")
_F16X2_WEIGHTS, _F16X2_GRADS = _packed_silu_asm("f16x2", "0x38003800", "0x3C003C00", "0x40004000")


@triton.jit
def _weights(s, alpha, dtype: tl.constexpr, SILU: tl.constexpr):
    """SiLU(alpha * s) as the ``dtype`` operand of the next product. With t = alpha*s/2,
    SiLU = t + t*tanh(t): "bf16x2" / "f16x2" in packed 16-bit arithmetic (two lanes per
    instruction; sm_90 still issues one MUFU op per lane for the tanh), "tanh" in fp32, "sigmoid"
    as x * sigmoid(x)."""
    if SILU == "bf16x2":
        a = tl.inline_asm_elementwise(
            _BF16X2_WEIGHTS, "=r,f,f", [s * (0.5 * alpha)], dtype=tl.bfloat16, is_pure=True, pack=2
        )
    elif SILU == "f16x2":
        a = tl.inline_asm_elementwise(
            _F16X2_WEIGHTS, "=r,f,f", [s * (0.5 * alpha)], dtype=tl.float16, is_pure=True, pack=2
        )
    elif SILU == "tanh":
        t = s * (0.5 * alpha)
        a = (t + t * _tanh(t)).to(dtype)
    else:
        x = s * alpha
        a = (x * tl.sigmoid(x)).to(dtype)
    return a


@triton.jit
def _weights_and_grads(s, dp, alpha, dtype: tl.constexpr, SILU: tl.constexpr):
    """(SiLU(x), dP * SiLU'(x)) at x = alpha * s as ``dtype`` operands, with
    SiLU'(x) = sigmoid(x) * (1 + x - SiLU(x)) and sigmoid(x) = (1 + tanh(x/2)) / 2."""
    if SILU == "bf16x2":
        a, ds = tl.inline_asm_elementwise(
            _BF16X2_GRADS,
            "=r,=r,f,f,f,f",
            [s * (0.5 * alpha), dp],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=2,
        )
    elif SILU == "f16x2":
        a, ds = tl.inline_asm_elementwise(
            _F16X2_GRADS,
            "=r,=r,f,f,f,f",
            [s * (0.5 * alpha), dp],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        if SILU == "tanh":
            t = s * (0.5 * alpha)
            th = _tanh(t)
            tt = t * th
            a = t + tt
            g = (0.5 + 0.5 * th) * (1.0 + t - tt)
        else:
            x = s * alpha
            sg = tl.sigmoid(x)
            a = x * sg
            g = sg * (1.0 + x - a)
        a = a.to(dtype)
        ds = (dp * g).to(dtype)
    return a, ds


@triton.jit
def _last_seen(rows, prefix):
    """Per query row i, the last key it sees besides itself: i in the prefix, prefix - 1 for a
    candidate. Row i then sees key j iff j <= last or j == i (two compares per score)."""
    return tl.where(rows < prefix, rows, prefix - 1)


@triton.jit
def _keep(i, j, last):
    """Row i sees key j (i, j, last broadcast against each other)."""
    return (j <= last) | (j == i)


@triton.jit
def _sequence(seq_offsets, num_targets, b, HAS_TARGETS: tl.constexpr):
    """(first token, length, prefix length L - n_t clamped at 0) of sequence b."""
    start = tl.load(seq_offsets + b).to(tl.int64)
    seq_len = (tl.load(seq_offsets + b + 1) - start).to(tl.int32)
    prefix = seq_len
    if HAS_TARGETS:
        prefix = tl.maximum(seq_len - tl.load(num_targets + b).to(tl.int32), 0)
    return start, seq_len, prefix


@triton.jit
def _key_spans(m_start, seq_len, prefix, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key spans for query rows [m_start, m_start + BLOCK_M): [0, nf) unmasked, [nf, e1) masked
    (diagonal or prefix end), [s2, hi) masked (candidate rows' own diagonal)."""
    hi = tl.minimum(m_start + BLOCK_M, seq_len)
    nf = (tl.minimum(m_start, prefix) // BLOCK_N) * BLOCK_N
    e1 = tl.maximum(nf, tl.cdiv(tl.minimum(prefix, hi), BLOCK_N) * BLOCK_N)
    s2 = tl.maximum(e1, (m_start // BLOCK_N) * BLOCK_N)
    return nf, e1, s2, hi


@triton.jit
def _fwd_span(
    acc,
    q,
    K,
    V,
    row0,
    col_k,
    col_v,
    offs_m,
    lo,
    hi,
    prefix,
    alpha,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SILU: tl.constexpr,
    PREC: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        k = K.load([row0 + n0, col_k])
        v = V.load([row0 + n0, col_v])
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:  # on the fp32 scores: SiLU(0) = 0, and the packed conversion stays packed
            offs_n = n0 + tl.arange(0, BLOCK_N)
            s = tl.where(_keep(offs_m[:, None], offs_n[None, :], _last_seen(offs_m, prefix)[:, None]), s, 0.0)
        acc = tl.dot(_weights(s, alpha, v.dtype, SILU), v, acc, input_precision=PREC)
    return acc


@triton.jit(do_not_specialize=["N_BUCKET"])
def _hstu_attention_fwd(
    Q,
    K,
    V,
    O,
    seq_offsets,
    num_targets,
    stride_ot,
    stride_oh,
    H,
    alpha,
    inv_n,
    N_BUCKET,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    SILU: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, seq_len, prefix = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    if m_start >= seq_len:
        return
    row0 = start.to(tl.int32)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    q = Q.load([row0 + m_start, h * DQK])
    nf, e1, s2, hi = _key_spans(m_start, seq_len, prefix, BLOCK_M, BLOCK_N)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    acc = _fwd_span(acc, q, K, V, row0, h * DQK, h * DV, offs_m, 0, nf, prefix, alpha, BLOCK_N, False, SILU, PREC)
    acc = _fwd_span(acc, q, K, V, row0, h * DQK, h * DV, offs_m, nf, e1, prefix, alpha, BLOCK_N, True, SILU, PREC)
    acc = _fwd_span(acc, q, K, V, row0, h * DQK, h * DV, offs_m, s2, hi, prefix, alpha, BLOCK_N, True, SILU, PREC)
    o_ptrs = O + start * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot + tl.arange(0, DV)[None, :]
    tl.store(o_ptrs, (acc * inv_n).to(O.dtype.element_ty), mask=(offs_m < seq_len)[:, None])


@triton.jit
def _store_sums(PART, sums, D: tl.constexpr):
    """A program's column sums [D] (fp32, before rounding) into its own row of PART [programs, D]:
    program (i, j) of the grid takes row j * (programs along axis 0) + i."""
    slot = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(PART + slot.to(tl.int64) * D + tl.arange(0, D), sums)


@triton.jit
def _dkdv_span(
    dk,
    dv,
    k,
    v,
    Q,
    DO,
    dq_seq,
    stride_dqt,
    row0,
    col_q,
    col_do,
    offs_n,
    lo,
    hi,
    seq_len,
    prefix,
    alpha,
    dq_scale,
    DQK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    SILU: tl.constexpr,
    PREC: tl.constexpr,
):
    for m0 in range(lo, hi, BLOCK_M):
        q = Q.load([row0 + m0, col_q])
        do = DO.load([row0 + m0, col_do])
        # Transposed tiles [BLOCK_N, BLOCK_M], so dV and dK are plain products with dO and Q.
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        if MASKED:  # zero scores and dP give exactly zero weights and dS (rows past the end too)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            keep = _keep(offs_m[None, :], offs_n[:, None], _last_seen(offs_m, prefix)[None, :])
            keep = keep & (offs_m < seq_len)[None, :]
            s_t = tl.where(keep, s_t, 0.0)
            dp_t = tl.where(keep, dp_t, 0.0)
        a_t, ds_t = _weights_and_grads(s_t, dp_t, alpha, q.dtype, SILU)
        dv = tl.dot(a_t, do, dv, input_precision=PREC)
        dk = tl.dot(ds_t, q, dk, input_precision=PREC)
        if ATOMIC_DQ:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            dq = tl.dot(tl.trans(ds_t), k, input_precision=PREC) * dq_scale
            dq_ptrs = dq_seq + offs_m[:, None] * stride_dqt + tl.arange(0, DQK)[None, :]
            tl.atomic_add(dq_ptrs, dq, mask=(offs_m < seq_len)[:, None], sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["N_BUCKET"])
def _hstu_attention_dkdv(
    Q,
    K,
    V,
    DO,
    DQ,
    DK,
    DV_,
    DKS,
    DVS,
    seq_offsets,
    num_targets,
    stride_dqt,
    stride_dqh,
    stride_dkt,
    stride_dkh,
    stride_dvt,
    stride_dvh,
    H,
    alpha,
    inv_n,
    N_BUCKET,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    SUMS: tl.constexpr,
    SILU: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    n_start = tl.program_id(0) * BLOCK_N  # low key blocks are seen by the most rows: they start first
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, seq_len, prefix = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    if n_start >= seq_len:
        if SUMS:
            _store_sums(DKS, tl.zeros([DQK], dtype=tl.float32), DQK)
            _store_sums(DVS, tl.zeros([DV], dtype=tl.float32), DV)
        return
    row0 = start.to(tl.int32)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    in_seq = (offs_n < seq_len)[:, None]
    k = K.load([row0 + n_start, h * DQK])
    v = V.load([row0 + n_start, h * DV])
    # Query spans: [m_lo, d_end) masked (diagonal), [d_end, u_end) unmasked, [u_end, m_hi) masked
    # (candidate rows, when this block straddles the prefix end, and the last block's rows past the
    # sequence's end: they are the next sequence's). Candidate keys: diagonal only.
    n_end = tl.minimum(n_start + BLOCK_N, seq_len)
    m_lo = (n_start // BLOCK_M) * BLOCK_M
    d_end = tl.cdiv(n_end, BLOCK_M) * BLOCK_M
    sees_prefix = n_start < prefix
    m_hi = tl.where(sees_prefix, tl.cdiv(seq_len, BLOCK_M) * BLOCK_M, d_end)
    u_end = tl.where(sees_prefix & (n_end > prefix), (prefix // BLOCK_M) * BLOCK_M, (seq_len // BLOCK_M) * BLOCK_M)
    u_end = tl.minimum(tl.maximum(d_end, u_end), m_hi)
    dq_seq = DQ + start * stride_dqt + h * stride_dqh
    dq_scale = alpha * inv_n
    dk = tl.zeros([BLOCK_N, DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV], dtype=tl.float32)
    col_q, col_do = h * DQK, h * DV
    dk, dv = _dkdv_span(
        dk, dv, k, v, Q, DO, dq_seq, stride_dqt, row0, col_q, col_do, offs_n, m_lo, d_end, seq_len, prefix,
        alpha, dq_scale, DQK, BLOCK_M, True, ATOMIC_DQ, SILU, PREC,
    )  # fmt: skip
    dk, dv = _dkdv_span(
        dk, dv, k, v, Q, DO, dq_seq, stride_dqt, row0, col_q, col_do, offs_n, d_end, u_end, seq_len, prefix,
        alpha, dq_scale, DQK, BLOCK_M, False, ATOMIC_DQ, SILU, PREC,
    )  # fmt: skip
    dk, dv = _dkdv_span(
        dk, dv, k, v, Q, DO, dq_seq, stride_dqt, row0, col_q, col_do, offs_n, u_end, m_hi, seq_len, prefix,
        alpha, dq_scale, DQK, BLOCK_M, True, ATOMIC_DQ, SILU, PREC,
    )  # fmt: skip
    dk_ptrs = DK + start * stride_dkt + h * stride_dkh + offs_n[:, None] * stride_dkt + tl.arange(0, DQK)[None, :]
    dv_ptrs = DV_ + start * stride_dvt + h * stride_dvh + offs_n[:, None] * stride_dvt + tl.arange(0, DV)[None, :]
    dk = dk * dq_scale
    dv = dv * inv_n
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=in_seq)
    tl.store(dv_ptrs, dv.to(DV_.dtype.element_ty), mask=in_seq)
    if SUMS:
        _store_sums(DKS, tl.sum(tl.where(in_seq, dk, 0.0), axis=0), DQK)
        _store_sums(DVS, tl.sum(tl.where(in_seq, dv, 0.0), axis=0), DV)


@triton.jit
def _dq_span(
    dq,
    q,
    do,
    K,
    V,
    row0,
    col_k,
    col_v,
    offs_m,
    lo,
    hi,
    prefix,
    alpha,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SILU: tl.constexpr,
    PREC: tl.constexpr,
):
    for n0 in range(lo, hi, BLOCK_N):
        k = K.load([row0 + n0, col_k])
        v = V.load([row0 + n0, col_v])
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        if MASKED:  # dS = dP * SiLU'(x): a zero dP gives exactly zero
            offs_n = n0 + tl.arange(0, BLOCK_N)
            dp = tl.where(_keep(offs_m[:, None], offs_n[None, :], _last_seen(offs_m, prefix)[:, None]), dp, 0.0)
        _, ds = _weights_and_grads(s, dp, alpha, k.dtype, SILU)
        dq = tl.dot(ds, k, dq, input_precision=PREC)
    return dq


@triton.jit(do_not_specialize=["N_BUCKET"])
def _hstu_attention_dq(
    Q,
    K,
    V,
    DO,
    DQ,
    DQS,
    seq_offsets,
    num_targets,
    stride_dqt,
    stride_dqh,
    H,
    alpha,
    inv_n,
    N_BUCKET,
    DQK: tl.constexpr,
    DV: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    SUMS: tl.constexpr,
    SILU: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    m_start = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    start, seq_len, prefix = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    if m_start >= seq_len:
        if SUMS:
            _store_sums(DQS, tl.zeros([DQK], dtype=tl.float32), DQK)
        return
    row0 = start.to(tl.int32)
    offs_m = m_start + tl.arange(0, BLOCK_M)
    in_seq = (offs_m < seq_len)[:, None]
    q = Q.load([row0 + m_start, h * DQK])
    do = DO.load([row0 + m_start, h * DV])
    nf, e1, s2, hi = _key_spans(m_start, seq_len, prefix, BLOCK_M, BLOCK_N)
    dq = tl.zeros([BLOCK_M, DQK], dtype=tl.float32)
    dq = _dq_span(dq, q, do, K, V, row0, h * DQK, h * DV, offs_m, 0, nf, prefix, alpha, BLOCK_N, False, SILU, PREC)
    dq = _dq_span(dq, q, do, K, V, row0, h * DQK, h * DV, offs_m, nf, e1, prefix, alpha, BLOCK_N, True, SILU, PREC)
    dq = _dq_span(dq, q, do, K, V, row0, h * DQK, h * DV, offs_m, s2, hi, prefix, alpha, BLOCK_N, True, SILU, PREC)
    dq_ptrs = DQ + start * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt + tl.arange(0, DQK)[None, :]
    dq = dq * (alpha * inv_n)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=in_seq)
    if SUMS:
        _store_sums(DQS, tl.sum(tl.where(in_seq, dq, 0.0), axis=0), DQK)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs, by backend; few, since a cold start
# compiles each. Every one builds without spills on its backend's targets (sm_90 and sm_100;
# gfx942 and gfx950, of those its shared memory keeps): results/kernel_resources.md.
CONFIGS = {
    "cuda": {
        "fwd": [(64, 64, 4, 3), (128, 64, 8, 4), (128, 64, 8, 3)],
        "dkdv": [(64, 128, 8, 3), (32, 64, 4, 3)],
        "dq": [(128, 64, 8, 3), (128, 64, 8, 4)],
    },
    "hip": {
        "fwd": [(128, 32, 8, 3), (64, 32, 4, 2)],
        "dkdv": [(32, 64, 4, 3), (16, 64, 4, 2)],
        "dq": [(64, 32, 4, 2)],
    },
}
# For targets none of those fits by the rule below (a smaller shared memory, or wider heads).
SMALL_MEMORY_CONFIGS = {"fwd": [(32, 32, 4, 2)], "dkdv": [(16, 32, 4, 2)], "dq": [(16, 32, 4, 2)]}
# fp32 is the accuracy path, not the speed path: one small config that fits any GPU's shared memory.
FP32_CONFIG = (32, 32, 4, 2)
TUNE_KEY = ["N_BUCKET", "DQK", "DV", "HAS_TARGETS", "SILU"]


def _footprint(kind: str, bm: int, bn: int, stages: int, dqk: int, dv: int, atomic: bool) -> tuple[int, int]:
    """Rough (shared-memory elements, fp32 accumulator + score elements held in registers) of a
    config, used only to skip configs that cannot fit before compiling them."""
    if kind == "fwd":
        return stages * bn * (dqk + dv) + bm * dqk, bm * dv + bm * bn
    if kind == "dkdv":
        return stages * bm * (dqk + dv) + bn * (dqk + dv) + 2 * bm * bn, bn * (dqk + dv) + 2 * bm * bn + (
            bm * dqk if atomic else 0
        )
    return stages * bn * (dqk + dv) + bm * (dqk + dv), bm * dqk + 2 * bm * bn


# Which tile each input's descriptor loads: query-side rows by BLOCK_M, key-side rows by BLOCK_N.
_TILES = {"Q": ("BLOCK_M", "DQK"), "DO": ("BLOCK_M", "DV"), "K": ("BLOCK_N", "DQK"), "V": ("BLOCK_N", "DV")}


def _set_tiles(nargs: dict) -> None:
    """Each descriptor's block shape for the config about to run (a descriptor's block is part of
    the compiled kernel's signature): every config's pre-launch hook."""
    for name, (rows, dim) in _TILES.items():
        if name in nargs:
            nargs[name].block_shape = [nargs[rows], nargs[dim]]


def _config(bm: int, bn: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages, pre_hook=_set_tiles)


def _rows(x: torch.Tensor) -> TensorDescriptor:
    """x [T, H, D] as a descriptor over its [T, H * D] rows; its tiles are [rows, D] at column h * D,
    read by the tensor-memory accelerator where there is one (no per-element addresses held in
    registers). A layout the descriptor cannot take (heads not side by side, a row stride or start
    not a multiple of 16 bytes) is copied first. Rows past T read as zeros."""
    x = tma_rows(x)
    total, heads, dim = x.shape
    return TensorDescriptor(x, [total, heads * dim], [x.stride(0), 1], [1, dim])


def _pruner(kind: str):
    """The rule that keeps a target's configs, from its backend's list in ``CONFIGS``: the estimated
    shared memory within the target's, and the fp32 accumulators within its registers (a lane's
    registers x lanes of the block). When no config of the list passes, the small-memory configs
    that pass are kept instead; when none passes either, the launch is refused here rather than
    failing on the device."""

    def prune(_placeholder, named_args, **meta):
        q = named_args["Q"].base
        if q.element_size() == 4:
            return [_config(*FP32_CONFIG)]
        target = current_target()
        assert target is not None, "the interpreter runs fixed tiles, not autotune configs"

        def fits(c: triton.Config) -> bool:
            smem, regs = _footprint(
                kind,
                c.kwargs["BLOCK_M"],
                c.kwargs["BLOCK_N"],
                c.num_stages,
                meta["DQK"],
                meta["DV"],
                meta.get("ATOMIC_DQ", False),
            )
            lanes = target.warp_size * c.num_warps
            return smem * q.element_size() <= target.shared_memory and regs <= target.registers_per_lane * lanes

        listed = [_config(*entry) for entry in CONFIGS[target.backend][kind]]
        small = [_config(*entry) for entry in SMALL_MEMORY_CONFIGS[kind]]
        kept = [c for c in listed if fits(c)] or [c for c in small if fits(c)]
        if not kept:
            raise RuntimeError(
                f"no {kind} attention config fits {target.name} ({target.shared_memory} bytes of shared memory) "
                f"at head dims {meta['DQK']}/{meta['DV']}: add one to SMALL_MEMORY_CONFIGS"
            )
        return kept

    return prune


def _tuned(kernel, kind: str, extra_key=(), reset=None):
    # The list given here is Triton's placeholder: the pruner hands the autotuner the target's list.
    return triton.autotune(
        configs=[_config(*c) for c in CONFIGS["cuda"][kind]],
        key=TUNE_KEY + list(extra_key),
        prune_configs_by={"early_config_prune": _pruner(kind)},
        reset_to_zero=reset,
    )(kernel)


_fwd_tuned = _tuned(_hstu_attention_fwd, "fwd")
_dkdv_tuned = _tuned(_hstu_attention_dkdv, "dkdv", extra_key=("ATOMIC_DQ", "SUMS"), reset=["DQ"])
_dq_tuned = _tuned(_hstu_attention_dq, "dq", extra_key=("SUMS",))


def _launch_fixed(plain, grid, args: tuple, consts: dict, tiles: dict, options: dict | None = None) -> None:
    """One launch at the given tiles, outside the autotuner: the descriptors' block shapes set as
    a config's pre-launch hook would set them."""
    _set_tiles({**dict(zip(plain.arg_names, args)), **consts, **tiles})
    plain[grid](*args, **consts, **tiles, **(options or {}))


def _launch(kind: str, tuned, plain, rows: int, bh: int, args: tuple, consts: dict) -> int:
    """Autotuned launch on a GPU; fixed small tiles under the interpreter (its timings mean nothing).
    Tiles set the order of each sum, and the autotuner picks them by timing, which differs from one
    process to the next: under ``torch.use_deterministic_algorithms(True)`` the first config of the
    list that fits the device is taken instead, so a run's results do not depend on timings.
    Returns the tile along the grid's first axis (the launch's programs there: cdiv(rows, tile))."""
    tile = "BLOCK_N" if kind == "dkdv" else "BLOCK_M"
    if interpreting():
        bm, bn = INTERPRET_BLOCKS[kind]
        size = bn if kind == "dkdv" else bm
        _launch_fixed(plain, (triton.cdiv(rows, size), bh), args, consts, {"BLOCK_M": bm, "BLOCK_N": bn})
        return size
    if torch.are_deterministic_algorithms_enabled():
        config = _pruner(kind)(tuned.configs, {"Q": args[0]}, **consts)[0]
        grid = (triton.cdiv(rows, config.kwargs[tile]), bh)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        _launch_fixed(plain, grid, args, consts, config.kwargs, options)
        return config.kwargs[tile]
    tuned[lambda meta: (triton.cdiv(rows, meta[tile]), bh)](*args, **consts)
    # The config the autotuner ran (compile-only runs launch nothing and leave it unset).
    config = getattr(tuned, "best_config", None) or tuned.configs[0]
    return config.kwargs[tile]


# The smallest tile along any launch's first grid axis: partial-sum buffers are sized for it.
_MIN_TILE = min(
    [min(INTERPRET_BLOCKS["dkdv"][1], INTERPRET_BLOCKS["dq"][0], FP32_CONFIG[0], FP32_CONFIG[1])]
    + [c[1] for lists in CONFIGS.values() for c in lists["dkdv"] + SMALL_MEMORY_CONFIGS["dkdv"]]
    + [c[0] for lists in CONFIGS.values() for c in lists["dq"] + SMALL_MEMORY_CONFIGS["dq"]]
)


def _empty(shape, dtype, device) -> torch.Tensor:
    # Output buffers; the tests swap this for a NaN-filled allocation to catch unwritten elements.
    return torch.empty(shape, dtype=dtype, device=device)


def _silu_form(target: KernelTarget | None, dtype: torch.dtype, choice: SiluChoice, kind: str) -> str:
    """Which SiLU a kernel evaluates (see ``_weights``), by target. Measured on an H200
    (notes_attention.md): packed 16-bit arithmetic pays in the dK/dV kernel (fewer FMA-pipe
    instructions, and fp16's fp32 form spills there); the forward and dQ kernels are as fast or
    faster with fp32 tanh.approx (packed, dQ needs more registers). results/kernel_resources.md has
    each form's registers and spills. Both are PTX: AMD targets, fp32 inputs and the interpreter
    (``target`` None) take the portable x * sigmoid(x). ``choice``: one form for every kernel, or a
    form per kernel kind (``{"dq": "bf16x2"}``; kinds not named take their default)."""
    if isinstance(choice, Mapping):
        unknown = sorted(set(choice) - set(KERNEL_KINDS))
        if unknown:
            raise ValueError(f"silu: {unknown} are not kernel kinds ({', '.join(KERNEL_KINDS)})")
        silu = choice.get(kind)
    else:
        silu = choice
    nvidia = target is not None and target.nvidia
    packed_form = {torch.bfloat16: "bf16x2", torch.float16: "f16x2"}.get(dtype, "")
    packed = target is not None and nvidia and packed_form != "" and int(target.arch) >= 90
    if silu is None:
        if not nvidia or dtype == torch.float32:
            return "sigmoid"
        return packed_form if packed and kind == "dkdv" else "tanh"
    packed_wrong = silu in ("bf16x2", "f16x2") and not (packed and silu == packed_form)
    if silu not in SILU_FORMS or packed_wrong or (silu == "tanh" and not nvidia):
        where = "the interpreter" if target is None else target.name
        raise ValueError(f"silu={silu!r} is not available for {dtype} on {where}")
    return silu


def _common(q: torch.Tensor, v: torch.Tensor, num_targets, silu: SiluChoice, kind: str) -> dict:
    # fp32: three TF32 products on NVIDIA tensor cores (fp32-level error); plain FMA elsewhere.
    # 16-bit inputs are exact in either; AMD's dot takes only "ieee" (or bf16x3 / bf16x6).
    target = current_target()
    nvidia = target is not None and target.nvidia
    prec = ("tf32x3" if q.dtype == torch.float32 else "tf32") if nvidia else "ieee"
    return {
        "DQK": q.shape[2],
        "DV": v.shape[2],
        "HAS_TARGETS": num_targets is not None,
        "SILU": _silu_form(target, q.dtype, silu, kind),
        "PREC": prec,
    }


def _empty_batch(q: torch.Tensor, seq_offsets: torch.Tensor, max_seq_len: int) -> bool:
    return q.shape[0] == 0 or seq_offsets.numel() < 2 or max_seq_len <= 0


def attention_fwd(
    q, k, v, seq_offsets, num_targets, max_seq_len: int, alpha: float, *, silu: SiluChoice = None
) -> torch.Tensor:
    """out [T, H, Dv] in q's dtype."""
    q, k, v = (unit_cols(t) for t in (q, k, v))
    total, heads, _ = q.shape
    out = _empty((total, heads, v.shape[2]), dtype=q.dtype, device=q.device)
    if _empty_batch(q, seq_offsets, max_seq_len):
        return out.zero_()
    bh = (seq_offsets.numel() - 1) * heads
    targets = num_targets if num_targets is not None else seq_offsets
    args = (
        _rows(q),
        _rows(k),
        _rows(v),
        out,
        seq_offsets,
        targets,
        out.stride(0),
        out.stride(1),
        heads,
        float(alpha),
        1.0 / max_seq_len,
        triton.next_power_of_2(max_seq_len),
    )
    _launch("fwd", _fwd_tuned, _hstu_attention_fwd, max_seq_len, bh, args, _common(q, v, num_targets, silu, "fwd"))
    return out


def _grad_buffers(out, q, k, v):
    """The caller's (dq, dk, dv) buffers, each shaped like its input with a dense feature dim."""
    if len(out) != 3 or any(
        tuple(o.shape) != tuple(t.shape) or o.stride(-1) != 1 or o.device != t.device for o, t in zip(out, (q, k, v))
    ):
        raise ValueError(
            "attention_bwd: out must be (dq, dk, dv) shaped like q, k, v on their device, each "
            "with unit stride in the feature dim"
        )
    return out


def _sum_buffers(col_sums, q, v):
    """The caller's (dq_sum, dk_sum, dv_sum) as fp32 [H, D] views, or None."""
    if col_sums is None:
        return None
    heads, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
    widths = (heads * dqk, heads * dqk, heads * dv)
    if len(col_sums) != 3 or any(
        tuple(t.shape) != (w,) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != q.device
        for t, w in zip(col_sums, widths)
    ):
        raise ValueError(
            f"attention_bwd: col_sums must be (dq_sum, dk_sum, dv_sum), contiguous fp32 of {widths} elements on {q.device}"
        )
    return tuple(t.view(heads, w // heads) for t, w in zip(col_sums, widths))


def _partials(bh: int, rows: int, width: int, device) -> torch.Tensor:
    # A row per program (cdiv(rows, tile) x bh of them, for the smallest tile); each writes its own.
    return torch.empty(bh * triton.cdiv(rows, _MIN_TILE) * width, dtype=torch.float32, device=device)


def _sum_partials(part: torch.Tensor | None, batch: int, rows: int, tile: int, out: torch.Tensor) -> None:
    """out [H, D] = the sum over sequences and row blocks of the launch's partials (a fixed order)."""
    assert part is not None  # allocated whenever sums are asked for
    heads, width = out.shape
    used = part[: batch * heads * triton.cdiv(rows, tile) * width]
    torch.sum(used.view(batch, heads, -1, width), dim=(0, 2), out=out)


def attention_bwd(
    do,
    q,
    k,
    v,
    seq_offsets,
    num_targets,
    max_seq_len: int,
    alpha: float,
    *,
    dq_mode: str | None = None,
    silu: SiluChoice = None,
    out=None,
    col_sums=None,
):
    """(dq, dk, dv), each in its input's dtype and shape. ``out`` = (dq, dk, dv) buffers (e.g. column
    slices of one wider gradient; any row and head strides) receives them instead of new tensors.
    ``col_sums`` = (dq_sum, dk_sum, dv_sum), contiguous fp32 [H·Dqk], [H·Dqk], [H·Dv] (e.g. the q,
    k, v slices of a projection's bias gradient), receives each gradient's sum over its rows: the
    kernels add their tiles up before rounding, so no pass re-reads the gradients for it."""
    dq_mode = dq_mode or DQ_MODE
    if dq_mode not in DQ_MODES:
        raise ValueError(f"dq_mode={dq_mode!r} is not one of {', '.join(DQ_MODES)}")
    if dq_mode == "atomic" and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(
            "attention_bwd: dq_mode='atomic' adds with atomics, in no fixed order; "
            "torch.use_deterministic_algorithms(True) needs dq_mode='separate'"
        )
    do, q, k, v = (unit_cols(t) for t in (do, q, k, v))
    sums = _sum_buffers(col_sums, q, v)
    if out is None:
        dq_out = None
        dk = _empty(k.shape, dtype=k.dtype, device=k.device)
        dv = _empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        dq_out, dk, dv = _grad_buffers(out, q, k, v)
    atomic = dq_mode == "atomic"
    if _empty_batch(q, seq_offsets, max_seq_len):
        if sums is not None:
            for t in sums:
                t.zero_()
        dq = torch.zeros_like(q) if dq_out is None else dq_out.zero_()
        return dq, dk.zero_(), dv.zero_()
    if atomic:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    else:
        dq = _empty(q.shape, dtype=q.dtype, device=q.device) if dq_out is None else dq_out
    heads = q.shape[1]
    batch = seq_offsets.numel() - 1
    bh = batch * heads
    dq_part, dk_part, dv_part = (
        (None, None, None) if sums is None else tuple(_partials(bh, max_seq_len, t.shape[1], q.device) for t in sums)
    )
    targets = num_targets if num_targets is not None else seq_offsets
    scalars = (heads, float(alpha), 1.0 / max_seq_len, triton.next_power_of_2(max_seq_len))
    q_rows, k_rows, v_rows, do_rows = (_rows(t) for t in (q, k, v, do))
    args = (
        q_rows,
        k_rows,
        v_rows,
        do_rows,
        dq,
        dk,
        dv,
        dk_part,
        dv_part,
        seq_offsets,
        targets,
        dq.stride(0),
        dq.stride(1),
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
    ) + scalars
    tile = _launch(
        "dkdv",
        _dkdv_tuned,
        _hstu_attention_dkdv,
        max_seq_len,
        bh,
        args,
        {**_common(q, v, num_targets, silu, "dkdv"), "ATOMIC_DQ": atomic, "SUMS": sums is not None},
    )
    if sums is not None:
        _sum_partials(dk_part, batch, max_seq_len, tile, sums[1])
        _sum_partials(dv_part, batch, max_seq_len, tile, sums[2])
    if atomic:  # the fp32 accumulator, rounded once into the input dtype (or the caller's buffer)
        if sums is not None:
            torch.sum(dq, dim=0, out=sums[0])
        return (dq.to(q.dtype) if dq_out is None else dq_out.copy_(dq)), dk, dv
    dq_args = (
        q_rows,
        k_rows,
        v_rows,
        do_rows,
        dq,
        dq_part,
        seq_offsets,
        targets,
        dq.stride(0),
        dq.stride(1),
    ) + scalars
    tile = _launch(
        "dq",
        _dq_tuned,
        _hstu_attention_dq,
        max_seq_len,
        bh,
        dq_args,
        {**_common(q, v, num_targets, silu, "dq"), "SUMS": sums is not None},
    )
    if sums is not None:
        _sum_partials(dq_part, batch, max_seq_len, tile, sums[0])
    return dq, dk, dv
