"""Which kernels run the jagged HSTU attention on a GPU: the one seam every caller goes through.

``attention_kernels(choice, q, v)`` returns the forward and backward the model's attention runs:
- ``gluon``: the warp-specialized Hopper kernels (``ops/gluon/attention.py``), forward and backward,
  for sm_90 with bf16 or fp16 inputs and head dims of 64 or 128;
- ``triton``: the portable Triton kernels (``ops/triton/attention.py``) for both;
- ``auto``: the fastest measured on each kind where the Gluon kernels apply: the Gluon forward
  and the portable backward (the Gluon backward's ordered dQ sum is slower today:
  docs/kernel-benchmarks.md, Attention); ``triton`` everywhere else (B200, MI300X / MI350X, fp32, other
  head dims, the interpreter, a compile for another target).
The choice is made from the launch's ``KernelTarget`` (``ops/triton/targets.py``), so a compile for
a GPU this machine does not have picks what that GPU would run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dispatch import interpreting

ATTENTION_KERNEL_CHOICES = ("auto", "gluon", "triton")
_GLUON_DTYPES = (torch.bfloat16, torch.float16)
_GLUON_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class AttentionKernels:
    forward: str  # "gluon" or "triton"
    backward: str
    fwd: Callable[..., torch.Tensor]
    bwd: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    def describe(self) -> str:
        return f"attention kernels: forward {self.forward}, backward {self.backward}"


def gluon_unavailable(q: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Gluon forward cannot take these inputs on the launch's target, or None if it can."""
    if interpreting():
        return "the Triton interpreter runs no Gluon kernels"
    from .triton.targets import current_target

    target = current_target()
    if target is None or not target.nvidia or target.arch != 90:
        return f"it is built for sm_90 (H100, H200), not {target.name if target else 'this device'}"
    if q.dtype not in _GLUON_DTYPES:
        return f"it takes bf16 or fp16, not {str(q.dtype).removeprefix('torch.')}"
    if q.shape[2] not in _GLUON_HEAD_DIMS or v.shape[2] not in _GLUON_HEAD_DIMS:
        return f"it takes head dims of {' or '.join(map(str, _GLUON_HEAD_DIMS))}, not {q.shape[2]}/{v.shape[2]}"
    return None


def attention_kernels(choice: str, q: torch.Tensor, v: torch.Tensor) -> AttentionKernels:
    """The kernels ``choice`` (``auto``, ``gluon`` or ``triton``) runs for q [T, H, Dqk], v [T, H, Dv]."""
    if choice not in ATTENTION_KERNEL_CHOICES:
        raise ValueError(f"attention_kernels={choice!r} is not one of {', '.join(ATTENTION_KERNEL_CHOICES)}")
    from .triton import attention as portable

    why_not = None if choice == "triton" else gluon_unavailable(q, v)
    if choice == "gluon" and why_not is not None:
        raise ValueError(f"attention_kernels=gluon: the Gluon attention cannot run here: {why_not}")
    if choice == "triton" or why_not is not None:
        return AttentionKernels("triton", "triton", portable.attention_fwd, portable.attention_bwd)
    from .gluon import attention as hopper

    if choice == "gluon":
        return AttentionKernels("gluon", "gluon", hopper.attention_fwd, hopper.attention_bwd)
    return AttentionKernels("gluon", "triton", hopper.attention_fwd, portable.attention_bwd)
