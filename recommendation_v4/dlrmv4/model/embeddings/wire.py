"""The precision of the embedding all-to-all (``embeddings.qcomm``): the looked-up rows cross it
forward and their gradients backward, in fp16 (the reference's recipe, with no loss scale), bf16,
or their own dtype ("none").

TorchRec's sharded lookup sends them through its quantized all-to-all on several ranks (on one it
skips the all-to-all and its codecs: there is no wire, in the reference's runs either); its codecs
are FBGEMM's with our encoder and decoder (``torchrec_backend/sharding.py: qcomm_registry``). The plain backend has
no all-to-all: on several ranks it rounds its rows and gradients through the same precision where
TorchRec's would cross the wire (``through_wire``), so both backends compute the same step.
"""

from __future__ import annotations

import torch

WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def cast_then_clamp(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` in ``dtype`` with out-of-range values at the type's largest finite value: the same
    numbers as FBGEMM's clamp-then-cast, whose clamp makes a full copy in the input's (fp32) dtype
    first. Cast first and clamp the small copy in place: the encoder's only temporary is the half
    precision result (a hot rank's all-to-all input can be most of its free memory)."""
    finfo = torch.finfo(dtype)
    if tensor.dtype == dtype:  # already in range or inf; never clamp the caller's tensor in place
        return torch.clamp(tensor, finfo.min, finfo.max)
    return tensor.to(dtype).clamp_(finfo.min, finfo.max)


def through_wire(tensor: torch.Tensor, wire_dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` (fp32) as it arrives on the other side of the all-to-all: encoded in ``wire_dtype``
    (cast, then clamped to its range) and decoded back to fp32; unchanged for None."""
    if wire_dtype is None:
        return tensor
    return cast_then_clamp(tensor, wire_dtype).to(tensor.dtype)
