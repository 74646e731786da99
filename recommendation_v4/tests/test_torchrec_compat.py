"""The one module that relies on TorchRec's and FBGEMM's insides: its check passes on the installed
versions, refuses in one line a TorchRec whose pieces changed, and its patch is installed once."""

from __future__ import annotations

import pytest
import torch

torchrec = pytest.importorskip("torchrec")

from dlrmv4.errors import UserError  # noqa: E402
from dlrmv4.model.embeddings.torchrec_backend import compat as torchrec_compat  # noqa: E402


def test_the_installed_versions_pass_and_the_patch_installs_once():
    from torchrec.distributed import dist_data

    torchrec_compat.check()
    torchrec_compat.install()
    patched = dist_data.SequenceEmbeddingsAwaitable.__init__
    torchrec_compat.install()
    assert dist_data.SequenceEmbeddingsAwaitable.__init__ is patched
    assert dist_data.SequenceEmbeddingsAwaitable._dlrmv4_original_init is not patched


def test_a_changed_awaitable_is_refused_in_one_line(monkeypatch):
    from torchrec.distributed import dist_data

    def changed(self, tensor_awaitable, permute, embedding_dim, extra=None):
        pass

    monkeypatch.delattr(dist_data.SequenceEmbeddingsAwaitable, "_dlrmv4_original_init", raising=False)
    monkeypatch.setattr(dist_data.SequenceEmbeddingsAwaitable, "__init__", changed)
    torchrec_compat.check.cache_clear()
    try:
        with pytest.raises(UserError) as info:
            torchrec_compat.check()
    finally:
        torchrec_compat.check.cache_clear()
    message = str(info.value)
    assert "\n" not in message and "SequenceEmbeddingsAwaitable.__init__" in message and "torchrec" in message


def test_the_learning_rate_reaches_every_group_through_step():
    class Fused(torch.optim.Optimizer):
        def __init__(self):
            super().__init__([torch.zeros(1, requires_grad=True)], {"lr": 0.1})
            self.steps = 0

        def step(self, closure=None):
            self.steps += 1

    fused = Fused()
    torchrec_compat.push_learning_rate(fused, 0.25)
    assert [g["lr"] for g in fused.param_groups] == [0.25] and fused.steps == 1
