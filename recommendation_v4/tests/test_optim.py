"""Dense Adam, the warm-up schedule, gradient clipping and divergence detection."""

from __future__ import annotations

import math

import pytest
import torch

from dlrmv4.config import TrainConfig
from dlrmv4.train.optim import (
    FiniteMonitor,
    TrainingDivergedError,
    WarmupSchedule,
    clip_dense_gradients,
    make_dense_optimizer,
)


def _params(seed: int, shapes=((7, 5), (5,), (3, 4, 2))) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    return params


def test_adam_hyperparameters_come_from_the_config():
    cfg = TrainConfig(learning_rate=2e-6, adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-7, weight_decay=0.01)
    opt = make_dense_optimizer(_params(0), cfg)
    assert isinstance(opt, torch.optim.Adam)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-6, (0.9, 0.98), 1e-7, 0.01)
    assert not group["fused"]  # CPU parameters: no fused kernel requested


def test_adam_state_starts_with_one_step_on_zero_gradients():
    """The reference's optimizer wrapper (TorchRec's init_state) makes Adam's state with a step on
    zero gradients: the step count is 1, the moments 0, and no parameter moves."""
    params = _params(2, shapes=((4, 3), (5,)))
    before = [(p.detach().clone(), p.grad.clone()) for p in params]
    opt = make_dense_optimizer(params, TrainConfig(learning_rate=1e-2))
    for p, (value, grad) in zip(params, before):
        state = opt.state[p]
        assert float(state["step"]) == 1.0
        assert torch.equal(state["exp_avg"], torch.zeros_like(p)) and torch.equal(
            state["exp_avg_sq"], torch.zeros_like(p)
        )
        assert torch.equal(p.detach(), value) and torch.equal(p.grad, grad)  # the caller's gradient is back


def test_adam_step_matches_a_hand_written_update():
    """The first real update is Adam's step 2: bias corrections 1 - beta^2."""
    cfg = TrainConfig(learning_rate=1e-2)
    (p,) = _params(1, shapes=((4, 3),))
    start, grad = p.detach().clone(), p.grad.clone()
    make_dense_optimizer([p], cfg).step()
    m = (1 - cfg.adam_beta1) * grad / (1 - cfg.adam_beta1**2)
    v = (1 - cfg.adam_beta2) * grad**2 / (1 - cfg.adam_beta2**2)
    torch.testing.assert_close(p.detach(), start - cfg.learning_rate * m / (v.sqrt() + cfg.adam_eps))


def test_reference_config_is_the_closed_division_recipe():
    group = make_dense_optimizer(_params(2), TrainConfig()).param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.95, 0.999), 1e-8, 0.0)


def test_no_parameters_is_an_error():
    with pytest.raises(ValueError, match="no parameters"):
        make_dense_optimizer([], TrainConfig())


@pytest.mark.parametrize("warmup", [24_000, 10, 7])
def test_warmup_lr(warmup):
    schedule = WarmupSchedule(TrainConfig(learning_rate=1e-6, warmup_steps=warmup))
    assert schedule.lr_at(0) == 0.0
    assert schedule.lr_at(1) == pytest.approx(1e-6 / warmup)
    assert schedule.lr_at(warmup // 2) == pytest.approx(1e-6 * (warmup // 2) / warmup)
    assert schedule.lr_at(warmup) == 1e-6
    assert schedule.lr_at(warmup + 1) == schedule.lr_at(10 * warmup) == 1e-6
    lrs = [schedule.lr_at(s) for s in range(warmup + 3)]
    assert lrs == sorted(lrs)


def test_no_warmup_starts_at_the_peak():
    schedule = WarmupSchedule(TrainConfig(learning_rate=3e-6, warmup_steps=0))
    assert schedule.lr_at(0) == schedule.lr_at(5) == 3e-6
    with pytest.raises(ValueError):
        schedule.lr_at(-1)


def test_apply_sets_dense_and_sparse_rates_together():
    opt = make_dense_optimizer(_params(3), TrainConfig())
    sparse: list[float] = []
    schedule = WarmupSchedule(TrainConfig(warmup_steps=100))
    assert schedule.apply(25, opt, sparse.append) == pytest.approx(2.5e-7)
    assert sparse == [opt.param_groups[0]["lr"]] == [pytest.approx(2.5e-7)]


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 1e3])
def test_clipping_matches_torch_clip_grad_norm(max_norm):
    ours, theirs = _params(4), _params(4)
    norm = clip_dense_gradients(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad)
    clipped = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours]))
    assert clipped.item() <= max_norm * (1 + 1e-5)


def test_clipping_zero_is_off_but_reports_the_norm():
    params = _params(5)
    before = [p.grad.clone() for p in params]
    norm = clip_dense_gradients(params, 0.0)
    expected = math.sqrt(sum(float((g**2).sum()) for g in before))
    assert norm.item() == pytest.approx(expected, rel=1e-5)
    for p, g in zip(params, before):
        assert torch.equal(p.grad, g)


def test_clipping_skips_parameters_without_gradients():
    params = _params(6)
    params[1].grad = None
    norm = clip_dense_gradients(params, 1.0)
    assert norm.item() > 1.0 and params[1].grad is None
    assert clip_dense_gradients([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    with pytest.raises(ValueError):
        clip_dense_gradients(params, -1.0)


def test_monitor_reports_the_first_bad_step_at_the_next_check():
    monitor = FiniteMonitor("cpu")
    for step, loss in enumerate([0.5, 0.4, 0.3]):
        monitor.update(torch.tensor(loss), step, window=0)
    monitor.check()
    monitor.update(torch.tensor(float("inf")), 3, window=1)
    monitor.update(torch.tensor(float("nan")), 4, window=2)
    monitor.update(torch.tensor(0.2), 5, window=2)
    with pytest.raises(TrainingDivergedError, match=r"step 3 \(window 1\)"):
        monitor.check()
