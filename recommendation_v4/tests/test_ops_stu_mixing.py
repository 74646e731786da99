"""The fused middle of the STU layer (``stu_mixing``): the Triton path (interpreted on the CPU, one
autograd function writing one gradient buffer) against the reference composition in float64, with
dropout compared through the kernel's own mask; the reference against the definition spelled out.

Inputs are fresh each run (the seed is printed); every torch.empty comes back NaN-filled, so a
column of the gradient buffer that no kernel writes fails the finiteness checks. Dropout: both
paths draw the same mask from (seed, row_offset), and a chunk of whole sequences run with its
first row as ``row_offset`` is that chunk of the whole run.
"""

from __future__ import annotations

import functools
import math
import secrets

import pytest
import torch
from test_ops_attention import INTERPRET, naive, random_lengths
from test_ops_layer_norm import TOL, gen, leaf64, poison, randn, rel_err  # noqa: F401  (fixtures)

from dlrmv4.ops.attention import hstu_attention
from dlrmv4.ops.output_block import output_block, output_block_keep_mask
from dlrmv4.ops.stu_mixing import stu_mixing

EPS = 1e-6
HEADS = 2
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="Triton interpreter tests (tests/gpu/ covers the compiled kernels)"
)


def make_inputs(lengths, dims, dtype, gen, device="cpu"):
    """uvqk [T, H·(2·Dv + 2·Dqk)] as a leaf, int64 offsets, and the attention LayerNorm's weight and
    bias, for dims = (H, Dqk, Dv)."""
    heads, qk_dim, v_dim = dims
    width = heads * (2 * v_dim + 2 * qk_dim)
    uvqk = randn((sum(lengths), width), gen, dtype, device).requires_grad_()
    offsets = torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(device)
    w = randn(heads * v_dim, gen, device=device, scale=0.3, shift=1.0).requires_grad_()
    b = randn(heads * v_dim, gen, device=device, scale=0.3).requires_grad_()
    return uvqk, offsets, w, b


def op_args(dims, p, seed, training):
    heads, qk_dim, v_dim = dims
    return dict(
        num_heads=heads,
        qk_dim=qk_dim,
        v_dim=v_dim,
        alpha=qk_dim**-0.5,
        eps=EPS,
        dropout_p=p,
        seed=seed,
        training=training,
    )


def run_both(lengths, dims, dtype, p, training, gen, device="cpu"):
    """(y, d_uvqk, d_weight, d_bias) of the Triton path and of the float64 reference composition
    (dropout through the kernel's mask), for the same upstream gradient."""
    uvqk, offsets, w, b = make_inputs(lengths, dims, dtype, gen, device)
    n, seed = max(lengths), secrets.randbits(31)
    kw = op_args(dims, p, seed, training)
    y = stu_mixing(uvqk, offsets, n, norm_weight=w, norm_bias=b, kernels="triton", **kw)
    dy = randn(y.shape, gen, dtype, device)
    y.backward(dy)
    mask = output_block_keep_mask(uvqk.shape[0], dims[0] * dims[2], p, seed, device)
    u64, w64, b64 = leaf64(uvqk), leaf64(w), leaf64(b)
    ref = stu_mixing(u64, offsets, n, norm_weight=w64, norm_bias=b64, kernels="pytorch", keep_mask=mask, **kw)
    ref.backward(dy.double())
    return (y, uvqk.grad, w.grad, b.grad), (ref, u64.grad, w64.grad, b64.grad)


def column_blocks(dims) -> dict[str, tuple[int, int]]:
    """The (first, end) columns of u, v, q, k in uvqk."""
    heads, qk_dim, v_dim = dims
    hv, hqk = heads * v_dim, heads * qk_dim
    return {"u": (0, hv), "v": (hv, 2 * hv), "q": (2 * hv, 2 * hv + hqk), "k": (2 * hv + hqk, 2 * hv + 2 * hqk)}


def check(got, ref, dims, dtype, tol: float | None = None) -> None:
    """y, each column block of d_uvqk on its own (so a small one cannot hide in a large one), and the
    LayerNorm parameters' gradients, within ``tol`` (default: the dtype's) relative error."""
    tol = tol or TOL[dtype]
    y, d_uvqk, dw, db = got
    assert y.dtype == dtype and d_uvqk.dtype == dtype
    pairs = [("y", y, ref[0]), ("d_norm_weight", dw, ref[2]), ("d_norm_bias", db, ref[3])]
    pairs += [(f"d{name}", d_uvqk[:, lo:hi], ref[1][:, lo:hi]) for name, (lo, hi) in column_blocks(dims).items()]
    for name, out, r in pairs:
        assert out.shape == r.shape and torch.isfinite(out).all(), f"{name}: shape or non-finite values"
        err = rel_err(out, r)
        assert err < tol, f"{name}: relative error {err:.2e} over {tol:.0e}"


