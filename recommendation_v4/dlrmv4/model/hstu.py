"""DlrmHSTU: the whole model (docs/model.md), from a batch's embeddings to logits and the loss.

Mixed precision: the preprocessor, the STU stack and the postprocessor's Linear run under autocast
in ``ModelConfig.sequence_dtype`` (bf16 by default); the postprocessor's layer norm, the item tower,
the head and the loss run in fp32 outside it.

A training step may run the model over its slice of the global batch in several chunks of
consecutive samples (``train/step.py``). What a chunk must share with the whole slice travels in a
``SliceContext``: the dropout seeds (drawn once per step from the model's own CPU generator,
``dropout_generator``, seeded from the run seed and checkpointed, so no device sync), the slice's
longest sequence (the attention's normaliser N), the slice's sample count (the loss is the mean
over the slice) and the chunk's first sequence row (dropout masks are drawn per global row), so a
chunk computes exactly the slice's rows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import NUM_CONTEXTUAL
from dlrmv4.model.dtypes import DTYPES
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.heads import ItemTower, LogitHead, Postprocessor
from dlrmv4.model.preprocessor import Preprocessor
from dlrmv4.model.stu import STUStack

SEED_LIMIT = 2**31 - 1


@dataclass(frozen=True, eq=False)
class ModelOutput:
    logits: torch.Tensor  # [B] fp32
    loss: torch.Tensor  # scalar fp32: this batch's share of the slice's mean BCE-with-logits x loss_scale


@dataclass(frozen=True)
class SliceContext:
    """What every chunk of one step's slice shares (see the module docstring)."""

    dropout_seeds: tuple[int, ...]  # input dropout, then one per STU layer
    max_seq_len: int  # the slice's longest sequence: the attention's N
    num_samples: int  # the slice's samples: the loss divides by this
    row_offset: int = 0  # the chunk's first sequence row in the slice's layout

    def at_row(self, row_offset: int) -> SliceContext:
        return dataclasses.replace(self, row_offset=row_offset)


class DlrmHSTU(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0, num_contextual: int = NUM_CONTEXTUAL) -> None:
        super().__init__()
        self.cfg = cfg
        self.preprocessor = Preprocessor(cfg, num_contextual)
        self.stu = STUStack(cfg)
        self.postprocessor = Postprocessor(cfg, DTYPES[cfg.sequence_dtype])
        self.item_tower = ItemTower(cfg)
        self.head = LogitHead(cfg)
        self.dropout_generator = torch.Generator().manual_seed(seed)

    @property
    def num_contextual(self) -> int:
        return self.preprocessor.num_contextual

    def slice_context(self, batch: TorchJaggedBatch) -> SliceContext:
        """The context of a step over ``batch`` (a rank's whole slice): draws this step's dropout seeds
        in training mode (a CPU generator: drawing never waits on the device)."""
        seeds = (
            torch.randint(0, SEED_LIMIT, (self.cfg.num_layers + 1,), generator=self.dropout_generator).tolist()
            if self.training
            else [0] * (self.cfg.num_layers + 1)
        )
        return SliceContext(tuple(seeds), batch.max_history_length + self.num_contextual + 1, batch.num_samples)

    def sequence_row(self, batch: TorchJaggedBatch, sample: int) -> int:
        """The first sequence row of sample ``sample`` in ``batch``'s layout [C contextual | history | candidate]."""
        return batch.history_row(sample) + sample * (self.num_contextual + 1)

    def user_representation(
        self, batch: TorchJaggedBatch, emb: SequenceEmbeddings, context: SliceContext
    ) -> torch.Tensor:
        """The candidate position's output of the sequence model, [B, D] (in the autocast dtype)."""
        device = emb.item.device
        dtype = DTYPES[self.cfg.sequence_dtype]
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            x, seq_offsets = self.preprocessor(
                emb,
                batch.history_offsets,
                batch.history_action,
                batch.history_timestamp,
                batch.query_time,
                context.dropout_seeds[0],
                context.row_offset,
            )
            # x is this forward's own: without gradients the layers may write over it.
            return self.stu(
                x, seq_offsets, context.max_seq_len, context.dropout_seeds[1:], context.row_offset, consume_input=True
            )

    def forward(
        self, batch: TorchJaggedBatch, emb: SequenceEmbeddings, context: SliceContext | None = None
    ) -> ModelOutput:
        """Logits and loss of ``batch``; ``context`` None: ``batch`` is the whole slice."""
        context = context if context is not None else self.slice_context(batch)
        if context.max_seq_len < batch.max_history_length + self.num_contextual + 1:
            raise ValueError(
                f"SliceContext.max_seq_len {context.max_seq_len} is shorter than this batch's longest "
                f"sequence {batch.max_history_length + self.num_contextual + 1}"
            )
        # The reference's postprocessor reads the candidate row's sequence timestamp: the query time.
        user = self.postprocessor(self.user_representation(batch, emb, context), batch.query_time)
        item = self.item_tower(emb.candidate.float())
        logits = self.head(user * item).squeeze(-1)
        # The sum over this batch / the slice's size: the chunks' losses add up to the slice's mean.
        bce = nn.functional.binary_cross_entropy_with_logits(logits, batch.label, reduction="sum")
        loss = bce * (self.cfg.loss_scale / context.num_samples)
        return ModelOutput(logits=logits, loss=loss)
