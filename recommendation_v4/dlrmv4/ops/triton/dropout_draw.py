"""The Triton kernels' dropout draw: keep decisions as a pure function of (seed, counter row, column).

Counter row r of a draw of D columns, column group g = c // 8: ``randint4x(seed, r * ceil(D / 8) + g)``
gives four 32-bit numbers n0..n3; column 8g + 2i takes the low 16 bits of n_i and 8g + 2i + 1 the
high 16 bits, and is kept iff that value is >= round(p * 2^16). One Philox call gives 8 decisions
from all four of its words (Philox is the draw's cost: 10 rounds of two 32x32-bit products a call).
``reference/philox.py``'s ``keep_decisions`` draws the same in torch.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split16(r, threshold):
    """Each 32-bit number of r [M, P] -> two decisions (low half, high half) -> [M, 2P], interleaved:
    column 2j takes the low 16 bits of number j, column 2j + 1 the high 16 bits."""
    r = r.to(tl.uint32, bitcast=True)
    lo = (r & 0xFFFF).to(tl.int32) >= threshold
    hi = (r >> 16).to(tl.int32) >= threshold
    both = tl.join(lo, hi)
    return tl.reshape(both, (both.shape[0], 2 * both.shape[1]))


@triton.jit
def keep8(seed, counter_rows, groups_per_row, d0, threshold, BLOCK_D: tl.constexpr):
    """Keep decisions [M, BLOCK_D] of columns d0 .. d0 + BLOCK_D - 1 (d0 a multiple of 8, BLOCK_D of
    8) of the counter rows ``counter_rows`` (int64 [M, 1]), ``groups_per_row`` = ceil(D / 8)."""
    groups = d0 // 8 + tl.arange(0, BLOCK_D // 8)
    n0, n1, n2, n3 = tl.randint4x(seed, counter_rows * groups_per_row + groups[None, :])
    # [M, G, 2, 2] with [m, g, j, k] = n_(2j + k): flattened, 32-bit number 4g + i is n_i of group g.
    n = tl.join(tl.join(n0, n2), tl.join(n1, n3))
    return split16(tl.reshape(n, (n.shape[0], BLOCK_D // 2)), threshold)
