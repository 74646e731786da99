"""The model's input interface: the embeddings of one jagged batch (the lookup itself is the
trainer's: TorchRec or the plain-PyTorch backend fills this from the batch's ids)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SequenceEmbeddings:
    history_item: torch.Tensor    # [T, E] jagged by the batch's history_offsets
    history_artist: torch.Tensor  # [T, E]
    history_album: torch.Tensor   # [T, E]
    candidate_item: torch.Tensor  # [B, E]
    candidate_artist: torch.Tensor
    candidate_album: torch.Tensor
    contextual: torch.Tensor      # [B, C, E], C = 8 (uid + 7 crosses, hashing.CONTEXTUAL_FEATURES order)
