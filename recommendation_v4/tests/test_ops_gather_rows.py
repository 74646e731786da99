"""Row gather and its segment-sum backward: the Triton kernels (interpreted) against the reference
(``index_add_`` in fp32) on skewed random indices, with segments longer than a chunk, rows no index
names, empty inputs and odd widths."""

from __future__ import annotations

import pytest
import torch
from test_ops_layer_norm import gen, poison, randn  # noqa: F401  (fixtures)

from dlrmv4.ops import gather_rows as gather_rows_module
from dlrmv4.ops.gather_rows import gather_rows, segment_sum
from dlrmv4.ops.reference import gather_rows as ref
from dlrmv4.ops.triton import gather_rows as tri


def skewed_index(m: int, num_rows: int, gen: torch.Generator, dtype=torch.int64) -> torch.Tensor:
    """Half the positions name row 1 (a segment over several chunks), the rest rows drawn at random
    (some rows named by no position when num_rows is large)."""
    index = torch.randint(0, num_rows, (m,), generator=gen)
    index[torch.randperm(m, generator=gen)[: m // 2]] = min(1, num_rows - 1)
    return index.to(dtype)


@pytest.mark.parametrize("chunk", [tri.CHUNK, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,num_rows,e", [(1, 1, 8), (7, 3, 24), (1100, 40, 33), (300, 500, 16), (64, 2, 600)])
def test_segment_sum_matches_index_add(chunk, dtype, m, num_rows, e, gen, poison, monkeypatch):
    monkeypatch.setattr(tri, "CHUNK", chunk)
    for index_dtype in (torch.int64, torch.int32):
        index = skewed_index(m, num_rows, gen, index_dtype)
        grad = randn((m, e), gen, dtype)
        got = tri.segment_sum(grad, index, num_rows)
        want = ref.segment_sum(grad, index, num_rows)
        assert got.dtype == dtype and got.shape == (num_rows, e)
        exact = torch.zeros((num_rows, e), dtype=torch.float64).index_add_(0, index.long(), grad.double())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.double(), exact, rtol=tol, atol=tol * 4)
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 4)
        assert torch.equal(tri.segment_sum(grad, index, num_rows), got)  # deterministic
        unnamed = torch.ones(num_rows, dtype=torch.bool)
        unnamed[index.long()] = False
        assert not got[unnamed].any()


def test_the_public_segment_sum_is_the_deterministic_kernel_on_a_gpu(gen, poison, monkeypatch):
    """``segment_sum`` (the plain backend's dense gradient exchange) takes the Triton kernel where
    ``auto`` picks Triton (a GPU, where ``index_add_`` adds with atomics in a changing order) and
    ``index_add_`` on the CPU, which adds in index order: the same bits on every run either way."""
    index, grad = skewed_index(900, 30, gen), randn((900, 40), gen)
    assert torch.equal(segment_sum(grad, index, 30), ref.segment_sum(grad, index, 30))
    monkeypatch.setattr(gather_rows_module, "resolve", lambda kernels, device: "triton")
    on_gpu = segment_sum(grad, index, 30)
    assert torch.equal(on_gpu, tri.segment_sum(grad, index, 30)) and torch.equal(on_gpu, segment_sum(grad, index, 30))


def test_segment_sum_of_nothing(gen, poison):
    assert torch.equal(tri.segment_sum(torch.zeros((0, 8)), torch.zeros(0, dtype=torch.int64), 5), torch.zeros(5, 8))
    assert tri.segment_sum(torch.zeros((3, 8)), torch.zeros(3, dtype=torch.int64), 0).shape == (0, 8)


def assert_row_sums(got: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> None:
    """got = the fp32 sums of ``weight``'s rows by ``index``, within fp32 summation's error, which
    grows with a row's sum of magnitudes (row 1 of ``skewed_index`` sums half the tokens)."""
    want = torch.zeros(got.shape, dtype=torch.float64).index_add_(0, index, weight.double())
    magnitude = torch.zeros(got.shape, dtype=torch.float64).index_add_(0, index, weight.double().abs())
    assert ((got.double() - want).abs() <= 1e-5 + 1e-5 * want.abs() + 1e-6 * magnitude).all()


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_gather_rows_forward_and_backward(kernels, gen, poison):
    rows = randn((30, 20), gen).requires_grad_()
    index = skewed_index(700, 30, gen)
    out = gather_rows(rows, index, kernels)
    assert torch.equal(out, rows.detach()[index])
    weight = randn((700, 20), gen)
    (out * weight).sum().backward()
    assert_row_sums(rows.grad, index, weight)
    # A column slice of the gradient (strided rows) gives the same sums.
    rows.grad = None
    wide = randn((700, 40), gen)
    (gather_rows(rows, index, kernels) * wide[:, 10:30]).sum().backward()
    assert_row_sums(rows.grad, index, wide[:, 10:30])


def test_gather_rows_checks_its_shapes():
    with pytest.raises(ValueError, match="gather_rows: rows must be"):
        gather_rows(torch.zeros(4), torch.zeros(2, dtype=torch.int64))
