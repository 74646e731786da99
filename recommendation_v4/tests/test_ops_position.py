"""Position/time encoding: the reference's indices against a per-token loop from SPEC §5.4, and
the Triton kernel (interpreted) against the reference in float64, elementwise (a wrong table row
for a single token must fail)."""

from __future__ import annotations

import math

import pytest
import torch

from dlrmv4.ops.position import position_time_encode
from dlrmv4.ops.reference.position import positions_and_buckets
from test_ops_layer_norm import gen, leaf64, poison, randn  # noqa: F401  (fixtures)

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
        ts[s:s + c] = query[i]  # contextual and candidate tokens carry the query time
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
@pytest.mark.parametrize("b,c,max_history,num_pos,d,seconds",
                         [(1, 8, 12, 64, 16, 60.0), (3, 2, 9, 6, 24, 60.0), (7, 0, 5, 3, 8, 0.7),
                          (13, 8, 3, 32, 40, 3600.0), (2, 8, 6, 32, 1024, 60.0)])
def test_kernel_matches_reference(dtype, b, c, max_history, num_pos, d, seconds, gen, poison):
    num_buckets = 2048  # the model's count: near its top, float32 rounding would move bucket edges
    _, seq_offsets, ts, query = make_batch(b, c, max_history, seconds, num_buckets, gen)
    n = int(seq_offsets[-1])
    # x as a column slice; table rows far apart, so that one wrong row index shows up elementwise.
    x = randn((n, d + 4), gen, dtype)[:, 2:2 + d].requires_grad_()
    pos_table = randn((num_pos, d), gen, scale=10.0).requires_grad_()
    time_table = randn((num_buckets, d), gen, scale=10.0).requires_grad_()
    scale = math.sqrt(d)
    out = position_time_encode(x, seq_offsets, ts, query, c, pos_table, time_table, scale, seconds,
                               kernels="triton")
    assert out.dtype == dtype and out.shape == (n, d)
    g = randn(out.shape, gen, dtype)
    out.backward(g)
    x64, p64, t64 = leaf64(x), leaf64(pos_table), leaf64(time_table)
    ref = position_time_encode(x64, seq_offsets, ts, query, c, p64, t64, scale, seconds, kernels="pytorch")
    ref.backward(g.double())
    tol = dict(atol=ATOL[dtype], rtol=ATOL[dtype])
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    assert pos_table.grad.dtype == torch.float32 and time_table.grad.dtype == torch.float32
    torch.testing.assert_close(pos_table.grad.double(), p64.grad, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(time_table.grad.double(), t64.grad, atol=1e-4, rtol=1e-5)


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
