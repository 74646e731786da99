"""DevicePrefetcher on the GPU: every batch arrives whole and in order, copied on the side stream
one step ahead, with no host synchronisation, even when the step overwrites the memory it frees."""

from __future__ import annotations

import numpy as np
import torch
from model_inputs import random_batch

from dlrmv4.data.batch import BATCH_DTYPES
from dlrmv4.train.prefetch import DevicePrefetcher


def test_batches_arrive_whole_in_order_without_syncs():
    rng = np.random.default_rng(3)
    host = [random_batch(rng.integers(1, 3000, 64), seed=i).pin_memory() for i in range(6)]
    device = torch.device("cuda")
    prefetcher = DevicePrefetcher(host, device)
    assert prefetcher.stream is not None
    seen = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in prefetcher:
            # A long kernel on the main stream while the next copy runs on the side stream; then
            # the batch's own memory is read after it, as the step would.
            busy = torch.randn(4096, 4096, device=device)
            for _ in range(20):
                busy = busy @ busy.tanh()
            seen.append({name: getattr(batch, name).sum() for name in BATCH_DTYPES})
            del batch
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(seen) == len(host)
    for want, got in zip(host, seen):
        for name in BATCH_DTYPES:
            assert int(got[name]) == int(getattr(want, name).sum()), name
