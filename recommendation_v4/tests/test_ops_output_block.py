"""The fused STU output block, Dropout([SiLU(u) ‖ attn ‖ SiLU(u) ⊙ LayerNorm(attn)]) from u before
its SiLU: Triton kernel (interpreted) against the reference in float64, and both against the
formula spelled out. Dropout: the reference's mask (``output_block_keep_mask``, torch only) is the
kernel's bit for bit, a chunk of rows run with its ``row_offset`` is that chunk of the whole run,
and the decisions keep 1 − p of the elements, independently."""

from __future__ import annotations

import functools
import secrets

import pytest
import torch
from test_ops_layer_norm import assert_close, gen, leaf64, poison, randn  # noqa: F401  (fixtures)

from dlrmv4.ops.output_block import output_block, output_block_keep_mask
from dlrmv4.ops.triton import output_block as tri

EPS = 1e-6


def make_inputs(t: int, hd: int, dtype: torch.dtype, gen: torch.Generator):
    """u and attn as column slices of one wide tensor, as the model's split of uvqk gives them; u
    wide enough to reach both saturated ends of the SiLU."""
    wide = randn((t, 4 * hd), gen, dtype, scale=3.0).requires_grad_()
    attn = randn((t, hd), gen, dtype, scale=2.0, shift=0.3).requires_grad_()
    w = randn(hd, gen, scale=0.3, shift=1.0).requires_grad_()
    b = randn(hd, gen, scale=0.3).requires_grad_()
    return wide, wide[:, hd : 2 * hd], attn, w, b


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
    kernel = (y, wide.grad[:, hd : 2 * hd], attn.grad, w.grad, b.grad, wide.grad)
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
    assert not dwide[:, :hd].any() and not dwide[:, 2 * hd :].any()


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
    t, hd, p, seed = 21, 32, 0.2, secrets.randbits(31)
    _, u, attn, w, b = make_inputs(t, hd, torch.float32, gen)
    y, mean, rstd, keep = tri.forward(u, attn, w, b, EPS, p, seed, True)
    dy = randn(y.shape, gen)
    du, da, dw, db = tri.backward(u, attn, w, b, dy, mean, rstd, keep, p)
    wide = torch.full((t, 3 * hd), 7.0)
    got = tri.backward(u, attn, w, b, dy, mean, rstd, keep, p, du_out=wide[:, hd : 2 * hd])
    assert got[0].data_ptr() == wide[:, hd : 2 * hd].data_ptr()
    assert torch.equal(wide[:, hd : 2 * hd], du)
    assert (wide[:, :hd] == 7).all() and (wide[:, 2 * hd :] == 7).all()
    for a, e in zip(got[1:], (da, dw, db)):
        assert torch.equal(a, e)
    with pytest.raises(ValueError, match="du_out must be"):
        tri.backward(u, attn, w, b, dy, mean, rstd, keep, p, du_out=wide[:, : hd - 1])


