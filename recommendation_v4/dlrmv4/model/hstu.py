"""DlrmHSTU: the whole model of SPEC §5, from a batch's embeddings to logits and the loss.

Mixed precision: the preprocessor and the STU stack run under autocast in
``ModelConfig.sequence_dtype`` (bf16 by default); the postprocessor, item tower, head and loss run
in fp32 outside it. Dropout seeds of the fused output blocks come from the model's own CPU
generator (``dropout_generator``, seeded from the run seed; checkpoints save its state), so the
step needs no device sync to draw them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlrmv4.config import ModelConfig
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import NUM_CONTEXTUAL
from dlrmv4.model.embeddings import SequenceEmbeddings
from dlrmv4.model.heads import ItemTower, LogitHead, Postprocessor
from dlrmv4.model.preprocessor import Preprocessor
from dlrmv4.model.stu import STUStack
from dlrmv4.ops.jagged import take_last

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
SEED_LIMIT = 2**31 - 1


@dataclass(frozen=True, eq=False)
class ModelOutput:
    logits: torch.Tensor  # [B] fp32
    loss: torch.Tensor    # scalar fp32: mean BCE-with-logits x loss_scale


class DlrmHSTU(nn.Module):
    def __init__(self, cfg: ModelConfig, seed: int = 0, num_contextual: int = NUM_CONTEXTUAL) -> None:
        super().__init__()
        self.cfg = cfg
        self.preprocessor = Preprocessor(cfg, num_contextual)
        self.stu = STUStack(cfg)
        self.postprocessor = Postprocessor(cfg)
        self.item_tower = ItemTower(cfg)
        self.head = LogitHead(cfg)
        self.dropout_generator = torch.Generator().manual_seed(seed)

    def _dropout_seeds(self) -> list[int]:
        # A CPU generator: drawing from it never waits on the device.
        draws = torch.randint(0, SEED_LIMIT, (self.cfg.num_layers,), generator=self.dropout_generator)
        return draws.tolist()

    def user_representation(self, batch: TorchJaggedBatch, emb: SequenceEmbeddings) -> torch.Tensor:
        """The candidate position's output of the sequence model, [B, D] (in the autocast dtype)."""
        device = emb.item.device
        dtype = DTYPES[self.cfg.sequence_dtype]
        seeds = self._dropout_seeds()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            x, seq_offsets, max_seq_len = self.preprocessor(
                emb, batch.history_offsets, batch.history_action, batch.history_timestamp, batch.query_time,
                batch.max_history_length)
            x = self.stu(x, seq_offsets, max_seq_len, seeds)
            return take_last(x, seq_offsets, kernels=self.cfg.kernels)

    def forward(self, batch: TorchJaggedBatch, emb: SequenceEmbeddings) -> ModelOutput:
        user = self.postprocessor(self.user_representation(batch, emb), batch.candidate_timestamp)
        item = self.item_tower(emb.candidate.float())
        logits = self.head(user * item).squeeze(-1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.label) * self.cfg.loss_scale
        return ModelOutput(logits=logits, loss=loss)
