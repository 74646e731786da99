"""The GPUs the kernels are built for, and the one a launch compiles for.

A kernel's choices that depend on the hardware (an NVIDIA-only instruction, a tile that must fit
the shared memory) are made from a ``KernelTarget``, never from the tensor's device directly, so
that ``cross_compile.py`` can make them for a GPU this machine does not have. At run time the
target is Triton's active driver's: the device the launch goes to.
"""

from __future__ import annotations

import dataclasses
import functools

from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from ..dispatch import interpreting

# Registers one lane may hold: 255 on NVIDIA; 512 on CDNA3/4 (256 VGPRs + 256 AGPRs).
REGISTERS_PER_LANE = {"cuda": 255, "hip": 512}


@dataclasses.dataclass(frozen=True)
class KernelTarget:
    name: str
    gpus: str
    backend: str  # "cuda" or "hip"
    arch: int | str  # compute capability x 10 (90) or the gfx name
    warp_size: int  # lanes of a warp (NVIDIA) or wavefront (AMD)
    shared_memory: int  # bytes of shared memory (LDS on AMD) one block may use

    @property
    def nvidia(self) -> bool:
        return self.backend == "cuda"

    @property
    def registers_per_lane(self) -> int:
        return REGISTERS_PER_LANE[self.backend]

    def gpu_target(self) -> GPUTarget:
        return GPUTarget(self.backend, self.arch, self.warp_size)


# The benchmark's hardware. Shared memory is the per-block opt-in maximum the driver reports.
TARGETS = (
    KernelTarget("sm_90", "H100, H200", "cuda", 90, 32, 232_448),
    KernelTarget("sm_100", "B200", "cuda", 100, 32, 232_448),
    KernelTarget("gfx942", "MI300X", "hip", "gfx942", 64, 65_536),
    KernelTarget("gfx950", "MI350X", "hip", "gfx950", 64, 163_840),
)


def target_named(name: str) -> KernelTarget:
    for target in TARGETS:
        if target.name == name:
            return target
    raise ValueError(f"no kernel target {name!r}: one of {', '.join(t.name for t in TARGETS)}")


def current_target() -> KernelTarget | None:
    """The target of the device the next launch goes to; None under the interpreter."""
    if interpreting():
        return None
    return _target_of_device(driver.active.get_current_device())


@functools.lru_cache(maxsize=None)
def _target_of_device(device: int) -> KernelTarget:
    gpu = driver.active.get_current_target()
    shared = driver.active.utils.get_device_properties(device)["max_shared_mem"]
    for target in TARGETS:
        if (target.backend, target.arch) == (gpu.backend, gpu.arch):
            return dataclasses.replace(target, shared_memory=shared)  # the device's own limit
    name = f"sm_{gpu.arch}" if gpu.backend == "cuda" else str(gpu.arch)
    return KernelTarget(name, "this GPU", gpu.backend, gpu.arch, gpu.warp_size, shared)
