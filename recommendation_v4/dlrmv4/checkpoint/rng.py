"""Capture and restore every random number generator a run draws from, for exact resume.

The state is a plain dict of picklable values (tuples, numpy arrays, CPU byte tensors) so the
checkpoint writer can store it beside the position. Restoring it and drawing again gives the
same numbers as a run that never stopped.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng_state(extra_generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Python ``random``, numpy's legacy global state, torch CPU, this process's CUDA device, and the
    named generators (for example the model's dropout generator and the loader's)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
        # The process's own device only: a resume may see another number of GPUs (another node
        # shape, a one-GPU machine), and no process draws on another's device. None without CUDA.
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "extra": {name: gen.get_state() for name, gen in extra_generators.items()},
    }


def restore_rng_state(state: dict[str, Any], extra_generators: dict[str, torch.Generator]) -> None:
    """Put every generator back where ``capture_rng_state`` found it.

    Other generator names raise ValueError before anything is changed: a partial restore would
    silently break bit-exact resume. The CUDA state goes to this process's device when both the
    saving and the resuming process had one (the training draws nothing from it: dropout's seeds
    come from the named generator).
    """
    saved_names, given_names = set(state["extra"]), set(extra_generators)
    if saved_names != given_names:
        raise ValueError(
            f"RNG state holds generators {sorted(saved_names)} but {sorted(given_names)} were "
            "given: resume with the same generators the run was saved with"
        )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for name, gen in extra_generators.items():
        gen.set_state(state["extra"][name])


def resume_seed(seed: int, step: int) -> int:
    """The global torch stream's seed after a resume on another world size: derived from (seed, step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0] >> 1)
