"""Which implementation an op runs: ``triton``, ``pytorch`` (the reference), or ``auto``.

``auto`` picks Triton for CUDA/ROCm tensors when Triton imports, and the PyTorch reference
otherwise (CPU tensors). Setting ``TRITON_INTERPRET=1`` before the process starts lets ``triton``
run the kernels on CPU tensors through Triton's interpreter (tests use this; it is slow).
"""

from __future__ import annotations

import functools
import os

import torch

KERNEL_CHOICES = ("auto", "triton", "pytorch")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(kernels: str, device: torch.device) -> str:
    """``triton`` or ``pytorch`` for tensors on ``device``."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if kernels == "pytorch":
        return "pytorch"
    usable = triton_available() and (device.type == "cuda" or interpreting())
    if kernels == "triton":
        if not usable:
            raise RuntimeError(f"Triton kernels need a CUDA/ROCm device or TRITON_INTERPRET=1 (tensors on {device})")
        return "triton"
    return "triton" if usable and device.type == "cuda" else "pytorch"
