"""A checkpoint's snapshot in device memory, so the step waits for a device-to-device copy of the state
instead of its copy over PCIe.

Staging the state straight to host memory stops the training for as long as the bytes take over the
bus (0.40 s for the train command benchmark's 16 GiB on an H200: four steps). Copied first into one buffer on the
device, at the rate of device memory, the step goes on at once; the writer's thread then copies the
snapshot to the pinned host copy on a stream of its own, beside the steps that follow, and writes it.
The snapshot is the state as it was at the save: the copy into it is queued on the training's stream
before the next step's updates, and the next save waits for the write (and so for its copy to host)
before it overwrites it.

That copy to host goes in pieces of ``PIECE_BYTES``, at most ``PIECES_IN_FLIGHT`` queued at a time: the
step's own copies to host (TorchRec's input distribution reads its splits every step) share the copy
engine with it and wait behind what is queued there, which would be the whole snapshot with every
tensor's copy queued at once.

It holds as much device memory again as the tensors it copies, for the whole run, so it is allocated
before the run's clock starts, in the room left beside the run's peak (the larger of the memory
plan's and the one the warm-up's steps and evals reached), the memory other libraries hold and a
margin (``spare_device_memory``). Where that room holds only part of the state, the snapshot takes the
tensors that fit and the step copies the rest to host memory itself, as it copies all of it where
there is no room."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _create_cpu_state_dict
from torch.distributed.tensor import DTensor

_ALIGN = 512  # bytes: every tensor's view starts at a multiple (any dtype's alignment)
# What the device keeps free beside the snapshot and the run's peak: the allocator's fragmentation,
# the plan's estimates, libraries' buffers made later.
MARGIN_FRACTION = 0.1
MARGIN_MIN_BYTES = 4 << 30
# The copy to host's pieces: a step's copy to host waits behind at most this many of them.
PIECE_BYTES = 32 << 20  # about 0.6 ms over PCIe 5
PIECES_IN_FLIGHT = 2  # one copying, one queued behind it


def tensor_leaves(state: Any) -> list[torch.Tensor]:
    """The tensors of a state dict in a fixed order (a sharded tensor's local shards, a DTensor's local
    tensor): a state and a copy of the same structure give their leaves in the same order."""
    if isinstance(state, ShardedTensor):
        return [shard.tensor for shard in state.local_shards()]
    if isinstance(state, DTensor):
        return [state._local_tensor]
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in tensor_leaves(value)]
    if isinstance(state, (list, tuple)):
        return [leaf for value in state for leaf in tensor_leaves(value)]
    return []


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current GPU, "cuda:0" its tensors' device)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def snapshot_layout(state: Any, device: torch.device, budget: int) -> tuple[list[int | None], int]:
    """Where each of ``state``'s tensors sits in a snapshot of at most ``budget`` bytes on ``device`` (its
    byte offset; None for a tensor elsewhere or past the budget, which the step copies to host itself),
    and the snapshot's bytes. The tensors are taken in order while they fit."""
    device = _indexed(device)
    offsets: list[int | None] = []
    used = 0
    for t in tensor_leaves(state):
        size = _aligned(t)
        if t.device == device and used + size <= budget:
            offsets.append(used)
            used += size
        else:
            offsets.append(None)
    return offsets, used


def _identity(tensor: torch.Tensor) -> tuple:
    """What makes two tensor objects the same tensor (a state dict's views are made anew at every call)."""
    return tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride()


