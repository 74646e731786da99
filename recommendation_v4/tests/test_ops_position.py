"""Position/time encoding: the reference's indices against a per-token loop of its rules (docs/model.md), and
the Triton kernel (interpreted) against the reference in float64, elementwise (a wrong table row
for a single token must fail). The fused input dropout: the reference's mask
(``input_dropout_keep_mask``) is the kernel's in the forward and the backward, a chunk of sequences
run with its first row as ``row_offset`` is that chunk of the whole run, and the decisions keep
1 − p of the elements, independently. The model's form, ``encode_sequences`` (the parts in, no
concatenated copy), against the reference's concatenation then encoding."""

from __future__ import annotations

import functools
import math
import secrets

import pytest
import torch
from test_ops_layer_norm import gen, leaf64, poison, randn  # noqa: F401  (fixtures)

from dlrmv4.ops.position import encode_sequences, input_dropout_keep_mask, position_time_encode
from dlrmv4.ops.reference import position as ref_position
from dlrmv4.ops.reference.position import positions_and_buckets

ATOL = {torch.float32: 1e-5, torch.float16: 5e-3}


def loop_indices(lengths, timestamps, query_time, c, num_pos, num_buckets, bucket_seconds):
    pos, bucket, i = [], [], 0
    for b, n in enumerate(lengths):
        history = n - c - 1
        for p in range(n):
            if p < c:
                k = p
            elif p == n - 1:
                k = c
            else:
                k = c + (history - (p - c))
            pos.append(min(k, num_pos - 1))
            dt = max(float(query_time[b] - timestamps[i]), 1e-6)
            bucket.append(min(int(math.sqrt(dt / bucket_seconds)), num_buckets - 1))
            i += 1
    return torch.tensor(pos), torch.tensor(bucket)


def make_batch(b, c, max_history, bucket_seconds, num_buckets, gen):
    """Sequences of C + L + 1 tokens; time differences on and next to bucket edges, zero, negative
    (a token after the query) and past the last bucket."""
    lengths = [c + 1 + int(x) for x in torch.randint(0, max_history + 1, (b,), generator=gen)]
    lengths[0] = c + 1 + max_history
    if b > 1:
        lengths[-1] = c + 1  # an empty history
    seq_offsets = torch.tensor([0] + lengths).cumsum(0)
    n = int(seq_offsets[-1])
    query = torch.randint(10**9, 2 * 10**9, (b,), generator=gen)
    k = torch.randint(0, num_buckets + 3, (n,), generator=gen)
    edge = (k * k * bucket_seconds).round().long() + torch.randint(-1, 2, (n,), generator=gen)
    anywhere = torch.randint(-100, int(bucket_seconds * (num_buckets + 2) ** 2), (n,), generator=gen)
    dt = torch.where(torch.rand(n, generator=gen) < 0.5, edge, anywhere)
    dt[c] = int(bucket_seconds * (num_buckets + 5) ** 2)  # past the last bucket
    if max_history > 1:
        dt[c + 1] = -5  # a token after the query time
    ts = query.repeat_interleave(torch.tensor(lengths)) - dt
    for i, (s, e) in enumerate(zip(seq_offsets[:-1].tolist(), seq_offsets[1:].tolist())):
        ts[s : s + c] = query[i]  # contextual and candidate tokens carry the query time
        ts[e - 1] = query[i]
    return lengths, seq_offsets, ts, query


