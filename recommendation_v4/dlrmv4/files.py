"""Files and directories written whole or not at all, and the early check that a place is writable.

A reader sees either the previous content or the complete new one: everything is written under a
temp name beside its final name and renamed once.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

from dlrmv4.errors import UserError


def check_writable(path: Path, what: str) -> None:
    """Fail early, with one line naming ``what``, when files cannot be created in directory ``path``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{what} {path} is not writable: {exc.strerror or exc}") from exc


def check_free_space(path: Path, needed: int, what: str) -> None:
    """Fail before any work, with one line, when the disk holding directory ``path`` (made if
    missing) has fewer than ``needed`` bytes free for ``what``."""
    path.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path).free
    if free < needed:
        raise UserError(
            f"{what} needs up to {needed / 1e9:.2f} GB under {path} but {free / 1e9:.2f} GB are free; "
            "free some space or point --data-path at a larger disk"
        )


def write_atomically(final: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` fills a temp file beside ``final``; only a complete file gets the final name."""
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex}.tmp")
    try:
        write(tmp)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temp directory beside ``final``; on success it replaces ``final`` in one rename.

    On any failure the temp directory is removed and ``final`` is untouched, so no crash leaves
    a half-written directory that looks complete.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
