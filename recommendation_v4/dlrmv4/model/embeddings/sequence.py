"""The model's input interface: the embeddings of one jagged batch (the lookup, TorchRec or the
plain-PyTorch backend of this package, fills this from the batch's ids).

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
    item: torch.Tensor  # [T + B, E]: history rows, then one candidate row per sample
    artist: torch.Tensor  # [T + B, E]
    album: torch.Tensor  # [T + B, E]
    contextual: torch.Tensor  # [B, C, E], C = 8 (uid + 7 crosses, hashing.CONTEXTUAL_FEATURES order)
    candidate: torch.Tensor  # [B, 3E] fp32: the candidate's (item ‖ artist ‖ album) rows, for the item tower

    @property
    def num_candidates(self) -> int:
        return self.contextual.shape[0]

    @property
    def num_history_rows(self) -> int:
        return self.item.shape[0] - self.num_candidates

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.item, self.artist, self.album, self.contextual, self.candidate

    def samples(self, start: int, stop: int, first_row: int, last_row: int) -> SequenceEmbeddings:
        """Samples [start, stop), whose history rows are [first_row, last_row), in the same layout (the
        shared tables' history and candidate rows are copied into one tensor each)."""
        t = self.num_history_rows

        def shared(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[first_row:last_row], x[t + start : t + stop]])

        return SequenceEmbeddings(
            item=shared(self.item),
            artist=shared(self.artist),
            album=shared(self.album),
            contextual=self.contextual[start:stop],
            candidate=self.candidate[start:stop],
        )
