"""The plain-PyTorch backend: fp32 tables replicated on every rank.

The backward leaves each lookup's gradient rows pending and ``sparse_step`` applies row-wise
Adagrad from them in place (``sparse_optimizer.py``), after exchanging them between ranks
(``exchange.py``). The rows and their gradients are rounded through the embedding all-to-all's
precision where TorchRec's would cross it (``wire.py``), so both backends take the same step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.sparse_features import feature_ids
from dlrmv4.model.embeddings.plain_backend.exchange import exchange_gradients
from dlrmv4.model.embeddings.plain_backend.sparse_optimizer import rowwise_adagrad_step_
from dlrmv4.model.embeddings.sequence import SequenceEmbeddings
from dlrmv4.model.embeddings.tables import (
    SparseEmbeddings,
    TableSettings,
    assemble_embeddings,
    init_rows,
    table_features,
)
from dlrmv4.model.embeddings.wire import through_wire

# The warm-up's scratch table: as many rows at most (its ids are folded into them).
_SCRATCH_ROWS = 1 << 16


class _TableLookup(torch.autograd.Function):
    """One table's rows for the sequence (in the sequence dtype) and for the item tower (fp32). The
    backward builds no ``weight.grad``: it hands the (ids, gradient rows) pairs to the table's list
    of pending gradients, which ``sparse_step`` updates from in place (as FBGEMM's fused backward
    does, without copying the rows into a sparse tensor)."""

    @staticmethod
    def forward(ctx, weight, sequence_ids, candidate_ids, dtype, pending, wire_dtype):
        ctx.save_for_backward(sequence_ids, candidate_ids)
        ctx.pending, ctx.wire_dtype = pending, wire_dtype
        rows = through_wire(F.embedding(sequence_ids, weight), wire_dtype)
        return rows.to(dtype), through_wire(F.embedding(candidate_ids, weight), wire_dtype)

    @staticmethod
    def backward(ctx, sequence_grad, candidate_grad):
        sequence_ids, candidate_ids = ctx.saved_tensors
        b = candidate_ids.numel()
        if not b:
            ctx.pending.append((sequence_ids, through_wire(sequence_grad.float(), ctx.wire_dtype)))
            return None, None, None, None, None, None
        # The sequence rows end with the candidates' rows. TorchRec looks a candidate up once and
        # feeds both uses from it, so its gradient crosses the wire as one sum: round it so here too.
        t = sequence_ids.numel() - b
        history = through_wire(sequence_grad[:t].float(), ctx.wire_dtype)
        candidate = through_wire(sequence_grad[t:].float() + candidate_grad, ctx.wire_dtype)
        ctx.pending.append((sequence_ids[:t], history))
        ctx.pending.append((candidate_ids, candidate))
        return None, None, None, None, None, None


class PlainEmbeddings(SparseEmbeddings):
    """fp32 nn.Parameter tables; the backward leaves each lookup's gradient rows pending and
    ``sparse_step`` applies row-wise Adagrad from them. On several ranks every rank holds every
    table (data parallel) and the gradients are all-gathered."""

    backend = "plain"
    lr_tensor: torch.Tensor  # a registered buffer

    def __init__(self, settings: TableSettings, wire_dtype: torch.dtype | None = None) -> None:
        super().__init__(settings)
        specs, dim, seed, device, lr = settings.specs, settings.dim, settings.seed, settings.device, settings.lr
        # The all-to-all's precision where TorchRec's would have one: on one rank it sends nothing
        # (TorchRec skips the all-to-all and its codecs there, and so does the reference).
        self.wire_dtype = wire_dtype if settings.cluster.world_size > 1 else None
        self.weights = nn.ParameterDict(
            {s.name: nn.Parameter(init_rows(i, s.rows, 0, s.rows, dim, seed, device)) for i, s in enumerate(specs)}
        )
        for s in specs:
            self.register_buffer(f"momentum_{s.name}", torch.zeros(s.rows, dtype=torch.float32, device=device))
        # A tensor, not a float: lr / tensor would become reciprocal-then-multiply, not FBGEMM's division.
        self.register_buffer("lr_tensor", torch.tensor(lr, dtype=torch.float32, device=device))
        self.pending: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {s.name: [] for s in specs}

    def forward(self, batch: TorchJaggedBatch, chunks: tuple[tuple[int, int], ...] = ()) -> SequenceEmbeddings:
        # The whole batch's layout whatever the chunks: the backward splits each table's rows into
        # history and candidate gradients by it.
        ids = feature_ids(batch)
        no_ids = torch.zeros(0, dtype=torch.int64, device=self.lr_tensor.device)
        sequence, candidate = {}, []
        for spec in self.specs:
            features = [ids[f] for f in table_features(spec.name)]
            # History and candidate ids in one lookup: its rows are SequenceEmbeddings' layout.
            rows, candidate_rows = _TableLookup.apply(
                self.weights[spec.name],
                torch.cat(features) if len(features) > 1 else features[0],
                features[1] if len(features) > 1 else no_ids,
                self.sequence_dtype,
                self.pending[spec.name],
                self.wire_dtype,
            )
            sequence[spec.name] = rows
            if len(features) > 1:
                candidate.append(candidate_rows)
        return assemble_embeddings(sequence, candidate)

    @torch.no_grad()
    def sparse_step(self) -> None:
        grads = {}
        for name, pieces in self.pending.items():
            if pieces:
                grads[name] = (torch.cat([i for i, _ in pieces]), [g for _, g in pieces])
                pieces.clear()
        exchanged = exchange_gradients(grads, self.specs, self.dim, self.cluster, self.lr_tensor.device)
        for name, grad in exchanged.items():
            rowwise_adagrad_step_(
                self.weights[name], getattr(self, f"momentum_{name}"), grad, self.lr_tensor, self.eps, self.kernels
            )

    @torch.no_grad()
    def warm_up_update(self, batch: TorchJaggedBatch) -> None:
        """The update's kernel on scratch rows, for the pieces ``sparse_step`` hands it: each table's
        history and candidate gradient rows (fp32), for ``batch``'s ids folded into the scratch rows."""
        ids = feature_ids(batch)
        for spec in self.specs:
            rows = min(spec.rows, _SCRATCH_ROWS)
            weight = torch.zeros(rows, self.dim, device=self.lr_tensor.device)
            momentum = torch.zeros(rows, device=self.lr_tensor.device)
            pieces = [ids[f] % rows for f in table_features(spec.name)]
            grads = [torch.ones(len(p), self.dim, device=weight.device) for p in pieces]
            rowwise_adagrad_step_(weight, momentum, (torch.cat(pieces), grads), self.lr_tensor, self.eps, self.kernels)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = lr
        self.lr_tensor.fill_(lr)

    def live_tables(self) -> dict[str, dict[str, Any]]:
        return {
            s.name: {"weight": self.weights[s.name].data, "momentum": getattr(self, f"momentum_{s.name}")}
            for s in self.specs
        }
