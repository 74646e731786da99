"""The stamp of a verified store: what ``verify`` checked, so that ``train`` can tell cheaply that the
store has not changed since.

Hashing a store takes minutes at Yambda-5B's size, too long for every run's start. A successful
``verify`` writes, beside the store (``processed/.<store>.verified.json``, outside the files its md5
list covers), each file's size and modification time. A run compares them with the files on disk:
any file added, removed, resized or rewritten since means the store is verified again before it is
trained on. Damage that keeps a file's size and modification time (bit rot) is left to ``verify``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STAMP_VERSION = 1


def stamp_path(store: Path) -> Path:
    return store.parent / f".{store.name}.verified.json"


def snapshot(store: Path) -> dict[str, list[int]]:
    """Every file of the store (its md5 list included): [size, modification time in ns]."""
    out = {}
    for p in sorted(store.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[p.relative_to(store).as_posix()] = [st.st_size, st.st_mtime_ns]
    return out


def write_stamp(store: Path, files: dict[str, list[int]], verified_at: float) -> None:
    """Record the store as verified: ``files`` is its ``snapshot`` taken before a verification that
    found no problem (a file changed while it ran then shows as changed)."""
    stamp = {"version": STAMP_VERSION, "verified_at": verified_at, "files": files}
    path = stamp_path(store)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(stamp))
    tmp.replace(path)


def clear_stamp(store: Path) -> None:
    stamp_path(store).unlink(missing_ok=True)


def unverified_reason(store: Path) -> str | None:
    """None when the store's files are as the last successful verification saw them; else why not,
    in a few words ("was never verified", "<file> changed since it was verified at <time>", ...)."""
    try:
        stamp = json.loads(stamp_path(store).read_text())
        recorded, at = stamp["files"], float(stamp["verified_at"])
        if stamp.get("version") != STAMP_VERSION:
            return "was verified by another version of this code"
    except FileNotFoundError:
        return "was never verified"
    except (OSError, ValueError, KeyError, TypeError):
        return "has an unreadable verification stamp"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))
    current = snapshot(store)
    for rel in sorted(recorded.keys() | current.keys()):
        if rel not in current:
            return f"lost {rel} since it was verified at {when}"
        if rel not in recorded:
            return f"gained {rel} since it was verified at {when}"
        if current[rel] != recorded[rel]:
            return f"changed {rel} since it was verified at {when}"
    return None
