"""The fused STU output block: Triton kernel (interpreted) against the reference in float64,
with dropout compared through the kernel's own mask (``output_block_keep_mask``)."""

from __future__ import annotations

import secrets

import pytest
import torch

from dlrmv4.ops.output_block import output_block, output_block_keep_mask
from test_ops_layer_norm import assert_close, gen, leaf64, poison, randn  # noqa: F401  (fixtures)

EPS = 1e-6


def make_inputs(t: int, hd: int, dtype: torch.dtype, gen: torch.Generator):
    """u and attn as column slices of one wide tensor, as the model's split of uvqk gives them."""
    wide = randn((t, 4 * hd), gen, dtype, scale=1.5).requires_grad_()
    attn = randn((t, hd), gen, dtype, scale=2.0, shift=0.3).requires_grad_()
    w = randn(hd, gen, scale=0.3, shift=1.0).requires_grad_()
    b = randn(hd, gen, scale=0.3).requires_grad_()
    return wide, wide[:, hd:2 * hd], attn, w, b


def run_both(t, hd, dtype, p, seed, training, gen):
    """Kernel and float64 reference (with the kernel's mask), forward and backward; returns both sides."""
    wide, u, attn, w, b = make_inputs(t, hd, dtype, gen)
    y = output_block(u, attn, w, b, EPS, p, seed, training, kernels="triton")
    dy = randn(y.shape, gen, dtype)
    y.backward(dy)
    mask = output_block_keep_mask(t, hd, p, seed, "cpu")
    u64, a64, w64, b64 = leaf64(u), leaf64(attn), leaf64(w), leaf64(b)
    ref = output_block(u64, a64, w64, b64, EPS, p, seed, training, kernels="pytorch", keep_mask=mask)
    ref.backward(dy.double())
    kernel = (y, wide.grad[:, hd:2 * hd], attn.grad, w.grad, b.grad, wide.grad)
    return kernel, (ref, u64.grad, a64.grad, w64.grad, b64.grad), mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,hd", [(0, 16), (1, 32), (17, 40), (64, 64)])
@pytest.mark.parametrize("p,training", [(0.0, True), (0.25, True), (0.25, False)])
def test_matches_reference(dtype, t, hd, p, training, gen, poison):
    (y, du, da, dw, db, dwide), ref, _ = run_both(t, hd, dtype, p, secrets.randbits(31), training, gen)
    assert y.shape == (t, 3 * hd) and y.dtype == dtype
    for name, out, r in zip(("y", "du", "dattn"), (y, du, da), ref[:3]):
        assert_close(out, r, dtype, name)
    assert_close(dw, ref[3], torch.float32, "dweight")
    assert_close(db, ref[4], torch.float32, "dbias")
    # The rest of the wide tensor gets no gradient: the slice's backward wrote only its columns.
    assert not dwide[:, :hd].any() and not dwide[:, 2 * hd:].any()


def test_no_affine(gen, poison):
    u = randn((9, 24), gen).requires_grad_()
    a = randn((9, 24), gen).requires_grad_()
    y = output_block(u, a, None, None, EPS, 0.0, 0, True, kernels="triton")
    y.backward(torch.ones_like(y))
    u64, a64 = leaf64(u), leaf64(a)
    ref = output_block(u64, a64, None, None, EPS, 0.0, 0, True, kernels="pytorch")
    ref.backward(torch.ones_like(ref))
    for name, out, r in (("y", y, ref), ("du", u.grad, u64.grad), ("da", a.grad, a64.grad)):
        assert_close(out, r, torch.float32, name)


def test_dropout_mask_is_a_function_of_the_seed(gen, poison):
    t, hd, p = 96, 64, 0.3
    seed = secrets.randbits(31)
    _, u, attn, w, b = make_inputs(t, hd, torch.float32, gen)
    y1 = output_block(u, attn, w, b, EPS, p, seed, True, kernels="triton")
    y2 = output_block(u, attn, w, b, EPS, p, seed, True, kernels="triton")
    y3 = output_block(u, attn, w, b, EPS, p, seed + 1, True, kernels="triton")
    assert torch.equal(y1, y2)
    assert not torch.equal(y1 != 0, y3 != 0)
    m1 = output_block_keep_mask(t, hd, p, seed, "cpu")
    assert m1.dtype == torch.bool and m1.view(torch.uint8).max() <= 1  # every element written
    assert torch.equal(m1, output_block_keep_mask(t, hd, p, seed, "cpu"))
    n = m1.numel()
    # Keep fraction within 5 standard deviations of 1 − p, in each of the three segments too.
    assert abs(m1.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    for seg in m1.view(t, 3, hd).unbind(1):
        assert abs(seg.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / (n / 3)) ** 0.5
    # The three segments draw independent decisions.
    s = m1.view(t, 3, hd).float()
    assert abs((s[:, 0] * s[:, 1]).mean().item() - (1 - p) ** 2) < 0.05
    assert torch.equal(y1 != 0, m1 & (y1 != 0))  # zeros exactly where dropped (inputs are never 0)
    assert (y1 != 0).sum() == m1.sum()


def test_reference_dropout_without_mask_scales_kept_values(gen):
    u, a = randn((50, 16), gen), randn((50, 16), gen)
    y = output_block(u, a, None, None, EPS, 0.5, 0, True, kernels="pytorch")
    full = output_block(u, a, None, None, EPS, 0.5, 0, False, kernels="pytorch")
    kept = y != 0
    assert 0.3 < kept.float().mean().item() < 0.7
    torch.testing.assert_close(y[kept], 2 * full[kept])


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="same"):
        output_block(torch.zeros(4, 8), torch.zeros(4, 9), None, None, EPS, 0.0, 0, False)
    with pytest.raises(ValueError, match="weight"):
        output_block(torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(9), None, EPS, 0.0, 0, False)
