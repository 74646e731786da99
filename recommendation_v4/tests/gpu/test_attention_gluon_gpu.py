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


def test_the_seam_runs_gluon_forward_and_portable_backward_on_hopper():
    seed = fresh_seed()
    lengths = [300, 4_095, 1, 129]
    q, k, v, offsets, nt = make_batch(lengths, HEADS, 128, 128, torch.bfloat16, "cuda", seed, 1)
    kernels = attention_kernels("auto", q, v)
    assert (kernels.forward, kernels.backward) == ("gluon", "triton")
    g = torch.randn(q.shape[0], HEADS, 128, device="cuda", dtype=torch.bfloat16)

    def grads(attention):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = hstu_attention(*leaves, offsets, 4_095, num_targets=nt, alpha=0.1, kernels="triton", attention=attention)
        return (out, *torch.autograd.grad(out, leaves, g))

    gluon, triton = grads("gluon"), grads("triton")
    for name, a, b in zip(("out", "dq", "dk", "dv"), gluon, triton):
        assert rel_err(a, b.double()) < 1e-2, name
    for a, b in zip(gluon[1:], triton[1:]):  # the same backward on the same inputs
        assert torch.equal(a, b)
