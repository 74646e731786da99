"""The processed store: memory-mapped columns, CSR by user, 64-bit offsets.

Layout of one store directory (every array is a plain ``.npy`` opened with ``mmap_mode='r'``)::

    meta.json                 schema version, source + revision, constants, split, counts
    md5sums                   "<md5>  <relative path>" for every other file
    train/user_offsets.npy    int64[U+1]   CSR offsets of each user's train-span events
    train/user_ids.npy        uint32[U]    raw uid of each CSR row (ascending)
    train/item_id.npy         uint32[E]    per event, users in order, time order inside a user
    train/timestamp.npy       uint32[E]
    train/event_code.npy      uint8[E]     listen 0, like 1, dislike 2, unlike 3, undislike 4
    train/action.npy          uint8[E]     history pool bit: 1 listen_plus, 2 like, 4 skip, 0 none
    train/is_organic.npy      uint8[E]
    train/session_id.npy      uint32[E]    per-user session number from 0 over the user's train
                                           events; a new one after a gap > session_gap_seconds
    test/...                  the same columns for the test day (users seen in train only); its
                              session_id numbers the user's test events on their own, from 0
    items/artist_id.npy       uint32[I]    per item_id: the last mapping row's id (0 = unmapped)
    items/album_id.npy        uint32[I]
    items/popularity.npy      int64[I]     train-span event count per item
    anchors/event_index.npy   int64[A]     global train event index of each anchor
    anchors/window_offsets.npy int64[N+1]  anchors of window w: event_index[offsets[w]:offsets[w+1]]

Anchors are listen events whose user-local index (position among the user's train-span
events) is at least ``min_history``. Windows count from t_min = the earliest anchor's timestamp:
window w holds the anchors with (timestamp - t_min) // window_seconds == w, in ascending event
index (user-major); N = ceil((t_last - t_min + 1) / window_seconds) with t_last the latest
anchor's timestamp. Windows 0..N-2 train, window N-1 is the eval holdout. meta.json records
``split.t_min``, ``split.t_last``, ``split.num_windows`` and ``counts.train_samples`` /
``counts.eval_samples`` (the anchors of windows 0..N-2 / of window N-1).
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dlrmv4.errors import UserError, one_line
from dlrmv4.parallel import usable_cores

# 2: the reference's split end, windows from the earliest anchor, sessions over train events only.
STORE_SCHEMA_VERSION = 2
META_FILE = "meta.json"
MD5_FILE = "md5sums"

EVENT_COLUMNS: dict[str, np.dtype] = {
    "item_id": np.dtype(np.uint32),
    "timestamp": np.dtype(np.uint32),
    "event_code": np.dtype(np.uint8),
    "action": np.dtype(np.uint8),
    "is_organic": np.dtype(np.uint8),
    "session_id": np.dtype(np.uint32),
}
ITEM_COLUMNS: dict[str, np.dtype] = {
    "artist_id": np.dtype(np.uint32),
    "album_id": np.dtype(np.uint32),
    "popularity": np.dtype(np.int64),
}
SPLITS = ("train", "test")


@dataclass(frozen=True)
class EventSplit:
    """One split's CSR arrays (memory-mapped)."""

    user_offsets: np.ndarray
    user_ids: np.ndarray
    item_id: np.ndarray
    timestamp: np.ndarray
    event_code: np.ndarray
    action: np.ndarray
    is_organic: np.ndarray
    session_id: np.ndarray

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_events(self) -> int:
        return int(self.user_offsets[-1])


@dataclass(frozen=True)
class Store:
    path: Path
    meta: dict[str, Any]
    train: EventSplit
    test: EventSplit
    artist_id: np.ndarray
    album_id: np.ndarray
    popularity: np.ndarray
    anchor_event_index: np.ndarray
    window_offsets: np.ndarray

    @property
    def num_windows(self) -> int:
        return len(self.window_offsets) - 1

    def window_anchors(self, window: int) -> np.ndarray:
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window {window} outside [0, {self.num_windows})")
        return self.anchor_event_index[self.window_offsets[window] : self.window_offsets[window + 1]]

    @property
    def window_start_ts(self) -> int:
        """t_min: window w starts at t_min + w * window_seconds (the train start when there are no anchors)."""
        split = self.meta["split"]
        return int(split["train_start"] if split.get("t_min") is None else split["t_min"])

    @property
    def window_seconds(self) -> int:
        return int(self.meta["constants"]["window_seconds"])


def split_files(split: str) -> dict[str, np.dtype]:
    files: dict[str, np.dtype] = {
        f"{split}/user_offsets.npy": np.dtype(np.int64),
        f"{split}/user_ids.npy": np.dtype(np.uint32),
    }
    files.update({f"{split}/{name}.npy": dtype for name, dtype in EVENT_COLUMNS.items()})
    return files


def expected_files() -> dict[str, np.dtype]:
    """Every array file of a store and its dtype."""
    files: dict[str, np.dtype] = {}
    for split in SPLITS:
        files.update(split_files(split))
    files.update({f"items/{name}.npy": dtype for name, dtype in ITEM_COLUMNS.items()})
    files["anchors/event_index.npy"] = np.dtype(np.int64)
    files["anchors/window_offsets.npy"] = np.dtype(np.int64)
    return files


def _load(path: Path, rel: str, dtype: np.dtype) -> np.ndarray:
    full = path / rel
    if not full.exists():
        raise UserError(f"{full}: store file is missing (re-run preprocessing)")
    try:
        arr = np.load(full, mmap_mode="r")
    except (ValueError, OSError) as exc:
        raise UserError(f"{full}: unreadable array ({one_line(exc)}); re-run preprocessing")
    if arr.dtype != dtype:
        raise UserError(f"{full}: dtype {arr.dtype}, expected {dtype}")
    return arr


