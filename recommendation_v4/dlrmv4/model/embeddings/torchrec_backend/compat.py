"""Every place this package relies on TorchRec's and FBGEMM's insides, in one module.

- ``install``: TorchRec's unbucketize step of row-wise sequence lookups
  (``dist_data.SequenceEmbeddingsAwaitable.__init__``) goes through ``permute.permute_rows``
  (a gather for the backward, not an atomic scatter). The TorchRec backend's factory calls it.
- ``codec_settings``, ``plain_cast_dtype``: the precision, direction and loss scale of an FBGEMM
  comm codec (``QuantizedCommCodec._comm_precision``, ``._is_fwd``, ``._loss_scale``), which
  ``sharding.py``'s codec takes over and reads.
- ``push_learning_rate``: TorchRec's fused optimizer hands a param group's learning rate to
  FBGEMM's kernels only in its ``step()``.
- ``torchrec_works``: whether TorchRec imports and FBGEMM's fused row-wise Adagrad runs here.

``check`` reads, once per process, that the installed TorchRec and FBGEMM still have what these
rely on (the awaitable's ``__init__`` parameters, the codec's fields, the fused optimizer's
``step``) and stops in one line naming the piece and the installed versions when they do not.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from typing import Any

import torch

from dlrmv4.errors import UserError

# What the code was written against and tested with (requirements*.txt pin them).
TESTED = "torchrec 1.6.1 / fbgemm-gpu 1.6.0 (CUDA), torchrec 1.8.0 / fbgemm-gpu-cpu 1.8.0"
_AWAITABLE_PARAMETERS = ["self", "tensor_awaitable", "unbucketize_permute_tensor", "embedding_dim"]
_CODEC_FIELDS = ("_comm_precision", "_is_fwd", "_loss_scale")


def _versions() -> str:
    found = []
    for name in ("torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"):
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found) or "no torchrec/fbgemm-gpu distribution found"


def _incompatible(piece: str, what: str) -> UserError:
    return UserError(
        f"the installed TorchRec/FBGEMM ({_versions()}) changed {piece}: {what}; this package relies on it "
        f"(model/embeddings/torchrec_backend/compat.py; tested with {TESTED})"
    )


@functools.lru_cache(maxsize=1)
def check() -> None:
    """Stop in one line when the installed TorchRec or FBGEMM lack what this module relies on."""
    from fbgemm_gpu.quantize_comm import QuantizedCommCodec
    from torchrec.distributed import dist_data
    from torchrec.optim.keyed import CombinedOptimizer

    awaitable = dist_data.SequenceEmbeddingsAwaitable
    original = getattr(awaitable, "_dlrmv4_original_init", awaitable.__init__)
    parameters = list(inspect.signature(original).parameters)
    if parameters != _AWAITABLE_PARAMETERS:
        raise _incompatible("SequenceEmbeddingsAwaitable.__init__", f"its parameters are {parameters}")
    source = inspect.getsource(QuantizedCommCodec.__init__)
    missing = [field for field in _CODEC_FIELDS if f"self.{field}" not in source]
    if missing:
        raise _incompatible("QuantizedCommCodec", f"it sets no {', '.join(missing)}")
    if not callable(getattr(CombinedOptimizer, "step", None)):
        raise _incompatible("the fused optimizer", "it has no step() to push a learning rate through")


def install() -> None:
    """Route TorchRec's unbucketize step of row-wise sequence lookups through ``permute_rows``
    (idempotent; after ``check``)."""
    from torchrec.distributed import dist_data

    from dlrmv4.model.embeddings.torchrec_backend.permute import permute_rows

    check()
    awaitable = dist_data.SequenceEmbeddingsAwaitable
    if hasattr(awaitable, "_dlrmv4_original_init"):
        return
    original = awaitable.__init__

    def __init__(self, tensor_awaitable, unbucketize_permute_tensor, embedding_dim: int) -> None:
        original(self, tensor_awaitable, None, embedding_dim)
        if unbucketize_permute_tensor is not None:
            self.callbacks.append(lambda ret: permute_rows(ret.view(-1, embedding_dim), unbucketize_permute_tensor))

    awaitable._dlrmv4_original_init = original
    awaitable.__init__ = __init__


def codec_settings(codec: Any) -> tuple[Any, bool]:
    """(comm precision, is forward) of a stock FBGEMM comm codec."""
    check()
    return codec._comm_precision, codec._is_fwd


def plain_cast_dtype(codec: Any) -> torch.dtype | None:
    """The dtype an fp16/bf16 comm codec without a loss scale casts rows to; None for any other
    codec (left to FBGEMM's own encode and decode)."""
    from fbgemm_gpu.split_embedding_configs import SparseType

    if codec._comm_precision in (SparseType.FP16, SparseType.BF16) and codec._loss_scale is None:
        return codec._comm_precision.as_dtype()
    return None


def push_learning_rate(fused_optimizer: Any, lr: float) -> None:
    """Set every param group's learning rate and hand it to FBGEMM's kernels (its ``step()`` does
    that, and nothing else: the update itself is fused into the backward)."""
    for group in fused_optimizer.param_groups:
        group["lr"] = lr
    fused_optimizer.step()


def torchrec_works(device: torch.device) -> bool:
    """True when TorchRec imports and FBGEMM's fused row-wise Adagrad kernel runs on ``device``."""
    try:
        import torchrec  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        on_gpu = device.type == "cuda"
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [
                (
                    4,
                    4,
                    EmbeddingLocation.DEVICE if on_gpu else EmbeddingLocation.HOST,
                    ComputeDevice.CUDA if on_gpu else ComputeDevice.CPU,
                )
            ],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            device=device,
        )
        tbe(torch.tensor([1, 2], device=device), torch.tensor([0, 1, 2], device=device)).sum().backward()
        return True
    except Exception:  # noqa: BLE001 - any failure to import or run means "use the plain backend"
        return False