def _aligned(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN


def device_bytes(state: Any, device: torch.device) -> int:
    """The bytes of ``state``'s tensors on ``device`` (what a whole snapshot would take)."""
    device = _indexed(device)
    return sum(_aligned(t) for t in tensor_leaves(state) if t.device == device)


def spare_device_memory(device: torch.device, planned_peak: int) -> tuple[int, str]:
    """The bytes a snapshot may take on ``device`` and what sets them. The run's peak is the larger of
    the memory plan's (``planned_peak``: a batch of full-length histories) and the one the allocator has
    seen (the warm-up's steps and evals, read after them); a margin stays free beside it."""
    if device.type != "cuda":
        return 2**62, "host memory"  # (a CPU run's snapshot is a host copy: the plan counts host memory)
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # the CUDA context, NCCL, FBGEMM's own
    peak = max(planned_peak, torch.cuda.max_memory_allocated(device))
    margin = max(MARGIN_MIN_BYTES, int(MARGIN_FRACTION * total))
    spare = max(total - others - peak - margin, 0)
    why = (
        f"{spare / 2**30:.1f} GiB spare of {total / 2**30:.0f}: the run's peak {peak / 2**30:.1f}, other "
        f"libraries {others / 2**30:.1f}, a margin of {margin / 2**30:.1f}"
    )
    return spare, why


class DeviceSnapshot:
    """One buffer on ``device`` holding a copy of a state dict's tensors that live there (of as many as
    ``budget`` bytes hold), and the host copy (pinned on a GPU) the writer's thread fills from it; the
    state's other tensors are copied straight into the host copy at the save."""

    def __init__(self, state: Any, device: torch.device, budget: int, piece_bytes: int = PIECE_BYTES) -> None:
        self.device = device = _indexed(device)
        self.piece_bytes = piece_bytes
        on_gpu = device.type == "cuda"
        self.host = _create_cpu_state_dict(state, pin_memory=on_gpu)  # what the write reads
        sources = tensor_leaves(state)
        self.layout = [(t.shape, t.dtype) for t in sources]
        offsets, self.nbytes = snapshot_layout(state, device, budget)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.views = [
            None if at is None else self.buffer[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, at in zip(sources, offsets)
        ]
        # A stream of its own: its copies (and the thread's work on them) run beside the training's kernels.
        self.stream = torch.cuda.Stream(device) if on_gpu else None
        self.taken = torch.cuda.Event() if on_gpu else None
        self._copy_of: dict[tuple, torch.Tensor] = {}  # the last take's sources to their copies

    def take(self, state: Any) -> Any:
        """Queue the copy of ``state``'s tensors into the snapshot behind the work on the current stream
        (the step goes on without waiting), then copy the others (host tensors, those past the budget)
        into the host copy now; returns the host copy, whole once ``to_host`` has run."""
        sources = tensor_leaves(state)
        if [(t.shape, t.dtype) for t in sources] != self.layout:
            raise RuntimeError("the state saved is not laid out as the one its device snapshot was made for")
        pairs = list(zip(sources, self.views, tensor_leaves(self.host)))
        for source, view, _ in pairs:
            if view is not None:
                view.copy_(source.detach(), non_blocking=True)
        if self.taken is not None:
            self.taken.record()
        self._copy_of = {_identity(source): view for source, view, _ in pairs if view is not None}
        for source, view, host in pairs:
            if view is None:
                host.copy_(source.detach())
        return self.host

    def copies_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The snapshot's copies of ``tensors`` (tensors of the state the last ``take`` copied), read on the
        snapshot's stream after ``to_host``; None unless it holds every one of them."""
        copies = [self._copy_of.get(_identity(t)) for t in tensors]
        return None if any(c is None for c in copies) else copies  # type: ignore[return-value]

    def to_host(self) -> None:
        """Copy the snapshot into the host copy and wait for it: on the snapshot's own stream, once the
        copy into it is done, in pieces of ``piece_bytes`` with at most ``PIECES_IN_FLIGHT`` queued (the
        writer's thread calls this, beside the steps after the save)."""
        pieces = [
            piece
            for host, view in zip(tensor_leaves(self.host), self.views)
            if view is not None
            for piece in byte_pieces(host, view, self.piece_bytes)
        ]
        if self.stream is None or self.taken is None:
            for host, view in pieces:
                host.copy_(view)
            return
        done = [torch.cuda.Event() for _ in range(PIECES_IN_FLIGHT)]
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self.taken)
            for i, (host, view) in enumerate(pieces):
                if i >= PIECES_IN_FLIGHT:
                    done[i % PIECES_IN_FLIGHT].synchronize()  # the piece queued PIECES_IN_FLIGHT ago
                host.copy_(view, non_blocking=True)
                done[i % PIECES_IN_FLIGHT].record(self.stream)
        self.stream.synchronize()


def byte_pieces(host: torch.Tensor, view: torch.Tensor, piece_bytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination, source) pairs of at most ``piece_bytes`` each that copy ``view`` into ``host``: their
    bytes in order, both contiguous; the whole pair where either is not contiguous."""
    if not (host.is_contiguous() and view.is_contiguous()) or host.numel() == 0:
        return [(host, view)]
    host_bytes, view_bytes = _as_bytes(host), _as_bytes(view)
    return [
        (host_bytes[start : start + piece_bytes], view_bytes[start : start + piece_bytes])
        for start in range(0, host_bytes.numel(), piece_bytes)
    ]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.element_size() == 1 else flat.view(torch.uint8)
