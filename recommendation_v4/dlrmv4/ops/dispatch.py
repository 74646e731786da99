"""Which implementation an op runs: ``triton``, ``pytorch`` (the reference), or ``auto``.

``auto`` picks Triton for CUDA/ROCm tensors when Triton imports, and the PyTorch reference
otherwise (CPU tensors). Setting ``TRITON_INTERPRET=1`` before the process starts lets ``triton``
run the kernels on CPU tensors through Triton's interpreter (tests use this; it is slow).
Inside ``compiling_only()`` (``triton/cross_compile.py``) ``triton`` is taken for CPU tensors too:
launches there compile for another GPU and run nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator

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


_COMPILING_ONLY = contextvars.ContextVar("compiling_only", default=False)


@contextlib.contextmanager
def compiling_only() -> Iterator[None]:
    token = _COMPILING_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILING_ONLY.reset(token)


def resolve(kernels: str, device: torch.device) -> str:
    """``triton`` or ``pytorch`` for tensors on ``device``."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels={kernels!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if kernels == "pytorch":
        return "pytorch"
    usable = triton_available() and (device.type == "cuda" or interpreting() or _COMPILING_ONLY.get())
    if kernels == "triton":
        if not usable:
            raise RuntimeError(f"Triton kernels need a CUDA/ROCm device or TRITON_INTERPRET=1 (tensors on {device})")
        return "triton"
    return "triton" if usable and device.type == "cuda" else "pytorch"
