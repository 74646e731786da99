"""A jagged batch of samples: per-token history values plus per-sample lengths/offsets.

Nothing is padded: sample b's history is ``history_*[history_offsets[b]:history_offsets[b + 1]]``
in time order. ``JaggedBatch`` holds numpy arrays on the host; ``TorchJaggedBatch`` is its torch
twin (same fields) and also carries the host-side sizes (plain ints and a host copy of the history
lengths), so the training step never has to read them back from the device, even to cut the batch
into chunks of samples (``samples``).

``to_torch`` (in the loader's worker) packs every field into one buffer, and lays the id fields out
in it as the sparse lookup's KeyedJaggedTensor holds them: one int64 region in ``ID_FIELDS`` order,
``contextual_ids`` column by column, with the KeyedJaggedTensor's lengths beside it
(``id_lengths``). Pinning and the copy to the device move that buffer as one, and the lookup wraps
the region as the KeyedJaggedTensor's values as it is (``sparse_features.py``).

With ``dedup_ids`` the worker also lays out the lookup's ids with each history feature's distinct
ids only (``lookup_ids``, ``unique_counts``), and for every history token the index of its id among
them (``history_inverse``): the lookup then fetches, and the all-to-all carries, each distinct id
of the batch once, and the tokens take their rows from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from dlrmv4.data.hashing import NUM_CONTEXTUAL

# Field -> dtype; the order is the dataclasses' field order.
# Each region of the packed buffer starts on a 16-byte boundary: Triton specializes a kernel on whether
# a pointer is 16-byte aligned, so a region's alignment must not depend on the lengths before it (a
# batch would otherwise compile a new kernel variant inside the timed run).
REGION_ALIGNMENT = 16
BATCH_DTYPES: dict[str, np.dtype] = {
    "history_lengths": np.dtype(np.int32),  # [B]
    "history_offsets": np.dtype(np.int64),  # [B+1]
    "history_item_id": np.dtype(np.int64),  # [T]
    "history_artist_id": np.dtype(np.int64),  # [T]
    "history_album_id": np.dtype(np.int64),  # [T]
    "history_action": np.dtype(np.int64),  # [T] pool bit 1 listen_plus, 2 like, 4 skip
    "history_timestamp": np.dtype(np.int64),  # [T]
    "contextual_ids": np.dtype(np.int64),  # [B, 8] rows, hashing.CONTEXTUAL_FEATURES order
    "candidate_item_id": np.dtype(np.int64),  # [B]
    "candidate_artist_id": np.dtype(np.int64),
    "candidate_album_id": np.dtype(np.int64),
    "candidate_timestamp": np.dtype(np.int64),
    "query_time": np.dtype(np.int64),  # [B] last history timestamp (anchor's if empty)
    "label": np.dtype(np.float32),  # [B] 1.0 when the anchor is listen_plus
    "anchor_index": np.dtype(np.int64),  # [B] global train event index (tracing)
}
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: torch.from_numpy(np.empty(0, dtype)).dtype for name, dtype in BATCH_DTYPES.items()
}
PER_SAMPLE = (
    "history_lengths",
    "candidate_item_id",
    "candidate_artist_id",
    "candidate_album_id",
    "candidate_timestamp",
    "query_time",
    "label",
    "anchor_index",
)
PER_TOKEN = ("history_item_id", "history_artist_id", "history_album_id", "history_action", "history_timestamp")
# The id fields in the sparse lookup's feature order (sparse_features.SPARSE_KEYS): history and
# candidate per shared table, then the contextual columns.
ID_FIELDS = (
    "history_item_id",
    "candidate_item_id",
    "history_artist_id",
    "candidate_artist_id",
    "history_album_id",
    "candidate_album_id",
    "contextual_ids",
)


# The history id fields, one per id the history shares with the candidate (sparse_features.SHARED_IDS).
HISTORY_ID_FIELDS = ("history_item_id", "history_artist_id", "history_album_id")
# Ids below this are made unique through a flag per possible id (linear time); larger ones by sorting.
DENSE_UNIQUE_LIMIT = 1 << 26


def spread_evenly(total: int, parts: int) -> np.ndarray:
    """``parts`` int64 counts that sum to ``total`` and differ by at most one (the larger first)."""
    return np.full(parts, total // parts, dtype=np.int64) + (np.arange(parts) < total % parts)


def unique_with_inverse(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``ids`` (non-negative int64) in ascending order, and for every element
    its index among them (int32): ``unique[inverse] == ids``."""
    if not len(ids):
        return ids[:0], np.zeros(0, dtype=np.int32)
    top = int(ids.max()) + 1
    if top > DENSE_UNIQUE_LIMIT or top > 16 * len(ids):  # a flag per possible id would cost more than a sort
        unique, inverse = np.unique(ids, return_inverse=True)
        return unique, inverse.astype(np.int32).reshape(-1)
    seen = np.zeros(top, dtype=bool)
    seen[ids] = True
    unique = np.flatnonzero(seen)
    rank = np.empty(top, dtype=np.int32)
    rank[unique] = np.arange(len(unique), dtype=np.int32)
    return unique.astype(np.int64, copy=False), rank[ids]


