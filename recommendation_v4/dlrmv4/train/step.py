"""One training step of both optimizers, with no host-device synchronisation.

The learning rate of the step (a Python float from the step count) goes to both optimizers, the
slice's ids are looked up once, the model runs forward and backward over the slice (through DDP on
several ranks), in ``train.chunks`` chunks of consecutive samples when the slice's activations do
not fit at once (``train/chunks.py``: the chunked step equals the unchunked one), the dense
gradients are clipped on the device, Adam steps, the tables take their row-wise Adagrad update,
and the loss goes to the divergence monitor, which records a non-finite value on the device.
Nothing reads the device back: ``tests/gpu/test_zero_sync.py`` runs steps under
``torch.cuda.set_sync_debug_mode("error")``.

Given the next batch (``upcoming``) and ``train.sparse_pipeline``, the step starts that batch's id
distribution once its own (first) forward is queued and takes it past its host wait after its own
backward: the host waits for the ids' counts twice, each time with the device busy on this step's
queued work, and the next step's lookup starts from ids already on their ranks
(``SparseEmbeddings.distribute_ids``). The numbers are the same either way.
"""

from __future__ import annotations

from typing import Callable

import torch

from dlrmv4.config import TrainConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.model.embeddings import SequenceEmbeddings, SparseEmbeddings
from dlrmv4.model.hstu import DlrmHSTU, SliceContext
from dlrmv4.train.chunks import ChunkedEmbeddings, chunk_bounds, chunk_context, gradient_sync
from dlrmv4.train.optim import FiniteMonitor, WarmupSchedule, clip_dense_gradients, make_dense_optimizer
from dlrmv4.train.prefetch import ready_point


class TrainStep:
    """``step(batch, step_index, window)`` -> the loss (a device tensor, detached)."""

    def __init__(
        self,
        model: DlrmHSTU,
        embeddings: SparseEmbeddings,
        cfg: TrainConfig,
        finite: FiniteMonitor,
        train_model: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        self.train_model = train_model if train_model is not None else model  # DDP-wrapped on several ranks
        self.embeddings = embeddings
        self.cfg = cfg
        self.finite = finite
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_dense_optimizer(self.dense_params, cfg)
        self.schedule = WarmupSchedule(cfg)
        # 0: the memory plan picks before a run; a step built without one runs the slice at once.
        self.chunks = max(cfg.chunks, 1)
        self.pipelined = cfg.sparse_pipeline

    def __call__(
        self, batch: TorchJaggedBatch, step: int, window: int, upcoming: TorchJaggedBatch | None = None
    ) -> torch.Tensor:
        ahead = upcoming if self.pipelined else None
        # On a GPU: the point of the stream from which ``upcoming`` is on the device (the prefetcher
        # made the stream wait for its copy before handing it over), before this step's work.
        ready = ready_point(ahead) if ahead is not None else None
        self.schedule.apply(step, self.optimizer, self.embeddings.set_learning_rate)
        bounds = tuple(chunk_bounds(batch.num_samples, self.chunks))
        emb = self.embeddings(batch, bounds)
        context = self.model.slice_context(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(
            batch, emb, context, bounds, self.train_model, lambda: self._send_ahead(ahead, ready)
        )
        if ahead is not None:
            self.embeddings.settle_ids()
        clip_dense_gradients(self.dense_params, self.cfg.grad_clip_norm)
        self.optimizer.step()
        self.embeddings.sparse_step()
        self.finite.update(loss, step, window)
        return loss

    def forward_backward(
        self,
        batch: TorchJaggedBatch,
        emb: SequenceEmbeddings,
        context: SliceContext,
        bounds: tuple[tuple[int, int], ...],
        model: torch.nn.Module,
        after_first_forward: Callable[[], None] = lambda: None,
    ) -> torch.Tensor:
        """The slice's forward and backward through ``model`` (in ``bounds``' chunks), down into the
        lookup ``emb`` came from; the loss, detached. ``after_first_forward`` runs with the first
        forward queued."""
        if len(bounds) == 1:
            loss = model(batch, emb, context).loss
            after_first_forward()
            loss.backward()
            return loss.detach()
        chunked = ChunkedEmbeddings(emb, batch)
        parts = []
        for i, (start, stop) in enumerate(bounds):
            leaves = chunked.leaves(start, stop)
            with gradient_sync(model, last_chunk=i + 1 == len(bounds)):
                part = model(batch.samples(start, stop), leaves, chunk_context(self.model, batch, context, start)).loss
                if i == 0:
                    after_first_forward()
                part.backward()
            chunked.store(start, stop, leaves)
            parts.append(part.detach())
            del leaves, part
        chunked.backward()
        return torch.stack(parts).sum()

    def _send_ahead(self, ahead: TorchJaggedBatch | None, ready: torch.cuda.Event | None) -> None:
        """Start ``ahead``'s id distribution. Called with a forward queued: the host's wait for the
        ids' counts here would otherwise leave the device with nothing to run."""
        if ahead is not None:
            self.embeddings.distribute_ids(ahead, ready)
