"""Jagged HSTU attention: the Triton kernels (through the interpreter on the CPU) against the PyTorch
reference in float64, the reference against a plain per-sequence loop, and the mask semantics.

Every run draws fresh inputs (the seed is in each failure message); outputs are poisoned with NaN
before the kernels run, so an unwritten element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

from dlrmv4.ops.attention import hstu_attention
from dlrmv4.ops.reference.attention import hstu_attention_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def make_batch(lengths, heads: int, dqk: int, dv: int, dtype, device, seed: int, targets=None):
    """q, k, v as non-contiguous [T, H, D] views of one [T, H*(2*dv+2*dqk)] projection (u|v|q|k), plus
    int64 offsets and the num_targets tensor (None, an int for every sequence, or a list)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    total = int(sum(lengths))
    width = heads * (2 * dv + 2 * dqk)
    proj = torch.randn(total, width, generator=gen, device=device).to(dtype)
    cuts = [heads * dv, 2 * heads * dv, 2 * heads * dv + heads * dqk, width]
    v = proj[:, cuts[0] : cuts[1]].view(total, heads, dv)
    q = proj[:, cuts[1] : cuts[2]].view(total, heads, dqk)
    k = proj[:, cuts[2] : cuts[3]].view(total, heads, dqk)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    if isinstance(targets, int):
        targets = [targets] * len(lengths)
    num_targets = None if targets is None else torch.tensor(targets, dtype=torch.int64, device=device)
    return q, k, v, offsets.to(device), num_targets


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite values (unwritten or overflowed elements)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def poison_outputs(monkeypatch) -> None:
    """Every output buffer the kernels allocate starts as NaN."""
    from dlrmv4.ops.triton import attention as tri

    def nan_empty(*shape, dtype=None, device=None):
        return torch.full(*shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(tri, "_empty", nan_empty)


def forward_backward(q, k, v, offsets, n, targets, alpha, kernels, grad_out=None, compute_dtype=None):
    """(out, dq, dk, dv, grad_out) with leaf copies of q, k, v (cast to compute_dtype when given)."""
    leaves = [t.detach().to(compute_dtype or t.dtype).requires_grad_() for t in (q, k, v)]
    out = hstu_attention(*leaves, offsets, n, num_targets=targets, alpha=alpha, kernels=kernels)
    if grad_out is None:
        grad_out = torch.randn(out.shape, dtype=torch.float64).to(out.device)
    out.backward(grad_out.to(out.dtype))
    return (out, *(t.grad for t in leaves), grad_out)


def check_against_reference(q, k, v, offsets, n, targets, alpha, tol, seed, kernels="triton"):
    got = forward_backward(q, k, v, offsets, n, targets, alpha, kernels)
    ref = forward_backward(
        q, k, v, offsets, n, targets, alpha, "pytorch", grad_out=got[-1], compute_dtype=torch.float64
    )
    for name, a, b in zip(("out", "dq", "dk", "dv"), got[:4], ref[:4]):
        assert a.dtype == q.dtype and a.shape == b.shape
        err = rel_err(a, b)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e} (seed {seed})"


