"""The STU layer op and its recompute modes: ``cheap`` and ``layer`` compute the same function and
the same gradients as ``none`` (dropout on, at a row offset), on the PyTorch reference and on the
Triton path (interpreted here; ``tests/gpu`` runs the compiled one in bf16); and what each mode
keeps for the backward, counted with autograd's saved-tensor hooks on the Triton path, is exactly
the memory plan's per-token inventory (``plan/activations.py``)."""

from __future__ import annotations

import math
import secrets

import pytest
import torch
from test_ops_attention import INTERPRET
from test_ops_layer_norm import gen, poison, randn, rel_err  # noqa: F401  (fixtures)

from dlrmv4.config import ModelConfig
from dlrmv4.ops.stu_layer import stu_layer
from dlrmv4.plan.activations import ActivationShape, stu_kept_bytes_per_token

HEADS, QK, V, D = 2, 16, 16, 32
LENGTHS = [5, 17, 1, 9, 30]
# The layer's shape arguments in every test here.
SHAPE = dict(norm_eps=1e-6, num_heads=HEADS, qk_dim=QK, v_dim=V, alpha=1 / math.sqrt(QK), attn_eps=1e-6)
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)"
)


def make_params(gen, dtype=torch.float32):
    width = HEADS * (2 * V + 2 * QK)

    def leaf(*shape, scale=1.0, shift=0.0):
        return randn(shape, gen, dtype, scale=scale, shift=shift).requires_grad_()

    return {
        "norm_weight": leaf(D, scale=0.2, shift=1.0),
        "norm_bias": leaf(D, scale=0.2),
        "uvqk_weight": leaf(width, D, scale=D**-0.5),
        "uvqk_bias": leaf(width, scale=0.1),
        "attn_norm_weight": leaf(HEADS * V, scale=0.2, shift=1.0),
        "attn_norm_bias": leaf(HEADS * V, scale=0.2),
        "out_weight": leaf(D, 3 * HEADS * V, scale=(3 * HEADS * V) ** -0.5),
    }


def run(
    mode: str,
    kernels: str,
    x: torch.Tensor,
    params: dict,
    offsets: torch.Tensor,
    dout: torch.Tensor,
    seed: int,
    row_offset: int,
    dropout_p: float = 0.1,
):
    x = x.detach().requires_grad_()
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    out = stu_layer(
        x,
        offsets,
        max(LENGTHS) + 3,
        **params,
        **SHAPE,
        dropout_p=dropout_p,
        seed=seed,
        training=True,
        row_offset=row_offset,
        recompute=mode,
        kernels=kernels,
    )
    out.backward(dout)
    return out.detach(), x.grad, {k: v.grad for k, v in params.items()}


def inputs(gen):
    offsets = torch.tensor([0] + LENGTHS).cumsum(0)
    x = randn((sum(LENGTHS), D), gen)
    return x, make_params(gen), offsets, randn((sum(LENGTHS), D), gen)


@pytest.mark.parametrize("mode", ["cheap", "layer"])
def test_reference_recompute_is_the_same_layer(mode, gen):
    x, params, offsets, dout = inputs(gen)
    seed = secrets.randbits(31)
    base = run("none", "pytorch", x, params, offsets, dout, seed, 7)
    other = run(mode, "pytorch", x, params, offsets, dout, seed, 7)
    assert torch.equal(other[0], base[0]) and torch.equal(other[1], base[1])
    for name, grad in base[2].items():
        assert torch.equal(other[2][name], grad), name


@needs_interpreter
@pytest.mark.parametrize("mode", ["cheap", "layer"])
def test_triton_recompute_is_the_same_layer(mode, gen, poison):
    x, params, offsets, dout = inputs(gen)
    seed = secrets.randbits(31)
    base = run("none", "triton", x, params, offsets, dout, seed, 123)
    other = run(mode, "triton", x, params, offsets, dout, seed, 123)
    assert torch.equal(other[0], base[0])  # the same kernels on the same inputs
    assert rel_err(other[1], base[1]) < 1e-6
    for name, grad in base[2].items():
        assert torch.isfinite(other[2][name]).all(), name
        assert rel_err(other[2][name], grad) < 1e-6, name
    ref = run("none", "pytorch", x, params, offsets, dout, seed, 123)  # the same mask on the reference
    assert rel_err(other[0], ref[0]) < 1e-5 and rel_err(other[1], ref[1]) < 1e-4
    for name, grad in ref[2].items():  # the uvqk bias's from the kernels' column sums
        assert rel_err(base[2][name], grad) < 1e-4 and rel_err(other[2][name], grad) < 1e-4, name


@pytest.mark.parametrize("kernels", ["pytorch", pytest.param("triton", marks=needs_interpreter)])
def test_a_consumed_input_holds_the_same_output(kernels, gen, poison):
    """Without gradients, ``consume_input`` writes the layer's output over x (no copy of it for
    the residual) and gives the same bits; with gradients, or asked not to, x is left alone."""
    x, params, offsets, _ = inputs(gen)
    params = {k: v.detach() for k, v in params.items()}
    common = dict(SHAPE, dropout_p=0.1, seed=3, training=False, kernels=kernels)
    with torch.no_grad():
        kept = x.clone()
        apart = stu_layer(kept, offsets, max(LENGTHS), **params, **common)
        assert torch.equal(kept, x)
        consumed = x.clone()
        out = stu_layer(consumed, offsets, max(LENGTHS), **params, **common, consume_input=True)
    assert out.data_ptr() == consumed.data_ptr() and torch.equal(out, apart)
    leaf = x.clone().requires_grad_()
    out = stu_layer(leaf, offsets, max(LENGTHS), **params, **common, consume_input=True)
    assert out.data_ptr() != leaf.data_ptr() and torch.equal(leaf.detach(), x) and torch.equal(out.detach(), apart)


def saved_activation_bytes(mode: str, x, params, offsets, seed: int) -> int:
    """Bytes of the [T, ...] tensors the layer's graph keeps for its backward (parameters and the
    [B+1] offsets excluded), each storage counted once."""
    storages: dict[int, int] = {}
    rows = x.shape[0]

    def pack(t: torch.Tensor):
        if t.dim() >= 1 and t.shape[0] == rows and not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = x.detach().requires_grad_()
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stu_layer(
            x,
            offsets,
            max(LENGTHS),
            **params,
            **SHAPE,
            dropout_p=0.1,
            seed=seed,
            training=True,
            recompute=mode,
            kernels="triton",
        )
    return sum(storages.values())


@needs_interpreter
@pytest.mark.parametrize("mode", ["none", "cheap", "layer"])
def test_kept_bytes_are_the_memory_plans_inventory(mode, gen):
    x, params, offsets, _ = inputs(gen)
    kept = saved_activation_bytes(mode, x, params, offsets, 5)
    shape = ActivationShape.from_config(
        ModelConfig(d_model=D, num_heads=HEADS, qk_dim=QK, v_dim=V, sequence_dtype="float32", linear_dropout=0.1)
    )
    assert kept == stu_kept_bytes_per_token(shape, mode) * x.shape[0]


def test_bad_recompute_mode_is_one_line(gen):
    x, params, offsets, dout = inputs(gen)
    with pytest.raises(ValueError, match="recompute='some' is not one of none, cheap, layer"):
        run("some", "pytorch", x, params, offsets, dout, 1, 0)
