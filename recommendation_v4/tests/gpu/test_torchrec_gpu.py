"""The TorchRec backend on the GPU against the plain one: the same lookups (rows in bf16), the same
row-wise Adagrad update, the same training trajectory over 100 steps; and chunked steps and the
recompute modes on the GPU within bf16 tolerance of the plain, unchunked step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from model_inputs import random_batch
from step_setup import small_table_config

from dlrmv4.train.trainer import build_step

pytest.importorskip("torchrec")
ROWS = 1_000
DEVICE = torch.device("cuda")


@pytest.fixture(autouse=True)
def _group(process_group):
    yield


def _batches(n: int, batch: int, max_len: int, seed: int):
    """Random batches whose label follows the candidate item (20% flipped): a trainable signal."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        b = random_batch(rng.integers(1, max_len - 9, batch), seed=seed + i).to(DEVICE)
        flip = torch.from_numpy(rng.random(batch) < 0.2).to(DEVICE)
        out.append(dataclasses.replace(b, label=((b.candidate_item_id % 2 == 1) ^ flip).float()))
    return out


def _reference(backend: str, recompute: str = "none", **train):
    return small_table_config(
        "yambda-5b",
        backend,
        ROWS,
        model={"input_dropout": 0.0, "linear_dropout": 0.0, "recompute": recompute},
        train={"warmup_steps": 10, "learning_rate": 5e-4, **train},
    )


def test_lookup_and_update_equal_the_plain_backend():
    tables = {}
    batch = _batches(1, 16, 512, seed=1)[0]
    for backend in ("plain", "torchrec"):
        step = build_step(_reference(backend), (0, 0, 0), DEVICE, seed=2)
        # Before the lookup: FBGEMM's CUDA kernels take the rate of the forward that saved the batch.
        step.embeddings.set_learning_rate(0.01)
        emb = step.embeddings(batch)
        g = torch.Generator(device=DEVICE).manual_seed(5)
        loss = sum((t.float() * torch.randn(t.shape, generator=g, device=DEVICE)).sum() for t in emb.tensors())
        tables[backend] = {"emb": [t.detach().clone() for t in emb.tensors()]}
        loss.backward()
        step.embeddings.sparse_step()
        tables[backend]["after"] = step.embeddings.state_for_checkpoint()["tables"]
    plain, rec = tables["plain"], tables["torchrec"]
    for a, b in zip(plain["emb"][:4], rec["emb"][:4]):  # history/candidate rows and contextual: bf16 both
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    assert torch.equal(plain["emb"][4].to(torch.bfloat16), rec["emb"][4])  # candidates: fp32 vs bf16 rows
    for name, table in plain["after"].items():
        # The candidates' item-tower gradient reaches FBGEMM in bf16 (its output dtype), the plain
        # backend's in fp32: the updates agree to bf16 rounding.
        torch.testing.assert_close(rec["after"][name]["momentum"], table["momentum"], rtol=2e-2, atol=1e-9)
        torch.testing.assert_close(rec["after"][name]["weight"], table["weight"], rtol=1e-3, atol=1e-4)


def _losses(backend: str, batches, recompute: str = "none", **train) -> np.ndarray:
    step = build_step(_reference(backend, recompute, **train), (0, 0, 0), DEVICE, seed=0)
    losses = torch.stack([step(batch, i, 0) for i, batch in enumerate(batches)])
    step.finite.check()
    return losses.cpu().numpy() / step.model.cfg.loss_scale


def test_torchrec_follows_the_plain_backend_for_100_steps():
    batches = _batches(100, 32, 1024, seed=11)
    plain, rec = _losses("plain", batches), _losses("torchrec", batches)
    plain_w, rec_w = plain.reshape(-1, 10).mean(1), rec.reshape(-1, 10).mean(1)
    print("window mean BCE, plain:   ", np.round(plain_w, 4))
    print("window mean BCE, torchrec:", np.round(rec_w, 4))
    assert plain_w[-3:].mean() < 0.67 and rec_w[-3:].mean() < 0.67, "the step does not learn"
    np.testing.assert_allclose(rec[:5], plain[:5], rtol=5e-3)
    np.testing.assert_allclose(rec_w, plain_w, rtol=0.03)


@pytest.mark.parametrize("backend", ["plain", "torchrec"])
def test_chunked_steps_on_the_gpu(backend):
    batches = _batches(20, 32, 1024, seed=21)
    whole = _losses(backend, batches, chunks=1)
    for chunks in (2, 4):
        np.testing.assert_allclose(_losses(backend, batches, chunks=chunks), whole, rtol=1e-2)


@pytest.mark.parametrize("mode", ["cheap", "layer"])
def test_recompute_modes_on_the_gpu(mode):
    batches = _batches(20, 32, 1024, seed=31)
    np.testing.assert_allclose(_losses("plain", batches, mode), _losses("plain", batches), rtol=1e-2)
