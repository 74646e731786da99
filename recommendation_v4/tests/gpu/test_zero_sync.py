"""The training step never waits for the device: several steps under
``torch.cuda.set_sync_debug_mode("error")``, at the embedded default's shape and the reference one,
unchunked and chunked. With TorchRec embeddings the only waits are TorchRec's own, in its input
distribution (recorded with the "warn" mode and attributed to their files)."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from model_inputs import random_batch

from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.train.trainer import build_step

ROWS = 100  # random_batch draws every id below this: small tables, the reference's widths


def _steps(preset: str, max_len: int, chunks: int, backend: str, sharding: str = "", dedup_ids: bool = False):
    cfg = load_config(preset)
    cfg = dataclasses.replace(
        cfg,
        embeddings=dataclasses.replace(
            cfg.embeddings, embedding_backend=backend, sharding_types=sharding, dedup_ids=dedup_ids
        ),
        sampler=dataclasses.replace(cfg.sampler, **{f"{name}_rows": ROWS for name in CONTEXTUAL_FEATURES}),
        train=dataclasses.replace(cfg.train, warmup_steps=3, chunks=chunks),
    )
    device = torch.device("cuda")
    step = build_step(cfg, (ROWS, ROWS, ROWS), device, seed=0)
    rng = np.random.default_rng(7)
    batches = [random_batch(rng.integers(1, max_len + 1, 8), seed=i, dedup_ids=dedup_ids).to(device) for i in range(8)]
    for i in range(3):  # allocator, autotuning and lazy initialisation may synchronise once
        step(batches[i], i, 0)
    torch.cuda.synchronize()
    return step, batches


@pytest.mark.parametrize(
    "preset, max_len, chunks", [("synthetic-tiny", 48, 1), ("yambda-5b", 4087, 1), ("yambda-5b", 4087, 3)]
)
def test_training_steps_do_not_synchronise(preset, max_len, chunks):
    step, batches = _steps(preset, max_len, chunks, "plain")
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(batches[i], i, 0) for i in range(3, 8)]  # past the warm-up too
        with pytest.raises(RuntimeError, match="synchroniz"):  # the guard is on: a host read fails
            float(losses[-1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    step.finite.check()
    assert all(bool(torch.isfinite(loss)) for loss in losses)


@pytest.mark.parametrize("pipelined, dedup_ids", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("sharding", ["*=row_wise", "*=table_wise"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_torchrec_steps_wait_only_in_torchrecs_input_distribution(sharding, chunks, pipelined, dedup_ids, request):
    """TorchRec's input distribution waits for the device in every step: it builds its
    feature permutation from a host list (``torch.tensor(recat, device=...)`` in dist_data.py) and,
    row-wise, reads the bucketised lengths back to size its all-to-all
    (``KeyedJaggedTensor.length_per_key`` in jagged_tensor.py). Those are the only waits of a
    TorchRec step: none is in this project's code. They cannot move out of TorchRec (they size its
    all-to-alls), but with the sparse-dist pipeline they belong to the next batch's distribution,
    which runs on its own stream during this step: the lookup itself then waits for nothing, also
    with the ids deduplicated (the loader's worker finds the distinct ids; their counts are host ints)."""
    pytest.importorskip("torchrec")
    request.getfixturevalue("process_group")
    step, batches = _steps("yambda-5b", 4087, chunks, "torchrec", sharding, dedup_ids)
    waits_in_lookups: list[int] = []
    lookup = step.embeddings.forward

    def counted_lookup(batch, *chunks):
        before = len(seen)
        out = lookup(batch, *chunks)
        waits_in_lookups.append(sum("synchroniz" in str(w.message) for w in seen[before:]))
        return out

    step.embeddings.forward = counted_lookup  # type: ignore[method-assign]
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            losses = [step(batches[i], i, 0, batches[i + 1] if pipelined and i < 7 else None) for i in range(3, 8)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    waits = [w for w in seen if "synchroniz" in str(w.message)]
    sites = sorted({(Path(w.filename).name, w.lineno) for w in waits})
    print(f"{sharding}, {chunks} chunk(s), pipelined {pipelined}, dedup {dedup_ids}: {len(waits)} waits at", sites)
    print("waits inside each lookup:", waits_in_lookups)
    assert not [w for w in waits if "torchrec" not in w.filename], sites
    assert {name for name, _ in sites} <= {"dist_data.py", "jagged_tensor.py"}, sites
    if pipelined:  # the first timed lookup's ids were not sent ahead (the warm-up steps ran without)
        assert waits_in_lookups[1:] == [0] * 4, waits_in_lookups
        assert step.embeddings.lookups_distributed_ahead == 4
    step.finite.check()
    assert all(bool(torch.isfinite(loss)) for loss in losses)
