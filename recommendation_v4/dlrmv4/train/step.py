"""One training step of both optimizers, with no host-device synchronisation.

The learning rate of the step (a Python float from the step count) goes to both optimizers, the
model runs forward and backward (through DDP on several ranks), the dense gradients are clipped
on the device, Adam steps, the tables take their row-wise Adagrad update, and the loss goes to the
divergence monitor, which records a non-finite value on the device. Nothing reads the device
back: ``tests/gpu/test_zero_sync.py`` runs steps under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import torch

from dlrmv4.config import TrainConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.embeddings import SparseEmbeddings
from dlrmv4.train.optim import FiniteMonitor, WarmupSchedule, clip_dense_gradients, make_dense_optimizer


class TrainStep:
    """``step(batch, step_index, window)`` -> the loss (a device tensor, detached)."""

    def __init__(self, model: DlrmHSTU, embeddings: SparseEmbeddings, cfg: TrainConfig, finite: FiniteMonitor,
                 train_model: torch.nn.Module | None = None) -> None:
        self.model = model
        self.train_model = train_model if train_model is not None else model  # DDP-wrapped on several ranks
        self.embeddings = embeddings
        self.cfg = cfg
        self.finite = finite
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_dense_optimizer(self.dense_params, cfg)
        self.schedule = WarmupSchedule(cfg)

    def __call__(self, batch: TorchJaggedBatch, step: int, window: int) -> torch.Tensor:
        self.schedule.apply(step, self.optimizer, self.embeddings.set_learning_rate)
        out = self.train_model(batch, self.embeddings(batch))
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        clip_dense_gradients(self.dense_params, self.cfg.grad_clip_norm)
        self.optimizer.step()
        self.embeddings.sparse_step()
        loss = out.loss.detach()
        self.finite.update(loss, step, window)
        return loss
