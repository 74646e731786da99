"""The persistent backward kernels' grid: no more programs than the GPU holds at once."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.ops.triton.layer_norm import backward as layer_norm_backward
from dlrmv4.ops.triton.occupancy import blocks_per_sm, persistent_grid

H100_SM = dict(sm_registers=65_536, sm_shared=233_472, sm_warps=64)


@pytest.mark.parametrize(
    "registers,shared,warps,blocks",
    [
        (48, 4_096, 8, 5),  # the LayerNorm backward's old launch: 8 an SM asked, 5 held
        (80, 4_096, 8, 3),  # the output block's backward
        (32, 0, 4, 16),  # warps bound it: 64 warps an SM
        (16, 0, 1, 32),  # the blocks-per-SM limit
        (32, 100_000, 4, 2),  # shared memory bounds it (1 KB a block reserved)
        (255, 0, 16, 1),  # a block that alone fills the registers still runs
    ],
)
def test_blocks_per_sm(registers, shared, warps, blocks):
    assert blocks_per_sm(registers, shared, warps, **H100_SM) == blocks


def test_grid_on_cpu_is_small_and_never_empty():
    assert persistent_grid(None, torch.device("cpu"), torch.float32, 1_000, 8, {}, lambda p: ()) == 4
    assert persistent_grid(None, torch.device("cpu"), torch.float32, 2, 8, {}, lambda p: ()) == 2
    assert persistent_grid(None, torch.device("cpu"), torch.float32, 0, 8, {}, lambda p: ()) == 1


def test_layer_norm_backward_with_many_row_blocks_per_program():
    """Under the interpreter four programs loop over every row block; the sums come out whole."""
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(203, 24, generator=gen), torch.randn(203, 24, generator=gen)
    w, b = torch.randn(24, generator=gen), torch.randn(24, generator=gen)
    mean, rstd = x.mean(1), (x.var(1, unbiased=False) + 1e-5).rsqrt()
    dx, dw, db = layer_norm_backward(x, w, b, dy, mean, rstd, swish=False)
    x64 = x.double().requires_grad_()
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    torch.nn.functional.layer_norm(x64, (24,), w64, b64, 1e-5).backward(dy.double())
    for got, want in ((dx, x64.grad), (dw, w64.grad), (db, b64.grad)):
        assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)
