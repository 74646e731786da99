"""Candidate attention (one query per sequence, its last row, over the whole sequence): the
reference equals the last rows of the full jagged attention, and the Triton kernels (interpreted
here; tests/gpu runs them compiled at full size) equal the reference, forward and backward, on
random jagged inputs with strided views."""

from __future__ import annotations

import pytest
import torch
from test_ops_attention import INTERPRET
from test_ops_layer_norm import gen, poison, randn, rel_err  # noqa: F401  (fixtures)

from dlrmv4.ops.candidate_attention import candidate_attention
from dlrmv4.ops.reference.attention import hstu_attention_reference
from dlrmv4.ops.reference.candidate_attention import split_vk

HEADS, QK, V = 2, 16, 32
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)"
)


def jagged(gen, batch: int = 6, longest: int = 45):
    lengths = torch.randint(1, longest + 1, (batch,), generator=gen)
    lengths[0] = 1  # a sequence of the candidate alone
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]), int(lengths.max())


def strided_inputs(gen, offsets, dtype):
    """q and vk as column slices of wider tensors, as the STU layer hands them over."""
    batch, total = offsets.numel() - 1, int(offsets[-1])
    q = randn((batch, HEADS * (V + QK) + 8), gen, dtype)[:, HEADS * V : HEADS * (V + QK)].unflatten(1, (HEADS, QK))
    vk = randn((total, HEADS * (V + QK) + 16), gen, dtype)[:, 16:]
    return q, vk


def test_reference_is_the_full_attentions_last_rows(gen):
    offsets, longest = jagged(gen)
    batch, total = offsets.numel() - 1, int(offsets[-1])
    q_all, k, v = (randn((total, HEADS, d), gen, torch.float64) for d in (QK, QK, V))
    full = hstu_attention_reference(q_all, k, v, offsets, longest + 2, None, 0.3)
    last = offsets[1:] - 1
    vk = torch.cat([v.flatten(1), k.flatten(1)], 1)
    out = candidate_attention(
        q_all[last], vk, offsets, longest + 2, num_heads=HEADS, qk_dim=QK, v_dim=V, alpha=0.3, kernels="pytorch"
    )
    assert out.shape == (batch, HEADS, V)
    assert rel_err(out, full[last]) < 1e-12


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_triton_equals_the_reference(dtype, tol, gen, poison):
    offsets, longest = jagged(gen)
    q, vk = strided_inputs(gen, offsets, dtype)
    dout = randn((offsets.numel() - 1, HEADS, V), gen, dtype)
    results = {}
    for kernels in ("pytorch", "triton"):
        q_leaf, vk_leaf = q.detach().requires_grad_(), vk.detach().requires_grad_()
        out = candidate_attention(
            q_leaf, vk_leaf, offsets, longest + 3, num_heads=HEADS, qk_dim=QK, v_dim=V, alpha=0.25, kernels=kernels
        )
        out.backward(dout)
        results[kernels] = (out, q_leaf.grad, vk_leaf.grad)
    for name, ref, tri in zip(("out", "dq", "dvk"), results["pytorch"], results["triton"]):
        assert tri.dtype == dtype and tri.shape == ref.shape, name
        assert rel_err(tri, ref) < tol, name
    v, k = split_vk(results["triton"][2], HEADS, QK, V)
    assert torch.isfinite(v).all() and torch.isfinite(k).all()  # every row written (poisoned empties)


def test_bad_inputs_are_one_line(gen):
    offsets, longest = jagged(gen)
    q, vk = strided_inputs(gen, offsets, torch.float32)
    kw = {"num_heads": HEADS, "qk_dim": QK, "v_dim": V, "alpha": 0.3, "kernels": "pytorch"}
    with pytest.raises(ValueError, match=r"vk must be \[T, H·\(Dv \+ Dqk\)\]"):
        candidate_attention(q, vk[:, 1:], offsets, longest, **kw)
    with pytest.raises(ValueError, match=r"seq_offsets must be a 1-D integer tensor \[B\+1\]"):
        candidate_attention(q, vk, offsets[1:], longest, **kw)
    with pytest.raises(ValueError, match="max_seq_len must be a host int"):
        candidate_attention(q, vk, offsets, torch.tensor(longest), **kw)
    with pytest.raises(ValueError, match="must share a dtype"):
        candidate_attention(q.double(), vk, offsets, longest, **kw)
