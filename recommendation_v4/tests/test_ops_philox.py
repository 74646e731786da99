"""The torch copy of Triton's Philox (``reference/philox.py``) against ``tl.randint4x`` itself (a
tiny kernel: interpreted on the CPU, compiled where CUDA is present) for random seeds and offsets
beyond 2^32, and against golden values (the Random123 known answer among them)."""

from __future__ import annotations

import secrets

import pytest
import torch
from test_ops_layer_norm import gen  # noqa: F401  (fixture)

from dlrmv4.ops.dispatch import interpreting, triton_available
from dlrmv4.ops.reference.philox import philox_randint4x, split16

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not triton_available() or (DEVICE == "cpu" and not interpreting()),
    reason="needs Triton and a GPU or the Triton interpreter",
)
if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["seed"])
    def _randint4x_kernel(O, OUT, n, seed, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        r0, r1, r2, r3 = tl.randint4x(seed, tl.load(O + i, mask=m, other=0))
        tl.store(OUT + i, r0.to(tl.uint32, bitcast=True).to(tl.int64), mask=m)
        tl.store(OUT + n + i, r1.to(tl.uint32, bitcast=True).to(tl.int64), mask=m)
        tl.store(OUT + 2 * n + i, r2.to(tl.uint32, bitcast=True).to(tl.int64), mask=m)
        tl.store(OUT + 3 * n + i, r3.to(tl.uint32, bitcast=True).to(tl.int64), mask=m)


def triton_randint4x(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """int64 [4, N]: ``tl.randint4x(seed, offsets)`` as uint32 values."""
    n = offsets.numel()
    out = torch.full((4, n), -1, dtype=torch.int64, device=offsets.device)
    _randint4x_kernel[(triton.cdiv(n, 128),)](offsets, out, n, seed, BLOCK=128)
    return out


def random_offsets(gen: torch.Generator) -> torch.Tensor:
    """Small offsets, both sides of 2^32 and 2^40, and random ones up to 2^62."""
    edges = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**40 - 1, 2**40, 2**62 - 1])
    return torch.cat(
        [
            edges,
            torch.arange(2, 40),
            torch.randint(0, 2**62, (200,), generator=gen),
            torch.randint(0, 2**33, (100,), generator=gen),
        ]
    ).to(DEVICE)


@needs_triton
def test_equals_triton_randint4x(gen):
    offsets = random_offsets(gen)
    seeds = [
        0,
        1,
        2**31 - 2,
        2**31 - 1,
        2**32 - 1,
        2**32,
        2**32 + 5,
        2**63 - 1,
        secrets.randbits(31),
        secrets.randbits(40),
        secrets.randbits(63),
    ]
    for seed in seeds:
        want = triton_randint4x(seed, offsets)
        got = torch.stack(philox_randint4x(seed, offsets))
        assert got.dtype == torch.int64 and got.device == offsets.device
        assert torch.equal(got, want), f"seed {seed}"


def test_golden_values():
    # Philox-4x32-10 of counter 0 and key 0: the known-answer test of Random123.
    assert [int(v) for v in philox_randint4x(0, torch.zeros(1, dtype=torch.int64))] == [
        0x6627E8D5,
        0xE169C58D,
        0xBC57AC4C,
        0x9B00DBD8,
    ]
    # Checked against tl.randint4x (Triton 3.6): a high key word and a high counter word.
    assert [int(v) for v in philox_randint4x(2**32 + 5, torch.tensor([2**33 + 3]))] == [
        3097703545,
        39102689,
        3724376591,
        1937335724,
    ]
    assert [int(v) for v in philox_randint4x(12345, torch.tensor([7]))] == [
        2667469288,
        1132955194,
        352380175,
        2594486496,
    ]


def test_values_are_uint32_and_shaped_like_the_offsets(gen):
    offsets = torch.randint(0, 2**62, (3, 5, 7), generator=gen)
    for r in philox_randint4x(secrets.randbits(63), offsets):
        assert r.shape == offsets.shape and r.dtype == torch.int64
        assert r.min() >= 0 and r.max() < 2**32
    n = torch.stack(philox_randint4x(7, torch.arange(20000)))
    # Uniform bits: every bit set about half the time (4 σ of 80k draws is 0.7%).
    bits = (n[..., None] >> torch.arange(32)) & 1
    assert (bits.float().mean((0, 1)) - 0.5).abs().max() < 0.01


def test_split16():
    x = torch.tensor([[0x12345678, 0xFFFF0000]])
    assert split16(x).tolist() == [[0x5678, 0x1234, 0x0000, 0xFFFF]]


@pytest.mark.parametrize("seed", [-1, 2**63, 1.0, True])
def test_bad_seed_is_reported(seed):
    with pytest.raises(ValueError, match="seed must be an int"):
        philox_randint4x(seed, torch.zeros(1, dtype=torch.int64))


def test_offsets_must_be_int64():
    with pytest.raises(ValueError, match="int64"):
        philox_randint4x(0, torch.zeros(1, dtype=torch.int32))
