"""Run a GPU step under ``torch.cuda.set_sync_debug_mode("error")``: any device-to-host wait raises."""

from __future__ import annotations

from typing import Callable

import torch


def run_without_syncs(step: Callable[[], object]) -> None:
    """One untimed call first (compiling and autotuning may synchronise), then one under the guard."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
