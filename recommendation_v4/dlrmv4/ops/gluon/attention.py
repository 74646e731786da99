"""Hopper (sm_90) HSTU attention in Gluon, forward and backward, warp-specialized: the same op and
semantics as ``ops/triton/attention.py``'s kernels (jagged ``seq_offsets``, the causal and
target-aware mask, ``1/N``, ``SiLU(alpha q.k)``, q/k/v as strided views of one projection), for
bf16 and fp16 inputs with head dims of 64 or 128 (``ops/attention_kernels.py`` picks them).

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

The backward is one kernel (``attention_bwd``): a program holds 128 keys (two consumer warpgroups
of 64) and walks the query tiles that see them, highest first, while a producer warp streams the Q
and dO tiles. Each consumer computes S^T and dP^T for its keys, the SiLU and SiLU', and accumulates
dV and dK in registers; both write dS^T into one shared tile, from which each computes half of the
tile's dQ columns (5 products a tile pair, nothing recomputed). dQ is summed in fp32 in global
memory in a fixed order: a block adds its tile after every lower key block's, waiting for its turn
on a per-tile counter (blocks are launched lowest first, so a turn never waits on a block that has
not started); a tile's dQ is staged in shared memory and added while the next tile's products run.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..strides import tma_rows, unit_cols
from ..triton.attention import _key_spans, _sequence  # scalar helpers, shared with the portable kernels

# Query rows per consumer warpgroup (wgmma's M is 64 per warpgroup); a program covers two.
ROWS_PER_CONSUMER = 64
# (key tile, stages of the K and V rings, ping-pong) by head dim: the rings and two Q tiles fit in
# shared memory (224 KB at head dim 128).
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
def _key_tiles(m_start, seq_len, prefix, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The key tiles rows [m_start, m_start + BLOCK_M) visit, as (tiles in [0, e1), their total,
    the first masked key nf, the start s2 of the candidate rows' span): tile i starts at
    i * BLOCK_N below the first count and at s2 + (i - first) * BLOCK_N after it; tiles from nf
    on are masked. The spans are the Triton forward's (``_key_spans``); there is always one tile."""
    nf, e1, s2, hi = _key_spans(m_start, seq_len, prefix, BLOCK_M, BLOCK_N)
    first = e1 // BLOCK_N
    total = first + gl.cdiv(gl.maximum(hi - s2, 0), BLOCK_N)
    return first, total, nf, s2


@gluon.jit
def _tile_start(i, first, s2, BLOCK_N: gl.constexpr):
    return gl.where(i < first, i * BLOCK_N, s2 + (i - first) * BLOCK_N)


