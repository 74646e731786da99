"""Batches onto the device one step ahead, so the host-to-device copy overlaps the step before it.

On a GPU, the copy of batch i+1 is issued on a side stream as soon as batch i is handed to the
step; the step of batch i+1 waits (on the device, not the host) for that copy's event. The loader's
worker processes already prepare batches while the GPU runs, so with this the GPU never idles on
data once the loader keeps up. On the CPU the batches pass through unchanged.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from dlrmv4.data.batch import TorchJaggedBatch


class DevicePrefetcher:
    def __init__(self, batches: Iterable[TorchJaggedBatch], device: torch.device) -> None:
        self.batches = batches
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __iter__(self) -> Iterator[TorchJaggedBatch]:
        if self.stream is None:
            for batch in self.batches:
                yield batch.to(self.device)
            return
        host = iter(self.batches)
        ahead = self._copy(next(host, None))
        while ahead is not None:
            batch, copied = ahead
            ahead = self._copy(next(host, None))  # starts before the step of ``batch`` is queued
            main = torch.cuda.current_stream(self.device)
            main.wait_event(copied)
            # Made on the side stream, used on the main one: the allocator must not hand the
            # memory back to the side stream until the main stream is done with it.
            for tensor in batch.device_buffers():
                tensor.record_stream(main)
            yield batch

    def _copy(self, batch: TorchJaggedBatch | None) -> tuple[TorchJaggedBatch, torch.cuda.Event] | None:
        if batch is None:
            return None
        with torch.cuda.stream(self.stream):
            on_device = batch.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return on_device, copied


def with_next(items: Iterable[TorchJaggedBatch]) -> Iterator[tuple[TorchJaggedBatch, TorchJaggedBatch | None]]:
    """Each item with the one after it (None for the last): a step starts the next batch's id
    distribution while it computes (``train.sparse_pipeline``)."""
    stream = iter(items)
    current = next(stream, None)
    while current is not None:
        upcoming = next(stream, None)
        yield current, upcoming
        current = upcoming


def ready_point(batch: TorchJaggedBatch) -> torch.cuda.Event | None:
    """On a GPU, the point of the current stream from which ``batch`` (handed over by the prefetcher,
    which made the stream wait for its copy) is on the device; None on the CPU."""
    if not batch.history_lengths.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event
