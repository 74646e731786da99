"""Triton's Philox generator (``tl.randint4x``, Triton 3.6, 10 rounds) in plain torch integer ops.

The dropout masks of the Triton kernels are a pure function of (seed, counter); this module
computes the same numbers on any device, so the PyTorch reference draws exactly the kernels'
masks without Triton. For an int64 offset Triton runs Philox-4x32 on the counter
(offset & 0xffffffff, offset >> 32, 0, 0) with the key (seed & 0xffffffff, (seed >> 32) &
0xffffffff). Values live in int64 tensors holding uint32s; products of two 32-bit values are
formed from 16-bit halves of one factor so that no intermediate reaches 2^63.
"""

from __future__ import annotations

import operator

import torch

N_ROUNDS = 10
# Counters drawn at once by the references' mask loops: bounds their int64 temporaries (about 2^24
# counters, 128 MiB each) without a loop per row.
COUNTERS_PER_CHUNK = 1 << 24
_MASK32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def _mul32(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32 bits of a · x for a 32-bit constant a and x holding uint32s."""
    p_lo = a * (x & 0xFFFF)  # < 2^48
    p_hi = a * (x >> 16)  # < 2^48; a · x = p_hi · 2^16 + p_lo
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    high = (p_hi + (p_lo >> 16)) >> 16
    return high, low


def philox_randint4x(seed: int, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four uint32 outputs (as int64 tensors shaped like ``offsets``) that ``tl.randint4x(seed,
    offsets)`` gives for int64 offsets >= 0 and an int seed in [0, 2^63)."""
    seed = _index("philox_randint4x", "seed", seed, 2**63)
    if offsets.dtype != torch.int64:
        raise ValueError(f"philox_randint4x: offsets must be int64, got {offsets.dtype}")
    c0, c1 = offsets & _MASK32, (offsets >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(offsets)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(N_ROUNDS):
        hi_b, lo_b = _mul32(_ROUND_B, c2)
        hi_a, lo_a = _mul32(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def split16(x: torch.Tensor) -> torch.Tensor:
    """[..., P] uint32s -> [..., 2P] 16-bit values: element 2j the low half of x[j], 2j + 1 the
    high half (the kernels' layout of two dropout decisions per 32-bit number)."""
    return torch.stack((x & 0xFFFF, x >> 16), dim=-1).flatten(-2)


def keep_decisions(seed: int, counter_rows: torch.Tensor, d: int, threshold: int) -> torch.Tensor:
    """bool [len(counter_rows), d]: the keep decisions of the Triton kernels' draw
    (``triton/dropout_draw.py``) for columns 0 .. d - 1 of the int64 ``counter_rows``: column 8g + 2i
    of row r is the low (8g + 2i + 1: the high) 16 bits of number i of ``randint4x(seed, r * ceil(d /
    8) + g)``, kept iff >= ``threshold``."""
    groups = (d + 7) // 8
    counters = counter_rows[:, None] * groups + torch.arange(groups, device=counter_rows.device)
    numbers = torch.stack(philox_randint4x(seed, counters), dim=-1)  # [R, G, 4]
    return split16(numbers).flatten(1)[:, :d] >= threshold


def dropout_threshold(dropout_p: float) -> int:
    """An element is dropped iff its 16-bit uniform is below this (p rounded to a multiple of 2^-16)."""
    return round(dropout_p * 65536)


def _index(op: str, name: str, value, end: int) -> int:
    """value as a Python int in [0, end) (NumPy integers pass; floats and bools do not)."""
    try:
        got = operator.index(value)
    except TypeError:
        got = -1
    if isinstance(value, bool) or not 0 <= got < end:
        raise ValueError(f"{op}: {name} must be an int in [0, 2**{end.bit_length() - 1}), got {value!r}")
    return got


def check_dropout(op: str, dropout_p: float, seed: int, row_offset: int) -> tuple[int, int]:
    """(seed, row_offset) as Python ints; one ValueError line for a bad probability, seed or offset."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{op}: dropout_p={dropout_p} must be in [0, 1)")
    return _index(op, "seed", seed, 2**63), _index(op, "row_offset", row_offset, 2**62)