@gluon.jit
def _fwd_producer(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
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
            q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, k_ready, k_empty, v_ready, v_empty,
            start.to(gl.int32), m_start, col_q, col_v, first, total, s2, BLOCK_N, STAGES,
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
                    _fwd_worker,
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
                        1,
                        BLOCK_N,
                        STAGES,
                        PINGPONG,
                    ),
                ),
                (
                    _fwd_worker,
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
                        2,
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
    x = tma_rows(x)
    total, heads, dim = x.shape
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


# ---------------------------------------------------------------------------------------------------
# Backward: dK, dV and dQ in one kernel, dQ summed in fp32 in a fixed order.
# ---------------------------------------------------------------------------------------------------

# Keys per program (two consumers of 64), query rows per tile, stages of the Q / dO ring.
BWD_KEYS = 128
BWD_QUERY_ROWS = 64
BWD_STAGES = 2


@gluon.jit
def _query_tiles(n_start, seq_len, prefix, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The query tiles keys [n_start, n_start + BLOCK_N) are seen by (the Triton dK/dV kernel's
    spans): [m_lo, m_hi) in BLOCK_M steps, masked below d_end and from u_end on."""
    n_end = gl.minimum(n_start + BLOCK_N, seq_len)
    m_lo = (n_start // BLOCK_M) * BLOCK_M
    d_end = gl.cdiv(n_end, BLOCK_M) * BLOCK_M
    sees_prefix = n_start < prefix
    m_hi = gl.where(sees_prefix, gl.cdiv(seq_len, BLOCK_M) * BLOCK_M, d_end)
    u_end = gl.where(sees_prefix & (n_end > prefix), (prefix // BLOCK_M) * BLOCK_M, (seq_len // BLOCK_M) * BLOCK_M)
    u_end = gl.minimum(gl.maximum(d_end, u_end), m_hi)
    return m_lo, m_hi, d_end, u_end


@gluon.jit
def _bwd_producer(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, qdo_ready, qdo_empty,
    row0, n_start, col_q, col_v, m_hi, tiles,
    BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row0 + n_start, col_q], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [row0 + n_start, col_v], kv_ready, v_smem)
    for j in range(tiles):
        stage = j % STAGES
        m0 = m_hi - (j + 1) * BLOCK_M  # the highest query tile first (see _bwd_consumer)
        mbarrier.wait(qdo_empty.index(stage), ((j // STAGES) & 1) ^ 1)
        ready = qdo_ready.index(stage)
        mbarrier.expect(ready, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [row0 + m0, col_q], ready, q_smem.index(stage))
        tma.async_copy_global_to_shared(do_desc, [row0 + m0, col_v], ready, do_smem.index(stage))


@gluon.jit
def _dq_add(dq_mine, m0, dq_acc, dq_turns, start, seq_len, rank, turn_row, col_acc, stride_acc,
            SLOT: gl.constexpr, BLOCK_M: gl.constexpr, ORDERED: gl.constexpr):  # fmt: skip
    """A tile's dQ columns (this consumer's half, staged in shared memory) into the fp32 sum:
    ORDERED, after every lower key block's (a fixed order: the same bits every run); else by relaxed
    atomics (in no fixed order)."""
    WIDTH: gl.constexpr = dq_mine.type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])  # 16-byte accesses
    gl.thread_barrier()  # the staged tile was written in the wgmma's layout by other threads
    dq = dq_mine.load(layout)
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = col_acc + SLOT * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, layout))
    ptrs = dq_acc + (start + rows.to(gl.int64))[:, None] * stride_acc + cols[None, :]
    in_seq = (rows < seq_len)[:, None]
    if ORDERED:
        turn = dq_turns + (turn_row + m0 // BLOCK_M) * 2 + SLOT
        while gl.atomic_add(turn, 0, sem="acquire") != rank:
            pass
        gl.store(ptrs, gl.load(ptrs, mask=in_seq, other=0.0, cache_modifier=".cg") + dq, mask=in_seq)
        gl.thread_barrier()
        gl.atomic_xchg(turn, rank + 1, sem="release")
    else:
        gl.atomic_add(ptrs, dq, mask=in_seq, sem="relaxed")


@gluon.jit
def _bwd_consumer(
    k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, qdo_ready, qdo_empty, ds_full, ds_empty,
    dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part,
    start, seq_len, prefix, n_start, m_hi, d_end, u_end, tiles, rank, turn_row,
    stride_dkt, stride_dvt, col_dk, col_dv, col_acc, stride_acc, alpha, inv_n,
    SLOT: gl.constexpr, STAGES: gl.constexpr, SUMS: gl.constexpr, ORDERED: gl.constexpr,
):  # fmt: skip
    KEYS: gl.constexpr = k_smem.type.shape[0] // 2  # this consumer's keys
    BLOCK_M: gl.constexpr = q_smem.type.shape[1]
    DQK: gl.constexpr = k_smem.type.shape[1]
    DV: gl.constexpr = v_smem.type.shape[1]
    dtype: gl.constexpr = k_smem.type.element_ty
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16]
    )
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQK, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQK // 2, 16]
    )

    keys = n_start + SLOT * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, s_layout))
    k_mine = k_smem.slice(SLOT * KEYS, KEYS, dim=0)
    v_mine = v_smem.slice(SLOT * KEYS, KEYS, dim=0)
    k_cols = k_smem.slice(SLOT * (DQK // 2), DQK // 2, dim=1)  # dQ's columns this consumer sums
    dk = gl.zeros([KEYS, DQK], gl.float32, dk_layout)
    dv = gl.zeros([KEYS, DV], gl.float32, dv_layout)
    dq_mine = dq_smem.index(SLOT)
    m_prev = m_hi
    mbarrier.wait(kv_ready, 0)
    for j in range(tiles):
        stage = j % STAGES
        buf = j % 2
        m0 = m_hi - (j + 1) * BLOCK_M
        mbarrier.wait(qdo_ready.index(stage), (j // STAGES) & 1)
        q = q_smem.index(stage)
        do = do_smem.index(stage)
        s_zero = gl.zeros([KEYS, BLOCK_M], gl.float32, s_layout)  # made here: no zeros live across tiles
        s_t = warpgroup_mma(k_mine, q.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_mine, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s_t, dp_t = warpgroup_mma_wait(0, deps=(s_t, dp_t))
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        if (m0 < d_end) | (m0 >= u_end):  # zero scores and dP give zero weights and dS
            last = gl.where(rows < prefix, rows, prefix - 1)
            keep = ((keys[:, None] <= last[None, :]) | (keys[:, None] == rows[None, :])) & (rows < seq_len)[None, :]
            s_t = gl.where(keep, s_t, 0.0)
            dp_t = gl.where(keep, dp_t, 0.0)
        t = s_t * (0.5 * alpha)
        th = _tanh(t)
        tt = t * th
        a_t = (t + tt).to(dtype)
        ds_t = (dp_t * ((0.5 + 0.5 * th) * (1.0 + t - tt))).to(dtype)
        dv = warpgroup_mma(gl.convert_layout(a_t, gl.DotOperandLayout(0, dv_layout, 2)), do, dv, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(ds_t, gl.DotOperandLayout(0, dk_layout, 2)), q, dk, is_async=True)
        if j > 0:  # the previous tile's dQ goes out while this tile's dV and dK products run
            _dq_add(dq_mine, m_prev, dq_acc, dq_turns, start, seq_len, rank, turn_row, col_acc, stride_acc,
                    SLOT, BLOCK_M, ORDERED)  # fmt: skip
        # dS^T's rows of this consumer's keys into the shared tile both consumers' dQ products read.
        mbarrier.wait(ds_empty.index(buf), ((j // 2) & 1) ^ 1)
        ds_smem.index(buf).slice(SLOT * KEYS, KEYS, dim=0).store(ds_t)
        fence_async_shared()
        mbarrier.arrive(ds_full.index(buf))
        mbarrier.wait(ds_full.index(buf), (j // 2) & 1)
        dq_zero = gl.zeros([BLOCK_M, DQK // 2], gl.float32, dq_layout)
        dq = warpgroup_mma(ds_smem.index(buf).permute((1, 0)), k_cols, dq_zero, use_acc=False, is_async=True)
        dq, dk, dv = warpgroup_mma_wait(0, deps=(dq, dk, dv))
        mbarrier.arrive(qdo_empty.index(stage))
        mbarrier.arrive(ds_empty.index(buf))
        dq_mine.store(dq)  # added to the sum while the next tile's products run
        m_prev = m0
    _dq_add(dq_mine, m_prev, dq_acc, dq_turns, start, seq_len, rank, turn_row, col_acc, stride_acc,
            SLOT, BLOCK_M, ORDERED)  # fmt: skip

    dk = dk * (alpha * inv_n)
    dv = dv * inv_n
    dk_rows = n_start + SLOT * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, dk_layout))
    dk_cols = gl.arange(0, DQK, layout=gl.SliceLayout(0, dk_layout))
    dv_rows = n_start + SLOT * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(1, dv_layout))
    dv_cols = gl.arange(0, DV, layout=gl.SliceLayout(0, dv_layout))
    dk_in = (dk_rows < seq_len)[:, None]
    dv_in = (dv_rows < seq_len)[:, None]
    gl.store(
        dk_ptr + (start + dk_rows.to(gl.int64))[:, None] * stride_dkt + col_dk + dk_cols[None, :],
        dk.to(dtype),
        mask=dk_in,
    )
    gl.store(
        dv_ptr + (start + dv_rows.to(gl.int64))[:, None] * stride_dvt + col_dv + dv_cols[None, :],
        dv.to(dtype),
        mask=dv_in,
    )
    if SUMS:  # fp32 column sums before rounding, one row of partials per consumer
        slot = (gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)) * 2 + SLOT
        gl.store(dk_part + slot.to(gl.int64) * DQK + dk_cols, gl.sum(gl.where(dk_in, dk, 0.0), axis=0))
        gl.store(dv_part + slot.to(gl.int64) * DV + dv_cols, gl.sum(gl.where(dv_in, dv, 0.0), axis=0))


@gluon.jit
def _bwd_worker(
    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem,
    kv_ready, qdo_ready, qdo_empty, ds_full, ds_empty, dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part,
    start, seq_len, prefix, n_start, m_hi, d_end, u_end, tiles, rank, turn_row,
    stride_dkt, stride_dvt, col_q, col_v, col_dk, col_dv, col_acc, stride_acc, alpha, inv_n,
    ROLE: gl.constexpr, STAGES: gl.constexpr, SUMS: gl.constexpr, ORDERED: gl.constexpr,
):  # fmt: skip
    """The worker partitions share one signature: ROLE 1 is the second consumer, 2 the producer."""
    if ROLE == 1:
        _bwd_consumer(
            k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, qdo_ready, qdo_empty, ds_full, ds_empty,
            dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part,
            start, seq_len, prefix, n_start, m_hi, d_end, u_end, tiles, rank, turn_row,
            stride_dkt, stride_dvt, col_dk, col_dv, col_acc, stride_acc, alpha, inv_n,
            1, STAGES, SUMS, ORDERED,
        )  # fmt: skip
    else:
        _bwd_producer(
            q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, qdo_ready, qdo_empty,
            start.to(gl.int32), n_start, col_q, col_v, m_hi, tiles, q_smem.type.shape[1], STAGES,
        )  # fmt: skip


@gluon.jit(do_not_specialize=["N_BUCKET"])
def _hstu_attention_bwd_ws(
    q_desc, k_desc, v_desc, do_desc, dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part, seq_offsets, num_targets,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_acc, H, alpha, inv_n, query_tiles, N_BUCKET,
    DQK: gl.constexpr, DV: gl.constexpr, HAS_TARGETS: gl.constexpr, STAGES: gl.constexpr, SUMS: gl.constexpr,
    ORDERED: gl.constexpr,
):  # fmt: skip
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    n_start = gl.program_id(0) * BLOCK_N
    b = gl.program_id(1) // H
    h = gl.program_id(1) % H
    start, seq_len, prefix = _sequence(seq_offsets, num_targets, b, HAS_TARGETS)
    if n_start >= seq_len:
        if SUMS:
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            slot = (gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)) * 2
            for c in gl.static_range(2):
                gl.store(
                    dk_part + (slot + c).to(gl.int64) * DQK + gl.arange(0, DQK, layout=zl),
                    gl.zeros([DQK], gl.float32, zl),
                )
                gl.store(
                    dv_part + (slot + c).to(gl.int64) * DV + gl.arange(0, DV, layout=zl), gl.zeros([DV], gl.float32, zl)
                )
        return
    m_lo, m_hi, d_end, u_end = _query_tiles(n_start, seq_len, prefix, BLOCK_M, BLOCK_N)
    tiles = (m_hi - m_lo) // BLOCK_M
    # dQ's turn: keys before the prefix end go in block order; a candidates' block after all of them.
    rank = gl.where(n_start < prefix, gl.program_id(0), gl.cdiv(prefix, BLOCK_N))
    turn_row = gl.program_id(1) * query_tiles
    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], k_desc.dtype)
    ds_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQK // 2], dq_smem_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    qdo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for stage in gl.static_range(STAGES):
        mbarrier.init(qdo_ready.index(stage), count=1)
        mbarrier.init(qdo_empty.index(stage), count=2)  # one arrival per consumer
    for buf in gl.static_range(2):
        mbarrier.init(ds_full.index(buf), count=2)
        mbarrier.init(ds_empty.index(buf), count=2)
    col_q = h * DQK
    col_v = h * DV
    col_dk = h * stride_dkh
    col_dv = h * stride_dvh
    col_acc = h * DQK
    gl.warp_specialize(
        [
            (
                _bwd_consumer,
                (
                    k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_ready, qdo_ready, qdo_empty, ds_full, ds_empty,
                    dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part,
                    start, seq_len, prefix, n_start, m_hi, d_end, u_end, tiles, rank, turn_row,
                    stride_dkt, stride_dvt, col_dk, col_dv, col_acc, stride_acc, alpha, inv_n,
                    0, STAGES, SUMS, ORDERED,
                ),
            ),
            (
                _bwd_worker,
                (
                    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem,
                    kv_ready, qdo_ready, qdo_empty, ds_full, ds_empty, dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part,
                    start, seq_len, prefix, n_start, m_hi, d_end, u_end, tiles, rank, turn_row,
                    stride_dkt, stride_dvt, col_q, col_v, col_dk, col_dv, col_acc, stride_acc, alpha, inv_n,
                    1, STAGES, SUMS, ORDERED,
                ),
            ),
            (
                _bwd_worker,
                (
                    q_desc, k_desc, v_desc, do_desc, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem,
                    kv_ready, qdo_ready, qdo_empty, ds_full, ds_empty, dk_ptr, dv_ptr, dq_acc, dq_turns, dk_part, dv_part,
                    start, seq_len, prefix, n_start, m_hi, d_end, u_end, tiles, rank, turn_row,
                    stride_dkt, stride_dvt, col_q, col_v, col_dk, col_dv, col_acc, stride_acc, alpha, inv_n,
                    2, STAGES, SUMS, ORDERED,
                ),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, PRODUCER_REGS],
    )  # fmt: skip


def attention_bwd(
    do, q, k, v, seq_offsets, num_targets, max_seq_len: int, alpha: float, *, out=None, col_sums=None, ordered=True
):
    """(dq, dk, dv) in one kernel: the same contract as ``ops/triton/attention.py``'s ``attention_bwd``
    (``out`` buffers, ``col_sums`` of each gradient's rows), for bf16 / fp16 with head dims 64 or 128.
    dQ is summed in fp32 over the key blocks in block order (each block waits for its turn on the
    query tile), so the result is the same bits every run; ``ordered=False`` adds it by atomics
    instead (in no fixed order: refused under ``torch.use_deterministic_algorithms``)."""
    from ..triton import attention as portable  # the buffer checks and the partial sums' layout

    if not ordered and torch.are_deterministic_algorithms_enabled():
        raise RuntimeError(
            "attention_bwd: ordered=False adds dQ with atomics, in no fixed order; "
            "torch.use_deterministic_algorithms(True) needs ordered=True"
        )

    do, q, k, v = (unit_cols(t) for t in (do, q, k, v))
    sums = portable._sum_buffers(col_sums, q, v)
    if out is None:
        dq_out = None
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        dq_out, dk, dv = portable._grad_buffers(out, q, k, v)
    total, heads, dqk = q.shape
    if total == 0 or seq_offsets.numel() < 2 or max_seq_len <= 0:
        if sums is not None:
            for t in sums:
                t.zero_()
        dq = torch.zeros_like(q) if dq_out is None else dq_out.zero_()
        return dq, dk.zero_(), dv.zero_()
    batch = seq_offsets.numel() - 1
    key_blocks = triton.cdiv(max_seq_len, BWD_KEYS)
    query_tiles = triton.cdiv(max_seq_len, BWD_QUERY_ROWS)
    dq_acc = torch.zeros((total, heads, dqk), dtype=torch.float32, device=q.device)
    turns = torch.zeros(batch * heads * query_tiles * 2, dtype=torch.int32, device=q.device)
    parts = [
        torch.empty(batch * heads * key_blocks * 2 * w, dtype=torch.float32, device=q.device) for w in (dqk, v.shape[2])
    ]
    targets = num_targets if num_targets is not None else seq_offsets
    _hstu_attention_bwd_ws[(key_blocks, batch * heads)](
        _rows(q, BWD_QUERY_ROWS),
        _rows(k, BWD_KEYS),
        _rows(v, BWD_KEYS),
        _rows(do, BWD_QUERY_ROWS),
        dk,
        dv,
        dq_acc,
        turns,
        parts[0],
        parts[1],
        seq_offsets,
        targets,
        dk.stride(0),
        dk.stride(1),
        dv.stride(0),
        dv.stride(1),
        dq_acc.stride(0),
        heads,
        float(alpha),
        1.0 / max_seq_len,
        query_tiles,
        triton.next_power_of_2(max_seq_len),
        DQK=dqk,
        DV=v.shape[2],
        HAS_TARGETS=num_targets is not None,
        STAGES=BWD_STAGES,
        SUMS=sums is not None,
        ORDERED=ordered,
        num_warps=4,
        maxnreg=MAXNREG,
    )
    dq_acc.mul_(alpha / max_seq_len)
    dq = dq_acc.to(q.dtype) if dq_out is None else dq_out.copy_(dq_acc)
    if sums is not None:
        torch.sum(dq_acc, dim=0, out=sums[0])
        for part, total_sum in zip(parts, sums[1:]):
            # One row per consumer of each program, programs (key block, sequence * heads + head).
            torch.sum(part.view(batch, heads, -1, total_sum.shape[1]), dim=(0, 2), out=total_sum)
    return dq, dk, dv
