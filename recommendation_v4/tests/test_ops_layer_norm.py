"""LayerNorm / SwishLayerNorm: the Triton kernels (interpreted on the CPU) against the PyTorch
reference in float64, on fresh random inputs with poisoned outputs.

The helpers at the top (fresh generator, poisoned allocations, relative error, tolerances) are
shared by the other op tests, which import them from here.
"""

from __future__ import annotations

import secrets

import pytest
import torch

from dlrmv4.ops.layer_norm import layer_norm, layer_norm_and_input, layer_norm_plus, swish_layer_norm

# ‖out − ref‖ / ‖ref‖ against a float64 reference: fp32 arithmetic lands near 1e-7.
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


@pytest.fixture
def gen() -> torch.Generator:
    """A CPU generator with a fresh seed each run; the seed is printed for reruns of a failure."""
    seed = secrets.randbits(31)
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty / empty_like during the test comes back filled with NaN (floats) or a
    sentinel (ints), so an output element that a kernel fails to write shows up."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(True if t.dtype == torch.bool else 123)

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_empty_like(*a, **k)))


def randn(
    shape, gen: torch.Generator, dtype=torch.float32, device="cpu", scale: float = 1.0, shift: float = 0.0
) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere makes it NaN, which fails every `<` check."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def leaf64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().double().requires_grad_()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    if ref.numel():
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"{what}: relative error {err:.2e} over {TOL[dtype]:.0e}"


def check_layer_norm(fn, x, weight, bias, eps, gen):
    """Forward and backward of the kernel against the float64 reference on the same values."""
    x.retain_grad()  # x may be a view of a leaf (a slice, a transpose)
    for t in (weight, bias):
        if t is not None:
            t.grad = None
    y = fn(x, weight, bias, eps, kernels="triton")
    assert y.dtype == x.dtype and y.shape == x.shape
    dy = randn(y.shape, gen, x.dtype, x.device)
    y.backward(dy)
    x64, w64, b64 = leaf64(x), leaf64(weight), leaf64(bias)
    ref = fn(x64, w64, b64, eps, kernels="pytorch")
    ref.backward(dy.double())
    assert_close(y, ref, x.dtype, "y")
    assert_close(x.grad, x64.grad, x.dtype, "dx")
    if weight is not None:
        assert weight.grad.dtype == weight.dtype
        assert_close(weight.grad, w64.grad, torch.float32, "dweight")
    if bias is not None:
        assert_close(bias.grad, b64.grad, torch.float32, "dbias")


