"""The fused STU output block, Dropout([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)]) from u before
its SiLU: Triton kernel (interpreted) against the reference in float64, and both against the
formula spelled out, with dropout compared through the kernel's own mask (``output_block_keep_mask``)."""

from __future__ import annotations

import secrets

import pytest
import torch

from dlrmv4.ops.output_block import output_block, output_block_keep_mask
from test_ops_layer_norm import assert_close, gen, leaf64, poison, randn  # noqa: F401  (fixtures)

EPS = 1e-6


def make_inputs(t: int, hd: int, dtype: torch.dtype, gen: torch.Generator):
    """u and attn as column slices of one wide tensor, as the model's split of uvqk gives them; u
    wide enough to reach both saturated ends of the SiLU."""
    wide = randn((t, 4 * hd), gen, dtype, scale=3.0).requires_grad_()
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


def spelled_out(u, attn, w, b, keep, p):
    """The block written out in float64 from u before its SiLU (no reference module involved)."""
    su = u * torch.sigmoid(u)
    mu = attn.mean(1, keepdim=True)
    ln = (attn - mu) / torch.sqrt(((attn - mu) ** 2).mean(1, keepdim=True) + EPS) * w + b
    return torch.cat([su, attn, su * ln], 1) * keep / (1 - p)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_silu_of_u_inside_the_block(p, gen, poison):
    """Kernel and reference apply the SiLU themselves: y and every gradient match the formula
    differentiated by autograd in float64, with and without dropout."""
    t, hd, seed = 37, 48, secrets.randbits(31)
    _, u, attn, w, b = make_inputs(t, hd, torch.float32, gen)
    keep = output_block_keep_mask(t, hd, p, seed, "cpu")
    u64, a64, w64, b64 = leaf64(u), leaf64(attn), leaf64(w), leaf64(b)
    want = spelled_out(u64, a64, w64, b64, keep, p)
    dy = randn(want.shape, gen)
    grads = torch.autograd.grad(want, (u64, a64, w64, b64), dy.double())
    ref = output_block(u64, a64, w64, b64, EPS, p, seed, True, kernels="pytorch", keep_mask=keep)
    torch.testing.assert_close(ref, want, rtol=1e-12, atol=1e-12)
    for kernels in ("triton", "pytorch"):
        leaves = [x.detach().clone().requires_grad_() for x in (u, attn, w, b)]
        y = output_block(*leaves, EPS, p, seed, True, kernels=kernels, keep_mask=keep)
        assert_close(y, want, torch.float32, f"{kernels} y")
        for name, got, g in zip(("du", "dattn", "dweight", "dbias"), torch.autograd.grad(y, leaves, dy), grads):
            assert_close(got, g, torch.float32, f"{kernels} {name}")


def test_backward_writes_du_into_a_given_buffer(gen, poison):
    """``du_out`` (the u columns of a wider gradient) receives du; the other columns stay as they were."""
    from dlrmv4.ops.triton import output_block as tri

    t, hd, p, seed = 21, 32, 0.2, secrets.randbits(31)
    _, u, attn, w, b = make_inputs(t, hd, torch.float32, gen)
    y, mean, rstd, keep = tri.forward(u, attn, w, b, EPS, p, seed, True)
    dy = randn(y.shape, gen)
    du, da, dw, db = tri.backward(u, attn, w, b, dy, mean, rstd, keep, p)
    wide = torch.full((t, 3 * hd), 7.0)
    got = tri.backward(u, attn, w, b, dy, mean, rstd, keep, p, du_out=wide[:, hd:2 * hd])
    assert got[0].data_ptr() == wide[:, hd:2 * hd].data_ptr()
    assert torch.equal(wide[:, hd:2 * hd], du)
    assert (wide[:, :hd] == 7).all() and (wide[:, 2 * hd:] == 7).all()
    for a, e in zip(got[1:], (da, dw, db)):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="du_out must be"):
        tri.backward(u, attn, w, b, dy, mean, rstd, keep, p, du_out=wide[:, :hd - 1])


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
    # So do neighbouring columns (the two 16-bit halves of one Philox number) and neighbouring rows.
    assert abs((s[:, :, 0::2] * s[:, :, 1::2]).mean().item() - (1 - p) ** 2) < 0.05
    assert abs((s[0::2] * s[1::2]).mean().item() - (1 - p) ** 2) < 0.05
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