# eq=False: arrays have no single truth value, so a generated __eq__ would only raise.
@dataclass(frozen=True, eq=False)
class JaggedBatch:
    history_lengths: np.ndarray
    history_offsets: np.ndarray
    history_item_id: np.ndarray
    history_artist_id: np.ndarray
    history_album_id: np.ndarray
    history_action: np.ndarray
    history_timestamp: np.ndarray
    contextual_ids: np.ndarray
    candidate_item_id: np.ndarray
    candidate_artist_id: np.ndarray
    candidate_album_id: np.ndarray
    candidate_timestamp: np.ndarray
    query_time: np.ndarray
    label: np.ndarray
    anchor_index: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.history_lengths)

    @property
    def max_history_length(self) -> int:
        return int(self.history_lengths.max()) if self.num_samples else 0

    @property
    def total_tokens(self) -> int:
        return int(self.history_offsets[-1])

    def validate(self) -> None:
        """Raise ValueError when dtypes, shapes or offsets are inconsistent."""
        b, t = self.num_samples, self.total_tokens
        for name, dtype in BATCH_DTYPES.items():
            arr = getattr(self, name)
            if arr.dtype != dtype:
                raise ValueError(f"JaggedBatch.{name}: dtype {arr.dtype}, expected {dtype}")
        shapes: dict[str, tuple[int, ...]] = {name: (b,) for name in PER_SAMPLE}
        shapes |= {name: (t,) for name in PER_TOKEN}
        shapes |= {"history_offsets": (b + 1,), "contextual_ids": (b, NUM_CONTEXTUAL)}
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"JaggedBatch.{name}: shape {getattr(self, name).shape}, expected {shape}")
        if self.history_offsets[0] != 0 or not np.array_equal(np.diff(self.history_offsets), self.history_lengths):
            raise ValueError("JaggedBatch: history_offsets are not the running sum of history_lengths")

    def to_torch(
        self, device: torch.device | str | None = None, pin_memory: bool = False, dedup_ids: bool = False
    ) -> TorchJaggedBatch:
        """Torch twin whose tensors are views of one packed host buffer (16-byte aligned regions), so a
        worker hands a batch over in one shared-memory segment and pinning or a device copy is one
        transfer; optionally pinned, then copied to ``device`` without blocking. The id fields are
        views of one region in the lookup's layout; ``dedup_ids`` adds the lookup's distinct ids
        (module docstring)."""
        b = self.num_samples
        ids = [np.ascontiguousarray(getattr(self, name)).reshape(-1) for name in ID_FIELDS[:-1]]
        ids.append(np.ascontiguousarray(self.contextual_ids.T).reshape(-1))  # column by column
        ones = np.ones(b, dtype=np.int64)
        lengths = self.history_lengths.astype(np.int64)
        regions = {
            "ids": np.concatenate(ids).astype(np.int64, copy=False),
            "id_lengths": np.concatenate([lengths, ones] * 3 + [ones] * NUM_CONTEXTUAL),
        }
        unique_counts = None
        if dedup_ids:
            uniques = {name: unique_with_inverse(getattr(self, name)) for name in HISTORY_ID_FIELDS}
            n_item, n_artist, n_album = (len(uniques[name][0]) for name in HISTORY_ID_FIELDS)
            unique_counts = (n_item, n_artist, n_album)
            # Only a history feature's total count of distinct ids matters to the lookup, but TorchRec's
            # sequence all-to-all copies each sample's rows with one warp (FBGEMM's
            # permute_2D_sparse_data): spread over the samples, the copy uses the whole GPU.
            spread = [spread_evenly(n, b) for n in unique_counts]
            lookup = [uniques[name][0] if name in uniques else arr for name, arr in zip(ID_FIELDS, ids)]
            regions["id_lengths"] = np.concatenate([x for n in spread for x in (n, ones)] + [ones] * NUM_CONTEXTUAL)
            regions["lookup_ids"] = np.concatenate(lookup).astype(np.int64, copy=False)
            regions["history_inverse"] = np.stack([uniques[name][1] for name in HISTORY_ID_FIELDS])
        regions |= {name: np.ascontiguousarray(getattr(self, name)) for name in BATCH_DTYPES if name not in ID_FIELDS}
        offsets, total = {}, 0
        for name, arr in regions.items():
            offsets[name] = total
            total += -(-arr.nbytes // REGION_ALIGNMENT) * REGION_ALIGNMENT
        packed = np.empty(total, dtype=np.uint8)
        for name, arr in regions.items():
            packed[offsets[name] : offsets[name] + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        buffer = torch.from_numpy(packed)
        views = {
            name: buffer[offsets[name] : offsets[name] + arr.nbytes]
            .view(torch.from_numpy(arr[:0]).dtype)
            .view(arr.shape)
            for name, arr in regions.items()
        }
        tensors = {name: views[name] for name in BATCH_DTYPES if name not in ID_FIELDS}
        start = 0
        for name, arr in zip(ID_FIELDS[:-1], ids):
            tensors[name] = views["ids"][start : start + len(arr)]
            start += len(arr)
        tensors["contextual_ids"] = views["ids"][start:].view(NUM_CONTEXTUAL, b).t()
        out = TorchJaggedBatch(
            **tensors,
            num_samples=b,
            max_history_length=self.max_history_length,
            total_tokens=self.total_tokens,
            host_history_lengths=regions["history_lengths"].copy(),
            id_lengths=views["id_lengths"],
            lookup_ids=views.get("lookup_ids"),
            history_inverse=views.get("history_inverse"),
            unique_counts=unique_counts,
        )
        if pin_memory:
            out = out.pin_memory()
        return out.to(device) if device is not None else out


@dataclass(frozen=True, eq=False)
class TorchJaggedBatch:
    history_lengths: torch.Tensor
    history_offsets: torch.Tensor
    history_item_id: torch.Tensor
    history_artist_id: torch.Tensor
    history_album_id: torch.Tensor
    history_action: torch.Tensor
    history_timestamp: torch.Tensor
    contextual_ids: torch.Tensor
    candidate_item_id: torch.Tensor
    candidate_artist_id: torch.Tensor
    candidate_album_id: torch.Tensor
    candidate_timestamp: torch.Tensor
    query_time: torch.Tensor
    label: torch.Tensor
    anchor_index: torch.Tensor
    # Host-side sizes: the model and the step need them without a device sync.
    num_samples: int
    max_history_length: int
    total_tokens: int
    host_history_lengths: np.ndarray  # [B] int32, on the host
    # The lookup's KeyedJaggedTensor lengths ([features x B] int64), where the id fields lie in one
    # region in the lookup's layout (``to_torch``); None for a batch cut from another (``samples``).
    id_lengths: torch.Tensor | None = None
    # With the ids deduplicated (``to_torch(dedup_ids=True)``; None otherwise and in a cut batch): the
    # lookup's values with each history feature's distinct ids only, their counts (host ints, history
    # item / artist / album), and for every history token the index of its id among them ([3, T] int32).
    lookup_ids: torch.Tensor | None = None
    history_inverse: torch.Tensor | None = None
    unique_counts: tuple[int, int, int] | None = None

    def history_row(self, sample: int) -> int:
        """Index of sample ``sample``'s first history row (``sample == num_samples``: the total)."""
        return int(self.host_history_lengths[:sample].sum())

    def samples(self, start: int, stop: int) -> TorchJaggedBatch:
        """Samples [start, stop) as a batch of their own: views of this batch's tensors, offsets
        rebased to 0 on the device (no host read)."""
        if not 0 <= start < stop <= self.num_samples:
            raise ValueError(f"samples [{start}, {stop}) are outside the batch's {self.num_samples}")
        h0, h1 = self.history_row(start), self.history_row(stop)
        lengths = self.host_history_lengths[start:stop]
        fields = {name: getattr(self, name)[h0:h1] for name in PER_TOKEN}
        fields |= {name: getattr(self, name)[start:stop] for name in PER_SAMPLE + ("contextual_ids",)}
        fields["history_offsets"] = self.history_offsets[start : stop + 1] - h0
        return TorchJaggedBatch(
            **fields,
            num_samples=stop - start,
            max_history_length=int(lengths.max()),
            total_tokens=h1 - h0,
            host_history_lengths=lengths,
        )

    def _tensor_fields(self) -> tuple[str, ...]:
        optional = ("id_lengths", "lookup_ids", "history_inverse")
        return tuple(BATCH_DTYPES) + tuple(name for name in optional if getattr(self, name) is not None)

    def _map(self, fn) -> TorchJaggedBatch:
        return dataclasses.replace(self, **{name: fn(getattr(self, name)) for name in self._tensor_fields()})

    def _packed(self) -> torch.Tensor | None:
        """The one uint8 buffer every field views (as ``to_torch`` builds it), else None."""
        storages = {getattr(self, name).untyped_storage().data_ptr() for name in self._tensor_fields()}
        if len(storages) != 1:
            return None
        storage = self.history_lengths.untyped_storage()
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

    def _on(self, buffer: torch.Tensor) -> TorchJaggedBatch:
        """The same field views over ``buffer`` (a copy of the packed buffer)."""
        storage = buffer.untyped_storage()
        return self._map(
            lambda t: torch.empty(0, dtype=t.dtype, device=buffer.device).set_(
                storage, t.storage_offset(), t.shape, t.stride()
            )
        )

    def pin_memory(self) -> TorchJaggedBatch:
        """Page-locked copy (one buffer when packed); the DataLoader's pin thread calls this by name."""
        packed = self._packed()
        if packed is None:
            return self._map(lambda t: t.pin_memory())
        return self._on(packed.pin_memory())

    def device_buffers(self) -> list[torch.Tensor]:
        """The tensors that own the batch's memory: the packed buffer, or every field."""
        packed = self._packed()
        return [packed] if packed is not None else [getattr(self, name) for name in self._tensor_fields()]

    def to(self, device: torch.device | str, non_blocking: bool = True) -> TorchJaggedBatch:
        """One host-to-device copy when packed (non-blocking from pinned memory)."""
        packed = self._packed()
        if packed is None or packed.device == torch.device(device):
            return self._map(lambda t: t.to(device, non_blocking=non_blocking))
        return self._on(packed.to(device, non_blocking=non_blocking))
