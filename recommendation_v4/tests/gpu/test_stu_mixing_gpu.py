"""stu_mixing at the model's size on the GPU: about 50k bf16 tokens in 18 jagged sequences up to
4,096, H = 4, Dqk = Dv = 128, dropout 0.1. The compiled Triton path against the reference
composition in float64, against the separate Triton ops, and without host syncs; dropout: the
kernels' mask is the reference's, and a chunk of sequences run with its first row as
``row_offset`` is bit for bit that chunk of the whole run. Skipped without CUDA (see conftest.py).
"""

from __future__ import annotations

import pytest
import torch
from sync_guard import run_without_syncs
from test_ops_attention import poison_outputs
from test_ops_gpu import assert_zeros_follow
from test_ops_layer_norm import gen, poison  # noqa: F401  (fixtures)
from test_ops_stu_mixing import check, fused_and_separate, make_inputs, op_args, run_both

from dlrmv4.ops.output_block import output_block_keep_mask
from dlrmv4.ops.stu_mixing import stu_mixing

CUDA = "cuda"
DIMS = (4, 128, 128)  # heads, Dqk, Dv
MAX_LEN = 4096
P = 0.1


def lengths(gen: torch.Generator) -> list[int]:
    """0, 1, an odd length and 4,096 among 14 random lengths in [2,500, 4,096]: about 50k tokens."""
    rest = torch.randint(2_500, MAX_LEN + 1, (14,), generator=gen).tolist()
    out = [0, 1, 2 * int(torch.randint(1_000, 2_000, (1,), generator=gen)) + 1, MAX_LEN] + rest
    return [out[i] for i in torch.randperm(len(out), generator=gen).tolist()]


@pytest.mark.parametrize("dq_mode", ["separate", "atomic"])
def test_matches_the_float64_reference(monkeypatch, dq_mode, gen):
    """bf16 against float64 on the same bf16 inputs; 2e-2 as the attention's own GPU test (its
    products and SiLU weights are bf16). The attention's outputs start as NaN (the global torch.empty
    poison would also hit the float64 reference's own autograd on CUDA)."""
    from dlrmv4.ops.triton import attention as tri

    poison_outputs(monkeypatch)
    monkeypatch.setattr(tri, "DQ_MODE", dq_mode)
    got, ref = run_both(lengths(gen), DIMS, torch.bfloat16, P, True, gen, CUDA)
    check(got, ref, DIMS, torch.bfloat16, tol=2e-2)


def test_equals_the_separate_triton_ops(monkeypatch, gen, poison):
    """The same kernels at the same launch shapes, only the gradient buffer differs: the same bits
    (dQ from the deterministic 'separate' kernel)."""
    from dlrmv4.ops.triton import attention as tri

    monkeypatch.setattr(tri, "DQ_MODE", "separate")
    fused, separate = fused_and_separate(lengths(gen), DIMS, torch.bfloat16, P, gen, CUDA)
    for name, a, e in zip(("y", "d_uvqk", "d_norm_weight", "d_norm_bias"), fused, separate):
        assert torch.equal(a, e), name


def test_chunks_are_the_whole(monkeypatch, gen, poison):
    """Sequences [i, j) run alone with row_offset = base + their first row (the whole run's N) give
    those rows of the whole run, y and d_uvqk bit for bit (dQ from the deterministic 'separate'
    kernel); the zeros of y are the reference's mask; the norm parameters' gradients add up."""
    from dlrmv4.ops.triton import attention as tri

    monkeypatch.setattr(tri, "DQ_MODE", "separate")
    seq_lengths = lengths(gen)
    uvqk, offsets, w, b = make_inputs(seq_lengths, DIMS, torch.bfloat16, gen, CUDA)
    n, base = max(seq_lengths), 2**25 + 3  # counters past 2^32
    kw = op_args(DIMS, P, 2**40 + int(torch.randint(2**31, (1,), generator=gen)), True)
    y = stu_mixing(uvqk, offsets, n, norm_weight=w, norm_bias=b, kernels="triton", row_offset=base, **kw)
    dy = torch.randn(y.shape, generator=gen).to(CUDA, torch.bfloat16)
    whole = (y, *torch.autograd.grad(y, (uvqk, w, b), dy))
    keep = output_block_keep_mask(uvqk.shape[0], DIMS[0] * DIMS[2], P, kw["seed"], CUDA, base)
    assert_zeros_follow(y, keep)
    dw, db = torch.zeros_like(w), torch.zeros_like(b)
    for i, j in ((0, 5), (5, 11), (11, len(seq_lengths))):
        a, e = int(offsets[i]), int(offsets[j])
        y = stu_mixing(
            uvqk[a:e],
            offsets[i : j + 1] - a,
            n,
            norm_weight=w,
            norm_bias=b,
            kernels="triton",
            row_offset=base + a,
            **kw,
        )
        got = (y, *torch.autograd.grad(y, (uvqk, w, b), dy[a:e]))
        assert torch.equal(got[0], whole[0][a:e]), f"y of sequences [{i}, {j})"
        assert torch.equal(got[1][a:e], whole[1][a:e]), f"d_uvqk of sequences [{i}, {j})"
        dw, db = dw + got[2], db + got[3]
    torch.testing.assert_close(dw, whole[2], rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(db, whole[3], rtol=1e-4, atol=1e-3)


def test_no_host_sync(gen):
    """Forward and backward launch kernels only: no device-to-host wait."""
    seq_lengths = lengths(gen)
    uvqk, offsets, w, b = make_inputs(seq_lengths, DIMS, torch.bfloat16, gen, CUDA)
    kw = op_args(DIMS, P, 5, True)

    def step():
        y = stu_mixing(
            uvqk, offsets, max(seq_lengths), norm_weight=w, norm_bias=b, kernels="triton", row_offset=123_456, **kw
        )
        torch.autograd.grad(y, (uvqk, w, b), torch.ones_like(y))

    run_without_syncs(step)
