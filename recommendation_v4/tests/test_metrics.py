"""Exact ROC AUC against a plain pairwise reference."""

from __future__ import annotations

import pytest
import torch

from dlrmv4.train.metrics import AucAccumulator, exact_auc


def _pairwise_auc(scores: list[float], labels: list[int]) -> float:
    """O(n²) definition: P(score+ > score-) + P(tie)/2 over all positive-negative pairs."""
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def _data(seed: int, n: int, levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels correlated with the scores; ``levels`` rounds the scores to force ties."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, generator=gen)
    labels = (torch.rand(n, generator=gen) < torch.sigmoid(1.5 * scores)).float()
    if levels is not None:
        scores = torch.round(scores * levels / 4) * 4 / levels
    return scores, labels


@pytest.mark.parametrize("seed,n,levels", [(0, 200, None), (1, 300, 8), (2, 257, 2), (3, 50, 1), (4, 2, None)])
def test_exact_auc_matches_pairwise_reference_with_ties(seed, n, levels):
    scores, labels = _data(seed, n, levels)
    labels[0], labels[1] = 0.0, 1.0  # both classes present
    expected = _pairwise_auc(scores.tolist(), labels.int().tolist())
    assert exact_auc(scores, labels) == pytest.approx(expected, abs=1e-12)


def test_all_tied_scores_give_one_half():
    assert exact_auc(torch.zeros(10), torch.tensor([0.0, 1.0] * 5)) == 0.5


def test_perfect_and_inverted_ranking():
    scores = torch.arange(10.0)
    labels = (scores >= 5).float()
    assert exact_auc(scores, labels) == 1.0
    assert exact_auc(-scores, labels) == 0.0


def test_exact_auc_is_invariant_under_monotone_transforms():
    scores, labels = _data(5, 1_000, levels=32)
    auc = exact_auc(scores, labels)
    for transformed in (torch.sigmoid(scores), 3 * scores - 7, torch.exp(scores), scores.double() ** 3):
        assert exact_auc(transformed, labels) == pytest.approx(auc, abs=1e-12)


def test_label_dtypes_and_shapes():
    scores, labels = _data(6, 100)
    auc = exact_auc(scores, labels)
    assert exact_auc(scores.view(10, 10), labels.bool().view(10, 10)) == pytest.approx(auc)
    assert exact_auc(scores.half(), labels.long()) == pytest.approx(exact_auc(scores.half().float(), labels))


@pytest.mark.parametrize(
    "scores,labels,message",
    [
        (torch.empty(0), torch.empty(0), "empty"),
        (torch.randn(5), torch.ones(5), "one class"),
        (torch.randn(5), torch.zeros(5), "one class"),
        (torch.randn(5), torch.ones(4), "5 scores and 4 labels"),
        (torch.randn(4), torch.tensor([0.0, 1.0, 2.0, 1.0]), "0 or 1"),
        (torch.tensor([0.1, float("nan"), 0.3, 0.2]), torch.tensor([0.0, 1.0, 0.0, 1.0]), "finite"),
    ],
)
def test_exact_auc_errors(scores, labels, message):
    with pytest.raises(ValueError, match=message):
        exact_auc(scores, labels)


def test_accumulator_over_batches_equals_one_shot():
    scores, labels = _data(7, 5_000, levels=64)
    acc = AucAccumulator()
    for start in range(0, 5_000, 777):
        acc.update(scores[start : start + 777].view(-1, 1), labels[start : start + 777])
    assert acc.num_samples == 5_000
    assert acc.compute() == exact_auc(scores, labels)
    restored = AucAccumulator("cpu")
    restored.load_state_dict(acc.state_dict())
    assert restored.compute() == acc.compute()
    acc.reset()
    with pytest.raises(ValueError, match="empty"):
        acc.compute()
