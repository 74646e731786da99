"""The model's input interface: the embeddings of one jagged batch (the lookup itself is the
trainer's: TorchRec or the plain-PyTorch backend fills this from the batch's ids).

Each shared table's rows come as one tensor, the T history rows (jagged by the batch's
history_offsets) followed by the B candidate rows: the order in which the model's token towers
take them, so neither the lookup nor the model copies them into a new layout. The sequence rows
may come in the sequence model's dtype (the autocast dtype: the plain backend looks them up in it);
the item tower's candidate rows are fp32 and their own tensor, so the two uses of a candidate row
never add their gradients into a full-size buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class SequenceEmbeddings:
    item: torch.Tensor        # [T + B, E]: history rows, then one candidate row per sample
    artist: torch.Tensor      # [T + B, E]
    album: torch.Tensor       # [T + B, E]
    contextual: torch.Tensor  # [B, C, E], C = 8 (uid + 7 crosses, hashing.CONTEXTUAL_FEATURES order)
    candidate: torch.Tensor   # [B, 3E] fp32: the candidate's (item ‖ artist ‖ album) rows, for the item tower

    @property
    def num_candidates(self) -> int:
        return self.contextual.shape[0]
