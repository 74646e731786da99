"""The non-attention ops at the model's shape on the GPU (bf16, fp16, fp32), compiled Triton
against the float64 reference; skipped as a whole without CUDA (see conftest.py).

Shape: 32 sequences of 8 contextual + up to 4,087 history + 1 candidate tokens (lengths 0, 1, odd
and max among them), D = H·d_v = 512. Dropout: the compiled kernels' masks equal the reference's
torch Philox masks (on the GPU too), and a chunk of rows run with its ``row_offset`` is bit for bit
that chunk of the whole run, at the model's full slice (about 730k rows) in bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sync_guard import run_without_syncs
from test_ops_layer_norm import (  # noqa: F401  (fixtures)
    assert_close,
    check_input_bias,
    check_norm_plus,
    gen,
    leaf64,
    poison,
    randn,
)
from test_ops_output_block import check_du_sums

from dlrmv4.ops.gather_rows import gather_rows
from dlrmv4.ops.jagged import concat_sequence_timestamps, concat_sequences, take_last
from dlrmv4.ops.layer_norm import layer_norm, swish_layer_norm
from dlrmv4.ops.output_block import output_block, output_block_keep_mask
from dlrmv4.ops.position import encode_sequences, input_dropout_keep_mask, position_time_encode

CUDA = "cuda"
B, C, D, MAX_HISTORY = 32, 8, 512, 4087
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FULL_ROWS = 730_000  # one rank's slice at the reference batch size
# Row offsets whose Philox counters (3 · row · ceil(D / 8) or row · ceil(D / 8)) pass 2^32.
HIGH_ROW = 2**25 + 12_345


def assert_zeros_follow(y: torch.Tensor, keep: torch.Tensor) -> None:
    """y is 0 wherever ``keep`` drops, and nonzero where it keeps but for the rare value that is 0
    itself (random inputs at this size hold a few)."""
    assert not ((y != 0) & ~keep).any(), "a dropped element is not 0"
    assert ((y == 0) & keep).sum().item() <= 1e-6 * y.numel(), "kept elements are 0"


def history_lengths(gen: torch.Generator) -> list[int]:
    lengths = torch.randint(1500, MAX_HISTORY, (B,), generator=gen).tolist()
    lengths[:4] = [0, 1, MAX_HISTORY, 2 * (lengths[4] // 2) + 1]
    return lengths


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(CUDA)


def model_history(gen: torch.Generator):
    """(history_offsets, history timestamps, query_time) of a batch."""
    lengths = history_lengths(gen)
    hist_offsets = offsets_of(lengths)
    query = torch.randint(1_600_000_000, 1_700_000_000, (B,), generator=gen).to(CUDA)
    # Half up to two years back (buckets up to sqrt(6.3e7 / 60) ≈ 1,025), half within a second of
    # a bucket edge 60·k² (k up to 2,100: past the last bucket too).
    dt = torch.randint(-10, 2 * 31_536_000, (sum(lengths),), generator=gen)
    k = torch.randint(0, 2100, dt.shape, generator=gen)
    edge = 60 * k * k + torch.randint(-1, 2, dt.shape, generator=gen)
    dt = torch.where(torch.rand(dt.shape, generator=gen) < 0.5, dt, edge)
    hist_query = query.cpu().repeat_interleave(torch.tensor(lengths))
    return hist_offsets, (hist_query - dt).to(CUDA), query


def model_batch(gen: torch.Generator):
    """(seq_offsets, timestamps, query_time) of a batch laid out by concat_sequences."""
    hist_offsets, history_ts, query = model_history(gen)
    ts = concat_sequence_timestamps(history_ts, hist_offsets, query, C)
    seq_offsets = hist_offsets + torch.arange(B + 1, device=CUDA) * (C + 1)
    return seq_offsets, ts, query


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn,width", [(layer_norm, 512), (swish_layer_norm, 256), (swish_layer_norm, 512)])
def test_layer_norm(fn, width, dtype, gen, poison):
    x = randn((B * 2850, width), gen, dtype, CUDA, scale=2.0, shift=0.5).requires_grad_()
    w = randn(width, gen, device=CUDA, shift=1.0).requires_grad_()
    b = randn(width, gen, device=CUDA).requires_grad_()
    y = fn(x, w, b, 1e-6, kernels="triton")
    dy = randn(y.shape, gen, dtype, CUDA)
    y.backward(dy)
    x64, w64, b64 = leaf64(x), leaf64(w), leaf64(b)
    ref = fn(x64, w64, b64, 1e-6, kernels="pytorch")
    ref.backward(dy.double())
    assert_close(y, ref, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(w.grad, w64.grad, dtype, "dweight")
    assert_close(b.grad, b64.grad, dtype, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_plus(dtype, gen, poison):
    """The preprocessor's sums of tower outputs at full size: bit for bit the norm then the add."""
    shape = (B * 2850, 512)
    x = randn(shape, gen, dtype, CUDA, scale=2.0, shift=0.5)
    w, b = randn(512, gen, device=CUDA, shift=1.0), randn(512, gen, device=CUDA)
    check_norm_plus(x, randn(shape, gen, dtype, CUDA), w, b, randn(shape, gen, dtype, CUDA))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,width", [("swish_layer_norm", 256), ("layer_norm_plus", 512), ("layer_norm", 512)])