def read_meta(path: Path) -> dict[str, Any]:
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise UserError(f"{path}: no {META_FILE}; this is not a processed store (run download_dataset.sh)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{meta_path}: not valid JSON: {one_line(exc)}")
    version = meta.get("schema_version")
    if version != STORE_SCHEMA_VERSION:
        made_by = "an older" if isinstance(version, int) and version < STORE_SCHEMA_VERSION else "another"
        raise UserError(
            f"{meta_path}: store schema version {version} was written by {made_by} preprocessing, this "
            f"code reads version {STORE_SCHEMA_VERSION}; re-run the preprocessing (python -m dlrmv4 "
            "prepare with the same dataset flags, or download_dataset.sh)"
        )
    return meta


def open_store(path: Path | str) -> Store:
    path = Path(path)
    meta = read_meta(path)
    files = expected_files()
    arrays = {rel: _load(path, rel, dtype) for rel, dtype in files.items()}

    def split(name: str) -> EventSplit:
        return EventSplit(
            user_offsets=arrays[f"{name}/user_offsets.npy"],
            user_ids=arrays[f"{name}/user_ids.npy"],
            **{c: arrays[f"{name}/{c}.npy"] for c in EVENT_COLUMNS},
        )

    return Store(
        path=path,
        meta=meta,
        train=split("train"),
        test=split("test"),
        artist_id=arrays["items/artist_id.npy"],
        album_id=arrays["items/album_id.npy"],
        popularity=arrays["items/popularity.npy"],
        anchor_event_index=arrays["anchors/event_index.npy"],
        window_offsets=arrays["anchors/window_offsets.npy"],
    )


# ---------------------------------------------------------------- writing


class ArrayAppender:
    """Writes a 1-D ``.npy`` by appending blocks; ``close`` fixes its length with ``shrink_npy``.

    Appending through a file handle (not a memmap) keeps written pages out of the process's
    resident set, so memory does not grow with the output.
    """

    def __init__(self, path: Path, dtype: np.dtype, capacity: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.dtype, self.size = path, np.dtype(dtype), 0
        self._fh = open(path, "wb")
        np.lib.format.write_array_header_1_0(
            self._fh, {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (capacity,)}
        )

    def append(self, block: np.ndarray) -> None:
        self._fh.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
        self.size += len(block)

    def close(self) -> None:
        self._fh.close()
        shrink_npy(self.path, self.size)


def save_array(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.save(path, np.ascontiguousarray(arr))


def file_md5(path: Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def file_md5s(paths: list[Path], workers: int = 0, on_file: Callable[[int], None] = lambda _: None) -> list[str]:
    """The md5 of each of ``paths`` (in their order), hashed by ``workers`` threads (0: one per usable core):
    hashlib lets go of the GIL while it hashes, so files are hashed in parallel, the largest first
    (the last to finish bounds the time). ``on_file`` gets each finished file's size."""
    workers = workers or usable_cores()
    sizes = [p.stat().st_size for p in paths]
    order = sorted(range(len(paths)), key=lambda i: -sizes[i])
    sums: list[str] = [""] * len(paths)
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(paths)))) as pool:
        futures = {pool.submit(file_md5, paths[i]): i for i in order}
        for future in as_completed(futures):
            i = futures[future]
            sums[i] = future.result()
            on_file(sizes[i])
    return sums


def store_files(path: Path) -> list[Path]:
    """Every file of the store but its md5 list, sorted."""
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != MD5_FILE)


def write_md5s(path: Path, workers: int = 0) -> dict[str, str]:
    files = store_files(path)
    sums = {full.relative_to(path).as_posix(): md5 for full, md5 in zip(files, file_md5s(files, workers))}
    (path / MD5_FILE).write_text("".join(f"{md5}  {rel}\n" for rel, md5 in sums.items()))
    return sums


def read_md5s(path: Path) -> dict[str, str]:
    md5_path = path / MD5_FILE
    if not md5_path.exists():
        raise UserError(f"{md5_path}: checksum list is missing (re-run preprocessing)")
    sums: dict[str, str] = {}
    for lineno, line in enumerate(md5_path.read_text().splitlines(), 1):
        parts = line.split(None, 1)
        if len(parts) != 2 or len(parts[0]) != 32:
            raise UserError(f"{md5_path}:{lineno}: malformed line {line!r}")
        sums[parts[1].strip()] = parts[0]
    return sums


def shrink_npy(path: Path, length: int) -> None:
    """Cut a 1-D ``.npy`` written at an upper-bound length down to ``length`` rows in place.

    The header is rewritten at its original size (a shorter shape always fits, padded with
    spaces as the format allows) and the file is truncated: no copy of the data.
    """
    with open(path, "r+b") as fh:
        version = np.lib.format.read_magic(fh)
        if version != (1, 0):
            raise ValueError(f"{path}: npy version {version} not supported")
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        data_start = fh.tell()
        if len(shape) != 1 or length > shape[0]:
            raise ValueError(f"{path}: cannot shrink shape {shape} to {length}")
        header = repr({"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": fortran, "shape": (length,)})
        room = data_start - 10  # magic (6) + version (2) + header length (2)
        body = header.encode("latin1")
        if len(body) + 1 > room:
            raise ValueError(f"{path}: new header does not fit")
        fh.seek(10)
        fh.write(body + b" " * (room - len(body) - 1) + b"\n")
        fh.truncate(data_start + length * dtype.itemsize)
