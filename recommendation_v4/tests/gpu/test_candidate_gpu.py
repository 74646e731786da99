"""The last layer for the candidate rows only at the model's size on the GPU (bf16, about 50k
tokens in 18 jagged sequences up to 4,096, H = 4, Dqk = Dv = 128, dropout 0.1): candidate attention's
compiled kernels against the float64 reference, the trimmed layer against the full layer's last
rows in bf16 and against its own float64 run, and no host syncs. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from sync_guard import run_without_syncs
from test_ops_layer_norm import gen, poison, randn, rel_err  # noqa: F401  (fixtures)
from test_stu_mixing_gpu import lengths as mixing_lengths

from dlrmv4.ops.candidate_attention import candidate_attention
from dlrmv4.ops.reference.jagged import take_last
from dlrmv4.ops.stu_candidate_layer import stu_candidate_layer
from dlrmv4.ops.stu_layer import stu_layer

CUDA = "cuda"
HEADS, QK, V, D = 4, 128, 128, 512
MAX_LEN = 4096


def lengths(gen: torch.Generator) -> list[int]:
    """The stu_mixing GPU test's lengths (1 and 4,096 among them) without the empty sequence: every
    sequence has its candidate."""
    return [n for n in mixing_lengths(gen) if n > 0]


def offsets_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(CUDA)


def test_candidate_attention_matches_the_float64_reference(monkeypatch, gen):
    """The kernels' output buffers start as NaN (a global torch.empty poison would also hit the
    float64 reference's own autograd on CUDA)."""
    from dlrmv4.ops.triton import candidate_attention as tri

    monkeypatch.setattr(
        tri, "_empty", lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    )
    offsets = offsets_of(lengths(gen))
    batch, total = offsets.numel() - 1, int(offsets[-1])
    q = randn((batch, HEADS, QK), gen, torch.bfloat16, CUDA)
    vk = randn((total, HEADS * (V + QK) + 64), gen, torch.bfloat16, CUDA)[:, 64:]  # a strided view
    dout = randn((batch, HEADS, V), gen, torch.bfloat16, CUDA)
    results = {}
    for kernels, dtype in (("triton", torch.bfloat16), ("pytorch", torch.float64)):
        q_leaf, vk_leaf = q.detach().to(dtype).requires_grad_(), vk.detach().to(dtype).requires_grad_()
        out = candidate_attention(
            q_leaf,
            vk_leaf,
            offsets,
            MAX_LEN,
            num_heads=HEADS,
            qk_dim=QK,
            v_dim=V,
            alpha=1 / math.sqrt(QK),
            kernels=kernels,
        )
        out.backward(dout.to(dtype))
        results[kernels] = (out, q_leaf.grad, vk_leaf.grad)
    for name, got, ref in zip(("out", "dq", "dvk"), results["triton"], results["pytorch"]):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all(), name
        assert rel_err(got, ref) < 1e-2, name


def layer_inputs(gen):
    width = HEADS * (2 * V + 2 * QK)
    offsets = offsets_of(lengths(gen))
    total = int(offsets[-1])
    params = {
        "norm_weight": randn(D, gen, device=CUDA, scale=0.2, shift=1.0),
        "norm_bias": randn(D, gen, device=CUDA, scale=0.2),
        "uvqk_weight": randn((width, D), gen, device=CUDA, scale=D**-0.5),
        "uvqk_bias": randn(width, gen, device=CUDA, scale=0.1),
        "attn_norm_weight": randn(HEADS * V, gen, device=CUDA, scale=0.2, shift=1.0),
        "attn_norm_bias": randn(HEADS * V, gen, device=CUDA, scale=0.2),
        "out_weight": randn((D, 3 * HEADS * V), gen, device=CUDA, scale=(3 * HEADS * V) ** -0.5),
    }
    x = randn((total, D), gen, device=CUDA)
    dout = randn((offsets.numel() - 1, D), gen, device=CUDA)
    return x, params, offsets, dout


def run_layer(trimmed: bool, kernels: str, dtype, x, params, offsets, dout, recompute: str = "none"):
    x = x.detach().to(dtype).requires_grad_()
    params = {
        k: v.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
        for k, v in params.items()
    }
    kwargs = dict(
        norm_eps=1e-6,
        num_heads=HEADS,
        qk_dim=QK,
        v_dim=V,
        alpha=1 / math.sqrt(QK),
        attn_eps=1e-6,
        dropout_p=0.1,
        seed=77,
        training=True,
        row_offset=1_000,
        recompute=recompute,
        kernels=kernels,
    )
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        if trimmed:
            out = stu_candidate_layer(x, offsets, MAX_LEN, **params, **kwargs)
        else:
            out = take_last(stu_layer(x, offsets, MAX_LEN, **params, **kwargs), offsets)
    out.float().backward(dout.to(out.dtype))
    return out.detach(), x.grad, {k: v.grad for k, v in params.items()}


@pytest.mark.parametrize("recompute", ["none", "cheap"])
def test_trimmed_layer_is_the_full_layers_last_rows_in_bf16(recompute, gen):
    """bf16 under autocast, as the model runs: the trimmed layer against the full layer (both
    compiled), and both against the trimmed layer's float64 reference run."""
    x, params, offsets, dout = layer_inputs(gen)
    trimmed = run_layer(True, "triton", torch.bfloat16, x, params, offsets, dout, recompute)
    full = run_layer(False, "triton", torch.bfloat16, x, params, offsets, dout)
    exact = run_layer(True, "pytorch", torch.float64, x, params, offsets, dout)
    for name, got, want, ref in (
        ("out", trimmed[0], full[0], exact[0]),
        ("dx", trimmed[1], full[1], exact[1]),
        *((n, trimmed[2][n], full[2][n], exact[2][n]) for n in exact[2]),
    ):
        assert rel_err(got, want) < 2e-2, name
        assert rel_err(got, ref) < 2e-2 and rel_err(want, ref) < 2e-2, name


def test_trimmed_layer_does_not_sync(gen):
    x, params, offsets, dout = layer_inputs(gen)
    run_layer(True, "triton", torch.bfloat16, x, params, offsets, dout)  # compile first
    run_without_syncs(lambda: run_layer(True, "triton", torch.bfloat16, x, params, offsets, dout))