def test_layer_norm_input_bias(kind, width, dtype, gen, poison):
    """A tower's bias gradient summed by the norm's backward, at a slice's token count."""
    check_input_bias(kind, "triton", dtype, B * 2850, width, CUDA, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_block_du_sums(dtype, gen, poison):
    check_du_sums(B * 2850, 512, dtype, CUDA, gen)


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_block(dtype, gen, poison):
    t, hd, p, seed = B * 2850, 512, 0.1, int(torch.randint(2**31, (1,), generator=gen))
    # u, before the SiLU the block applies, is a column slice of the projection (wide enough to
    # reach both saturated ends of the SiLU).
    uvqk = randn((t, 4 * hd), gen, dtype, CUDA, scale=3.0).requires_grad_()
    u = uvqk[:, :hd]
    attn = randn((t, hd), gen, dtype, CUDA, scale=3.0).requires_grad_()
    w = randn(hd, gen, device=CUDA, shift=1.0).requires_grad_()
    b = randn(hd, gen, device=CUDA).requires_grad_()
    y = output_block(u, attn, w, b, 1e-6, p, seed, True, kernels="triton")
    assert torch.equal(y, output_block(u, attn, w, b, 1e-6, p, seed, True, kernels="triton"))
    dy = randn(y.shape, gen, dtype, CUDA)
    y.backward(dy)
    mask = output_block_keep_mask(t, hd, p, seed, CUDA)
    assert abs(mask.float().mean().item() - (1 - p)) < 1e-3
    assert torch.equal(y != 0, mask & (y != 0))
    # The first segment is SiLU(u), kept and scaled: one rounding to dtype, element by element.
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    want = F.silu(u.detach().double()) * mask[:, :hd] / (1 - p)
    torch.testing.assert_close(y[:, :hd].double(), want, rtol=tol, atol=tol * 1e-3)
    u64, a64, w64, b64 = leaf64(u), leaf64(attn), leaf64(w), leaf64(b)
    ref = output_block(u64, a64, w64, b64, 1e-6, p, seed, True, kernels="pytorch", keep_mask=mask)
    ref.backward(dy.double())
    assert_close(y, ref, dtype, "y")
    assert_close(uvqk.grad[:, :hd], u64.grad, dtype, "du")
    assert not uvqk.grad[:, hd:].any()
    assert_close(attn.grad, a64.grad, dtype, "dattn")
    assert_close(w.grad, w64.grad, dtype, "dweight")
    assert_close(b.grad, b64.grad, dtype, "dbias")
    other = output_block_keep_mask(t, hd, p, seed + 1, CUDA)
    assert (other != mask).float().mean().item() > 0.1


def test_output_block_masks_are_the_references():
    """The compiled mask kernel and the forward's stored bits against the torch Philox mask on the
    GPU, at the full slice and at row offsets whose counters pass 2^32."""
    from dlrmv4.ops.triton import output_block as tri

    t, hd, p = FULL_ROWS, 512, 0.1
    for seed, row_offset in ((int(torch.randint(2**31 - 1, (1,))), 0), (2**40 + 77, HIGH_ROW)):
        want = output_block_keep_mask(t, hd, p, seed, CUDA, row_offset)
        assert torch.equal(tri.keep_mask(t, hd, p, seed, torch.device(CUDA), row_offset), want)
        assert abs(want.float().mean().item() - (1 - p)) < 1e-3
        del want
    rows = 40_000  # the forward's stored bits, on fewer rows (u and attn are [rows, hd] bf16)
    u = torch.randn((rows, hd), device=CUDA, dtype=torch.bfloat16)
    keep = tri.forward(u, u, None, None, 1e-6, p, seed, True, row_offset)[3]
    bits = torch.stack([(keep >> s) & 1 for s in range(3)], 1).flatten(1).bool()
    assert torch.equal(bits, output_block_keep_mask(rows, hd, p, seed, CUDA, row_offset))


def test_output_block_chunks_are_the_whole(gen, poison):
    """bf16 at the full slice: rows [a, b) run with row_offset = a (after a base offset) give rows
    [a, b) of the whole run, y and du, dattn bit for bit; dweight, dbias add up to rounding."""
    t, hd, p, seed = FULL_ROWS, 512, 0.1, int(torch.randint(2**31 - 1, (1,), generator=gen))
    u = randn((t, hd), gen, torch.bfloat16, CUDA, scale=3.0).requires_grad_()
    attn = randn((t, hd), gen, torch.bfloat16, CUDA, scale=2.0).requires_grad_()
    w = randn(hd, gen, device=CUDA, shift=1.0).requires_grad_()
    b = randn(hd, gen, device=CUDA).requires_grad_()
    dy = randn((t, 3 * hd), gen, torch.bfloat16, CUDA)
    y = output_block(u, attn, w, b, 1e-6, p, seed, True, kernels="triton", row_offset=HIGH_ROW)
    whole = (y, *torch.autograd.grad(y, (u, attn, w, b), dy))
    del y
    dw, db = torch.zeros_like(w), torch.zeros_like(b)
    for a, e in ((0, 100_003), (100_003, 500_000), (500_000, t)):
        y = output_block(u[a:e], attn[a:e], w, b, 1e-6, p, seed, True, kernels="triton", row_offset=HIGH_ROW + a)
        got = (y, *torch.autograd.grad(y, (u, attn, w, b), dy[a:e]))
        assert torch.equal(got[0], whole[0][a:e]), f"y of rows [{a}, {e})"
        assert torch.equal(got[1][a:e], whole[1][a:e]) and torch.equal(got[2][a:e], whole[2][a:e]), f"[{a}, {e})"
        dw, db = dw + got[3], db + got[4]
        del y, got
    torch.testing.assert_close(dw, whole[3], rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(db, whole[4], rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sequence_layout_and_take_last(dtype, gen, poison):
    """encode_sequences with zero tables, unit scale and no dropout is the concatenation, bit for
    bit, and its backward the split; take_last reads each sequence's candidate."""
    lengths = history_lengths(gen)
    hist_offsets = offsets_of(lengths)
    ctx = randn((B, C, D), gen, dtype, CUDA).requires_grad_()
    hist = randn((sum(lengths), D), gen, dtype, CUDA).requires_grad_()
    cand = randn((B, D), gen, dtype, CUDA).requires_grad_()
    tokens = torch.cat([hist, cand])
    stamps, query = (
        torch.zeros(sum(lengths), dtype=torch.int64, device=CUDA),
        torch.zeros(B, dtype=torch.int64, device=CUDA),
    )
    tables = torch.zeros((8, D), device=CUDA), torch.zeros((4, D), device=CUDA)
    values, seq_offsets = encode_sequences(ctx, tokens, hist_offsets, stamps, query, *tables, 1.0, kernels="triton")
    ref, ref_offsets = concat_sequences(ctx, tokens, hist_offsets)
    assert torch.equal(values, ref) and torch.equal(seq_offsets, ref_offsets)
    last = take_last(values, seq_offsets, kernels="triton")
    assert torch.equal(last, cand)
    g_values, g_last = randn(values.shape, gen, dtype, CUDA), randn(last.shape, gen, dtype, CUDA)
    got = torch.autograd.grad((values, last), (ctx, hist, cand), (g_values, g_last))
    ref_last = take_last(ref, ref_offsets, kernels="pytorch")
    want = torch.autograd.grad((ref, ref_last), (ctx, hist, cand), (g_values, g_last))
    for name, a, e in zip(("dcontextual", "dhistory", "dcandidate"), got, want):
        assert torch.equal(a, e), name


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_encode_sequences(p, gen, poison):
    """The model's form at full size, bf16: the kernel reading the parts against the reference's
    concatenation then encoding in float64; the same dropout zeros."""
    hist_offsets, history_ts, query = model_history(gen)
    ctx = randn((B, C, D), gen, torch.bfloat16, CUDA).requires_grad_()
    tokens = randn((history_ts.numel() + B, D), gen, torch.bfloat16, CUDA).requires_grad_()
    tables = [randn((rows, D), gen, device=CUDA, scale=10.0).requires_grad_() for rows in (8192, 2048)]
    drop = dict(dropout_p=p, seed=int(torch.randint(2**31, (1,), generator=gen)), training=True, row_offset=HIGH_ROW)
    args = (hist_offsets, history_ts, query)
    out, offs = encode_sequences(ctx, tokens, *args, *tables, math.sqrt(D), kernels="triton", **drop)
    g = randn(out.shape, gen, torch.bfloat16, CUDA)
    got = torch.autograd.grad(out, (ctx, tokens, *tables), g)
    leaves = [leaf64(x) for x in (ctx, tokens, *tables)]
    ref, _ = encode_sequences(leaves[0], leaves[1], *args, *leaves[2:], math.sqrt(D), kernels="pytorch", **drop)
    want = torch.autograd.grad(ref, leaves, g.double())
    assert torch.equal(offs, hist_offsets + torch.arange(B + 1, device=CUDA) * (C + 1))
    assert torch.equal(out != 0, ref != 0)
    torch.testing.assert_close(out.double(), ref.detach(), atol=0.4, rtol=1e-2)
    for name, a, e in zip(("dcontextual", "dtokens"), got, want):
        torch.testing.assert_close(a.double(), e, atol=0.1, rtol=1e-2, msg=name)
    for name, a, e in zip(("dpos_table", "dtime_table"), got[2:], want[2:]):
        torch.testing.assert_close(a.double(), e, atol=1e-3, rtol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_position_time_encode(dtype, p, gen, poison):
    """Kernel and reference each draw the input dropout's mask (p > 0): the same zeros, the same
    values and gradients."""
    seq_offsets, ts, query = model_batch(gen)
    n = ts.numel()
    x = randn((n, D), gen, dtype, CUDA).requires_grad_()
    pos_table = randn((8192, D), gen, device=CUDA, scale=10.0).requires_grad_()
    time_table = randn((2048, D), gen, device=CUDA, scale=10.0).requires_grad_()
    drop = dict(
        dropout_p=p, seed=2**33 + int(torch.randint(2**31, (1,), generator=gen)), training=True, row_offset=HIGH_ROW
    )
    out = position_time_encode(
        x, seq_offsets, ts, query, C, pos_table, time_table, math.sqrt(D), kernels="triton", **drop
    )
    g = randn(out.shape, gen, dtype, CUDA)
    out.backward(g)
    x64, p64, t64 = leaf64(x), leaf64(pos_table), leaf64(time_table)
    ref = position_time_encode(x64, seq_offsets, ts, query, C, p64, t64, math.sqrt(D), kernels="pytorch", **drop)
    ref.backward(g.double())
    if p > 0:
        keep = input_dropout_keep_mask(n, D, p, drop["seed"], CUDA, HIGH_ROW)
        assert abs(keep.float().mean().item() - (1 - p)) < 2e-3
        assert_zeros_follow(out, keep)
        assert_zeros_follow(x.grad, keep & (g != 0))
    # Elementwise: one token with a wrong table row fails. Tolerances: one rounding in dtype.
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), ref.detach(), atol=tol * 40, rtol=tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(pos_table.grad.double(), p64.grad, atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(time_table.grad.double(), t64.grad, atol=1e-3, rtol=1e-5)


def test_position_time_encode_deterministic(gen, poison, deterministic_algorithms):
    """Under deterministic algorithms the tables' gradients (thousands of tokens per position row)
    are summed in a fixed order: the same bits twice, and the reference's values."""
    seq_offsets, ts, query = model_batch(gen)
    x = randn((ts.numel(), D), gen, torch.bfloat16, CUDA)
    tables = [randn((rows, D), gen, device=CUDA, scale=10.0) for rows in (8192, 2048)]
    g = randn(x.shape, gen, torch.bfloat16, CUDA)

    def grads(xx, pt, tt, kernels):
        leaves = [t.detach().requires_grad_() for t in (xx, pt, tt)]
        out = position_time_encode(leaves[0], seq_offsets, ts, query, C, *leaves[1:], math.sqrt(D), kernels=kernels)
        return torch.autograd.grad(out, leaves, g.to(out.dtype))

    first, second = grads(x, *tables, "triton"), grads(x, *tables, "triton")
    for name, a, b in zip(("dx", "dpos", "dtime"), first, second):
        assert torch.equal(a, b), name
    want = grads(x.double(), *(t.double() for t in tables), "pytorch")
    torch.testing.assert_close(first[1].double(), want[1], atol=1e-3, rtol=1e-5)
    torch.testing.assert_close(first[2].double(), want[2], atol=1e-3, rtol=1e-5)


def test_position_time_encode_chunks_are_the_whole(gen, poison):
    """bf16 with dropout at the full slice (about 730k rows: the 32 sequences repeated), the rows of
    consecutive sequences run with their first row as row_offset: out and dx bit for bit, the
    tables' gradients to rounding."""
    seq_offsets, ts, query = model_batch(gen)
    reps = -(-FULL_ROWS // ts.numel())
    lengths = seq_offsets.diff().repeat(reps)
    seq_offsets = torch.cat([seq_offsets[:1], lengths.cumsum(0)])
    ts, query = ts.repeat(reps), query.repeat(reps)
    n = ts.numel()
    x = randn((n, D), gen, torch.bfloat16, CUDA).requires_grad_()
    tables = [randn((8192, D), gen, device=CUDA).requires_grad_(), randn((2048, D), gen, device=CUDA).requires_grad_()]
    g = randn((n, D), gen, torch.bfloat16, CUDA)
    drop = dict(dropout_p=0.2, seed=int(torch.randint(2**31 - 1, (1,), generator=gen)), training=True)
    out = position_time_encode(x, seq_offsets, ts, query, C, *tables, math.sqrt(D), kernels="triton", **drop)
    whole = (out, *torch.autograd.grad(out, (x, *tables), g))
    del out
    nseq = seq_offsets.numel() - 1
    sums = [torch.zeros_like(t) for t in tables]
    for i, j in ((0, 5), (5, nseq // 2 + 1), (nseq // 2 + 1, nseq)):
        a, e = int(seq_offsets[i]), int(seq_offsets[j])
        out = position_time_encode(
            x[a:e],
            seq_offsets[i : j + 1] - a,
            ts[a:e],
            query[i:j],
            C,
            *tables,
            math.sqrt(D),
            kernels="triton",
            row_offset=a,
            **drop,
        )
        dx, dpt, dtt = torch.autograd.grad(out, (x, *tables), g[a:e])
        assert torch.equal(out, whole[0][a:e]) and torch.equal(dx[a:e], whole[1][a:e]), f"rows [{a}, {e})"
        sums = [sums[0] + dpt, sums[1] + dtt]
        del out, dx
    for name, got, want in zip(("dpos_table", "dtime_table"), sums, whole[2:]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2, msg=name)


def test_no_host_sync(gen):
    """Forward and backward of every op launch kernels only: no device-to-host wait."""
    hist_offsets, history_ts, query = model_history(gen)
    dt = torch.bfloat16
    ctx, cand = randn((B, C, D), gen, dt, CUDA), randn((B, D), gen, dt, CUDA)
    hist = randn((history_ts.numel(), D), gen, dt, CUDA)
    w, b = randn(D, gen, device=CUDA), randn(D, gen, device=CUDA)
    tables = randn((8192, D), gen, device=CUDA), randn((2048, D), gen, device=CUDA)
    leaves = [t.requires_grad_() for t in (ctx, cand, hist, w, b, *tables)]

    def step():
        x, offs = encode_sequences(
            ctx,
            torch.cat([hist, cand]),
            hist_offsets,
            history_ts,
            query,
            *tables,
            math.sqrt(D),
            kernels="triton",
            dropout_p=0.2,
            seed=9,
            training=True,
            row_offset=HIGH_ROW,
        )
        n = swish_layer_norm(layer_norm(x, w, b, 1e-6, kernels="triton"), w, b, 1e-6, kernels="triton")
        y = output_block(n, x, w, b, 1e-6, 0.1, 7, True, kernels="triton", row_offset=HIGH_ROW)
        loss = take_last(y, offs, kernels="triton").float().sum()
        torch.autograd.grad(loss, leaves)

    run_without_syncs(step)


@pytest.mark.parametrize("distinct", [3_600, 200_000])
def test_gather_rows_at_full_size(distinct, gen):
    """A slice's distinct rows spread to its ~730k tokens (Zipf-skewed: one row takes over 100k
    tokens) and back: the segment-sum backward equals a float64 sum, the same bits on every call,
    and neither direction waits on the host."""
    p = 1.0 / torch.arange(1, distinct + 1, dtype=torch.float64) ** 1.2
    index = torch.multinomial(p, FULL_ROWS, replacement=True, generator=gen).to(device=CUDA, dtype=torch.int32)
    rows = randn((distinct, D), gen, torch.bfloat16, CUDA).requires_grad_()
    weight = randn((FULL_ROWS, D), gen, torch.bfloat16, CUDA)
    out = gather_rows(rows, index, kernels="triton")
    assert torch.equal(out, rows.detach()[index.long()])
    (grad,) = torch.autograd.grad(out, rows, weight)
    want = torch.zeros((distinct, D), dtype=torch.float64, device=CUDA).index_add_(0, index.long(), weight.double())
    torch.testing.assert_close(grad.double(), want, rtol=1e-2, atol=1e-2)
    assert torch.equal(torch.autograd.grad(gather_rows(rows, index, kernels="triton"), rows, weight)[0], grad)
    run_without_syncs(lambda: torch.autograd.grad(gather_rows(rows, index, kernels="triton"), rows, weight))
