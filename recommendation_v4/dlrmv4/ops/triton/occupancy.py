"""How many programs of a grid-stride (persistent) kernel the GPU holds at once.

A persistent backward launches a fixed number of programs that loop over the row blocks. More
programs than the multiprocessors hold at once run as a second wave: the first wave's programs
finish their share and the device then runs the rest at part of its bandwidth (measured on an
H200: the LayerNorm backward at 48 registers a lane holds 5 blocks of 8 warps an SM, so 8 an SM ran
in two waves). So the grid is capped at the resident count, computed from the compiled kernel's
registers, shared memory and warps, as the CUDA occupancy calculator does.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from ..dispatch import interpreting

SM_MAX_BLOCKS = 32  # resident blocks an SM takes at most (sm_90, sm_100)
REGISTER_ALLOCATION = 256  # registers are given to a warp in units of this many


@functools.lru_cache(maxsize=None)
def _sm_limits(index: int) -> tuple[int, int, int, int]:
    """(multiprocessors, registers, shared bytes, warps) of one SM of device ``index``."""
    props = torch.cuda.get_device_properties(index)
    registers = getattr(props, "regs_per_multiprocessor", 65_536)  # not reported by every torch build
    warps = props.max_threads_per_multi_processor // props.warp_size
    return props.multi_processor_count, registers, props.shared_memory_per_multiprocessor, warps


def blocks_per_sm(registers: int, shared: int, warps: int, sm_registers: int, sm_shared: int, sm_warps: int) -> int:
    """Blocks of ``warps`` warps, ``registers`` a lane and ``shared`` bytes that one NVIDIA SM
    holds at once (at least 1); each block also takes 1 KB of shared memory the driver reserves."""
    per_warp = math.ceil(registers * 32 / REGISTER_ALLOCATION) * REGISTER_ALLOCATION
    by_registers = sm_registers // max(1, per_warp * warps)
    by_shared = sm_shared // (shared + 1024)
    return max(1, min(by_registers, by_shared, sm_warps // warps, SM_MAX_BLOCKS))


_resident: dict[tuple, int] = {}  # blocks an SM holds, per compiled variant


def persistent_grid(
    kernel: Any,
    device: torch.device,
    dtype: torch.dtype,
    n_blocks: int,
    per_sm: int,
    meta: dict[str, Any],
    launch_args: Callable[[int], tuple],
) -> int:
    """Programs for a grid-stride launch of ``kernel`` (its constexprs and num_warps in ``meta``,
    its data in ``dtype``) over ``n_blocks`` row blocks: at most ``per_sm`` an SM, and no more than
    the SMs hold at once. ``launch_args(programs)`` gives the launch's arguments; they are bound
    (the kernel compiled, nothing launched) once per variant to read its registers. AMD keeps
    ``per_sm`` (its occupancy is not computed here); the interpreter and compile-only runs (CPU
    tensors) use few programs."""
    if device.type != "cuda" or interpreting():
        return max(1, min(n_blocks, 4))
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms, sm_registers, sm_shared, sm_warps = _sm_limits(index)
    if torch.version.hip is not None:
        return max(1, min(n_blocks, per_sm * sms))
    key = (kernel.fn.__name__, index, str(dtype), tuple(sorted(meta.items())))
    if key not in _resident:
        compiled = kernel.warmup(*launch_args(1), grid=(1,), **meta)
        compiled.run  # noqa: B018 - loading the binary reads its register count
        _resident[key] = blocks_per_sm(
            compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, sm_registers, sm_shared, sm_warps
        )
    return max(1, min(n_blocks, min(per_sm, _resident[key]) * sms))


def launch_persistent(
    kernel: Any,
    device: torch.device,
    dtype: torch.dtype,
    n_blocks: int,
    per_sm: int,
    meta: dict[str, Any],
    partials: Callable[[int], tuple],
    launch_args: Callable[..., tuple],
) -> tuple:
    """Launches ``kernel`` on a grid-stride grid over ``n_blocks`` row blocks (``persistent_grid``)
    and returns the per-program partial buffers it filled: ``partials(programs)`` allocates them,
    ``launch_args(programs, *buffers)`` gives the launch's arguments. Nothing is launched when
    there are no row blocks (the buffers come back as ``partials`` made them)."""
    programs = 1
    if n_blocks > 0:
        programs = persistent_grid(
            kernel, device, dtype, n_blocks, per_sm, meta, lambda p: launch_args(p, *partials(p))
        )
    buffers = partials(programs)
    if n_blocks > 0:
        kernel[(programs,)](*launch_args(programs, *buffers), **meta)
    return buffers
