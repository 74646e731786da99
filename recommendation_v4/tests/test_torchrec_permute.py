"""The unbucketize step of TorchRec's row-wise sequence lookup: a permutation of rows whose
backward gathers by the inverse permutation, with exactly index_select's gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlrmv4.model.embeddings.torchrec_backend.permute import permute_rows

pytest.importorskip("torchrec")


def test_permute_rows_has_index_selects_values_and_gradient():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1000, 24, generator=g, dtype=torch.float64).requires_grad_()
    permutation = torch.randperm(1000, generator=g)
    upstream = torch.randn(1000, 24, generator=g, dtype=torch.float64)
    ours = permute_rows(rows, permutation)
    ours.backward(upstream)
    reference = rows.detach().clone().requires_grad_()
    torch.index_select(reference, 0, permutation).backward(upstream)
    assert torch.equal(ours, reference.detach()[permutation])
    assert torch.equal(rows.grad, reference.grad)
    with pytest.raises(ValueError, match="not a permutation"):
        permute_rows(rows, permutation[:10])


def _graph_names(tensor: torch.Tensor) -> set[str]:
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def test_row_wise_lookups_go_through_it(gloo_world_of_one):
    from test_embeddings import batch, config

    from dlrmv4.model.embeddings import make_embeddings, table_specs

    cfg = config("torchrec")
    cfg = dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, sharding_types="*=row_wise"))
    emb = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", 7)(batch(1))
    assert any("PermuteRows" in name for name in _graph_names(emb.item))
    assert not any(name.startswith("IndexSelectBackward") for name in _graph_names(emb.item))
