"""The planner's measured costs, each with where it was measured: the relative step time of the
recompute modes and of the chunk sizes, and what a table served from host memory costs.
"""

from __future__ import annotations

import math

GIB = 1 << 30
MIB = 1 << 20
# Relative step time of each recompute mode: the reference model's whole step at batch 256 on an
# H100 (benchmarks/results/end_to_end_recompute.md: 1,665 / 1,514 / 1,388 samples/s).
RECOMPUTE_COST = {"none": 1.0, "cheap": 1.10, "layer": 1.20}
# Training samples/s of the whole step by per-GPU batch (chunk samples), the reference model on one
# H200 (benchmarks/results/end_to_end.md).
CHUNK_RATE = ((32, 1_132.0), (64, 1_626.0), (128, 1_723.0), (256, 1_755.0), (512, 1_750.0))
# Relative step time per table served from host memory: a slice's 1,024 rows of 2 KiB over the host
# link, forward and update, against a step of about 0.6 s; it only breaks ties toward HBM.
UVM_COST = 0.001
# Share of a uvm_caching table's rows cached in HBM (FBGEMM's and TorchRec's default).
CACHE_LOAD_FACTOR = 0.2
# Host memory of one process besides its uvm tables: runtime, CUDA context, loader, pinned buffers.
PROCESS_HOST_BYTES = 4 * GIB
# Share of the tables' rows a delta checkpoint holds with a checkpoint per window: the most a window of
# synthetic-1b (Yambda-5B's users and catalog) changed of a rank's block (benchmarks/results/delta_rows_1b.md).
DELTA_ROW_SHARE = 0.0308


def chunk_efficiency(samples: int) -> float:
    """Relative step time of a chunk of ``samples`` against the best measured batch (1.0 from 256
    samples up); log2-linear between the measured points, proportional to the batch below 32."""
    best = max(rate for _, rate in CHUNK_RATE)
    if samples >= CHUNK_RATE[3][0]:
        return 1.0
    if samples <= CHUNK_RATE[0][0]:
        return best / (CHUNK_RATE[0][1] * max(samples, 1) / CHUNK_RATE[0][0])
    for (b0, r0), (b1, r1) in zip(CHUNK_RATE, CHUNK_RATE[1:]):
        if samples <= b1:
            t = (math.log2(samples) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return best / (r0 + t * (r1 - r0))
    return 1.0
