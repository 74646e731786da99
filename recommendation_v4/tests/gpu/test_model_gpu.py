"""The full model at the reference shape on the GPU: both kernel modes, matching losses and grads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from model_inputs import random_batch, random_embeddings

from dlrmv4.config_loading import load_config
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.hstu import DlrmHSTU


def _run(cfg, batch, seed):
    torch.manual_seed(0)
    model = DlrmHSTU(cfg).cuda()
    emb = random_embeddings(batch, cfg.embedding_dim, seed=seed)
    emb = dataclasses.replace(
        emb, **{n: getattr(emb, n).detach().cuda().requires_grad_() for n in SequenceEmbeddings.TENSORS}
    )
    out = model(batch, emb)
    out.loss.backward()
    grads = torch.cat([p.grad.flatten().float() for p in model.parameters()])
    return out.logits.detach().float(), grads, emb.item.grad.float()


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-3), ("bfloat16", 3e-2)])
def test_kernel_modes_agree_at_the_reference_shape(dtype, tol):
    base = dataclasses.replace(
        load_config("yambda-5b").model, input_dropout=0.0, linear_dropout=0.0, sequence_dtype=dtype
    )
    rng = np.random.default_rng()
    lengths = [0, 1, 4087, int(rng.integers(2, 4087)), int(rng.integers(2, 4087)) | 1]
    batch = random_batch(lengths, seed=int(rng.integers(2**31))).to("cuda")
    seed = int(rng.integers(2**31))
    ref = _run(dataclasses.replace(base, kernels="pytorch"), batch, seed)
    tri = _run(dataclasses.replace(base, kernels="triton"), batch, seed)
    for a, b in zip(tri, ref):
        assert torch.isfinite(a).all()
        assert float((a - b).norm() / b.norm()) < tol
