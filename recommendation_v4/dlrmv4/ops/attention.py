"""Jagged HSTU attention: the public op, its dispatcher and the autograd glue for the Triton kernels.

``hstu_attention(q, k, v, seq_offsets, max_seq_len, num_targets=None, alpha=..., kernels="auto",
attention="auto")``:
per sequence b of L tokens with n_t = num_targets[b] candidates at its end, token i attends to j iff
``(j <= i and j < L - n_t) or j == i``; ``A_ij = SiLU(alpha q_i.k_j) / N`` (no softmax, N =
max_seq_len, the batch's longest sequence) and ``out_i = sum_j A_ij v_j``, accumulated in fp32 and
returned in the input dtype as [T, H, Dv]. q, k, v may be strided views of one projection output.
Nothing here reads device values on the host.
"""

from __future__ import annotations

import torch

from .attention_kernels import attention_kernels
from .dispatch import resolve
from .reference.attention import hstu_attention_reference

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _TritonHSTUAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_offsets, num_targets, max_seq_len: int, alpha: float, attention: str):
        kernels = attention_kernels(attention, q, v)
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
        ctx.max_seq_len, ctx.alpha, ctx.bwd = max_seq_len, alpha, kernels.bwd
        return kernels.fwd(q, k, v, seq_offsets, num_targets, max_seq_len, alpha)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, seq_offsets, num_targets = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(grad_out, q, k, v, seq_offsets, num_targets, ctx.max_seq_len, ctx.alpha)
        return dq, dk, dv, None, None, None, None, None


def check_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets) -> None:
    """A one-line ValueError for inputs no implementation takes (also used by ops/stu_mixing.py)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(
            f"hstu_attention: q, k must be [T, H, Dqk] and v [T, H, Dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"hstu_attention: q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if seq_offsets.dim() != 1 or seq_offsets.numel() < 1 or seq_offsets.dtype.is_floating_point:
        raise ValueError("hstu_attention: seq_offsets must be a 1-D integer tensor [B+1] of cumulative lengths")
    batch = seq_offsets.numel() - 1
    if num_targets is not None and (num_targets.shape != (batch,) or num_targets.dtype.is_floating_point):
        raise ValueError(f"hstu_attention: num_targets must be an integer tensor [B] = [{batch}]")
    if isinstance(max_seq_len, torch.Tensor) or not hasattr(max_seq_len, "__index__") or max_seq_len < 0:
        raise ValueError(
            f"hstu_attention: max_seq_len must be a host int >= 0 (the longest sequence); got {max_seq_len!r}"
        )
    devices = {t.device for t in (q, k, v, seq_offsets) + ((num_targets,) if num_targets is not None else ())}
    if len(devices) != 1:
        raise ValueError(f"hstu_attention: all tensors must be on one device; got {sorted(map(str, devices))}")


def check_triton_attention_inputs(q, v) -> None:
    """A one-line ValueError for inputs the Triton kernels do not take."""
    if q.dtype not in _TRITON_DTYPES:
        raise ValueError(
            f"hstu_attention: the Triton kernel takes fp16/bf16/fp32, not {q.dtype}; use kernels='pytorch'"
        )
    for name, d in (("Dqk", q.shape[2]), ("Dv", v.shape[2])):
        if d < 16 or d > 256 or d & (d - 1):
            raise ValueError(
                f"hstu_attention: the Triton kernel needs {name} a power of two in [16, 256], got {d}; "
                "use kernels='pytorch'"
            )


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    *,
    num_targets: torch.Tensor | None = None,
    alpha: float,
    kernels: str = "auto",
    attention: str = "auto",
) -> torch.Tensor:
    """Jagged HSTU attention, [T, H, Dv] in q's dtype (see the module docstring). ``attention``:
    which GPU kernels the Triton path runs (``ops/attention_kernels.py``)."""
    check_attention_inputs(q, k, v, seq_offsets, max_seq_len, num_targets)
    max_seq_len = int(max_seq_len)
    if resolve(kernels, q.device) == "pytorch":
        return hstu_attention_reference(q, k, v, seq_offsets, max_seq_len, num_targets, alpha)
    check_triton_attention_inputs(q, v)
    return _TritonHSTUAttention.apply(q, k, v, seq_offsets, num_targets, max_seq_len, float(alpha), attention)
