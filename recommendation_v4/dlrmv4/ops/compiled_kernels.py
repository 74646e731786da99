"""How many of the project's Triton kernels this process has compiled and autotuned so far: the run
counts them at RUN_START and at its end, so a compilation inside the timed run shows in its log.

A kernel variant is one entry of a ``triton.jit`` function's per-device cache (a new specialization:
constexprs, dtypes, integer arguments' divisibility); an autotuned key is one entry of an autotuner's
cache (a new tuning key, each one timing every config of its list).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from dlrmv4.ops.dispatch import triton_available

_KERNEL_MODULES = "dlrmv4.ops.triton."


@dataclass(frozen=True)
class CompiledKernels:
    variants: int
    autotuned: int

    def since(self, before: CompiledKernels) -> CompiledKernels:
        return CompiledKernels(self.variants - before.variants, self.autotuned - before.autotuned)


def compiled_kernels() -> CompiledKernels | None:
    """The counts over the kernel modules imported so far; None where Triton is not there or its
    caches are not laid out as this reads them (the interpreter's functions have none)."""
    if not triton_available():
        return None
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, KernelInterface

    functions: dict[int, JITFunction] = {}
    tuners: dict[int, Autotuner] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(_KERNEL_MODULES):
            continue
        for value in vars(module).values():
            if isinstance(value, Autotuner):
                tuners[id(value)] = value
            # Autotuners and heuristics wrap the jit function in ``fn``.
            while isinstance(value, KernelInterface) and not isinstance(value, JITFunction):
                value = getattr(value, "fn", None)
            if isinstance(value, JITFunction):
                functions[id(value)] = value
    try:
        variants = sum(len(caches[0]) for f in functions.values() for caches in f.device_caches.values())
        autotuned = sum(len(t.cache) for t in tuners.values())
    except (AttributeError, TypeError, IndexError):
        return None
    return CompiledKernels(variants, autotuned)
