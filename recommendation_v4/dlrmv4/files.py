"""Files and directories written whole or not at all, and the early check that a place is writable.

A reader sees either the previous content or the complete new one: everything is written under a
temp name beside its final name and renamed once.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
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


def write_failure(path: Path, exc: BaseException) -> UserError | None:
    """A failed write of ``path`` as one line naming it and the cause, or None when ``exc`` shows no
    I/O cause (a bug, to be raised as it is). The cause is an OSError anywhere in ``exc``'s chain
    (DCP wraps each rank's failure in a CheckpointException), else, since torch's zip writer turns a
    short write into a RuntimeError that names only file offsets ("unexpected pos 704 vs 598"), what
    the system says now: a disk with no room left, or the process's file-size limit."""
    cause = _os_error_in(exc)
    if cause is not None and cause.errno:
        return UserError(f"cannot write {path}: {os.strerror(cause.errno)}")
    reason = _write_limit(path)
    if reason is not None:
        return UserError(f"cannot write {path}: {reason}")
    if isinstance(exc, OSError):
        return UserError(f"cannot write {path}: {' '.join(str(exc).split())}")
    return None


@contextlib.contextmanager
def write_errors_in_one_line(path: Path) -> Iterator[None]:
    """Writes of ``path`` that fail for an I/O cause (``write_failure``) end in one line naming it
    and the cause; anything else (a bug, Ctrl-C, a UserError) goes on as it is."""
    try:
        yield
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        error = write_failure(path, exc)
        if error is None:
            raise
        raise error from exc


@contextlib.contextmanager
def read_errors_in_one_line(path: Path) -> Iterator[None]:
    """Reads under ``path`` that fail for an I/O cause (an OSError anywhere in the exception's chain,
    DCP's per-rank failures included) end in one line naming the file and the cause."""
    try:
        yield
    except (UserError, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        cause = _os_error_in(exc)
        if cause is None:
            raise
        raise UserError(
            f"cannot read {cause.filename or path}: {cause.strerror or os.strerror(cause.errno or 0)}"
        ) from exc


def _os_error_in(exc: BaseException | None, seen: set[int] | None = None) -> OSError | None:
    seen = set() if seen is None else seen
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno:
            return exc
        for failure in getattr(exc, "failures", {}).values():  # DCP's CheckpointException: rank -> (exc, tb)
            found = _os_error_in(failure[0] if isinstance(failure, tuple) else failure, seen)
            if found is not None:
                return found
        exc = exc.__cause__ or exc.__context__
    return None


def _write_limit(path: Path) -> str | None:
    """Why a write under ``path`` cannot go on, if the system says so: no room, or a file-size limit."""
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    if free < 1 << 20:
        return f"No space left on device ({free:,} bytes free)"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        return f"File too large (the process's file-size limit is {limit:,} bytes)"
    return None


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


# A temp file or directory of the writers here: ".<final name>.tmp-<pid>[-<hex>]" (".old-" for a
# directory being replaced). The PID says whether its writer still runs.
_TEMP_NAME = re.compile(r"^\..+\.(?:tmp|old)-(\d+)(?:-[0-9a-f]+)?$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def remove_dead_temps(directory: Path, say: Callable[[str], None] = lambda _: None) -> None:
    """Remove the temp files and directories in ``directory`` whose writer died before its rename
    (kill -9, a lost node), saying so; a live writer's stay. PIDs are this host's: a directory that
    writers on several hosts share (a run's checkpoints) is cleaned by one rank only."""
    if not directory.is_dir():
        return
    for p in sorted(directory.iterdir()):
        match = _TEMP_NAME.match(p.name)
        if not match or int(match.group(1)) == os.getpid() or _pid_alive(int(match.group(1))):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        say(f"removed {p}, left by process {match.group(1)}, which ended before finishing it")


def write_atomically(final: Path, write: Callable[[Path], Any]) -> None:
    """``write(tmp)`` fills a temp file beside ``final``; only a complete file gets the final name. A
    write that fails for an I/O cause is one line naming ``final`` and the cause."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with write_errors_in_one_line(final):
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
