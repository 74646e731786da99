"""The parts of the training step that a kernel's device time is booked to, by kernel name.

One list for every profile of the step (``bench_end_to_end.py``'s breakdown and ``bench_train.py``'s
profiled window), so that their tables name the same parts. First match wins (lower-cased names of
PyTorch's, Triton's, FBGEMM's and cuBLAS's kernels and the profiler's memcpy/memset events).
"""

from __future__ import annotations

import re

STEP_PARTS: list[tuple[str, str]] = [
    ("attention", r"hstu_attention|candidate_attention"),
    # The copy engines' work (the prefetcher's batches, a checkpoint's staging): beside the kernels.
    ("host-device copies", r"memcpy (htod|dtoh)"),
    ("dense optimizer", r"adam|multi_tensor|foreach|clip|norm_kernel|l2norm"),
    # Before GEMMs: FBGEMM's own kernels ("fbgemm_gpu::...") would match "gemm" there.
    (
        "embedding lookup + update",
        r"adagrad|index|embedding|sort|segment|scatter|gather|radix|unique|cumsum|bucketize|linearize",
    ),
    ("GEMMs", r"gemm|sm90|cutlass|cublas|matmul|nvjet|xmma|splitk"),
    ("layer norms", r"layer_norm|layernorm|_ln_"),
    ("output block", r"output_block"),
    ("position and time encoding", r"position_time"),
    ("concatenations and copies", r"cat|memcpy|memset|copy|fill"),
    ("other elementwise", r"jagged|elementwise|vectorized|reduce|silu|swish|dropout|mul|add|where|sigmoid|norm"),
]
OTHER = "other"
PART_NAMES = [name for name, _ in STEP_PARTS] + [OTHER]


def step_part(kernel_name: str) -> str:
    """The part a kernel (or memcpy/memset event) of the step belongs to."""
    name = kernel_name.lower()
    return next((part for part, pattern in STEP_PARTS if re.search(pattern, name)), OTHER)
