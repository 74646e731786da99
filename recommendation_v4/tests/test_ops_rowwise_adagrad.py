"""The sparse row-wise Adagrad update: the Triton kernel (interpreted on the CPU) against the
PyTorch reference and against the update written out densely in float64."""

from __future__ import annotations

import pytest
import torch
from test_ops_layer_norm import gen  # noqa: F401  (fixture)

from dlrmv4.ops.rowwise_adagrad import rowwise_adagrad_

EPS = 1e-8


def dense_update(weight, momentum, ids, values, lr, eps):
    """FBGEMM's update in float64 from the dense per-row gradient sum (the definition)."""
    w, m = weight.double(), momentum.double()
    g = torch.zeros_like(w).index_add_(0, ids, values.double())
    touched = torch.zeros(w.shape[0], dtype=torch.bool).index_fill_(0, ids, True)
    m = torch.where(touched, m + (g * g).sum(1) / w.shape[1], m)
    mult = torch.where(touched, lr / (m.sqrt() + eps), 0.0)
    return w - mult[:, None] * g, m


def case(gen, rows, n, dim, hot, dtype=torch.float32, stride_pad=0):
    """ids with a few hot rows repeated many times (runs longer than the kernel's block), the rest
    uniform; values possibly 16-bit and with a row stride wider than the row."""
    ids = torch.randint(0, rows, (n,), generator=gen)
    ids[torch.randperm(n, generator=gen)[:hot]] = torch.randint(0, 3, (hot,), generator=gen)
    wide = torch.randn(n, dim + stride_pad, generator=gen).to(dtype)
    weight = torch.randn(rows, dim, generator=gen)
    momentum = torch.rand(rows, generator=gen)
    return weight, momentum, ids, wide[:, :dim]


@pytest.mark.parametrize("rows,n,dim,hot", [(50, 1, 16, 0), (50, 200, 24, 60), (7, 300, 32, 100), (1000, 64, 8, 0)])
def test_kernel_matches_reference_and_definition(gen, rows, n, dim, hot):
    weight, momentum, ids, values = case(gen, rows, n, dim, hot, stride_pad=5)
    lr = torch.tensor(0.05)
    want_w, want_m = dense_update(weight, momentum, ids, values, 0.05, EPS)
    out = {}
    for kernels in ("triton", "pytorch"):
        w, m = weight.clone(), momentum.clone()
        rowwise_adagrad_(w, m, ids, values, lr, EPS, kernels=kernels)
        out[kernels] = (w, m)
        torch.testing.assert_close(m.double(), want_m, rtol=1e-6, atol=1e-7, msg=f"{kernels} momentum")
        torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-6, msg=f"{kernels} weight")
    untouched = torch.ones(rows, dtype=torch.bool).index_fill_(0, ids, False)
    for kernels, (w, m) in out.items():  # rows not in the batch keep their exact bits
        assert torch.equal(w[untouched], weight[untouched]) and torch.equal(m[untouched], momentum[untouched]), kernels


def test_kernel_takes_bf16_rows_and_is_deterministic(gen):
    weight, momentum, ids, values = case(gen, 20, 500, 16, 300, dtype=torch.bfloat16)
    lr = torch.tensor(0.1)
    runs = []
    for _ in range(2):
        w, m = weight.clone(), momentum.clone()
        rowwise_adagrad_(w, m, ids, values, lr, EPS, kernels="triton")
        runs.append((w, m))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    want_w, want_m = dense_update(weight, momentum, ids, values.float(), 0.1, EPS)
    torch.testing.assert_close(runs[0][0].double(), want_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(runs[0][1].double(), want_m, rtol=1e-6, atol=1e-7)


def test_zero_eps_leaves_row_zero_alone(gen):
    """Row 0 untouched, zero state, eps 0: a padded slot must not turn it into 0 * inf = NaN."""
    weight, momentum = torch.randn(10, 8, generator=gen), torch.zeros(10)
    ids = torch.tensor([3, 3, 5, 9, 9, 9])
    for kernels in ("triton", "pytorch"):
        w, m = weight.clone(), momentum.clone()
        rowwise_adagrad_(w, m, ids, torch.randn(6, 8, generator=gen), torch.tensor(0.1), 0.0, kernels=kernels)
        assert torch.equal(w[0], weight[0]) and m[0] == 0, kernels
        assert torch.isfinite(w).all(), kernels


def test_empty_batch_and_bad_shapes():
    w, m = torch.ones(4, 8), torch.zeros(4)
    rowwise_adagrad_(w, m, torch.zeros(0, dtype=torch.int64), torch.zeros(0, 8), torch.tensor(0.1), EPS)
    assert torch.equal(w, torch.ones(4, 8))
    with pytest.raises(ValueError, match="values"):
        rowwise_adagrad_(w, m, torch.zeros(3, dtype=torch.int64), torch.zeros(3, 7), torch.tensor(0.1), EPS)
    with pytest.raises(ValueError, match="momentum"):
        rowwise_adagrad_(
            w, torch.zeros(5), torch.zeros(3, dtype=torch.int64), torch.zeros(3, 8), torch.tensor(0.1), EPS
        )


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_gradient_rows_in_pieces(gen, kernels):
    """The rows may come as pieces (a bf16 sequence part and an fp32 candidate part, or more, as
    several backwards leave them): the update is that of their concatenation."""
    weight, momentum, ids, _ = case(gen, 40, 260, 16, 80)
    pieces = [torch.randn(200, 16, generator=gen).to(torch.bfloat16), torch.randn(60, 16, generator=gen)]
    want_w, want_m = dense_update(weight, momentum, ids, torch.cat([p.float() for p in pieces]), 0.05, EPS)
    for split in (pieces, [pieces[0][:90], pieces[0][90:], pieces[1]]):
        w, m = weight.clone(), momentum.clone()
        rowwise_adagrad_(w, m, ids, split, torch.tensor(0.05), EPS, kernels=kernels)
        torch.testing.assert_close(m.double(), want_m, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="pieces"):
        rowwise_adagrad_(weight, momentum, ids, [pieces[0]], torch.tensor(0.05), EPS, kernels=kernels)


@pytest.mark.parametrize("chunk,block_j", [(4, 1), (8, 4), (16, 8)])
def test_runs_longer_than_a_chunk(gen, chunk, block_j):
    """A row owning most of the batch (popular items) is summed chunk by chunk, then updated once;
    runs starting on a chunk boundary, ending on one, and shorter than one all meet the definition."""
    from dlrmv4.ops.triton import rowwise_adagrad as tri

    weight, momentum, ids, values = case(gen, 12, 301, 8, 220, stride_pad=3)
    want_w, want_m = dense_update(weight, momentum, ids, values, 0.05, EPS)
    w, m = weight.clone(), momentum.clone()
    tri.rowwise_adagrad_(w, m, ids, [values], torch.tensor(0.05), EPS, block_j=block_j, chunk=chunk)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.double(), want_w, rtol=1e-6, atol=1e-6)
