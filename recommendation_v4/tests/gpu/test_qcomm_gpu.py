"""The all-to-all encoder on the GPU: FBGEMM's fp16 numbers, and no more device memory than the
fp16 copy it returns (FBGEMM's own encoder also holds a full fp32 copy of its input)."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.config import EmbeddingConfig
from dlrmv4.model.embeddings.torchrec_backend.sharding import qcomm_registry

pytest.importorskip("torchrec")
from fbgemm_gpu.quantize_utils import fp32_to_fp16_with_clamp  # noqa: E402


def _peak_above_input(fn, rows: torch.Tensor) -> int:
    """Device bytes ``fn(rows)`` needs at its peak beyond what was allocated before it ran."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(rows)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def test_the_encoder_holds_only_the_fp16_copy_on_the_gpu():
    # A hot rank's all-to-all input at the reference's size: 1,024 samples x ~2,800 tokens, 512 wide.
    rows = torch.randn(2_867_200, 512, device="cuda") * 1e3
    rows[0, 0] = 1e9  # beyond fp16's range
    encoder = qcomm_registry(EmbeddingConfig(qcomm="fp16"))["SEQUENCE_EMBEDDINGS_ALL_TO_ALL"].forward
    ours = encoder.encode(rows)
    assert torch.equal(ours.view(torch.int16), fp32_to_fp16_with_clamp(rows).view(torch.int16))
    del ours
    half = rows.numel() * 2
    assert _peak_above_input(encoder.encode, rows) == half
    assert _peak_above_input(fp32_to_fp16_with_clamp, rows) == half + rows.numel() * 4