def separate_ops(uvqk, offsets, n, w, b, dims, p, seed, training):
    """The same computation through the separate public Triton ops, under autograd's split."""
    heads, qk_dim, v_dim = dims
    u, v, q, k = (uvqk[:, lo:hi] for lo, hi in column_blocks(dims).values())
    attn = hstu_attention(
        q.unflatten(1, (heads, qk_dim)),
        k.unflatten(1, (heads, qk_dim)),
        v.unflatten(1, (heads, v_dim)),
        offsets,
        n,
        alpha=qk_dim**-0.5,
        kernels="triton",
    )
    return output_block(u, attn.flatten(1), w, b, EPS, p, seed, training, kernels="triton")


def fused_and_separate(lengths, dims, dtype, p, gen, device="cpu"):
    """((y, d_uvqk, d_weight, d_bias) of stu_mixing, the same of the separate Triton ops)."""
    uvqk, offsets, w, b = make_inputs(lengths, dims, dtype, gen, device)
    n, seed = max(lengths), secrets.randbits(31)
    y = stu_mixing(uvqk, offsets, n, norm_weight=w, norm_bias=b, kernels="triton", **op_args(dims, p, seed, True))
    dy = randn(y.shape, gen, dtype, device)
    fused = (y, *torch.autograd.grad(y, (uvqk, w, b), dy))
    y2 = separate_ops(uvqk, offsets, n, w, b, dims, p, seed, True)
    return fused, (y2, *torch.autograd.grad(y2, (uvqk, w, b), dy))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_dim,v_dim", [(32, 16), (16, 32)])
@pytest.mark.parametrize("p,training", [(0.0, True), (0.25, True), (0.25, False)])
def test_triton_matches_the_reference_composition(dtype, qk_dim, v_dim, p, training, gen, poison):
    # 0, 1, an odd length and 53 (no multiple of the interpreter's 16/32 tiles) among five sequences.
    lengths = random_lengths(gen, 5, 53)
    dims = (HEADS, qk_dim, v_dim)
    got, ref = run_both(lengths, dims, dtype, p, training, gen)
    assert got[0].shape == (sum(lengths), 3 * HEADS * v_dim)
    check(got, ref, dims, dtype)


@needs_interpreter
def test_fused_equals_the_separate_triton_ops(gen, poison):
    """One autograd function, one gradient buffer: the same kernels, so the same bits as the
    separate ops (whose backward concatenates du, dv, dq, dk)."""
    fused, separate = fused_and_separate(random_lengths(gen, 4, 41), (HEADS, 32, 16), torch.float32, 0.2, gen)
    for name, a, e in zip(("y", "d_uvqk", "d_norm_weight", "d_norm_bias"), fused, separate):
        assert torch.equal(a, e), name


@needs_interpreter
def test_atomic_dq_is_copied_into_the_gradient_buffer(monkeypatch, gen, poison):
    from dlrmv4.ops.triton import attention as tri

    monkeypatch.setattr(tri, "DQ_MODE", "atomic")
    dims = (HEADS, 16, 32)
    got, ref = run_both([17, 0, 40, 3], dims, torch.float32, 0.25, True, gen)
    check(got, ref, dims, torch.float32)


@needs_interpreter
@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_empty_batch(kernels, gen, poison):
    dims = (HEADS, 16, 16)
    uvqk, offsets, w, b = make_inputs([0, 0], dims, torch.float32, gen)
    y = stu_mixing(uvqk, offsets, 0, norm_weight=w, norm_bias=b, kernels=kernels, **op_args(dims, 0.1, 3, True))
    assert y.shape == (0, 3 * HEADS * 16)
    y.sum().backward()
    assert uvqk.grad.shape == uvqk.shape
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))