@pytest.mark.parametrize("fn", [layer_norm, swish_layer_norm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,width", [(1, 64), (37, 48), (130, 7), (5, 300)])
def test_matches_reference(fn, dtype, rows, width, gen, poison):
    x = randn((rows, width), gen, dtype, scale=2.0, shift=0.5).requires_grad_()
    w = randn(width, gen, scale=0.5, shift=1.0).requires_grad_()
    b = randn(width, gen, scale=0.5).requires_grad_()
    check_layer_norm(fn, x, w, b, 1e-5, gen)


@pytest.mark.parametrize("fn", [layer_norm, swish_layer_norm])
@pytest.mark.parametrize("has_w,has_b", [(False, False), (True, False), (False, True)])
def test_optional_affine(fn, has_w, has_b, gen, poison):
    x = randn((19, 33), gen).requires_grad_()
    w = randn(33, gen, shift=1.0).requires_grad_() if has_w else None
    b = randn(33, gen).requires_grad_() if has_b else None
    check_layer_norm(fn, x, w, b, 1e-6, gen)


@pytest.mark.parametrize("fn", [layer_norm, swish_layer_norm])
def test_non_contiguous_and_batched_inputs(fn, gen, poison):
    w = randn(24, gen, shift=1.0).requires_grad_()
    b = randn(24, gen).requires_grad_()
    wide = randn((21, 80), gen).requires_grad_()
    check_layer_norm(fn, wide[:, 50:74], w, b, 1e-5, gen)  # a column slice: row stride 80
    check_layer_norm(fn, randn((24, 17), gen).t().requires_grad_(), w, b, 1e-5, gen)  # column stride 17
    check_layer_norm(fn, randn((3, 5, 24), gen).requires_grad_(), w, b, 1e-5, gen)


def check_norm_plus(x, addend, weight, bias, dy):
    """``layer_norm_plus`` against LayerNorm then a separate add (the same kernels): the output and
    every gradient bit for bit, the output also against the float64 reference."""
    outs = []
    for fused in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in (x, addend, weight, bias)]
        xl, al, wl, bl = leaves
        if fused:
            y = layer_norm_plus(xl, wl, bl, 1e-5, al, kernels="triton")
        else:
            y = layer_norm(xl, wl, bl, 1e-5, kernels="triton") + al
        y.backward(dy)
        outs.append([y.detach()] + [t.grad for t in leaves])
    for what, fused, apart in zip(("y", "dx", "d_addend", "dweight", "dbias"), *outs):
        assert fused.dtype == apart.dtype and torch.equal(fused, apart), what
    reference = layer_norm_plus(*(leaf64(t) for t in (x, weight, bias)), 1e-5, leaf64(addend), kernels="pytorch")
    assert_close(outs[0][0], reference, x.dtype, "y against the float64 reference")


# bf16 runs on the GPU (tests/gpu/test_ops_gpu.py): the interpreter truncates fp32 -> bf16 casts.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape,sliced", [((37, 48), False), ((21, 24), True), ((3, 5, 24), False)])
def test_norm_plus_an_addend_is_the_two_ops_bit_for_bit(dtype, shape, sliced, gen, poison):
    width = shape[-1]
    x = randn(shape, gen, dtype, scale=2.0, shift=0.5)
    addend = randn((shape[0], 80), gen, dtype)[:, 50 : 50 + width] if sliced else randn(shape, gen, dtype)
    w, b = randn(width, gen, scale=0.5, shift=1.0), randn(width, gen, scale=0.5)
    check_norm_plus(x, addend, w, b, randn(shape, gen, dtype))


def test_norm_plus_checks_the_addend(gen):
    x = randn((4, 8), gen)
    with pytest.raises(ValueError, match=r"addend has shape \(4, 7\)"):
        layer_norm_plus(x, None, None, 1e-5, randn((4, 7), gen))
    wider = randn((4, 8), gen, torch.float64)  # another dtype: the add's own promotion
    assert layer_norm_plus(x, None, None, 1e-5, wider).dtype == torch.float64


def test_empty_input(gen):
    x = randn((0, 16), gen).requires_grad_()
    w = randn(16, gen).requires_grad_()
    y = layer_norm(x, w, None, 1e-5, kernels="triton")
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16))


def test_auto_uses_reference_on_cpu_and_checks_shapes(gen):
    x = randn((4, 8), gen)
    assert torch.equal(layer_norm(x, None, None, 1e-5), layer_norm(x, None, None, 1e-5, kernels="pytorch"))
    with pytest.raises(ValueError, match="weight has shape"):
        layer_norm(x, torch.ones(7), None, 1e-5)


