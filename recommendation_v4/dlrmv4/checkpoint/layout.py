"""A checkpoint on disk: the names of its directory and files, and its ``COMPLETE`` marker, written
last and checked before a resume trusts it.

``run_dir/checkpoints/step-<8 digits>/`` holds
  - the tensor state (model, optimizers, embedding tables) written by ``torch.distributed.checkpoint``
    (DCP: ``.metadata`` + ``__<rank>_<n>.distcp``), so sharded state saves the same way later;
  - ``position.json`` (the data position and counters) and ``state.pkl`` (small non-tensor state:
    RNG states, the run's history, run-log state, the settings of the resume contract);
  - for a delta checkpoint, ``chain.json``: the checkpoint it continues (``chain``);
  - ``COMPLETE``: sha256 and size of every other file. It also catches later damage (truncation,
    bit rot).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlrmv4.checkpoint.dcp_io import io_threads, missing_pieces

MARKER = "COMPLETE"
POSITION_FILE = "position.json"
CHAIN_FILE = "chain.json"
PICKLE_FILE = "state.pkl"
CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_HASH_CHUNK = 1 << 20


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def step_dir(root: Path, step: int) -> Path:
    """The directory of the checkpoint after ``step`` steps, under ``checkpoints_dir``."""
    return root / f"step-{step:08d}"


def step_dirs(root: Path) -> list[Path]:
    """``step-*`` directories, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _content_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MARKER)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(tmp: Path) -> None:
    """The marker over every file in ``tmp``, written once they all are."""
    paths = _content_files(tmp)
    with ThreadPoolExecutor(io_threads()) as pool:  # hashlib lets go of the GIL on large reads
        digests = list(pool.map(sha256, paths))
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests)}
    write_synced(tmp / MARKER, json.dumps({"files": files}, indent=1, sort_keys=True).encode())
    fsync_dir(tmp)  # the entries themselves, before the rename makes the checkpoint the newest


def marker_problem(ckpt: Path, verify_hashes: bool) -> str | None:
    """Why ``ckpt`` cannot be trusted, or None when it matches its marker."""
    try:
        listed = json.loads((ckpt / MARKER).read_text())["files"]
    except FileNotFoundError:
        return f"no {MARKER} marker (its writer did not finish)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MARKER} marker ({type(exc).__name__})"
    present = {str(p.relative_to(ckpt)) for p in _content_files(ckpt)}
    if present != set(listed):
        return f"files differ from the {MARKER} list (missing or extra: {sorted(present ^ set(listed))})"
    for name, meta in sorted(listed.items()):
        size = (ckpt / name).stat().st_size
        if size != meta["size"]:
            return f"{name} is {size} bytes, the marker says {meta['size']}"
    if verify_hashes:
        names = sorted(listed)
        with ThreadPoolExecutor(io_threads()) as pool:  # hashlib lets go of the GIL on large reads
            digests = list(pool.map(sha256, [ckpt / name for name in names]))
        for name, digest in zip(names, digests):
            if digest != listed[name]["sha256"]:
                return f"{name} does not match its sha256 in the marker"
    # A marker over files written short (by code before the writes were checked) is no proof.
    return missing_pieces(ckpt)