def test_reference_is_the_definition(gen):
    """The reference composition against the formula written out with explicit column offsets
    (u, v, q, k in that order), a per-sequence attention loop and an explicit SiLU and LayerNorm."""
    qk_dim, v_dim, p = 8, 4, 0.3
    dims = (HEADS, qk_dim, v_dim)
    lengths = random_lengths(gen, 4, 19)
    uvqk, offsets, w, b = make_inputs(lengths, dims, torch.float64, gen)
    t, hv, hqk, n = uvqk.shape[0], HEADS * v_dim, HEADS * qk_dim, max(lengths)
    mask = torch.rand((t, 3 * hv), generator=gen) >= p
    alpha = qk_dim**-0.5
    y = stu_mixing(
        uvqk, offsets, n, norm_weight=w, norm_bias=b, kernels="pytorch", keep_mask=mask, **op_args(dims, p, 0, True)
    )
    x = uvqk.detach()
    u, v = x[:, :hv], x[:, hv : 2 * hv].reshape(t, HEADS, v_dim)
    q = x[:, 2 * hv : 2 * hv + hqk].reshape(t, HEADS, qk_dim)
    k = x[:, 2 * hv + hqk :].reshape(t, HEADS, qk_dim)
    attn = naive(q, k, v, offsets, n, None, alpha).reshape(t, hv)
    mu = attn.mean(1, keepdim=True)
    ln = (attn - mu) / torch.sqrt(((attn - mu) ** 2).mean(1, keepdim=True) + EPS) * w.detach() + b.detach()
    su = u * torch.sigmoid(u)
    want = torch.cat([su, attn, su * ln], 1) * mask / (1 - p)
    torch.testing.assert_close(y.detach(), want, rtol=1e-10, atol=1e-12)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_draws_the_kernels_mask(dtype, gen, poison):
    """Without ``keep_mask`` the reference draws the Triton path's mask from (seed, row_offset)."""
    dims, p = (HEADS, 16, 16), 0.3
    lengths = random_lengths(gen, 4, 23)
    uvqk, offsets, w, b = make_inputs(lengths, dims, dtype, gen)
    kw = {**op_args(dims, p, secrets.randbits(63), True), "row_offset": secrets.randbits(33)}
    y = stu_mixing(uvqk, offsets, max(lengths), norm_weight=w, norm_bias=b, kernels="triton", **kw)
    ref = stu_mixing(
        leaf64(uvqk), offsets, max(lengths), norm_weight=leaf64(w), norm_bias=leaf64(b), kernels="pytorch", **kw
    )
    want = output_block_keep_mask(uvqk.shape[0], HEADS * 16, p, kw["seed"], "cpu", kw["row_offset"])
    assert torch.equal(y != 0, want) and torch.equal(ref != 0, want)
    assert rel_err(y, ref) < TOL[dtype]


