"""The probe behind the bit-for-bit tests of ``test_chunked_step.py`` (``row_count_probe.py``) finds a
kernel whose rows depend on the row count, names it, and leaves padded positions out."""

from __future__ import annotations

import torch
from row_count_probe import ChunkRows, RowCountProbe


@torch.library.custom_op("row_count_probe_test::shifted_by_rows", mutates_args=(), tags=(torch.Tag.pointwise,))
def shifted_by_rows(x: torch.Tensor) -> torch.Tensor:
    """Elementwise, but every element moves by the tensor's row count."""
    return x + x.shape[0]


@torch.library.custom_op("row_count_probe_test::last_position_by_rows", mutates_args=(), tags=(torch.Tag.pointwise,))
def last_position_by_rows(x: torch.Tensor) -> torch.Tensor:
    """[samples, positions]: only the last position moves by the row count."""
    y = x.clone()
    y[:, -1] += x.shape[0]
    return y


ROWS = ChunkRows({6: [(0, 2), (2, 6)]})


def test_exact_ops_pass_and_a_row_count_dependent_op_is_named():
    x = torch.randn(6, 5)
    exact = RowCountProbe()
    with exact:
        _ = x * 2 + 1
    assert len(exact.calls) == 2 and exact.difference(ROWS) is None
    found = RowCountProbe()
    with found:
        _ = torch.ops.row_count_probe_test.shifted_by_rows(x * 2)
    assert (
        found.difference(ROWS)
        == "shifted_by_rows.default of (6, 5): its rows 0-2 of 6 differ when computed on their own"
    )


def test_positions_past_a_sequence_are_left_out():
    """Rows are samples and the 5 columns their positions: a difference at the last position counts
    only where a sample's sequence reaches it."""
    probe = RowCountProbe()
    with probe:
        torch.ops.row_count_probe_test.last_position_by_rows(torch.randn(6, 5))

    def rows(lengths: list[int]) -> ChunkRows:
        return ChunkRows(ROWS.bounds, {6: torch.arange(6)}, torch.tensor(lengths), max_seq_len=5)

    assert probe.difference(rows([4, 3, 4, 1, 2, 4])) is None
    assert "its rows 2-6 of 6 differ" in probe.difference(rows([4, 3, 4, 1, 5, 4]))