@pytest.mark.parametrize("b,c,max_history,num_pos", [(1, 8, 12, 64), (3, 2, 9, 6), (7, 0, 5, 3), (16, 8, 1, 32)])
def test_reference_indices_match_the_loop(b, c, max_history, num_pos, gen):
    lengths, seq_offsets, ts, query = make_batch(b, c, max_history, 60.0, 20, gen)
    pos, bucket = positions_and_buckets(seq_offsets, ts, query, c, num_pos, 20, 60.0)
    want_pos, want_bucket = loop_indices(lengths, ts, query, c, num_pos, 20, 60.0)
    assert torch.equal(pos, want_pos)
    assert torch.equal(bucket, want_bucket)
    assert bucket.min() == 0 and bucket.max() == 19  # the clamps were exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "b,c,max_history,num_pos,d,seconds",
    [
        (1, 8, 12, 64, 16, 60.0),
        (3, 2, 9, 6, 24, 60.0),
        (7, 0, 5, 3, 8, 0.7),
        (13, 8, 3, 32, 40, 3600.0),
        (2, 8, 6, 32, 1024, 60.0),
        (3, 1, 4, 8, 1100, 60.0),
    ],
)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_kernel_matches_reference(dtype, b, c, max_history, num_pos, d, seconds, p, gen, poison):
    """Each draws its own dropout mask (p > 0): the same mask, so the same values and gradients."""
    num_buckets = 2048  # the model's count: near its top, float32 rounding would move bucket edges
    _, seq_offsets, ts, query = make_batch(b, c, max_history, seconds, num_buckets, gen)
    n = int(seq_offsets[-1])
    # x as a column slice; table rows far apart, so that one wrong row index shows up elementwise.
    x = randn((n, d + 4), gen, dtype)[:, 2 : 2 + d].requires_grad_()
    pos_table = randn((num_pos, d), gen, scale=10.0).requires_grad_()
    time_table = randn((num_buckets, d), gen, scale=10.0).requires_grad_()
    scale = math.sqrt(d)
    drop = dict(dropout_p=p, seed=secrets.randbits(63), training=True, row_offset=secrets.randbits(34))
    out = position_time_encode(
        x, seq_offsets, ts, query, c, pos_table, time_table, scale, seconds, kernels="triton", **drop
    )
    assert out.dtype == dtype and out.shape == (n, d)
    g = randn(out.shape, gen, dtype)
    out.backward(g)
    x64, p64, t64 = leaf64(x), leaf64(pos_table), leaf64(time_table)
    ref = position_time_encode(x64, seq_offsets, ts, query, c, p64, t64, scale, seconds, kernels="pytorch", **drop)
    assert torch.equal(out != 0, ref != 0)
    ref.backward(g.double())
    tol = dict(atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    assert pos_table.grad.dtype == torch.float32 and time_table.grad.dtype == torch.float32
    torch.testing.assert_close(pos_table.grad.double(), p64.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(time_table.grad.double(), t64.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,max_history,d", [(1, 8, 12, 16), (5, 2, 9, 24), (7, 0, 5, 8), (3, 8, 4, 1100)])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_encode_sequences_matches_reference(dtype, b, c, max_history, d, p, gen, poison):
    """The kernel reading the contextual rows and the tokens where they lie, against the
    reference's concatenation then encoding in float64: values, both parts' gradients and the
    tables', elementwise; the same dropout zeros."""
    lengths = [int(n) for n in torch.randint(0, max_history + 1, (b,), generator=gen)]
    lengths[0] = max_history
    history_offsets = torch.tensor([0] + lengths).cumsum(0)
    t = int(history_offsets[-1])
    query = torch.randint(10**9, 2 * 10**9, (b,), generator=gen)
    ago = torch.randint(-100, 60 * 2100**2, (t,), generator=gen)  # past the last bucket too
    history_ts = query.repeat_interleave(torch.tensor(lengths)) - ago
    # Parts with row strides of their own: the contextual block permuted, the tokens a column slice.
    ctx = randn((c, b, d), gen, dtype).transpose(0, 1).requires_grad_()
    tokens = randn((t + b, d + 3), gen, dtype)[:, 1 : 1 + d].requires_grad_()
    tables = [randn((64, d), gen, scale=10.0).requires_grad_(), randn((2048, d), gen, scale=10.0).requires_grad_()]
    drop = dict(dropout_p=p, seed=secrets.randbits(63), training=True, row_offset=secrets.randbits(34))
    args = (history_offsets, history_ts, query)
    out, seq_offsets = encode_sequences(ctx, tokens, *args, *tables, math.sqrt(d), kernels="triton", **drop)
    assert out.dtype == dtype and out.shape == (t + b * (c + 1), d)
    g = randn(out.shape, gen, dtype)
    got = torch.autograd.grad(out, (ctx, tokens, *tables), g)
    leaves = [leaf64(x) for x in (ctx, tokens, *tables)]
    ref, ref_offsets = encode_sequences(
        leaves[0], leaves[1], *args, *leaves[2:], math.sqrt(d), kernels="pytorch", **drop
    )
    want = torch.autograd.grad(ref, leaves, g.double())
    assert torch.equal(seq_offsets, ref_offsets)
    assert torch.equal(out != 0, ref != 0)
    tol = dict(atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    for name, a, e in zip(("dcontextual", "dtokens"), got, want):
        torch.testing.assert_close(a.double(), e, **tol, msg=name)
    for name, a, e in zip(("dpos_table", "dtime_table"), got[2:], want[2:]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), e, atol=1e-4, rtol=1e-5, msg=name)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_deterministic_backward_matches_reference(p, gen, poison, deterministic_algorithms):
    """Under deterministic algorithms the tables' gradients are summed by torch in a fixed order
    instead of with atomics: the same values."""
    test_kernel_matches_reference(torch.float32, 13, 8, 3, 32, 40, 3600.0, p, gen, poison)
    test_encode_sequences_matches_reference(torch.float32, 5, 2, 9, 24, p, gen, poison)


def test_bad_inputs_are_reported(gen):
    _, seq_offsets, ts, query = make_batch(2, 1, 3, 60.0, 8, gen)
    x = randn((int(seq_offsets[-1]), 8), gen)
    table = randn((8, 8), gen)
    with pytest.raises(ValueError, match="columns"):
        position_time_encode(x, seq_offsets, ts, query, 1, table[:, :4], table, 1.0)
    with pytest.raises(ValueError, match="timestamps"):
        position_time_encode(x, seq_offsets, ts[1:], query, 1, table, table, 1.0)
    with pytest.raises(ValueError, match="positive"):
        position_time_encode(x, seq_offsets, ts, query, 1, table, table, 1.0, 0.0)
    for bad, match in (
        ({"dropout_p": 1.0}, "dropout_p"),
        ({"dropout_p": -0.5}, "dropout_p"),
        ({"row_offset": -1}, "row_offset"),
        ({"seed": -3}, "seed"),
        ({"seed": 0.5}, "seed"),
    ):
        with pytest.raises(ValueError, match=f"position_time_encode: {match}"):
            position_time_encode(x, seq_offsets, ts, query, 1, table, table, 1.0, training=True, **bad)
        with pytest.raises(ValueError, match=f"input_dropout_keep_mask: {match}"):
            input_dropout_keep_mask(4, 8, **{"dropout_p": 0.1, "seed": 0, "row_offset": 0, **bad}, device="cpu")


def unit_batch(n: int, d: int):
    """Inputs whose encoding is 1 everywhere (x = 1, zero tables): the output is the scaled mask."""
    seq_offsets = torch.tensor([0, n // 3, n])
    return (
        torch.ones(n, d).requires_grad_(),
        seq_offsets,
        torch.zeros(n, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(n, d).requires_grad_(),
        torch.zeros(4, d).requires_grad_(),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,d", [(1, 8), (37, 20), (29, 40), (11, 64), (5, 1030)])
def test_reference_mask_is_the_kernels(dtype, n, d, poison):
    """On inputs that encode to 1 the kernel's output and x gradient (of a gradient of ones) are the
    scaled mask, for seeds and row offsets past 2^32: both equal the reference's mask."""
    p = 0.3
    for seed, row_offset in (
        (secrets.randbits(31), 0),
        (2**32 + secrets.randbits(31), secrets.randbits(34)),
        (secrets.randbits(63), secrets.randbits(40)),
    ):
        x, offs, ts, query, pt, tt = unit_batch(n, d)
        x = x.detach().to(dtype).requires_grad_()
        out = position_time_encode(
            x,
            offs,
            ts,
            query,
            1,
            pt,
            tt,
            1.0,
            kernels="triton",
            dropout_p=p,
            seed=seed,
            training=True,
            row_offset=row_offset,
        )
        dx, dpt = torch.autograd.grad(out, (x, pt), torch.ones_like(out))
        keep = input_dropout_keep_mask(n, d, p, seed, "cpu", row_offset)
        assert keep.shape == (n, d) and keep.dtype == torch.bool
        want = (keep / (1 - p)).to(dtype)
        assert torch.equal(out, want) and torch.equal(dx, want), f"seed {seed}, row offset {row_offset}"
        # The table gradients are the masked, scaled gradient too: summed over the table's rows,
        # each column gets the sum of its column of the scaled mask.
        torch.testing.assert_close(dpt.sum(0), keep.sum(0) / (1 - p))


def chunked(kernels, x, seq_offsets, ts, query, c, tables, g, drop, cuts):
    """(out, dx, dpos_table, dtime_table) of the sequences cut at ``cuts``, each chunk alone with
    row_offset = its first row, put together."""
    outs, dxs, dpt, dtt = [], [], 0, 0
    for i, j in zip(cuts[:-1], cuts[1:]):
        a, e = int(seq_offsets[i]), int(seq_offsets[j])
        leaves = [x[a:e].detach().clone().requires_grad_(), *(t.detach().clone().requires_grad_() for t in tables)]
        out = position_time_encode(
            leaves[0],
            seq_offsets[i : j + 1] - a,
            ts[a:e],
            query[i:j],
            c,
            *leaves[1:],
            2.0,
            kernels=kernels,
            **{**drop, "row_offset": drop["row_offset"] + a},
        )
        grads = torch.autograd.grad(out, leaves, g[a:e])
        outs.append(out)
        dxs.append(grads[0])
        dpt, dtt = dpt + grads[1], dtt + grads[2]
    return torch.cat(outs), torch.cat(dxs), dpt, dtt


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_a_chunk_of_sequences_with_its_row_offset_is_that_chunk_of_the_whole(kernels, gen, poison):
    """Sequences [i, j) run alone with row_offset = their first row give those rows of the whole
    run with dropout: the same zeros, the same values and x gradients (bit for bit from the kernel,
    to rounding from the float64 reference), and table gradients that add up."""
    dtype = torch.float32 if kernels == "triton" else torch.float64
    _, seq_offsets, ts, query = make_batch(7, 2, 9, 60.0, 16, gen)
    n, d = int(seq_offsets[-1]), 24
    x = randn((n, d), gen, dtype).requires_grad_()
    tables = [randn((12, d), gen, dtype).requires_grad_(), randn((16, d), gen, dtype).requires_grad_()]
    g = randn((n, d), gen, dtype)
    drop = dict(dropout_p=0.25, seed=secrets.randbits(31), training=True, row_offset=secrets.randbits(20))
    out = position_time_encode(x, seq_offsets, ts, query, 2, *tables, 2.0, kernels=kernels, **drop)
    whole = (out, *torch.autograd.grad(out, (x, *tables), g))
    cuts = [0, *sorted(torch.randint(0, 8, (2,), generator=gen).tolist()), 7]
    got = chunked(kernels, x, seq_offsets, ts, query, 2, tables, g, drop, cuts)
    same = torch.equal if kernels == "triton" else functools.partial(torch.allclose, rtol=1e-13, atol=1e-13)
    assert torch.equal(got[0] != 0, whole[0] != 0)
    assert (got[0] == 0).float().mean().item() > 0.1
    for name, a, e in zip(("out", "dx"), got, whole):
        assert same(a, e), name
    for name, a, e in zip(("dpos_table", "dtime_table"), got[2:], whole[2:]):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=name)


def test_input_dropout_mask_statistics():
    """Keep rate 1 − p overall and at each of the 8 columns of a Philox group; independent decisions
    in neighbouring columns (two halves of one number, and two numbers), groups and rows; a range of
    rows is that range of the whole; another seed or row range gives unrelated decisions."""
    n, d, p, seed = 2000, 64, 0.3, secrets.randbits(63)
    m = input_dropout_keep_mask(n, d, p, seed, "cpu")
    f = m.float()
    assert abs(f.mean().item() - (1 - p)) < 5 * (p * (1 - p) / m.numel()) ** 0.5
    per_col = f.view(n, d // 8, 8).mean((0, 1))
    assert (per_col - (1 - p)).abs().max().item() < 5 * (p * (1 - p) / (m.numel() / 8)) ** 0.5
    both = (1 - p) ** 2
    for a, b in (
        (f[:, 0::2], f[:, 1::2]),
        (f[:, 0::8], f[:, 2::8]),
        (f[:, 1::8], f[:, 7::8]),
        (f[:, :-8], f[:, 8:]),
        (f[:-1], f[1:]),
    ):
        assert abs((a * b).mean().item() - both) < 5 * (both * (1 - both) / a.numel()) ** 0.5
    assert torch.equal(input_dropout_keep_mask(200, d, p, seed, "cpu", row_offset=150), m[150:350])
    agree = p * p + (1 - p) ** 2
    for other in (input_dropout_keep_mask(n, d, p, seed + 1, "cpu"), input_dropout_keep_mask(n, d, p, seed, "cpu", n)):
        assert abs((other == m).float().mean().item() - agree) < 5 * (agree * (1 - agree) / m.numel()) ** 0.5


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
@pytest.mark.parametrize("p,training", [(0.0, True), (0.5, False)])
def test_no_dropout_draws_nothing(kernels, p, training, monkeypatch, gen):
    """Without training or at p = 0 the op is the plain encoding and draws no random numbers."""
    monkeypatch.setattr(ref_position, "keep_decisions", lambda *a: pytest.fail("drew a mask"))
    x, offs, ts, query, pt, tt = unit_batch(9, 16)
    out = position_time_encode(
        x, offs, ts, query, 1, pt, tt, 1.0, kernels=kernels, dropout_p=p, seed=5, training=training, row_offset=3
    )
    assert torch.equal(out, torch.ones(9, 16))


def test_reference_backward_is_the_same_bits_on_several_threads(gen):
    """The tables' gradients of the PyTorch path are summed in a fixed order: with several CPU
    threads, backwards of one input give the same bits every time (indexing's backward added the
    rows with atomics across threads, so the embedded default's CPU run changed with the thread
    schedule)."""
    b, c, max_history, bucket_seconds, num_buckets, d = 64, 2, 400, 60.0, 64, 32
    lengths, seq_offsets, ts, query = make_batch(b, c, max_history, bucket_seconds, num_buckets, gen)
    x = randn((int(seq_offsets[-1]), d), gen)
    dout = randn(x.shape, gen)
    pos_table, time_table = randn((max_history + c + 1, d), gen), randn((num_buckets, d), gen)

    def grads() -> tuple[torch.Tensor, torch.Tensor]:
        p, t = pos_table.clone().requires_grad_(), time_table.clone().requires_grad_()
        out = position_time_encode(x, seq_offsets, ts, query, c, p, t, 1.5, bucket_seconds, kernels="pytorch")
        out.backward(dout)
        return p.grad, t.grad

    threads = torch.get_num_threads()
    torch.set_num_threads(max(4, threads))
    try:
        first = grads()
        for _ in range(8):
            for got, want in zip(grads(), first):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)
