"""How many of the project's Triton kernels (its Gluon kernels too: ``gluon.jit`` functions are
Triton JIT functions) this process has compiled and autotuned so far: the run counts them at
RUN_START and at its end, so a compilation inside the timed run shows in its log.

A kernel variant is one entry of a ``triton.jit`` function's per-device cache (a new specialization:
constexprs, dtypes, integer arguments' divisibility); an autotuned key is one entry of an autotuner's
cache (a new tuning key, each one timing every config of its list).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from dlrmv4.ops.dispatch import triton_available

_KERNEL_MODULES = ("dlrmv4.ops.triton.", "dlrmv4.ops.gluon.")  # the modules whose kernels count


@dataclass(frozen=True)
class CompiledKernels:
    variants: frozenset[tuple[str, str]]  # (kernel, its specialization's cache key)
    autotuned: frozenset[tuple[str, str]]  # (kernel, its tuning key)

    def since(self, before: CompiledKernels) -> CompiledKernels:
        return CompiledKernels(self.variants - before.variants, self.autotuned - before.autotuned)

    def describe(self) -> str:
        """Counts, with the kernels named (``name x n``) where there are any."""

        def named(entries: frozenset[tuple[str, str]]) -> str:
            counts = Counter(name for name, _ in entries)
            listed = ", ".join(f"{name} x {n}" if n > 1 else name for name, n in sorted(counts.items()))
            return f"{len(entries)}" + (f" ({listed})" if listed else "")

        return f"{named(self.variants)} compiled, {named(self.autotuned)} autotuned"

    def as_dict(self) -> dict[str, list[list[str]]]:
        return {"compiled": sorted(map(list, self.variants)), "autotuned": sorted(map(list, self.autotuned))}


def compiled_kernels() -> CompiledKernels | None:
    """The compiled variants and tuned keys over the kernel modules imported so far; None where Triton
    is not there or its caches are not laid out as this reads them (the interpreter's functions have none)."""
    if not triton_available():
        return None
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction, KernelInterface

    functions: dict[int, JITFunction] = {}
    tuners: dict[int, tuple[str, Autotuner]] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith(_KERNEL_MODULES):
            continue
        for value in vars(module).values():
            tuner = value if isinstance(value, Autotuner) else None
            # Autotuners and heuristics wrap the jit function in ``fn``.
            while isinstance(value, KernelInterface) and not isinstance(value, JITFunction):
                value = getattr(value, "fn", None)
            if isinstance(value, JITFunction):
                functions[id(value)] = value
                if tuner is not None:
                    tuners[id(tuner)] = (value.__name__, tuner)
    try:
        variants = frozenset(
            (f.__name__, str(key))
            for f in functions.values()
            for caches in f.device_caches.values()
            for key in caches[0]
        )
        autotuned = frozenset((name, str(key)) for name, tuner in tuners.values() for key in tuner.cache)
    except (AttributeError, TypeError, IndexError):
        return None
    return CompiledKernels(variants, autotuned)
