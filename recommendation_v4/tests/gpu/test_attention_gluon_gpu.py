"""The Hopper Gluon attention forward (ops/gluon/attention.py) on an sm_90 GPU against the float64
reference and the portable Triton forward: every edge of the tiles and the mask, the reference
shape, bf16 and fp16, strided views, the same bits twice, and the model's seam picking it.
Skipped without CUDA (tests/gpu/conftest.py) and on GPUs other than sm_90."""

from __future__ import annotations

import pytest
import torch
from test_ops_attention import fresh_seed, make_batch, rel_err

from dlrmv4.ops.attention import hstu_attention
from dlrmv4.ops.attention_kernels import attention_kernels
from dlrmv4.ops.gluon import attention as hopper
from dlrmv4.ops.reference.attention import hstu_attention_reference
from dlrmv4.ops.triton import attention as portable

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)
HEADS = 4
# Lengths around every tile (64 query rows a consumer, 128 a program, 128 keys a tile), empty and
# one-token sequences, and the reference's longest.
EDGES = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 192, 255, 256, 257, 383, 384, 385, 1_000, 4_095, 4_096]


def check(lengths, targets, dim, dtype, tol):
    seed = fresh_seed()
    q, k, v, offsets, nt = make_batch(lengths, HEADS, dim, dim, dtype, "cuda", seed, targets)
    n = max(lengths)
    alpha = dim**-0.5
    out = torch.full((q.shape[0], HEADS, dim), float("nan"), dtype=dtype, device="cuda")
    out.copy_(hopper.attention_fwd(q, k, v, offsets, nt, n, alpha))
    ref = hstu_attention_reference(q.double(), k.double(), v.double(), offsets, n, nt, alpha)
    err = rel_err(out, ref)
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e} (seed {seed})"
    assert torch.equal(out, hopper.attention_fwd(q, k, v, offsets, nt, n, alpha)), f"bits differ (seed {seed})"
    portable_err = rel_err(portable.attention_fwd(q, k, v, offsets, nt, n, alpha), ref)
    assert err <= 1.05 * portable_err + 1e-6, f"{err:.2e} against the portable kernel's {portable_err:.2e}"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("targets", [None, 1, "random"])
