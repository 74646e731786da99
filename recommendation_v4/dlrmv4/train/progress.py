"""The training progress bar: samples/s, running loss, last AUC and the ETA to the end of the data.

The bar advances every step from host-side counts only. The loss shown is the running mean of the
current window, a device value: it is read at most once per ``refresh_seconds`` (one sync per
refresh, none per step), so the bar never makes the step wait on the host.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from typing import Callable

from tqdm import tqdm


class TrainProgress:
    def __init__(self, total_samples: int, done_samples: int, enabled: bool, refresh_seconds: float = 2.0):
        self.enabled = enabled
        self.refresh_seconds = refresh_seconds
        self.bar = tqdm(
            total=total_samples,
            initial=done_samples,
            unit="sample",
            unit_scale=True,
            desc="train",
            dynamic_ncols=True,
            mininterval=0.5,
            smoothing=0.1,
            disable=not enabled,
        )
        self.last_auc: float | None = None
        self._next_refresh = 0.0

    def update(self, samples: int, read_loss: Callable[[], float]) -> None:
        self.bar.update(samples)
        now = time.monotonic()
        if self.enabled and now >= self._next_refresh:
            self._next_refresh = now + self.refresh_seconds
            postfix = {"loss": f"{read_loss():.4f}"}
            if self.last_auc is not None:
                postfix["auc"] = f"{self.last_auc:.4f}"
            self.bar.set_postfix(postfix, refresh=False)

    def record_auc(self, auc: float) -> None:
        self.last_auc = auc

    def quiet(self):
        """Context for a log line: the bar steps aside while the line is written."""
        return tqdm.external_write_mode(file=sys.stdout) if self.enabled else nullcontext()

    def close(self) -> None:
        self.bar.close()
