"""Jagged HSTU attention at the reference shape on the GPU (B=32, H=4, d=128, lengths ~2,740-4,095):
the compiled Triton kernels against the float64 reference, both dQ modes, the mask semantics, and
no re-tuning inside a max_seq_len bucket. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_ops_attention import check_against_reference, check_column_sums, fresh_seed, make_batch, poison_outputs

from dlrmv4.ops.attention import hstu_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEADS, DIM, BATCH = 4, 128, 32
ALPHA = DIM**-0.5


def reference_lengths(gen: torch.Generator) -> list[int]:
    """Random lengths in [2,740, 4,095] plus the edge cases 0, 1, an odd length and the maximum."""
    lengths = torch.randint(2_740, 4_096, (BATCH,), generator=gen).tolist()
    lengths[:4] = [0, 1, 2_741 + 2 * int(torch.randint(0, 600, (1,), generator=gen)), 4_095]
    return [lengths[i] for i in torch.randperm(BATCH, generator=gen).tolist()]


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-4), (torch.float16, 1e-2)])
@pytest.mark.parametrize("targets", [1, "random"])
def test_full_size_matches_float64_reference(monkeypatch, dtype, tol, targets, dq_mode):
    from dlrmv4.ops.triton import attention as tri

    if dtype != torch.bfloat16 and (dq_mode == "atomic" or targets != 1):
        pytest.skip("fp32 / fp16 run once (their SiLU and product paths do not depend on the mode)")
    poison_outputs(monkeypatch)
    monkeypatch.setattr(tri, "DQ_MODE", dq_mode)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = reference_lengths(gen)
    if targets == "random":
        targets = torch.randint(0, 64, (BATCH,), generator=gen).tolist()
    q, k, v, offsets, nt = make_batch(lengths, HEADS, DIM, DIM, dtype, "cuda", seed, targets)
    check_against_reference(q, k, v, offsets, max(lengths), nt, ALPHA, tol, seed)


@pytest.mark.parametrize(
    "silu", ["tanh", "bf16x2", "sigmoid", {"dq": "bf16x2"}], ids=["tanh", "bf16x2", "sigmoid", "dq-bf16x2"]
)
def test_every_silu_form_matches_the_reference(monkeypatch, silu):
    """Each SiLU form the kernels can take on this GPU, in every kernel or in one kind only (the
    benchmark's variants), against the float64 reference."""
    from dlrmv4.ops.triton import attention as tri

    monkeypatch.setattr(tri, "attention_fwd", functools.partial(tri.attention_fwd, silu=silu))
    monkeypatch.setattr(tri, "attention_bwd", functools.partial(tri.attention_bwd, silu=silu))
    poison_outputs(monkeypatch)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = reference_lengths(gen)
    targets = torch.randint(0, 64, (BATCH,), generator=gen).tolist()
    q, k, v, offsets, nt = make_batch(lengths, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed, targets)
    check_against_reference(q, k, v, offsets, max(lengths), nt, ALPHA, 2e-2, seed)


def test_deterministic_configs_match_the_reference(monkeypatch, deterministic_algorithms):
    """Under deterministic algorithms each kernel runs its list's first config that fits instead of
    the autotuner's pick (timings differ from one process to the next): no autotuning, the same bits
    twice, and the float64 reference's values."""
    from dlrmv4.ops.triton import attention as tri

    def no_tuning(*args, **kwargs):
        raise AssertionError("autotuned under deterministic algorithms")

    for tuned in (tri._fwd_tuned, tri._dkdv_tuned, tri._dq_tuned):
        monkeypatch.setattr(tuned, "run", no_tuning)
    poison_outputs(monkeypatch)
    seed = fresh_seed()
    lengths = reference_lengths(torch.Generator().manual_seed(seed))
    q, k, v, offsets, nt = make_batch(lengths, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed, 1)
    g = torch.randn_like(v)

    def grads():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        out = hstu_attention(qq, kk, vv, offsets, max(lengths), num_targets=nt, alpha=ALPHA, kernels="triton")
        return (out, *torch.autograd.grad(out, (qq, kk, vv), g))

    for name, a, b in zip(("out", "dq", "dk", "dv"), grads(), grads()):
        assert torch.equal(a, b), name
    check_against_reference(q, k, v, offsets, max(lengths), nt, ALPHA, 2e-2, seed)


def test_mask_semantics_full_length():
    seed = fresh_seed()
    length, n_t = 4_095, 2
    prefix = length - n_t
    q, k, v, offsets, nt = make_batch([length], HEADS, DIM, DIM, torch.bfloat16, "cuda", seed, n_t)
    k, v = k.clone(), v.clone()
    base = hstu_attention(q, k, v, offsets, length, num_targets=nt, alpha=ALPHA, kernels="triton")
    for j in (0, 1_000, prefix - 1, prefix, length - 1):
        k2, v2 = k.clone(), v.clone()
        k2[j] += 3.0
        v2[j] -= 2.0
        out = hstu_attention(q, k2, v2, offsets, length, num_targets=nt, alpha=ALPHA, kernels="triton")
        changed = ((out - base).abs().amax(dim=(1, 2)) > 0).cpu()
        rows = torch.arange(length)
        sees = ((j <= rows) & (j < prefix)) | (rows == j)
        assert torch.equal(changed, sees), f"key {j}: rows changed differ from the mask (seed {seed})"


def test_no_retune_inside_a_bucket():
    from dlrmv4.ops.triton import attention as tri

    gen = torch.Generator().manual_seed(fresh_seed())
    lengths = reference_lengths(gen)
    q, k, v, offsets, nt = make_batch(lengths, HEADS, DIM, DIM, torch.bfloat16, "cuda", 0, 1)
    tuned = []
    for n in (max(lengths), 3_000, 2_049):  # one bucket (4,096): the first call tunes, later ones reuse
        out = hstu_attention(q, k, v, offsets, n, num_targets=nt, alpha=ALPHA, kernels="triton")
        assert torch.isfinite(out).all()
        tuned.append(len(tri._fwd_tuned.cache))
    assert tuned[0] == tuned[-1], f"forward re-tuned inside the bucket: {tuned}"


def test_reference_bf16_full_size_finite():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    q, k, v, offsets, nt = make_batch(reference_lengths(gen), HEADS, DIM, DIM, torch.bfloat16, "cuda", seed, 1)
    out = hstu_attention(q * 4, k * 4, v, offsets, 4_095, num_targets=nt, alpha=ALPHA, kernels="pytorch")
    assert torch.isfinite(out).all(), f"seed {seed}"


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_full_size_column_sums(dq_mode, deterministic):
    """The gradients' column sums (a q, k, v bias's gradient) from the compiled kernels' tiles,
    autotuned or under deterministic algorithms (the first config that fits)."""
    if deterministic and dq_mode == "atomic":
        pytest.skip("atomic dQ is refused under deterministic algorithms")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = reference_lengths(gen)
    targets = torch.randint(0, 64, (BATCH,), generator=gen).tolist()
    q, k, v, offsets, nt = make_batch(lengths, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed, targets)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        check_column_sums(q, k, v, offsets, nt, 4_096, ALPHA, dq_mode, seed)
    finally:
        torch.use_deterministic_algorithms(before)
