"""Chunked steps: one optimizer step over a rank's slice of the global batch, the dense model run
over it in chunks of consecutive samples that fit in memory.

The slice's ids are looked up once (one TorchRec input/output distribution), its rows laid out
chunk by chunk where the backend can (``SequenceEmbeddings.chunks``). Each chunk gets its rows of
the looked-up embeddings as leaves of a graph of its own; its backward fills the leaves'
gradients, which are copied into one gradient buffer per looked-up tensor (every row belongs to
exactly one chunk). After the last chunk, one backward through the lookup with those buffers:
TorchRec's fused row-wise Adagrad runs once, and the plain backend's pending rows are those of the
whole slice. The dense gradients accumulate over the chunks (DDP reduces them once, with the last
chunk). The step therefore equals the unchunked step: the loss is the slice's mean, every chunk uses
the slice's attention normaliser and draws the dropout masks of its own rows of the slice
(``model/hstu.py`` ``SliceContext``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.hstu import DlrmHSTU, SliceContext


def chunk_bounds(num_samples: int, chunks: int) -> list[tuple[int, int]]:
    """Sample ranges of ``chunks`` consecutive chunks whose sizes differ by at most one (fewer when the
    slice has fewer samples: never an empty chunk)."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    n = max(1, min(chunks, num_samples))
    return [(num_samples * i // n, num_samples * (i + 1) // n) for i in range(n)]


class ChunkedEmbeddings:
    """A slice's looked-up embeddings, handed to its chunks as leaves, and the gradient buffers the
    chunks fill."""

    def __init__(self, emb: SequenceEmbeddings, batch: TorchJaggedBatch) -> None:
        self.emb, self.batch = emb, batch
        self.grads = [torch.empty_like(t) for t in emb.tensors()]

    def leaves(self, start: int, stop: int) -> SequenceEmbeddings:
        rows = self.batch.history_row(start), self.batch.history_row(stop)
        part = self.emb.samples(start, stop, *rows)
        return dataclasses.replace(part, **{n: getattr(part, n).detach().requires_grad_() for n in part.TENSORS})

    def store(self, start: int, stop: int, leaves: SequenceEmbeddings) -> None:
        """Copy the chunk's leaf gradients into their rows of the slice's buffers."""
        pieces = self.emb.shared_rows(start, stop, self.batch.history_row(start), self.batch.history_row(stop))
        for buffer, leaf in zip(self.grads[:3], leaves.tensors()[:3]):
            grad, first = _grad_or_zeros(leaf), 0
            for rows in pieces:
                last = first + rows.stop - rows.start
                buffer[rows].copy_(grad[first:last])
                first = last
        for buffer, leaf in zip(self.grads[3:], leaves.tensors()[3:]):
            buffer[start:stop].copy_(_grad_or_zeros(leaf))

    def backward(self) -> None:
        """One backward through the lookup (the sparse update's gradients) with the filled buffers."""
        tensors = self.emb.tensors()
        pairs = [(t, g) for t, g in zip(tensors, self.grads) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _grad_or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def chunk_context(model: DlrmHSTU, batch: TorchJaggedBatch, context: SliceContext, start: int) -> SliceContext:
    """The slice's context for the chunk that starts at sample ``start``."""
    return context.at_row(model.sequence_row(batch, start))


def chunked_logits(model: DlrmHSTU, batch: TorchJaggedBatch, emb: SequenceEmbeddings, chunks: int) -> torch.Tensor:
    """The logits of a whole slice, forward only, computed chunk by chunk (evaluation)."""
    context = model.slice_context(batch)
    bounds = chunk_bounds(batch.num_samples, chunks)
    if len(bounds) == 1:
        return model(batch, emb, context).logits
    return torch.cat(
        [
            model(
                batch.samples(start, stop),
                emb.samples(start, stop, batch.history_row(start), batch.history_row(stop)),
                chunk_context(model, batch, context, start),
            ).logits
            for start, stop in bounds
        ]
    )


def gradient_sync(train_model: torch.nn.Module, last_chunk: bool):
    """DDP reduces the dense gradients once, in the backward of the last chunk."""
    no_sync = getattr(train_model, "no_sync", None)
    if last_chunk or no_sync is None:
        return contextlib.nullcontext()
    return no_sync()
