"""Hopper (sm_90) HSTU attention forward in Gluon, warp-specialized: the same op and semantics as
``ops/triton/attention.py``'s ``attention_fwd`` (jagged ``seq_offsets``, the causal and
target-aware mask, ``1/N``, ``SiLU(alpha q.k)``, q/k/v as strided views of one projection), for
bf16 and fp16 inputs.

Why a second kernel: Triton waits on each QK^T before the SiLU, so the multi-function unit's time
adds to the tensor cores'. Here each program (128 query rows of one sequence and head) runs three
partitions:
- a producer warp streams K and V tiles into rings of shared-memory stages by TMA (K and V each
  with a "ready" mbarrier, the copy's bytes landed, and an "empty" one, both consumers are done
  with it); it also loads the two consumers' Q tiles;
- two consumer warpgroups, 64 query rows each, walk the same key tiles. In its turn (an mbarrier
  ping-pong between the two) a consumer issues a step's two products as async wgmma, the next
  tile's ``Q K^T`` and this tile's ``P V`` with P from registers; then, while the other consumer's
  products run, it waits for its scores and evaluates the next tile's SiLU.
The key tiles are the Triton forward's spans (unmasked prefix, masked diagonal / prefix end,
candidate rows' own diagonal): tiles no row can see are never loaded. A tile may run past the
sequence's end into the next sequence's rows (zeros past T): the masked spans drop them and rows
past the end are not stored, so each sequence's output is independent of its neighbours.
Every sum runs in a fixed order (key tiles ascending, the wgmma's own order inside a tile), so the
same inputs give the same bits in every run.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..strides import unit_cols

# Query rows per consumer warpgroup (wgmma's M is 64 per warpgroup); a program covers two.
ROWS_PER_CONSUMER = 64
# (key tile, stages of the K and V rings, ping-pong) by head dim: the ring plus two Q tiles within shared memory.
FWD_TILES = {64: (128, 3, True), 128: (128, 3, True)}
# Registers per lane: the producer warp's (the minimum) and each consumer's; the kernel's cap
# (maxnreg) keeps the 9 warps (12 for register allocation) within the 64 K registers of an SM.
PRODUCER_REGS = gl.constexpr(24)
CONSUMER_REGS = gl.constexpr(240)
MAXNREG = 168


@gluon.jit
def _tanh(t):
    return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [t], dtype=gl.float32, is_pure=True, pack=1)


@gluon.jit
def _sequence(seq_offsets, num_targets, b, HAS_TARGETS: gl.constexpr):
    """(first token, length, prefix length L - n_t clamped at 0) of sequence b."""
    start = gl.load(seq_offsets + b).to(gl.int64)
    seq_len = (gl.load(seq_offsets + b + 1) - start).to(gl.int32)
    prefix = seq_len
    if HAS_TARGETS:
        prefix = gl.maximum(seq_len - gl.load(num_targets + b).to(gl.int32), 0)
    return start, seq_len, prefix


@gluon.jit
def _key_tiles(m_start, seq_len, prefix, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key tiles rows [m_start, m_start + BLOCK_M) visit, as (tiles in [0, e1), their total,
    the first masked key nf, the start s2 of the candidate rows' span): tile i starts at
    i * BLOCK_N below the first count and at s2 + (i - first) * BLOCK_N after it; tiles from nf
    on are masked. The spans are the Triton forward's ``_key_spans``; there is always one tile."""
    hi = gl.minimum(m_start + BLOCK_M, seq_len)
    nf = (gl.minimum(m_start, prefix) // BLOCK_N) * BLOCK_N
    e1 = gl.maximum(nf, gl.cdiv(gl.minimum(prefix, hi), BLOCK_N) * BLOCK_N)
    s2 = gl.maximum(e1, (m_start // BLOCK_N) * BLOCK_N)
    first = e1 // BLOCK_N
    total = first + gl.cdiv(gl.maximum(hi - s2, 0), BLOCK_N)
    return first, total, nf, s2


@gluon.jit
def _tile_start(i, first, s2, BLOCK_N: gl.constexpr):
    return gl.where(i < first, i * BLOCK_N, s2 + (i - first) * BLOCK_N)


@gluon.jit
def _fwd_producer(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
    row0, m_start, col_q, col_v, first, total, s2,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    rows: gl.constexpr = q_desc.block_type.shape[0]
    for slot in gl.static_range(2):
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(
            q_desc, [row0 + m_start + slot * rows, col_q], q_ready.index(slot), q_smem.index(slot)
        )
    for i in range(total):
        stage = i % STAGES
        phase = ((i // STAGES) & 1) ^ 1  # a stage is free once both consumers let it go (first pass: at once)
        n0 = _tile_start(i, first, s2, BLOCK_N)
        mbarrier.wait(k_empty.index(stage), phase)
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row0 + n0, col_q], k_ready.index(stage), k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase)
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row0 + n0, col_v], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _masked_weights(s, rows, n0, last, nf, alpha, dtype: gl.constexpr, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """SiLU(alpha s) as 16-bit P, with the scores of keys row i cannot see zeroed first (SiLU(0) = 0)
    on tiles from nf on: SiLU = t + t tanh(t) at t = alpha s / 2, one tanh.approx a score."""
    if n0 >= nf:
        cols = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        keep = (cols[None, :] <= last[:, None]) | (cols[None, :] == rows[:, None])
        s = gl.where(keep, s, 0.0)
    t = s * (0.5 * alpha)
    return (t + t * _tanh(t)).to(dtype)


@gluon.jit
def _fwd_consumer(
    out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
    start, seq_len, prefix, m_start, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
    SLOT: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    DV: gl.constexpr = v_smem.type.shape[2]
    dtype: gl.constexpr = v_smem.type.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    rows = m_start + SLOT * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    last = gl.where(rows < prefix, rows, prefix - 1)  # the last key a row sees besides itself
    q = q_smem.index(SLOT)
    mbarrier.wait(q_ready.index(SLOT), 0)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)

    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0))
    p = _masked_weights(s, rows, _tile_start(0, first, s2, BLOCK_N), last, nf, alpha, dtype, BLOCK_N, s_layout)
    for i in range(total - 1):
        stage = i % STAGES
        nxt = (i + 1) % STAGES
        mbarrier.wait(k_ready.index(nxt), ((i + 1) // STAGES) & 1)
        mbarrier.wait(v_ready.index(stage), (i // STAGES) & 1)
        # Both products of a step are issued in this consumer's turn; the other consumer issues
        # its own while this one evaluates the next tile's SiLU.
        if PINGPONG:
            mbarrier.wait(turns.index(SLOT), (i & 1) ^ (1 - SLOT))
        s_next = warpgroup_mma(q, k_smem.index(nxt).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(p, p_layout), v_smem.index(stage), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turns.index(1 - SLOT))
        s = warpgroup_mma_wait(1, deps=(s_next,))
        mbarrier.arrive(k_empty.index(nxt))
        p = _masked_weights(s, rows, _tile_start(i + 1, first, s2, BLOCK_N), last, nf, alpha, dtype, BLOCK_N, s_layout)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(stage))
    i = total - 1
    mbarrier.wait(v_ready.index(i % STAGES), (i // STAGES) & 1)
    if PINGPONG:
        mbarrier.wait(turns.index(SLOT), (i & 1) ^ (1 - SLOT))
    acc = warpgroup_mma(gl.convert_layout(p, p_layout), v_smem.index(i % STAGES), acc, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turns.index(1 - SLOT))
    out = warpgroup_mma_wait(0, deps=(acc,))

    out_rows = m_start + SLOT * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))
    ptrs = out_ptr + (start + out_rows.to(gl.int64))[:, None] * stride_ot + col_o + cols[None, :]
    gl.store(ptrs, (out * inv_n).to(dtype), mask=(out_rows < seq_len)[:, None])


@gluon.jit
def _fwd_worker(
    q_desc, k_desc, v_desc, out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
    start, seq_len, prefix, m_start, col_q, col_v, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
    ROLE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    """The worker partitions share one signature: ROLE 1 is the second consumer, 2 the producer."""
    if ROLE == 1:
        _fwd_consumer(
            out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
            start, seq_len, prefix, m_start, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
            1, BLOCK_N, STAGES, PINGPONG,
        )  # fmt: skip
    else:
        _fwd_producer(
            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
            start.to(gl.int32), m_start, col_q, col_v, first, total, s2, BLOCK_N, STAGES,
        )  # fmt: skip


@gluon.jit
def _fwd_producer_worker(
    q_desc, k_desc, v_desc, out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
    start, seq_len, prefix, m_start, col_q, col_v, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    _fwd_worker(
        q_desc, k_desc, v_desc, out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
        start, seq_len, prefix, m_start, col_q, col_v, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
        2, BLOCK_N, STAGES, PINGPONG,
    )  # fmt: skip


@gluon.jit
def _fwd_consumer_worker(
    q_desc, k_desc, v_desc, out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
    start, seq_len, prefix, m_start, col_q, col_v, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
):  # fmt: skip
    _fwd_worker(
        q_desc, k_desc, v_desc, out_ptr, q_smem, k_smem, v_smem, q_ready, turns, k_ready, k_empty, v_ready, v_empty,
        start, seq_len, prefix, m_start, col_q, col_v, col_o, stride_ot, alpha, inv_n, first, total, nf, s2,
        1, BLOCK_N, STAGES, PINGPONG,
    )  # fmt: skip


@gluon.jit(do_not_specialize=["N_BUCKET"])
def _hstu_attention_fwd_ws(
    q_desc, k_desc, v_desc, out_ptr, seq_offsets, num_targets,
    stride_ot, stride_oh, H, alpha, inv_n, N_BUCKET,
    DQK: gl.constexpr, DV: gl.constexpr, HAS_TARGETS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,
):  # fmt: skip
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    m_start = (gl.num_programs(0) - 1 - gl.program_id(0)) * (2 * BLOCK_M)  # heaviest blocks first
    b = gl.program_id(1) // H
    h = gl.program_id(1) % H
    start, seq_len, prefix = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    if m_start >= seq_len:
        return
    if True:
        first, total, nf, s2 = _key_tiles(m_start, seq_len, prefix, 2 * BLOCK_M, BLOCK_N)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for slot in gl.static_range(2):
            mbarrier.init(q_ready.index(slot), count=1)
            mbarrier.init(turns.index(slot), count=1)
        for stage in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(stage), count=1)
            mbarrier.init(v_ready.index(stage), count=1)
            mbarrier.init(k_empty.index(stage), count=2)  # one arrival per consumer
            mbarrier.init(v_empty.index(stage), count=2)
        col_q = h * DQK
        col_v = h * DV
        col_o = h * stride_oh
        gl.warp_specialize(
            [
                (
                    _fwd_consumer,
                    (
                        out_ptr,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_ready,
                        turns,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        start,
                        seq_len,
                        prefix,
                        m_start,
                        col_o,
                        stride_ot,
                        alpha,
                        inv_n,
                        first,
                        total,
                        nf,
                        s2,
                        0,
                        BLOCK_N,
                        STAGES,
                        PINGPONG,
                    ),
                ),  # fmt: skip
                (
                    _fwd_consumer_worker,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        out_ptr,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_ready,
                        turns,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        start,
                        seq_len,
                        prefix,
                        m_start,
                        col_q,
                        col_v,
                        col_o,
                        stride_ot,
                        alpha,
                        inv_n,
                        first,
                        total,
                        nf,
                        s2,
                        BLOCK_N,
                        STAGES,
                        PINGPONG,
                    ),
                ),
                (
                    _fwd_producer_worker,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        out_ptr,
                        q_smem,
                        k_smem,
                        v_smem,
                        q_ready,
                        turns,
                        k_ready,
                        k_empty,
                        v_ready,
                        v_empty,
                        start,
                        seq_len,
                        prefix,
                        m_start,
                        col_q,
                        col_v,
                        col_o,
                        stride_ot,
                        alpha,
                        inv_n,
                        first,
                        total,
                        nf,
                        s2,
                        BLOCK_N,
                        STAGES,
                        PINGPONG,
                    ),
                ),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _rows(x: torch.Tensor, block_rows: int) -> TensorDescriptor:
    """x [T, H, D] as a TMA descriptor over its [T, H * D] rows with [block_rows, D] tiles at column
    h * D. A layout TMA cannot take (heads not side by side, a row stride or start not a multiple
    of 16 bytes) is copied first. Rows past T read as zeros."""
    total, heads, dim = x.shape
    size = x.element_size()
    if not ((heads == 1 or x.stride(1) == dim) and (x.stride(0) * size) % 16 == 0 and x.data_ptr() % 16 == 0):
        x = x.clone(memory_format=torch.contiguous_format)
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, dim], _GL_DTYPES[x.dtype])
    return TensorDescriptor(x, [total, heads * dim], [x.stride(0), 1], [block_rows, dim], layout)


def attention_fwd(q, k, v, seq_offsets, num_targets, max_seq_len: int, alpha: float) -> torch.Tensor:
    """out [T, H, Dv] in q's dtype (bf16 or fp16; Dqk and Dv 64 or 128)."""
    q, k, v = (unit_cols(t) for t in (q, k, v))
    total, heads, dqk = q.shape
    dv = v.shape[2]
    out = torch.empty((total, heads, dv), dtype=q.dtype, device=q.device)
    if total == 0 or seq_offsets.numel() < 2 or max_seq_len <= 0:
        return out.zero_()
    block_n, stages, pingpong = FWD_TILES[max(dqk, dv)]
    rows_per_program = 2 * ROWS_PER_CONSUMER
    grid = (triton.cdiv(max_seq_len, rows_per_program), (seq_offsets.numel() - 1) * heads)
    targets = num_targets if num_targets is not None else seq_offsets
    _hstu_attention_fwd_ws[grid](
        _rows(q, ROWS_PER_CONSUMER),
        _rows(k, block_n),
        _rows(v, block_n),
        out,
        seq_offsets,
        targets,
        out.stride(0),
        out.stride(1),
        heads,
        float(alpha),
        1.0 / max_seq_len,
        triton.next_power_of_2(max_seq_len),
        DQK=dqk,
        DV=dv,
        HAS_TARGETS=num_targets is not None,
        BLOCK_N=block_n,
        STAGES=stages,
        PINGPONG=pingpong,
        num_warps=4,
        maxnreg=MAXNREG,
    )
    return out