@pytest.mark.parametrize("kernels", ["triton", "pytorch"])
def test_a_chunk_of_sequences_with_its_row_offset_is_that_chunk_of_the_whole(kernels, gen, poison):
    """Consecutive sequences [i, j) run alone with row_offset = their first row (and the whole
    run's N) give those rows of the whole run, with dropout: the same zeros, the same values and
    d_uvqk (bit for bit from the kernels; to rounding from the float64 reference); the norm
    parameters' gradients add up over the chunks."""
    if kernels == "triton" and not INTERPRET:
        pytest.skip("Triton interpreter test")
    dims, p, seed = (HEADS, 16, 16), 0.25, secrets.randbits(31)
    dtype = torch.float32 if kernels == "triton" else torch.float64
    lengths = random_lengths(gen, 6, 21)
    uvqk, offsets, w, b = make_inputs(lengths, dims, dtype, gen)
    n, base = max(lengths), secrets.randbits(20)
    kw = {**op_args(dims, p, seed, True), "kernels": kernels}
    y = stu_mixing(uvqk, offsets, n, norm_weight=w, norm_bias=b, row_offset=base, **kw)
    dy = randn(y.shape, gen, dtype)
    whole = (y, *torch.autograd.grad(y, (uvqk, w, b), dy))
    same = torch.equal if kernels == "triton" else functools.partial(torch.allclose, rtol=1e-12, atol=1e-12)
    cuts = sorted(torch.randint(0, len(lengths) + 1, (2,), generator=gen).tolist())
    dw, db = torch.zeros_like(w), torch.zeros_like(b)
    for i, j in ((0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], len(lengths))):
        a, e = int(offsets[i]), int(offsets[j])
        part = uvqk[a:e].detach().clone().requires_grad_()
        leaves = (part, w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
        y = stu_mixing(
            part, offsets[i : j + 1] - a, n, norm_weight=leaves[1], norm_bias=leaves[2], row_offset=base + a, **kw
        )
        got = (y, *torch.autograd.grad(y, leaves, dy[a:e]))
        assert torch.equal(got[0] != 0, whole[0][a:e] != 0), f"the zeros of sequences [{i}, {j})"
        for name, g, full in zip(("y", "d_uvqk"), got, whole):
            assert same(g, full[a:e]), f"{name} of sequences [{i}, {j})"
        dw, db = dw + got[2], db + got[3]
    torch.testing.assert_close(dw, whole[2], rtol=1e-5, atol=1e-5)  # fp32 parameters: fp32 sums
    torch.testing.assert_close(db, whole[3], rtol=1e-5, atol=1e-5)


def test_bad_input_is_reported():
    uvqk, offsets = torch.zeros(7, 128), torch.tensor([0, 3, 7])
    w = torch.ones(32)
    kw = op_args((HEADS, 16, 16), 0.0, 0, False)

    def call(x=uvqk, offs=offsets, n=4, weight=w, **over):
        return stu_mixing(x, offs, n, norm_weight=weight, norm_bias=None, **{**kw, **over})

    assert call().shape == (7, 96)  # CPU tensors and kernels="auto": the reference
    with pytest.raises(ValueError, match=r"uvqk must be \[T, H"):
        call(x=torch.zeros(7, 127))
    with pytest.raises(ValueError, match="norm_weight must be"):
        call(weight=torch.ones(16))
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        call(num_heads=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        call(n=torch.tensor(4))
    with pytest.raises(ValueError, match="seq_offsets"):
        call(offs=torch.tensor([0.0, 7.0]))
    with pytest.raises(ValueError, match="kernels"):
        call(kernels="cuda")
    with pytest.raises(ValueError, match="stu_mixing: row_offset must be"):
        call(row_offset=-1)
    with pytest.raises(ValueError, match=r"stu_mixing: dropout_p=1.0 must be in \[0, 1\)"):
        call(dropout_p=1.0)
    with pytest.raises(ValueError, match="stu_mixing: seed must be"):
        call(seed=2**63)
    if INTERPRET:
        with pytest.raises(ValueError, match="power of two"):
            stu_mixing(
                torch.zeros(7, 96),
                offsets,
                4,
                norm_weight=None,
                norm_bias=None,
                **{**kw, "qk_dim": 12, "v_dim": 12, "kernels": "triton"},
            )


@needs_interpreter
def test_stu_layer_runs_the_fused_op(monkeypatch, gen):
    """STULayer (through ops/stu_layer.py) hands its projection to stu_mixing with the layer's dims,
    alpha, norm parameters, dropout and row offset, and adds the output projection of y to its input.
    That is the forward without grad; with grad, the projection and the mixing run as one autograd
    function (for the bias gradient), which gives the same output."""
    import dataclasses

    from test_model import SMALL

    from dlrmv4.model import stu
    from dlrmv4.ops import stu_layer

    cfg = dataclasses.replace(SMALL, kernels="triton", linear_dropout=0.2)
    layer = stu.STULayer(cfg)
    seen = {}

    def spy(uvqk, seq_offsets, max_seq_len, **kw):
        seen.update(kw, width=uvqk.shape[1], max_seq_len=max_seq_len)
        return stu_mixing(uvqk, seq_offsets, max_seq_len, **kw)

    monkeypatch.setattr(stu_layer, "stu_mixing", spy)
    x = randn((12, cfg.d_model), gen)
    with torch.no_grad():
        out = layer(x, torch.tensor([0, 5, 12]), 7, dropout_seed=11, row_offset=30)
    assert out.shape == x.shape
    assert seen["width"] == cfg.num_heads * (2 * cfg.v_dim + 2 * cfg.qk_dim) and seen["max_seq_len"] == 7
    assert seen["norm_weight"] is layer.attn_norm_weight and seen["norm_bias"] is layer.attn_norm_bias
    assert seen["alpha"] == pytest.approx(1 / math.sqrt(cfg.qk_dim))
    assert (seen["dropout_p"], seen["seed"], seen["training"], seen["row_offset"]) == (0.2, 11, True, 30)
    kw = {k: v for k, v in seen.items() if k not in ("width", "max_seq_len")}
    y = stu_mixing(layer.uvqk(layer.input_norm(x)), torch.tensor([0, 5, 12]), 7, **kw)
    torch.testing.assert_close(out, x + layer.out(y))
    seen.clear()
    trained = layer(x.requires_grad_(), torch.tensor([0, 5, 12]), 7, dropout_seed=11, row_offset=30)
    assert not seen and trained.requires_grad
    torch.testing.assert_close(trained, out, rtol=0, atol=0)
