"""The model's input interface: the embeddings of one jagged batch (the lookup, TorchRec or the
plain-PyTorch backend of this package, fills this from the batch's ids).

Each shared table's rows come as one tensor, the T history rows (jagged by the batch's
history_offsets) followed by the B candidate rows: the order in which the model's token towers
take them, so neither the lookup nor the model copies them into a new layout. The sequence rows
may come in the sequence model's dtype (the autocast dtype: the plain backend looks them up in it);
the item tower's candidate rows are fp32 and their own tensor, so the two uses of a candidate row
never add their gradients into a full-size buffer.

A step that runs its slice in chunks (``train/chunks.py``) asks the lookup for ``chunks`` layout:
the shared tables' rows chunk after chunk, each chunk's history rows then its candidates', so a
chunk's rows are one contiguous view of each tensor rather than a copy of two pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True, eq=False)
class SequenceEmbeddings:
    item: torch.Tensor  # [T + B, E]: history rows, then one candidate row per sample
    artist: torch.Tensor  # [T + B, E]
    album: torch.Tensor  # [T + B, E]
    contextual: torch.Tensor  # [B, C, E], C = 8 (uid + 7 crosses, hashing.CONTEXTUAL_FEATURES order)
    candidate: torch.Tensor  # [B, 3E] fp32: the candidate's (item ‖ artist ‖ album) rows, for the item tower
    # The sample ranges the shared tables' rows are laid out by, one after another (module docstring);
    # () or one range: the whole batch's history rows, then its candidates'.
    chunks: tuple[tuple[int, int], ...] = ()
    TENSORS: ClassVar[tuple[str, ...]] = ("item", "artist", "album", "contextual", "candidate")

    @property
    def num_candidates(self) -> int:
        return self.contextual.shape[0]

    @property
    def num_history_rows(self) -> int:
        return self.item.shape[0] - self.num_candidates

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.TENSORS)

    def shared_rows(self, start: int, stop: int, first_row: int, last_row: int) -> tuple[slice, ...]:
        """Where samples [start, stop), whose history rows are [first_row, last_row), have their rows
        in a shared table's tensor: its history rows, then its candidates' (one slice in a chunked
        layout, two in the whole batch's)."""
        if len(self.chunks) > 1:
            if (start, stop) not in self.chunks:
                raise ValueError(f"samples [{start}, {stop}) are not one of the layout's chunks {self.chunks}")
            # Before the chunk: the history rows and the candidates of the samples before it.
            return (slice(first_row + start, last_row + stop),)
        t = self.num_history_rows
        return slice(first_row, last_row), slice(t + start, t + stop)

    def samples(self, start: int, stop: int, first_row: int, last_row: int) -> SequenceEmbeddings:
        """Samples [start, stop), whose history rows are [first_row, last_row), in the whole-batch
        layout: views of the shared tables' rows in a chunked layout, copies of their two pieces in
        the whole batch's."""
        pieces = self.shared_rows(start, stop, first_row, last_row)

        def shared(x: torch.Tensor) -> torch.Tensor:
            return x[pieces[0]] if len(pieces) == 1 else torch.cat([x[p] for p in pieces])

        return SequenceEmbeddings(
            item=shared(self.item),
            artist=shared(self.artist),
            album=shared(self.album),
            contextual=self.contextual[start:stop],
            candidate=self.candidate[start:stop],
        )