@pytest.mark.parametrize("dim", [64, 128])
def test_every_edge_matches_the_float64_reference(dtype, tol, targets, dim):
    gen = torch.Generator().manual_seed(fresh_seed())
    lengths = [EDGES[i] for i in torch.randperm(len(EDGES), generator=gen).tolist()]
    if targets == "random":
        targets = [int(torch.randint(0, n + 2, (1,), generator=gen)) for n in lengths]
    check(lengths, targets, dim, dtype, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_reference_shape_matches(dtype, tol):
    gen = torch.Generator().manual_seed(fresh_seed())
    lengths = torch.randint(2_740, 4_096, (32,), generator=gen).tolist()
    check(lengths, 1, 128, dtype, tol)


def op_grads(q, k, v, offsets, nt, g, attention):
    """hstu_attention's output and (dq, dk, dv) with the kernels ``attention`` picks."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = hstu_attention(*leaves, offsets, 4_095, num_targets=nt, alpha=0.1, kernels="triton", attention=attention)
    return (out, *torch.autograd.grad(out, leaves, g))


def test_the_seam_runs_gluon_forward_and_portable_backward_on_hopper():
    seed = fresh_seed()
    lengths = [300, 4_095, 1, 129]
    q, k, v, offsets, nt = make_batch(lengths, HEADS, 128, 128, torch.bfloat16, "cuda", seed, 1)
    kernels = attention_kernels("auto", q, v)
    assert (kernels.forward, kernels.backward) == ("gluon", "triton")
    g = torch.randn(q.shape[0], HEADS, 128, device="cuda", dtype=torch.bfloat16)

    gluon, triton = op_grads(q, k, v, offsets, nt, g, "auto"), op_grads(q, k, v, offsets, nt, g, "triton")
    for name, a, b in zip(("out", "dq", "dk", "dv"), gluon, triton):
        assert rel_err(a, b.double()) < 1e-2, name
    for a, b in zip(gluon[1:], triton[1:]):  # the same backward on the same inputs
        assert torch.equal(a, b)


def check_backward(lengths, targets, dim, dtype, tol, seed):
    q, k, v, offsets, nt = make_batch(lengths, HEADS, dim, dim, dtype, "cuda", seed, targets)
    n, alpha = max(lengths), dim**-0.5
    g = torch.randn(q.shape[0], HEADS, dim, device="cuda", dtype=dtype)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(hstu_attention_reference(*leaves, offsets, n, nt, alpha), leaves, g.double())
    # Into column slices of one poisoned buffer, with the column sums, as the STU mixing asks for them.
    grad = torch.full((q.shape[0], 3 * HEADS * dim), float("nan"), dtype=dtype, device="cuda")
    out = tuple(grad[:, i * HEADS * dim : (i + 1) * HEADS * dim].view(-1, HEADS, dim) for i in range(3))
    sums = tuple(torch.full((HEADS * dim,), float("nan"), device="cuda") for _ in range(3))
    hopper.attention_bwd(g, q, k, v, offsets, nt, n, alpha, out=out, col_sums=sums)
    for name, got, want in zip(("dq", "dk", "dv"), out, ref):
        err = rel_err(got, want)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e} (seed {seed})"
    for name, got, want in zip(("dq", "dk", "dv"), sums, ref):
        err = rel_err(got, want.sum(0).flatten())
        assert err < tol, f"{name} column sums: relative error {err:.2e} (seed {seed})"
    again = hopper.attention_bwd(g, q, k, v, offsets, nt, n, alpha)
    for name, a, b in zip(("dq", "dk", "dv"), out, again):
        assert torch.equal(a, b), f"{name}: bits differ between two runs (seed {seed})"


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("targets", [None, 1, "random"])
@pytest.mark.parametrize("dim", [64, 128])
def test_backward_every_edge_matches_the_float64_reference(dtype, tol, targets, dim):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = [EDGES[i] for i in torch.randperm(len(EDGES), generator=gen).tolist()]
    if targets == "random":
        targets = [int(torch.randint(0, n + 2, (1,), generator=gen)) for n in lengths]
    check_backward(lengths, targets, dim, dtype, tol, seed)


def test_backward_at_the_reference_shape():
    seed = fresh_seed()
    lengths = torch.randint(2_740, 4_096, (32,), generator=torch.Generator().manual_seed(seed)).tolist()
    check_backward(lengths, 1, 128, torch.bfloat16, 2e-2, seed)


def test_backward_unordered_dq_is_refused_under_deterministic_algorithms(deterministic_algorithms):
    q, k, v, offsets, nt = make_batch([300], HEADS, 128, 128, torch.bfloat16, "cuda", 0, 1)
    with pytest.raises(RuntimeError, match="ordered=False adds dQ with atomics"):
        hopper.attention_bwd(torch.ones_like(q), q, k, v, offsets, nt, 300, 0.1, ordered=False)


def test_gluon_runs_both_gluon_kernels_in_the_op():
    seed = fresh_seed()
    q, k, v, offsets, nt = make_batch([300, 4_095, 1, 129], HEADS, 128, 128, torch.bfloat16, "cuda", seed, 1)
    g = torch.randn(q.shape[0], HEADS, 128, device="cuda", dtype=torch.bfloat16)

    both, auto = op_grads(q, k, v, offsets, nt, g, "gluon"), op_grads(q, k, v, offsets, nt, g, "auto")
    assert torch.equal(both[0], auto[0])  # one forward
    expected = hopper.attention_bwd(g, q, k, v, offsets, nt, 4_095, 0.1)
    for name, a, b in zip(("dq", "dk", "dv"), both[1:], expected):
        assert torch.equal(a, b), name
