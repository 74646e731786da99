"""The HSTU model on the CPU: forward/backward, Triton (interpreter) vs PyTorch parity, FLOPs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from model_inputs import random_batch, random_embeddings

from dlrmv4.config import ModelConfig
from dlrmv4.config_loading import load_config
from dlrmv4.model.flops import batch_flops, dense_flops_per_sample
from dlrmv4.model.hstu import DlrmHSTU

SMALL = ModelConfig(
    embedding_dim=16,
    d_model=32,
    num_layers=2,
    num_heads=2,
    qk_dim=16,
    v_dim=16,
    preprocessor_hidden=16,
    action_dim=4,
    item_tower_hidden=16,
    head_hidden=16,
    num_position_buckets=64,
    num_time_buckets=32,
    sequence_dtype="float32",
)
LENGTHS = [0, 1, 7, 20, 3]


def _model(cfg: ModelConfig, seed: int = 0) -> DlrmHSTU:
    torch.manual_seed(seed)
    return DlrmHSTU(cfg, seed=seed)


def _grads(model: DlrmHSTU) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_forward_backward_reaches_every_parameter():
    model = _model(dataclasses.replace(SMALL, kernels="pytorch"))
    batch = random_batch(LENGTHS, seed=1)
    emb = random_embeddings(batch, SMALL.embedding_dim, seed=2)
    out = model(batch, emb)
    assert out.logits.shape == (len(LENGTHS),) and out.logits.dtype == torch.float32
    assert torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert missing == []
    assert emb.item.grad is not None and emb.contextual.grad is not None


def test_triton_kernels_match_the_pytorch_reference():
    """The same weights, inputs and no dropout: Triton (interpreter, fp32) vs the PyTorch reference."""
    cfg = dataclasses.replace(SMALL, input_dropout=0.0, linear_dropout=0.0)
    batch = random_batch(LENGTHS, seed=int(np.random.SeedSequence().entropy % 2**31))
    results = {}
    for kernels in ("pytorch", "triton"):
        model = _model(dataclasses.replace(cfg, kernels=kernels), seed=3)
        emb = random_embeddings(batch, cfg.embedding_dim, seed=4)
        out = model(batch, emb)
        out.loss.backward()
        results[kernels] = (out.logits.detach(), out.loss.detach(), _grads(model), emb.item.grad)
    ref, tri = results["pytorch"], results["triton"]
    assert _rel(tri[0], ref[0]) < 1e-4
    assert _rel(tri[1], ref[1]) < 1e-4
    assert ref[2].keys() == tri[2].keys()
    for name in ref[2]:
        assert _rel(tri[2][name], ref[2][name]) < 1e-3, name
    assert _rel(tri[3], ref[3]) < 1e-3


def test_dropout_is_reproducible_from_the_seed():
    cfg = dataclasses.replace(SMALL, kernels="triton", input_dropout=0.0, linear_dropout=0.3)
    batch = random_batch(LENGTHS, seed=5)
    emb = random_embeddings(batch, cfg.embedding_dim, seed=6)
    losses = [float(_model(cfg, seed=s)(batch, emb).loss.detach()) for s in (7, 7)]
    assert losses[0] == losses[1]
    other = _model(cfg, seed=7)
    other.dropout_generator.manual_seed(8)
    assert float(other(batch, emb).loss.detach()) != losses[0]


def test_eval_mode_has_no_dropout():
    cfg = dataclasses.replace(SMALL, kernels="pytorch", input_dropout=0.5, linear_dropout=0.5)
    model = _model(cfg).eval()
    batch = random_batch(LENGTHS, seed=9)
    emb = random_embeddings(batch, cfg.embedding_dim, seed=10)
    assert torch.equal(model(batch, emb).logits, model(batch, emb).logits)


def test_bf16_autocast_keeps_head_and_loss_in_fp32():
    model = _model(dataclasses.replace(SMALL, kernels="pytorch", sequence_dtype="bfloat16"))
    batch = random_batch([5, 9], seed=11)
    emb = random_embeddings(batch, SMALL.embedding_dim, seed=12)
    assert model.user_representation(batch, emb, model.slice_context(batch)).dtype == torch.bfloat16
    out = model(batch, emb)
    assert out.logits.dtype == torch.float32 and out.loss.dtype == torch.float32 and torch.isfinite(out.loss)


def test_reference_flops_match_the_spec():
    cfg = load_config("yambda-5b").model
    f = dense_flops_per_sample(cfg, 4096)
    assert f.stu == pytest.approx(315.68e9, rel=1e-4)
    assert f.attention / f.stu == pytest.approx(0.571, abs=1e-3)
    assert f.other > 0
    # Exact counts on real lengths add up per sample.
    lengths = [4096, 2048, 100]
    total = batch_flops(cfg, lengths)
    assert total.stu == pytest.approx(sum(dense_flops_per_sample(cfg, s).stu for s in lengths))


def test_tower_takes_its_input_in_column_blocks():
    """tower(a, b) is tower(cat([a, b], -1)) without the concatenation, gradients included."""
    from dlrmv4.model.layers import Tower

    torch.manual_seed(3)
    tower = Tower(24, 16, 8, 1e-6, "pytorch").double()
    a = torch.randn(5, 10, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 14, dtype=torch.float64, requires_grad=True)
    blocks = tower(a, b)
    blocks.square().sum().backward()
    grads = (a.grad, b.grad, tower[0].weight.grad, tower[0].bias.grad)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    tower.zero_grad()
    whole = tower(torch.cat([a2, b2], -1))
    whole.square().sum().backward()
    torch.testing.assert_close(blocks, whole, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, (a2.grad, b2.grad, tower[0].weight.grad, tower[0].bias.grad)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="do not add up to 24"):
        tower(a)
