"""The training step never waits for the device: several steps under
``torch.cuda.set_sync_debug_mode("error")``, at the embedded default's shape and the reference one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dlrmv4.config import load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.embeddings import make_embeddings, table_specs
from dlrmv4.train.optim import FiniteMonitor
from dlrmv4.train.step import TrainStep
from model_inputs import random_batch

ROWS = 100  # random_batch draws every id below this: small tables, the reference's widths


@pytest.mark.parametrize("preset, max_len", [("synthetic-tiny", 48), ("yambda-5b", 4087)])
def test_training_steps_do_not_synchronise(preset, max_len):
    cfg = load_config(preset)
    cfg = dataclasses.replace(
        cfg, embeddings=dataclasses.replace(cfg.embeddings, embedding_backend="plain"),
        sampler=dataclasses.replace(cfg.sampler, **{f"{name}_rows": ROWS for name in CONTEXTUAL_FEATURES}),
        train=dataclasses.replace(cfg.train, warmup_steps=3))
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = DlrmHSTU(cfg.model, seed=0).to(device)
    embeddings = make_embeddings(table_specs(cfg, ROWS, ROWS, ROWS), cfg, device, seed=0)
    step = TrainStep(model, embeddings, cfg.train, FiniteMonitor(device))
    rng = np.random.default_rng(7)
    batches = [random_batch(rng.integers(1, max_len + 1, 8), seed=i).to(device) for i in range(8)]
    for i in range(3):  # allocator, autotuning and lazy initialisation may synchronise once
        step(batches[i], i, 0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(batches[i], i, 0) for i in range(3, 8)]  # past the warm-up too
        with pytest.raises(RuntimeError, match="synchroniz"):  # the guard is on: a host read fails
            float(losses[-1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    step.finite.check()
    assert all(bool(torch.isfinite(loss)) for loss in losses)