@pytest.mark.parametrize("rows", [None, [4, 0, 9, 4]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_and_input(rows, dtype, gen, poison):
    """(LayerNorm(x), x or x[rows]) with the residual's gradient added inside the norm's backward
    (or into the rows): the same values and gradients as the norm and the gather apart, float64."""
    x = randn((11, 40), gen, dtype, scale=2.0, shift=0.5).requires_grad_()
    w = randn(40, gen, shift=1.0).requires_grad_()
    b = randn(40, gen).requires_grad_()
    index = None if rows is None else torch.tensor(rows)
    n, residual = layer_norm_and_input(x, w, b, 1e-5, rows=index, kernels="triton")
    dn, dr = randn(n.shape, gen, dtype), randn(residual.shape, gen, dtype)
    grads = torch.autograd.grad([n, residual], [x, w, b], [dn, dr])
    x64, w64, b64 = leaf64(x), leaf64(w), leaf64(b)
    n64 = layer_norm(x64, w64, b64, 1e-5, kernels="pytorch")
    r64 = x64 if index is None else x64.index_select(0, index)
    refs = torch.autograd.grad([n64, r64], [x64, w64, b64], [dn.double(), dr.double()])
    assert_close(n, n64, dtype, "n")
    assert torch.equal(residual, x if index is None else x.index_select(0, index))
    for got, want, what in zip(grads, refs, ("dx", "dweight", "dbias")):
        assert_close(got, want, dtype if what == "dx" else torch.float32, what)
    # Only the norm used: the residual's gradient is absent and dx is the norm's alone.
    n, _ = layer_norm_and_input(x, w, b, 1e-5, rows=index, kernels="triton")
    (dx,) = torch.autograd.grad(n, [x], dn)
    (dx64,) = torch.autograd.grad(layer_norm(x64, w64, b64, 1e-5, kernels="pytorch"), [x64], dn.double())
    assert_close(dx, dx64, dtype, "dx, norm only")


def check_input_bias(kind, kernels, dtype, rows, width, device, gen):
    """norm(a W^T + c, input_bias=c), c detached in the GEMM, against norm(a W^T + c) with c in the
    GEMM's own graph, in float64: the same output, and c, a, W, the norm's weight and bias get the
    same gradients (c's summed by the norm's backward instead of by the GEMM's)."""
    a = randn((rows, 20), gen, dtype, device, scale=0.5).requires_grad_()
    gemm_w = randn((width, 20), gen, device=device, scale=0.3).requires_grad_()
    c = randn(width, gen, device=device, scale=0.5).requires_grad_()
    w = randn(width, gen, device=device, scale=0.5, shift=1.0).requires_grad_()
    b = randn(width, gen, device=device, scale=0.5).requires_grad_()
    addend = randn((rows, width), gen, dtype, device)

    def norm(x, weight, bias, input_bias, kernels):
        args = dict(kernels=kernels, input_bias=input_bias)
        if kind == "layer_norm_plus":
            return layer_norm_plus(x, weight, bias, 1e-5, addend.to(x.dtype), **args)
        return {"layer_norm": layer_norm, "swish_layer_norm": swish_layer_norm}[kind](x, weight, bias, 1e-5, **args)

    h = torch.nn.functional.linear(a, gemm_w.to(dtype), c.detach().to(dtype))
    y = norm(h, w, b, c, kernels)
    dy = randn(y.shape, gen, dtype, device)
    grads = torch.autograd.grad(y, [a, gemm_w, c, w, b], dy)
    leaves = [leaf64(t) for t in (a, gemm_w, c, w, b)]
    y64 = norm(torch.nn.functional.linear(*leaves[:3]), *leaves[3:], None, "pytorch")
    refs = torch.autograd.grad(y64, leaves, dy.double())
    assert_close(y, y64, dtype, "y")
    for got, want, what in zip(grads, refs, ("da", "dW", "dc (input_bias)", "dweight", "dbias")):
        assert got.dtype == (dtype if what == "da" else torch.float32), what
        assert_close(got, want, dtype, what)  # h itself is rounded to dtype


@pytest.mark.parametrize("kind", ["layer_norm", "swish_layer_norm", "layer_norm_plus"])
@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,width", [(37, 48), (130, 7), (0, 16)])
def test_input_bias_gets_the_gemms_bias_gradient(kind, kernels, dtype, rows, width, gen, poison):
    check_input_bias(kind, kernels, dtype, rows, width, "cpu", gen)


def test_dx_sum_is_checked(gen):
    from dlrmv4.ops.triton import layer_norm as tri

    x, dy = randn((6, 8), gen), randn((6, 8), gen)
    _, mean, rstd = tri.forward(x, None, None, 1e-5, False)
    for bad in (torch.empty(7), torch.empty(8, dtype=torch.float16), torch.empty(16)[::2]):
        with pytest.raises(ValueError, match=r"dx_sum must be contiguous fp32 \[8\]"):
            tri.backward(x, None, None, dy, mean, rstd, False, dx_sum=bad)
    with pytest.raises(ValueError, match="input_bias has shape"):
        layer_norm(x, None, None, 1e-5, input_bias=torch.zeros(7))
