"""Each attention kernel once, inside a profiler range, for Nsight Compute: the Gluon forward, the portable
forward, the portable backward (dK/dV and dQ kernels), the Gluon backward with dQ summed in a fixed
order and with dQ added by atomics. Every kernel runs twice before the range (compilation, autotuning),
so what ncu sees is the steady kernel. Shape as ``bench_attention.py``'s (B=32, H=4, d=128, bf16, one
candidate per sequence), one of its length mixes.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        python benchmarks/kernels/ncu_attention.py [--mix jagged]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_attention import MIXES, inputs, mixes

from dlrmv4.ops.gluon import attention as hopper
from dlrmv4.ops.triton import attention as tri


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = {short: name for name, short in MIXES.items()}
    parser.add_argument("--mix", default="jagged", choices=sorted(names), help="length mix (length_mix.py)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        sys.exit("[ncu_attention] error: needs a Hopper GPU (sm_90): the Gluon kernels run only there")
    heads, dim = 4, 128
    lengths = mixes(32, seed=0)[names[args.mix]]
    q, k, v, offsets, targets, grad = inputs(lengths, heads, dim, seed=0)
    n, alpha = max(lengths), dim**-0.5
    kernels = [
        lambda: hopper.attention_fwd(q, k, v, offsets, targets, n, alpha),
        lambda: tri.attention_fwd(q, k, v, offsets, targets, n, alpha),
        lambda: tri.attention_bwd(grad, q, k, v, offsets, targets, n, alpha),
        lambda: hopper.attention_bwd(grad, q, k, v, offsets, targets, n, alpha),
        lambda: hopper.attention_bwd(grad, q, k, v, offsets, targets, n, alpha, ordered=False),
    ]
    for run in kernels:
        run()
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for run in kernels:
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"[ncu_attention] {args.mix}: {sum(lengths):,} tokens, {len(kernels)} calls profiled")


if __name__ == "__main__":
    main()
