"""Jagged sequence assembly against a loop of torch.cat written straight from the layout
[C contextual, L history, 1 candidate] per user: the reference's concatenation, and the Triton
encoding's reads of the parts (interpreted; with zero tables, unit scale and no dropout it is the
concatenation itself, bit for bit, and its backward the split)."""

from __future__ import annotations

import pytest
import torch
from test_ops_layer_norm import gen, poison, randn  # noqa: F401  (fixtures)

from dlrmv4.ops.jagged import concat_sequence_timestamps, concat_sequences, take_last
from dlrmv4.ops.position import encode_sequences


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)


def random_lengths(b: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Lengths 0, 1, max and odd ones, in random order (the first b of them)."""
    fixed = [0, 1, max_len, max_len | 1 if max_len > 2 else 1]
    rest = torch.randint(0, max_len + 1, (max(0, b - len(fixed)),), generator=gen).tolist()
    lengths = fixed + rest
    return [lengths[i] for i in torch.randperm(len(lengths), generator=gen)[:b].tolist()]


def loop_concat(ctx, hist, offsets, cand):
    parts = []
    for b in range(cand.shape[0]):
        parts += [ctx[b], hist[offsets[b] : offsets[b + 1]], cand[b : b + 1]]
    return torch.cat(parts)


def inputs(b, c, d, lengths, dtype, gen, contiguous=True):
    offsets = offsets_of(lengths)
    t = int(offsets[-1])
    if contiguous:
        ctx, hist, cand = randn((b, c, d), gen, dtype), randn((t, d), gen, dtype), randn((b, d), gen, dtype)
    else:  # a permuted contextual block, history and candidate as column slices
        ctx = randn((c, b, d), gen, dtype).transpose(0, 1)
        hist = randn((t, d + 5), gen, dtype)[:, 3 : 3 + d]
        cand = randn((b, 2 * d), gen, dtype)[:, d:]
    return ctx.requires_grad_(), hist.requires_grad_(), cand.requires_grad_(), offsets


def grads(tensors):
    out = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    return out


def identity_encoding(ctx, tokens, offsets, kernels):
    """encode_sequences with zero tables, unit scale and no dropout: the concatenation itself."""
    b, d = ctx.shape[0], tokens.shape[-1]
    t = tokens.shape[0] - b
    stamps = torch.zeros(t, dtype=torch.int64)
    tables = torch.zeros(8, d), torch.zeros(4, d)
    return encode_sequences(
        ctx, tokens, offsets, stamps, torch.zeros(b, dtype=torch.int64), *tables, 1.0, kernels=kernels
    )


@pytest.mark.parametrize("form", ["concat_sequences", "encode_sequences triton", "encode_sequences pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,c,d,max_len", [(1, 8, 16, 5), (4, 3, 24, 9), (7, 0, 8, 33), (6, 2, 40, 1), (3, 2, 1100, 4)])
def test_concat_matches_loop(form, dtype, b, c, d, max_len, gen, poison):
    lengths = random_lengths(b, max_len, gen)
    for contiguous in (True, False):
        ctx, hist, cand, offsets = inputs(b, c, d, lengths, dtype, gen, contiguous)
        tokens = torch.cat([hist, cand])
        if form == "concat_sequences":
            values, seq_offsets = concat_sequences(ctx, tokens, offsets)
        else:
            values, seq_offsets = identity_encoding(ctx, tokens, offsets, form.split()[1])
        expect = loop_concat(ctx, hist, offsets, cand)
        assert values.dtype == dtype and torch.equal(values, expect)  # a copy: bit-exact
        assert seq_offsets.dtype == torch.int64
        assert torch.equal(seq_offsets, offsets_of([n + c + 1 for n in lengths]))
        g = randn(values.shape, gen, dtype)
        values.backward(g)
        got = grads((ctx, hist, cand))
        expect.backward(g)
        for name, a, e in zip(("dcontextual", "dhistory", "dcandidate"), got, grads((ctx, hist, cand))):
            assert torch.equal(a, e), name


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
@pytest.mark.parametrize("b,d", [(1, 8), (5, 24), (70, 16)])
def test_take_last(kernels, b, d, gen, poison):
    lengths = torch.randint(1, 7, (b,), generator=gen).tolist()
    offsets = offsets_of(lengths)
    values = randn((int(offsets[-1]), d + 3), gen)[:, :d].requires_grad_()
    last = take_last(values, offsets, kernels=kernels)
    assert torch.equal(last, values[offsets[1:] - 1])
    g = randn(last.shape, gen)
    last.backward(g)
    expect = torch.zeros(values.shape)
    expect[offsets[1:] - 1] = g
    assert torch.equal(values.grad, expect)


@pytest.mark.parametrize("c", [0, 1, 8])
def test_timestamps_follow_the_concat_layout(c, gen):
    lengths = random_lengths(5, 6, gen)
    offsets = offsets_of(lengths)
    hist = torch.randint(0, 10**9, (int(offsets[-1]),), generator=gen)
    query = torch.randint(10**9, 2 * 10**9, (5,), generator=gen)
    out = concat_sequence_timestamps(hist, offsets, query, c)
    # Contextual rows carry 0 (the reference's: their time bucket is sqrt(query time / unit)).
    zeros = torch.zeros(c, dtype=torch.int64)
    expect = torch.cat([torch.cat([zeros, hist[offsets[b] : offsets[b + 1]], query[b : b + 1]]) for b in range(5)])
    assert out.dtype == torch.int64 and torch.equal(out, expect)


@pytest.mark.parametrize("op", [concat_sequences, identity_encoding])
def test_bad_inputs_are_reported(op, gen):
    ctx, hist, cand, offsets = inputs(2, 1, 8, [1, 2], torch.float32, gen)
    tokens = torch.cat([hist, cand])
    args = () if op is concat_sequences else ("triton",)
    with pytest.raises(ValueError, match="int64"):
        op(ctx, tokens, offsets.int(), *args)
    with pytest.raises(ValueError, match="candidate rows"):
        op(ctx, tokens[:, 1:], offsets, *args)
    with pytest.raises(ValueError, match=r"\[B, C, D\]"):
        op(ctx[0], tokens, offsets, *args)
    if op is identity_encoding:
        with pytest.raises(ValueError, match="one dtype"):
            op(ctx.double(), tokens, offsets, *args)
