"""Which of a store's windows train and which one is the holdout, and their sample counts."""

from __future__ import annotations

import numpy as np

from dlrmv4.data.store import Store
from dlrmv4.errors import UserError


def split_windows(store: Store) -> tuple[list[int], int]:
    """Train windows (all but the last) and the holdout window (the last: a partial day on Yambda)."""
    if store.num_windows < 2:
        raise UserError(
            f"the store at {store.path} has {store.num_windows} window(s) of anchors; training needs at "
            "least two (train windows and the holdout): use more data or a smaller --min-history"
        )
    return list(range(store.num_windows - 1)), store.num_windows - 1


def sample_counts(store: Store) -> tuple[int, int]:
    """(train samples: the anchors of every train window, eval samples: the holdout's anchors)."""
    windows, holdout = split_windows(store)
    anchors = np.diff(np.asarray(store.window_offsets))
    return int(anchors[windows].sum()), int(anchors[holdout])