def naive(q, k, v, offsets, n, targets, alpha):
    """The definition, one sequence and one (i, j) rule at a time (float64)."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for b in range(len(offsets) - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        length = hi - lo
        prefix = length - (0 if targets is None else int(targets[b]))
        mask = torch.tensor(
            [[float((j <= i and j < prefix) or j == i) for j in range(length)] for i in range(length)],
            dtype=torch.float64,
        )
        s = torch.einsum("ihd,jhd->hij", q[lo:hi].double(), k[lo:hi].double())
        a = torch.nn.functional.silu(alpha * s) * mask / n
        out[lo:hi] = torch.einsum("hij,jhd->ihd", a, v[lo:hi].double())
    return out


def random_lengths(gen: torch.Generator, batch: int, max_len: int) -> list[int]:
    """0, 1, an odd length and the maximum first, random lengths after."""
    fixed = [0, 1, 2 * int(torch.randint(1, max_len // 2, (1,), generator=gen)) - 1, max_len]
    rest = torch.randint(0, max_len + 1, (max(0, batch - len(fixed)),), generator=gen).tolist()
    lengths = (fixed + rest)[:batch]
    return [lengths[i] for i in torch.randperm(batch, generator=gen).tolist()]


def test_reference_matches_the_definition():
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, 5, 23)
    targets = torch.randint(0, 4, (5,), generator=gen).tolist()
    for tg in (None, targets):
        q, k, v, offsets, nt = make_batch(lengths, 2, 8, 4, torch.float64, "cpu", seed, tg)
        ref = hstu_attention_reference(q, k, v, offsets, max(lengths), nt, 0.3)
        err = rel_err(ref, naive(q, k, v, offsets, max(lengths), nt, 0.3))
        assert err < 1e-12, f"relative error {err:.2e} (seed {seed})"


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
@pytest.mark.parametrize("targets", [None, 1, "random"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_triton_matches_reference(monkeypatch, dtype, tol, targets, batch):
    poison_outputs(monkeypatch)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(torch.randint(40, 70, (1,), generator=gen))] if batch == 1 else random_lengths(gen, batch, 67)
    if targets == "random":  # several candidates, sometimes more than the sequence holds
        targets = torch.randint(0, 20, (batch,), generator=gen).tolist()
    q, k, v, offsets, nt = make_batch(lengths, 2, 32, 16, dtype, "cpu", seed, targets)
    check_against_reference(q, k, v, offsets, max(lengths), nt, 0.25, tol, seed)


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)")
def test_atomic_dq_and_larger_normaliser(monkeypatch):
    """dQ through fp32 atomics gives the same gradients; N larger than the longest sequence only
    scales (and idles grid rows)."""
    from dlrmv4.ops.triton import attention as tri

    poison_outputs(monkeypatch)
    monkeypatch.setattr(tri, "DQ_MODE", "atomic")
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, 4, 45)
    q, k, v, offsets, nt = make_batch(lengths, 1, 16, 32, torch.float32, "cpu", seed, 2)
    check_against_reference(q, k, v, offsets, 80, nt, 0.4, 1e-5, seed)


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)")
def test_atomic_dq_is_refused_under_deterministic_algorithms(deterministic_algorithms):
    from dlrmv4.ops.triton import attention as tri

    q, k, v, offsets, nt = make_batch([9, 5], 1, 16, 16, torch.float32, "cpu", 0, 1)
    with pytest.raises(RuntimeError, match="dq_mode='atomic'.*deterministic"):
        tri.attention_bwd(torch.ones_like(v), q, k, v, offsets, nt, 9, 0.5, dq_mode="atomic")


@pytest.mark.parametrize("kernels", ["pytorch"] + (["triton"] if INTERPRET else []))
def test_mask_semantics(kernels):
    """A future token, and another candidate, leave a row's output unchanged; prefix rows never see
    candidates; a candidate sees the whole prefix and itself."""
    seed = fresh_seed()
    length, n_t = 37, 3
    prefix = length - n_t
    q, k, v, offsets, nt = make_batch([length], 1, 16, 16, torch.float32, "cpu", seed, n_t)
    q, k, v = (t.clone() for t in (q, k, v))

    def run(kk, vv):
        return hstu_attention(q, kk, vv, offsets, length, num_targets=nt, alpha=0.5, kernels=kernels)

    base = run(k, v)
    for j in (5, prefix - 1, prefix + 1):  # perturb key/value j; only rows that may see j change
        k2, v2 = k.clone(), v.clone()
        k2[j] += 3.0
        v2[j] -= 2.0
        changed = (run(k2, v2) - base).abs().amax(dim=(1, 2)) > 0
        sees = torch.tensor([(j <= i and j < prefix) or j == i for i in range(length)])
        assert torch.equal(changed, sees), f"key {j}: rows changed {changed.nonzero().flatten().tolist()} (seed {seed})"


def test_reference_bf16_long_sequences_stay_finite():
    seed = fresh_seed()
    lengths = [1100, 1, 0, 1031]
    q, k, v, offsets, nt = make_batch(lengths, 2, 64, 64, torch.bfloat16, "cpu", seed, 1)
    q, k, v = (t * 8 for t in (q, k, v))  # large scores: bf16 arithmetic would overflow
    out = hstu_attention(q, k, v, offsets, 1100, num_targets=nt, alpha=64**-0.5, kernels="pytorch")
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    ref = hstu_attention_reference(*(t.double() for t in (q, k, v)), offsets, 1100, nt, 64**-0.5)
    assert rel_err(out, ref) < 1e-2


def test_dispatch_and_input_checks():
    q, k, v, offsets, _ = make_batch([3, 4], 2, 16, 16, torch.float32, "cpu", 0)
    auto = hstu_attention(q, k, v, offsets, 4, alpha=0.2)  # CPU tensors: auto takes the reference
    torch.testing.assert_close(auto, hstu_attention_reference(q, k, v, offsets, 4, None, 0.2))
    with pytest.raises(ValueError, match="kernels"):
        hstu_attention(q, k, v, offsets, 4, alpha=0.2, kernels="cuda")
    with pytest.raises(ValueError, match="share a dtype"):
        hstu_attention(q, k.double(), v, offsets, 4, alpha=0.2)
    with pytest.raises(ValueError, match=r"\[T, H, Dqk\]"):
        hstu_attention(q[:, :1], k, v, offsets, 4, alpha=0.2)
    with pytest.raises(ValueError, match="max_seq_len"):
        hstu_attention(q, k, v, offsets, torch.tensor(4), alpha=0.2)
    with pytest.raises(ValueError, match="num_targets"):
        hstu_attention(q, k, v, offsets, 4, num_targets=torch.ones(3, dtype=torch.int64), alpha=0.2)
    if INTERPRET:
        with pytest.raises(ValueError, match="power of two"):
            hstu_attention(q[..., :12], k[..., :12], v, offsets, 4, alpha=0.2, kernels="triton")


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)")
def test_empty_batch():
    q, k, v, offsets, _ = make_batch([0, 0], 1, 16, 16, torch.float32, "cpu", 0)
    for kernels in ("triton", "pytorch"):
        out, dq, dk, dv, _ = forward_backward(q, k, v, offsets, 0, None, 0.2, kernels)
        assert out.shape == (0, 1, 16) and dq.shape == (0, 1, 16)


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)")
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_backward_into_column_slices_of_one_buffer(monkeypatch, dq_mode):
    """attention_bwd(out=...) writes dq, dk, dv into the q, k, v columns of one [T, W] gradient, equal
    to the gradients it returns otherwise, and leaves the other columns alone."""
    from dlrmv4.ops.triton.attention import attention_bwd

    poison_outputs(monkeypatch)
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, 4, 45)
    heads, dqk, dv = 2, 32, 16
    q, k, v, offsets, _ = make_batch(lengths, heads, dqk, dv, torch.float32, "cpu", seed)
    do = torch.randn(v.shape, generator=gen)
    args = (do, q, k, v, offsets, None, max(lengths), 0.3)
    fresh = attention_bwd(*args, dq_mode=dq_mode)
    grad = torch.full((q.shape[0], heads * (2 * dv + 2 * dqk)), 7.0)
    cols = [
        grad[:, lo : lo + heads * d].unflatten(1, (heads, d))
        for lo, d in ((2 * heads * dv, dqk), (2 * heads * dv + heads * dqk, dqk), (heads * dv, dv))
    ]
    got = attention_bwd(*args, dq_mode=dq_mode, out=tuple(cols))
    for name, a, slot, e in zip(("dq", "dk", "dv"), got, cols, fresh):
        assert a.data_ptr() == slot.data_ptr(), f"{name} not returned in its buffer"
        torch.testing.assert_close(slot, e, rtol=0, atol=0, msg=f"{name} (seed {seed})")
    assert (grad[:, : heads * dv] == 7).all(), "the u columns were written"
    with pytest.raises(ValueError, match="out must be"):
        attention_bwd(*args, out=(cols[0], cols[1], cols[0]))


def check_column_sums(q, k, v, offsets, num_targets, n: int, alpha: float, dq_mode: str, seed: int) -> None:
    """attention_bwd(col_sums=...) against the sums of the gradients it returns."""
    from dlrmv4.ops.triton.attention import attention_bwd

    gen = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(v.shape, generator=gen, device=q.device).to(q.dtype)
    args = (do, q, k, v, offsets, num_targets, n, alpha)
    heads, dqk, dv = q.shape[1], q.shape[2], v.shape[2]
    sums = tuple(torch.full((heads * d,), float("nan"), device=q.device) for d in (dqk, dqk, dv))
    grads = attention_bwd(*args, dq_mode=dq_mode, col_sums=sums)
    # fp32: the same values in another order. 16-bit: the returned gradients are rounded (the
    # interpreter truncates: up to 2^-7 of a value), the sums are not.
    tol = 1e-5 if q.dtype == torch.float32 else 1e-2
    for name, g, got in zip(("dq", "dk", "dv"), grads, sums):
        expected = g.double().sum(0).flatten()
        scale = g.double().abs().sum(0).flatten().clamp_min(1e-6)
        err = ((got.double() - expected).abs() / scale).max().item()
        assert err < tol, f"{name}: column sums off by {err:.1e} (seed {seed})"
    with pytest.raises(ValueError, match="col_sums must be"):
        attention_bwd(*args, col_sums=(sums[0], sums[1], sums[1][:1]))


@pytest.mark.skipif(not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)")
@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_column_sums(dq_mode, dtype):
    """attention_bwd(col_sums=...) gives each gradient's sum over its rows (what a bias of the q, k,
    v projection gets), summed before rounding: with targets, empty sequences and an N above the
    longest sequence (so some programs have no rows)."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    lengths = random_lengths(gen, 5, 45)
    targets = torch.randint(0, 3, (len(lengths),), generator=gen).tolist()
    q, k, v, offsets, num_targets = make_batch(lengths, 2, 32, 16, dtype, "cpu", seed, targets)
    check_column_sums(q, k, v, offsets, num_targets, max(lengths) + 40, 0.3, dq_mode, seed)