def check_du_sums(t: int, hd: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """output_block backward's ``du_sum`` against the sum of the du it returns; du itself, dattn and
    the weight gradients are the same as without it."""
    p, seed = 0.2, secrets.randbits(31)
    u, attn, w, b = (z.to(device) for z in make_inputs(t, hd, dtype, gen)[1:])
    y, mean, rstd, keep = tri.forward(u, attn, w, b, EPS, p, seed, True)
    dy = randn(y.shape, gen, dtype).to(device)
    plain = tri.backward(u, attn, w, b, dy, mean, rstd, keep, p)
    du_sum = torch.full((hd,), float("nan"), device=device)
    got = tri.backward(u, attn, w, b, dy, mean, rstd, keep, p, du_sum=du_sum)
    for a, e in zip(got, plain):
        assert torch.equal(a, e)
    expected = plain[0].double().sum(0)
    scale = plain[0].double().abs().sum(0).clamp_min(1e-6)
    err = ((du_sum.double() - expected).abs() / scale).max().item()
    # 16-bit: the returned du is rounded (the interpreter truncates: up to 2^-7 of a value), the sum is not.
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), f"du_sum off by {err:.1e}"
    with pytest.raises(ValueError, match="du_sum must be"):
        tri.backward(u, attn, w, b, dy, mean, rstd, keep, p, du_sum=du_sum[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [0, 1, 45])
def test_backward_sums_du_over_rows(dtype, t, gen, poison):
    """``du_sum`` receives du's sum over the rows (a bias gradient of u's projection), added up
    before rounding."""
    check_du_sums(t, 40, dtype, "cpu", gen)


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
    # So do neighbouring columns (the two 16-bit halves of one Philox number), the columns that take
    # the four numbers of one Philox call, and neighbouring rows.
    assert abs((s[:, :, 0::2] * s[:, :, 1::2]).mean().item() - (1 - p) ** 2) < 0.05
    for word in (1, 2, 3):
        assert abs((s[:, :, 0::8] * s[:, :, 2 * word :: 8]).mean().item() - (1 - p) ** 2) < 0.05
    assert abs((s[0::2] * s[1::2]).mean().item() - (1 - p) ** 2) < 0.05
    assert torch.equal(y1 != 0, m1 & (y1 != 0))  # zeros exactly where dropped (inputs are never 0)
    assert (y1 != 0).sum() == m1.sum()


def test_reference_dropout_without_mask_scales_kept_values(gen):
    """Without ``keep_mask`` the reference draws the kernel's mask from (seed, row_offset)."""
    seed, row_offset = secrets.randbits(40), secrets.randbits(20)
    u, a = randn((50, 16), gen), randn((50, 16), gen)
    y = output_block(u, a, None, None, EPS, 0.5, seed, True, kernels="pytorch", row_offset=row_offset)
    full = output_block(u, a, None, None, EPS, 0.5, seed, False, kernels="pytorch")
    kept = output_block_keep_mask(50, 16, 0.5, seed, "cpu", row_offset)
    assert 0.3 < kept.float().mean().item() < 0.7
    assert torch.equal(y != 0, kept)
    torch.testing.assert_close(y[kept], 2 * full[kept])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,hd", [(1, 16), (29, 40), (40, 33), (70, 64)])
def test_reference_mask_is_the_kernels(dtype, t, hd, gen, poison):
    """The torch mask equals the kernel's: its mask kernel, the forward's stored bits (each for seeds
    and row offsets past 2^32), and the zeros of y when the reference and the kernel each draw
    their own mask."""
    p = 0.3
    for seed, row_offset in (
        (secrets.randbits(31), 0),
        (2**32 + secrets.randbits(31), secrets.randbits(33)),
        (secrets.randbits(63), secrets.randbits(40)),
    ):
        want = output_block_keep_mask(t, hd, p, seed, "cpu", row_offset)
        assert torch.equal(tri.keep_mask(t, hd, p, seed, torch.device("cpu"), row_offset), want)
        _, u, attn, w, b = make_inputs(t, hd, dtype, gen)
        keep = tri.forward(u, attn, w, b, EPS, p, seed, True, row_offset)[3]
        bits = torch.stack([(keep >> s) & 1 for s in range(3)], 1).flatten(1).bool()
        assert torch.equal(bits, want)
    y = output_block(u, attn, w, b, EPS, p, seed, True, kernels="triton", row_offset=row_offset)
    ref = output_block(
        leaf64(u), leaf64(attn), leaf64(w), leaf64(b), EPS, p, seed, True, kernels="pytorch", row_offset=row_offset
    )
    assert torch.equal(y != 0, want) and torch.equal(ref != 0, want)
    assert_close(y, ref, dtype, "y")


def chunks_of(t: int, gen: torch.Generator) -> list[tuple[int, int]]:
    """[0, t) cut into three consecutive chunks at random points (one may be empty)."""
    cuts = sorted(torch.randint(0, t + 1, (2,), generator=gen).tolist())
    return [(0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], t)]


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_a_chunk_with_its_row_offset_is_that_chunk_of_the_whole(kernels, gen, poison):
    """Rows [a, b) run with row_offset = a (inside an offset batch, too) give rows [a, b) of the
    run over all rows: the same zeros, and the same values and gradients (bit for bit from the
    kernel; to rounding from the reference, whose CPU ops vectorise by the row count); the
    LayerNorm weights' gradients add up."""
    t, hd, p, seed, base = 61, 40, 0.25, secrets.randbits(31), secrets.randbits(24)
    dtype = torch.float32 if kernels == "triton" else torch.float64
    _, u, attn, w, b = make_inputs(t, hd, dtype, gen)
    w, b = w.to(dtype), b.to(dtype)
    dy = randn((t, 3 * hd), gen, dtype)
    leaves = [x.detach().clone().requires_grad_() for x in (u, attn, w, b)]
    y = output_block(*leaves, EPS, p, seed, True, kernels=kernels, row_offset=base)
    whole = (y, *torch.autograd.grad(y, leaves, dy))
    same = torch.equal if kernels == "triton" else functools.partial(torch.allclose, rtol=1e-13, atol=1e-13)
    dw, db = torch.zeros(hd, dtype=dtype), torch.zeros(hd, dtype=dtype)
    for a, e in chunks_of(t, gen):
        part = [
            u[a:e].detach().clone().requires_grad_(),
            attn[a:e].detach().clone().requires_grad_(),
            w.detach().clone().requires_grad_(),
            b.detach().clone().requires_grad_(),
        ]
        y = output_block(*part, EPS, p, seed, True, kernels=kernels, row_offset=base + a)
        got = (y, *torch.autograd.grad(y, part, dy[a:e]))
        assert torch.equal(got[0] != 0, whole[0][a:e] != 0), f"the zeros of rows [{a}, {e})"
        for name, g, full in zip(("y", "du", "dattn"), got, whole):
            assert same(g, full[a:e]), f"{name} of rows [{a}, {e})"
        dw, db = dw + got[3], db + got[4]
    torch.testing.assert_close(dw, whole[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, whole[4], rtol=1e-5, atol=1e-5)


def test_mask_of_a_row_range_is_that_range_of_the_whole(gen):
    t, hd, p, seed = 300, 24, 0.4, secrets.randbits(63)
    whole = output_block_keep_mask(t, hd, p, seed, "cpu")
    for a, e in chunks_of(t, gen):
        assert torch.equal(output_block_keep_mask(e - a, hd, p, seed, "cpu", row_offset=a), whole[a:e])
    # Another seed or another row range: different, uncorrelated decisions.
    for other in (output_block_keep_mask(t, hd, p, seed ^ 1, "cpu"), output_block_keep_mask(t, hd, p, seed, "cpu", t)):
        agree, want = (other == whole).float().mean().item(), p * p + (1 - p) ** 2
        assert abs(agree - want) < 5 * (want * (1 - want) / whole.numel()) ** 0.5


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="same"):
        output_block(torch.zeros(4, 8), torch.zeros(4, 9), None, None, EPS, 0.0, 0, False)
    with pytest.raises(ValueError, match="weight"):
        output_block(torch.zeros(4, 8), torch.zeros(4, 8), torch.ones(9), None, EPS, 0.0, 0, False)


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
@pytest.mark.parametrize(
    "p,seed,row_offset,match",
    [
        (1.0, 0, 0, "dropout_p"),
        (-0.1, 0, 0, "dropout_p"),
        (0.1, -1, 0, "seed"),
        (0.1, 2**63, 0, "seed"),
        (0.1, 1.5, 0, "seed"),
        (0.1, 0, -1, "row_offset"),
        (0.1, 0, 2.0, "row_offset"),
    ],
)
def test_bad_dropout_arguments_are_reported(kernels, p, seed, row_offset, match):
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=f"output_block: {match}"):
        output_block(x, x, None, None, EPS, p, seed, True, kernels=kernels, row_offset=row_offset)
    with pytest.raises(ValueError, match=f"output_block_keep_mask: {match}"):
        output_block_keep_mask(4, 8, p, seed, "cpu", row_offset)
