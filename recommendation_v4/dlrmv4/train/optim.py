"""Dense optimizer, learning-rate warm-up, gradient clipping and divergence detection (docs/training.md).

Nothing here reads a device value back to the host inside the training step: the learning rate
is a Python float computed from the step count, the clipping norm stays a device tensor, and
non-finite losses are recorded on the device and read only where the loop syncs anyway.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from dlrmv4.config import TrainConfig
from dlrmv4.errors import UserError


class TrainingDivergedError(UserError):
    """The loss became NaN or infinite; the message names the first step and window seen."""

    def __init__(self, step: int, window: int):
        self.step = step
        self.window = window
        super().__init__(
            f"training diverged: non-finite loss at step {step} (window {window}); lower the "
            "learning rate or resume from an earlier checkpoint"
        )


def make_dense_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Adam:
    """Adam over the dense parameters with the closed-division hyperparameters from ``cfg``, its state
    made by one step on zero gradients as the reference's is (the step count starts at 1).

        The fused kernel is used where every parameter lives on a CUDA/ROCm device (one launch for
        all parameters); elsewhere torch picks its own ``foreach`` default.
    """
    params = list(params)
    if not params:
        raise ValueError("make_dense_optimizer got no parameters")
    on_gpu = all(p.device.type == "cuda" and p.is_floating_point() for p in params)
    optimizer = torch.optim.Adam(
        params,
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        fused=True if on_gpu else None,
    )
    # The reference's optimizer wrapper (TorchRec's KeyedOptimizer.init_state) creates Adam's state
    # with one step on zero gradients: nothing moves, and the first real update is step 2 of Adam's
    # bias correction.
    gradients = [p.grad for p in params]  # the caller's, if any, come back afterwards
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p, grad in zip(params, gradients):
        p.grad = grad
    return optimizer


class WarmupSchedule:
    """Linear warm-up from 0 to ``cfg.learning_rate`` over ``cfg.warmup_steps`` steps, then constant;
    the tables' rate follows the same ramp to ``cfg.sparse_peak_lr``.

    ``step`` is the 0-based index of the optimizer update about to be taken, so step 0 trains
    at 0 (the checker's ``opt_learning_rate_warmup_start_lr`` 0.0) and step ``warmup_steps``
    and later at the peak. With ``warmup_steps`` 0 the peak applies from step 0. The schedule is
    a pure function of the step: a resumed run needs only the step count (the resume contract
    refuses one under a different schedule).
    """

    def __init__(self, cfg: TrainConfig):
        if cfg.learning_rate < 0 or cfg.warmup_steps < 0:
            raise ValueError(
                f"learning_rate and warmup_steps must be >= 0, got {cfg.learning_rate} and {cfg.warmup_steps}"
            )
        self.peak_lr = float(cfg.learning_rate)
        self.sparse_peak_lr = float(cfg.sparse_peak_lr)
        self.warmup_steps = int(cfg.warmup_steps)

    def lr_at(self, step: int) -> float:
        return self._ramp(self.peak_lr, step)

    def sparse_lr_at(self, step: int) -> float:
        return self._ramp(self.sparse_peak_lr, step)

    def _ramp(self, peak: float, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step >= self.warmup_steps:
            return peak
        return peak * step / self.warmup_steps

    def apply(self, step: int, dense_opt: torch.optim.Optimizer, set_sparse_lr: Callable[[float], None]) -> float:
        """Set the learning rates of step ``step`` on both optimizers (one rate, docs/training.md, unless
        ``sparse_learning_rate`` gives the tables their own); returns the dense one.

        Called every step, also past the warm-up, so a resumed run and a fresh one set the same
        rate without either keeping track of what was set before.
        """
        lr = self.lr_at(step)
        for group in dense_opt.param_groups:
            group["lr"] = lr
        set_sparse_lr(self.sparse_lr_at(step))
        return lr


def clip_dense_gradients(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the dense gradients to ``max_norm`` (0: off).

    Pass the dense parameters only: the embedding tables' row-wise Adagrad is fused into the
    backward and their gradients never materialise. Returns the pre-clip norm as a device
    tensor (also when clipping is off, for logging); the scaling is branch-free on the device
    (``clip_grad_norm_`` multiplies by ``min(1, max_norm / (norm + 1e-6))``), so no host sync.
    """
    if max_norm < 0:
        raise ValueError(f"max_norm must be >= 0 (0 turns clipping off), got {max_norm}")
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else None)
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)  # takes parameters, scales .grad
    return norm


class FiniteMonitor:
    """Records, on the device and without a sync, the first step whose loss was not finite.

    Contract: ``update(loss, step, window)`` every step (a few tiny kernels, no host read);
    ``check()`` at the points where the loop syncs anyway (end of a logging interval, before an
    eval, before writing a checkpoint). ``check`` raises naming the first bad step and window,
    so a run is caught at most one interval late and never checkpoints a diverged state; after
    a passing ``check`` the monitor holds nothing worth saving, hence no state dict.
    """

    def __init__(self, device: torch.device | str, reduce_min: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self._step = torch.full((), -1, dtype=torch.int64, device=device)
        self._window = torch.full((), -1, dtype=torch.int64, device=device)
        # Several ranks: the first bad step of any rank, so every rank stops with the same message.
        self._reduce_min = reduce_min

    def update(self, loss: torch.Tensor, step: int, window: int) -> None:
        first_bad = ~torch.isfinite(loss.detach()).all() & (self._step < 0)
        self._step = torch.where(first_bad, step, self._step)
        self._window = torch.where(first_bad, window, self._window)

    def check(self) -> None:
        if self._reduce_min is not None:
            # (step, window) as one key, smallest step first; windows fit in 20 bits.
            none = torch.iinfo(torch.int64).max
            key = torch.where(self._step < 0, none, self._step * (1 << 20) + self._window)
            key = self._reduce_min(key.reshape(1).clone())[0]
            step, window = (-1, -1) if int(key) == none else divmod(int(key), 1 << 20)
        else:
            step, window = torch.stack([self._step, self._window]).tolist()
        if step >= 0:
            raise TrainingDivergedError(step, window)
