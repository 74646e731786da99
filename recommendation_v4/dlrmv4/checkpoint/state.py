"""What a checkpoint holds: the loop's position, the tensor entries written by DCP (and loaded in
place) and the small state pickled beside them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful


@dataclass(frozen=True)
class CheckpointPosition:
    """Where the loop stands: enough to continue with the next batch exactly."""

    step: int  # optimizer steps done: the loader's position (every step is one global batch)
    samples_seen: int  # train samples consumed (all processes)
    window: int  # index of the current train window


class ModelAndOptimizers(Stateful):
    """A model and its optimizers as one DCP entry.

    Goes through ``torch.distributed.checkpoint.state_dict``: optimizer state is keyed by parameter
    name (not by position), and an optimizer that has not stepped yet gets its state tensors
    allocated first, so loading in place into a fresh optimizer fills them instead of dropping them.
    """

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizers, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


class HostCopy(Stateful):
    """An entry whose tensors are already host copies that the run will not change (a delta's rows): the
    asynchronous writer writes them as they are instead of staging them."""


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stateful entries (modules, ModelAndOptimizers) go through DCP; the rest is pickled."""
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            # A fresh optimizer has no state tensors for DCP to load into: its state would be lost.
            raise TypeError(f"state[{key!r}] is a bare optimizer: wrap it as ModelAndOptimizers(model, [optimizer])")
    tensor_state = {k: v for k, v in state.items() if isinstance(v, Stateful)}
    return tensor_state, {k: v for k, v in state.items() if k not in tensor_state}