def test_silu_form_is_chosen_per_kernel_kind():
    """One SiLU form for every kernel, or a form per kernel kind with the others at their default;
    a kind that does not exist, or a form the target cannot run, is refused."""
    from dlrmv4.ops.triton.attention import _silu_form
    from dlrmv4.ops.triton.targets import TARGETS

    hopper, mi300 = (next(t for t in TARGETS if t.name == name) for name in ("sm_90", "gfx942"))
    bf16 = torch.bfloat16

    def forms(choice, target=hopper, dtype=bf16):
        return [_silu_form(target, dtype, choice, kind) for kind in ("fwd", "dkdv", "dq")]

    assert forms(None) == ["tanh", "bf16x2", "tanh"]
    assert forms("tanh") == ["tanh", "tanh", "tanh"]
    assert forms({"dq": "bf16x2"}) == ["tanh", "bf16x2", "bf16x2"]
    assert forms({"dkdv": "tanh", "fwd": "sigmoid"}) == ["sigmoid", "tanh", "tanh"]
    assert forms(None, mi300) == ["sigmoid"] * 3
    assert forms(None, None, torch.float32) == ["sigmoid"] * 3
    with pytest.raises(ValueError, match="not kernel kinds"):
        forms({"bwd": "tanh"})
    with pytest.raises(ValueError, match="not available"):
        forms({"dq": "bf16x2"}, mi300)
    with pytest.raises(ValueError, match="not available"):
        forms({"dq": "bf16x2"}, hopper, torch.float16)
