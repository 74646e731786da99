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
    """Python ``random``, numpy's legacy global state, torch CPU, each CUDA device, and the named
    generators (for example the model's dropout generator and the loader's)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
        # One state per visible device; an empty list on a CPU-only machine.
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "extra": {name: gen.get_state() for name, gen in extra_generators.items()},
    }


def restore_rng_state(state: dict[str, Any], extra_generators: dict[str, torch.Generator]) -> None:
    """Put every generator back where ``capture_rng_state`` found it.

    A mismatch (other generator names, another number of CUDA devices) raises ValueError before
    anything is changed: a partial restore would silently break bit-exact resume.
    """
    saved_names, given_names = set(state["extra"]), set(extra_generators)
    if saved_names != given_names:
        raise ValueError(
            f"RNG state holds generators {sorted(saved_names)} but {sorted(given_names)} were "
            "given: resume with the same generators the run was saved with"
        )
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(state["cuda"]) != devices:
        raise ValueError(
            f"RNG state holds {len(state['cuda'])} CUDA device state(s) but {devices} device(s) "
            "are visible: resume on the same number of devices per process"
        )
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if devices:
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, gen in extra_generators.items():
        gen.set_state(state["extra"][name])


def resume_seed(seed: int, step: int) -> int:
    """The global torch stream's seed after a resume on another world size: derived from (seed, step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1, np.uint64)[0] >> 1)
