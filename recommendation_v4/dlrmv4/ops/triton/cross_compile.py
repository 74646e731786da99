"""The kernels compiled for a GPU this machine does not have (Triton compiles ahead of time for any
target, no GPU needed).

Inside ``compiling_for(target)`` every kernel launch compiles for ``target`` and runs nothing: a
stand-in Triton driver names the target (and its shared memory, for the autotune pruning rule),
each launch is turned into Triton's warm-up (compile, no launch), and an autotuned launch compiles
the configs the target keeps (the first, or all of them) instead of timing them. Ops are taken on
CPU tensors (``dispatch.compiling_only``), so the model's own code makes the launches, with the
shapes, dtypes and constants a real step would use; their outputs are left unwritten.

Relies on Triton 3.6's launch path (``JITFunction.run``, ``Autotuner.run`` / ``prune_configs``),
which the pinned version keeps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import types
from collections.abc import Iterator
from typing import Any

import torch
from triton.backends.driver import DriverBase
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from ..dispatch import compiling_only
from . import targets as kernel_targets
from .targets import KernelTarget

CONFIG_CHOICES = ("first", "all")


@dataclasses.dataclass(frozen=True)
class CompiledVariant:
    """One kernel as compiled: its constexpr arguments, launch options and the compiled binary."""

    kernel: str
    dtype: str  # of its first tensor argument
    constants: tuple[tuple[str, Any], ...]
    num_warps: int
    num_stages: int
    binary: Any  # triton.compiler.CompiledKernel: .asm by stage, .metadata (shared bytes, ...)

    @property
    def shared_memory(self) -> int:
        return int(self.binary.metadata.shared)

    def constant(self, name: str) -> Any:
        return dict(self.constants)[name]

    def describe(self) -> str:
        blocks = ", ".join(f"{k}={v}" for k, v in self.constants if k.startswith("BLOCK"))
        return f"{blocks}, warps={self.num_warps}, stages={self.num_stages}"


class _TargetDriver(DriverBase):
    """Triton's view of a GPU that is not here: enough to bind and compile, nothing to launch."""

    def __init__(self, target: KernelTarget, device: int) -> None:
        super().__init__()
        self.target, self.device = target, device
        self.utils = types.SimpleNamespace(get_device_properties=self._properties)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def _properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.target.shared_memory}

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError(f"{self.target.name}: compile-only, nothing is launched")

    def get_current_target(self):
        return self.target.gpu_target()

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError(f"{self.target.name}: compile-only, kernels cannot be timed")

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def _constants(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[tuple[str, Any], ...]:
    bound = inspect.signature(fn.fn).bind_partial(*args, **{k: v for k, v in kwargs.items() if k in fn.arg_names})
    return tuple((p.name, bound.arguments[p.name]) for p in fn.params if p.is_constexpr and p.name in bound.arguments)


@contextlib.contextmanager
def compiling_for(target: KernelTarget, configs: str = "first") -> Iterator[list[CompiledVariant]]:
    """Launches inside compile for ``target``; the list fills with each distinct variant compiled.
    ``configs``: an autotuned kernel's first config the target keeps, or all of them."""
    if configs not in CONFIG_CHOICES:
        raise ValueError(f"configs={configs!r} is not one of {', '.join(CONFIG_CHOICES)}")
    compiled: list[CompiledVariant] = []
    seen: set[tuple] = set()
    launch, tuned_launch = JITFunction.run, Autotuner.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        binary = launch(self, *args, grid=grid, warmup=True, **kwargs)
        meta = binary.metadata
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        dtype = "" if first is None else str(first.dtype).removeprefix("torch.")
        variant = CompiledVariant(
            self.__name__, dtype, _constants(self, args, kwargs), meta.num_warps, meta.num_stages, binary
        )
        key = (variant.kernel, variant.dtype, repr(variant.constants), variant.num_warps, variant.num_stages)
        if key not in seen:
            seen.add(key)
            compiled.append(variant)
        return binary

    def compile_kept_configs(self, *args, grid, warmup, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        kept = self.prune_configs(kwargs)
        for config in kept if configs == "all" else kept[:1]:
            if config.pre_hook is not None:  # as Autotuner.run: e.g. a descriptor's block shape
                config.pre_hook({**self.nargs, **kwargs, **config.all_kwargs()})
            self.fn.run(*args, grid=grid, warmup=True, **kwargs, **config.all_kwargs())
        self.nargs = None

    # A device number of its own per target: Triton keeps one binder (and target) per device.
    device = 1_000 + kernel_targets.TARGETS.index(target) if target in kernel_targets.TARGETS else 999
    previous = driver._active  # None until a launch has asked for one; reset_active would make one
    driver.set_active(_TargetDriver(target, device))
    JITFunction.run, Autotuner.run = compile_only, compile_kept_configs
    try:
        with compiling_only():
            yield compiled
    finally:
        JITFunction.run, Autotuner.run = launch, tuned_launch
        driver._active = previous
