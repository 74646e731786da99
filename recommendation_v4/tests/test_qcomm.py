"""The quantized embedding all-to-all's encoder: FBGEMM's numbers without its fp32 temporary.

A hot rank (a few popular ids route much of every rank's lookups to it) sends an all-to-all input
that can fill most of its free memory; FBGEMM's fp16/bf16 encoder clamps in the input's dtype
before it casts, so it briefly holds a second full-size fp32 copy. Ours casts first and clamps the
half-precision copy in place."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.config import EmbeddingConfig
from dlrmv4.model.embeddings.torchrec_backend.sharding import cast_then_clamp, qcomm_registry

pytest.importorskip("torchrec")
from fbgemm_gpu.quantize_utils import fp32_to_bf16_with_clamp, fp32_to_fp16_with_clamp  # noqa: E402

STOCK = {torch.float16: fp32_to_fp16_with_clamp, torch.bfloat16: fp32_to_bf16_with_clamp}


def _hot_rows(n: int = 4096, dim: int = 64) -> torch.Tensor:
    """Lookups with values beyond fp16's range, infinities and NaN among ordinary ones."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(n, dim, generator=g) * torch.logspace(-8, 6, n).unsqueeze(1)
    rows[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    rows[1, :2] = torch.tensor([65_504.0, 65_520.0])  # fp16's largest value, and the first that rounds past it
    return rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cast_then_clamp_gives_fbgemms_numbers(dtype):
    rows = _hot_rows()
    ours = cast_then_clamp(rows, dtype)
    assert ours.dtype == dtype and torch.equal(_bits(ours), _bits(STOCK[dtype](rows)))
    assert torch.isfinite(ours[1:]).all() and ours[0, 0] == torch.finfo(dtype).max
    same = rows.to(dtype)
    before = same.clone()
    assert torch.equal(_bits(cast_then_clamp(same, dtype)), _bits(STOCK[dtype](same.float())))
    assert torch.equal(_bits(same), _bits(before))  # the caller's tensor is left as it was


def _largest_allocation(fn) -> int:
    """Bytes of the largest CPU allocation made while ``fn`` runs (the profiler's memory events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]
    return max(sizes, default=0)


def test_the_encoder_allocates_only_the_half_precision_copy():
    rows = torch.randn(1 << 18, 64)  # 64 MiB of fp32 lookups
    half_bytes = rows.numel() * 2
    codecs = qcomm_registry(EmbeddingConfig(qcomm="fp16"))
    encoder = codecs["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"].forward
    assert _largest_allocation(lambda: encoder.encode(rows)) == half_bytes
    # FBGEMM's own encoder, measured the same way, makes the full fp32 copy this avoids.
    assert _largest_allocation(lambda: fp32_to_fp16_with_clamp(rows)) == rows.numel() * 4


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_every_codec_of_the_registry_is_the_low_memory_one(precision, dtype):
    registry = qcomm_registry(EmbeddingConfig(qcomm=precision))
    assert registry and qcomm_registry(EmbeddingConfig(qcomm="none")) is None
    rows = _hot_rows()
    for codecs in registry.values():
        for codec in (codecs.forward, codecs.backward):
            assert type(codec).__name__ == "CastThenClampCodec" and codec.quantized_dtype == dtype
            sent = codec.encode(rows)
            assert torch.equal(_bits(sent), _bits(STOCK[dtype](rows)))
            torch.testing.assert_close(codec.decode(sent), sent.float(), rtol=0, atol=0, equal_nan=True)
