"""Checkpoints that a crash never leaves half-valid, and the cadence that decides when to write one.

Layout: ``run_dir/checkpoints/step-<8 digits>/`` holding
  - the tensor state (model, optimizers, embedding tables) written by ``torch.distributed.checkpoint``
    (DCP: ``.metadata`` + ``__<rank>_<n>.distcp``), so sharded state saves the same way later;
  - ``position.json`` (the data position and counters) and ``state.pkl`` (small non-tensor state:
    RNG states, the run's history, run-log state, the settings of the resume contract);
  - for a delta checkpoint, ``chain.json``: the checkpoint it continues (its parent) and the sha256 of
    the parent's marker; a delta holds the dense state whole and only the table rows that changed
    since its parent (``table_deltas``), so a resume loads the whole checkpoint at the chain's start
    and applies every delta after it, and a checkpoint is usable only with its whole chain;
  - ``COMPLETE``: sha256 and size of every other file, written last.
The directory is built under a temp name beside it and renamed once, so a reader sees either no
checkpoint or a whole one; the marker also catches later damage (truncation, bit rot).

Several processes: every rank writes its shards into rank 0's temp directory (DCP, coordinated
over the gloo control group), rank 0 gathers the per-rank small state (RNG streams) into
``state.pkl``, writes the marker and renames; the run directory must be on a file system every
node sees. DCP reshards on load, so a checkpoint written by N ranks loads on M.

``CheckpointWriter`` writes them asynchronously: the caller waits only while the state is copied to
host memory; a background thread writes the copy as ``save_checkpoint`` does (same files, same
atomic rename), so a kill during the write leaves the previous checkpoint whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from dlrmv4.checkpoint.dcp_io import dcp_load, dcp_save, io_threads, missing_pieces
from dlrmv4.config import TrainConfig
from dlrmv4.distributed import Cluster
from dlrmv4.errors import UserError
from dlrmv4.files import (
    atomic_directory,
    read_errors_in_one_line,
    remove_dead_temps,
    write_errors_in_one_line,
    write_failure,
)

MARKER = "COMPLETE"
POSITION_FILE = "position.json"
CHAIN_FILE = "chain.json"
PICKLE_FILE = "state.pkl"
CHECKPOINT_DIR = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_HASH_CHUNK = 1 << 20


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written, in one line naming it and the cause (the previous
    checkpoint stays whole)."""


@dataclass(frozen=True)
class CheckpointPosition:
    """Where the loop stands: enough to continue with the next batch exactly."""

    step: int  # optimizer steps done: the loader's position (every step is one global batch)
    samples_seen: int  # train samples consumed (all processes)
    window: int  # index of the current train window


class ModelAndOptimizers(Stateful):
    """A model and its optimizers as one DCP entry.

    Goes through ``torch.distributed.checkpoint.state_dict``: optimizer state is keyed by parameter
    name (not by position), and an optimizer that has not stepped yet gets its state tensors
    allocated first, so loading in place into a fresh optimizer fills them instead of dropping them.
    """

    def __init__(self, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model = model
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizers, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def _split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stateful entries (modules, ModelAndOptimizers) go through DCP; the rest is pickled."""
    for key, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            # A fresh optimizer has no state tensors for DCP to load into: its state would be lost.
            raise TypeError(f"state[{key!r}] is a bare optimizer: wrap it as ModelAndOptimizers(model, [optimizer])")
    tensor_state = {k: v for k, v in state.items() if isinstance(v, Stateful)}
    return tensor_state, {k: v for k, v in state.items() if k not in tensor_state}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _content_files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != MARKER)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def _step_dirs(root: Path) -> list[Path]:
    """``step-*`` directories, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)), key=lambda p: p.name)


def _prune(root: Path, keep: int, just_written: Path) -> None:
    """Keep ``keep`` restore points, each on a chain of its own (a whole checkpoint and the deltas
    after it), and every checkpoint their chains go back through: the one just written, then the
    newest complete checkpoint of each older chain. Points on one chain would all be lost with its
    whole checkpoint; with every checkpoint whole these are the newest ``keep``."""
    complete = [p for p in _step_dirs(root) if (p / MARKER).is_file()]
    ancestry = {p: _ancestry(p) for p in complete + [just_written]}
    kept, starts = [just_written], {ancestry[just_written][-1]}
    for ckpt in reversed(complete):
        if len(kept) == keep:
            break
        if ancestry[ckpt][-1] not in starts:
            kept.append(ckpt)
            starts.add(ancestry[ckpt][-1])
    needed = {p for ckpt in kept for p in ancestry[ckpt]}
    for p in complete:
        if p not in needed:
            # Out of the step-* names first: a kill inside the removal leaves a dead writer's temp
            # (removed at the next start), not a checkpoint without its marker.
            old = p.with_name(f".{p.name}.old-{os.getpid()}")
            with contextlib.suppress(OSError):
                os.rename(p, old)
                p = old
            shutil.rmtree(p, ignore_errors=True)


def _parent(ckpt: Path) -> tuple[Path, str] | None:
    """The checkpoint a delta continues and the sha256 its marker must have; None for a whole checkpoint."""
    try:
        chain = json.loads((ckpt / CHAIN_FILE).read_text())
    except FileNotFoundError:
        return None
    return ckpt.parent / chain["parent"], chain["parent_marker_sha256"]


def _ancestry(ckpt: Path) -> list[Path]:
    """``ckpt`` and the checkpoints its chain goes back through, as far as they exist (newest first)."""
    chain = [ckpt]
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        while (parent := _parent(chain[-1])) is not None and parent[0].is_dir() and parent[0] not in chain:
            chain.append(parent[0])
    return chain


def checkpoint_chain(ckpt: str | os.PathLike) -> list[Path]:
    """The checkpoints a resume from ``ckpt`` loads, oldest (the whole one) first. Check the chain with
    ``resume_point`` or ``latest_checkpoint`` first."""
    return list(reversed(_ancestry(Path(ckpt))))


def save_checkpoint(
    run_dir: str | os.PathLike,
    position: CheckpointPosition,
    state: dict[str, Any],
    keep_last: int,
    cluster: Cluster | None = None,
    rank_state: Any = None,
    parent: Path | None = None,
) -> Path:
    """Write ``run_dir/checkpoints/step-<position.step>/`` atomically and prune to ``keep_last``.

    ``state`` maps names to Stateful objects (``nn.Module``, ``ModelAndOptimizers``), saved by DCP
    and later loaded in place, or to small picklable values (the history, run-log state, ...).
    ``rank_state`` is this rank's own small state (RNG streams); ``load_checkpoint`` returns every
    rank's as ``rank_states``. ``parent``: the checkpoint this one continues (a delta checkpoint,
    whose state holds only what changed since it; None: a whole checkpoint). With a cluster of several
    ranks every rank must call this.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    tensor_state, small_state = _split_state(state)
    root = _checkpoints_dir(run_dir)
    final = root / f"step-{position.step:08d}"
    with _as_write_error(), write_errors_in_one_line(final):  # the previous checkpoint stays whole
        if cluster is None or cluster.world_size == 1:
            root.mkdir(parents=True, exist_ok=True)
            remove_dead_temps(root)
            with atomic_directory(final) as tmp:
                _raise_for(_thread_problem(final, dcp_save(tensor_state, tmp)) or _incomplete(final, tmp))
                _write_small_files(tmp, position, {**small_state, "rank_states": [rank_state]}, parent)
        elif cluster.is_main:
            root.mkdir(parents=True, exist_ok=True)
            remove_dead_temps(root)
            others_wait = False  # for the outcome of rank 0's own part: the small files and the rename
            try:
                with atomic_directory(final) as tmp:
                    cluster.broadcast(str(tmp))
                    own = _thread_problem(final, dcp_save(tensor_state, tmp, cluster))
                    gathered = cluster.gather((rank_state, own))
                    assert gathered is not None  # rank 0 gathers
                    problem = next((p for _, p in gathered if p is not None), None) or _incomplete(final, tmp)
                    cluster.broadcast(problem)  # every rank ends with the same line, or goes on
                    _raise_for(problem)
                    others_wait = True
                    _write_small_files(tmp, position, {**small_state, "rank_states": [s for s, _ in gathered]}, parent)
            except BaseException as exc:
                if others_wait:  # they end with rank 0's line instead of waiting out the collective timeout
                    with contextlib.suppress(Exception):  # this rank's own error is the one to raise
                        cluster.broadcast(_rank_0_problem(final, exc))
                raise
            cluster.broadcast(None)  # the others go on once the checkpoint is complete
        else:
            tmp = Path(cluster.broadcast(None))
            own = _thread_problem(final, dcp_save(tensor_state, tmp, cluster))
            cluster.gather((rank_state, own))
            _raise_for(cluster.broadcast(None))
            _raise_for(cluster.broadcast(None))
            return final
    _fsync_dir(root)
    _prune(root, keep_last, final)
    return final


@contextlib.contextmanager
def _as_write_error():
    """A save's one-line errors as ``CheckpointWriteError``: a caller tells a failed write from other errors."""
    try:
        yield
    except CheckpointWriteError:
        raise
    except UserError as exc:
        raise CheckpointWriteError(str(exc)) from exc


def _rank_0_problem(final: Path, exc: BaseException) -> str:
    """The line the other ranks end with when rank 0 fails to finish ``final`` (its files, its rename)."""
    if isinstance(exc, KeyboardInterrupt):
        return f"cannot write {final}: rank 0 was stopped before it was complete"
    if isinstance(exc, UserError):
        return str(exc)
    error = write_failure(final, exc)
    return str(error) if error is not None else f"cannot write {final}: rank 0 failed: {type(exc).__name__}: {exc}"


def _thread_problem(final: Path, error: BaseException | None) -> str | None:
    """A writer thread's error as the line the save ends with (a bug's own text where it has no I/O cause)."""
    if error is None:
        return None
    failure = write_failure(final, error)
    return str(failure) if failure is not None else f"cannot write {final}: {type(error).__name__}: {error}"


def _incomplete(final: Path, tmp: Path) -> str | None:
    """The line the save ends with when the tensor files written into ``tmp`` do not match their
    ``.metadata`` (a piece not placed, a file cut short or not listed); None when they do."""
    missing = missing_pieces(tmp)
    return None if missing is None else f"cannot write {final}: the files written are not whole ({missing})"


def _raise_for(problem: str | None) -> None:
    if problem is not None:
        raise UserError(problem)


def _write_small_files(
    tmp: Path, position: CheckpointPosition, small_state: dict[str, Any], parent: Path | None = None
) -> None:
    """position.json, state.pkl, a delta's chain.json and, last, the marker over every file in ``tmp``."""
    if parent is not None:
        chain = {"parent": parent.name, "parent_marker_sha256": _sha256(parent / MARKER)}
        _write_synced(tmp / CHAIN_FILE, json.dumps(chain, indent=1).encode())
    _write_synced(tmp / POSITION_FILE, json.dumps(dataclasses.asdict(position), indent=1).encode())
    _write_synced(tmp / PICKLE_FILE, pickle.dumps(small_state, protocol=pickle.HIGHEST_PROTOCOL))
    paths = _content_files(tmp)
    with ThreadPoolExecutor(io_threads()) as pool:  # hashlib lets go of the GIL on large reads
        digests = list(pool.map(_sha256, paths))
    files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests)}
    _write_synced(tmp / MARKER, json.dumps({"files": files}, indent=1, sort_keys=True).encode())
    _fsync_dir(tmp)  # the entries themselves, before the rename makes the checkpoint the newest


def _problem(ckpt: Path, verify_hashes: bool) -> str | None:
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
            digests = list(pool.map(_sha256, [ckpt / name for name in names]))
        for name, digest in zip(names, digests):
            if digest != listed[name]["sha256"]:
                return f"{name} does not match its sha256 in the marker"
    # A marker over files written short (by code before the writes were checked) is no proof.
    return missing_pieces(ckpt)


def _chain_problem(ckpt: Path, verify_hashes: bool, checked: dict[Path, str | None]) -> str | None:
    """Why a resume from ``ckpt`` cannot be trusted: its own problem or one of the checkpoints its chain
    goes back through (gone, rewritten since, or damaged); None when the whole chain is sound.
    ``checked`` holds each checkpoint's own problem once found: the checkpoints of one chain share
    their ancestors, which are hashed once."""
    seen: set[Path] = set()
    while True:
        if ckpt not in checked:
            checked[ckpt] = _problem(ckpt, verify_hashes)
        problem = checked[ckpt]
        if problem is not None:
            return problem if not seen else f"the checkpoint it continues, {ckpt.name}: {problem}"
        seen.add(ckpt)
        try:
            parent = _parent(ckpt)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"unreadable {CHAIN_FILE} in {ckpt.name} ({type(exc).__name__})"
        if parent is None:
            return None
        path, marker_sha256 = parent
        if not (path / MARKER).is_file() or path in seen:
            return f"the checkpoint it continues, {path.name}, is gone"
        if _sha256(path / MARKER) != marker_sha256:
            return f"the checkpoint it continues, {path.name}, was written again since"
        ckpt = path


def latest_checkpoint(run_dir: str | os.PathLike, verify_hashes: bool = True, warn: bool = True) -> Path | None:
    """The newest checkpoint that matches its marker; each newer one that does not is skipped, with
    one warning line on stderr when ``warn``. ``verify_hashes=False`` checks sizes only (fast on huge
    tables)."""
    checked: dict[Path, str | None] = {}
    for ckpt in reversed(_step_dirs(_checkpoints_dir(run_dir))):
        problem = _chain_problem(ckpt, verify_hashes, checked)
        if problem is None:
            return ckpt
        if warn:
            print(f"[dlrmv4] warning: skipping checkpoint {ckpt}: {problem}", file=sys.stderr)
    return None


def resume_point(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint a run resumes from, None for a run directory without checkpoints; each newer
    one skipped gets one warning line. Checkpoints none of which is sound are refused in one line
    (and no warnings): starting over would rewrite the run's MLPerf log, which only ``--restart``
    may do. A run looks this up once (``run.start_run``): each check hashes the checkpoint's files."""
    steps = _step_dirs(_checkpoints_dir(run_dir))
    skipped: list[tuple[Path, str]] = []
    checked: dict[Path, str | None] = {}
    for ckpt in reversed(steps):
        problem = _chain_problem(ckpt, True, checked)
        if problem is None:
            for path, why in skipped:
                print(f"[dlrmv4] warning: skipping checkpoint {path}: {why}", file=sys.stderr)
            return ckpt
        skipped.append((ckpt, problem))
    if skipped:
        raise UserError(
            f"{_checkpoints_dir(run_dir)} holds {len(steps)} checkpoint(s) but none is usable (the newest, "
            f"{steps[-1].name}: {skipped[0][1]}); pass --restart to start the run over"
        )
    return None


def load_small_state(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's small non-tensor state (``state.pkl``) alone: cheap, read before the tensors."""
    with open(Path(path) / PICKLE_FILE, "rb") as fh:
        return pickle.load(fh)


def load_checkpoint(
    path: str | os.PathLike, state_template: dict[str, Any], cluster: Cluster | None = None
) -> tuple[CheckpointPosition, dict[str, Any]]:
    """Load a checkpoint written by ``save_checkpoint``.

    Stateful entries of ``state_template`` (modules, ``ModelAndOptimizers``) are restored in place
    through DCP and returned as the same objects (resharded to this cluster); the other entries are
    returned as saved (the template's values for them are ignored), with ``rank_states`` the list
    of every saving rank's own state. Call ``latest_checkpoint`` first to pick a sound one.
    """
    path = Path(path)
    tensor_state, _ = _split_state(state_template)
    with read_errors_in_one_line(path):
        saved = json.loads((path / POSITION_FILE).read_text())
        # Checkpoints written before two unused counters were dropped still hold them.
        position = CheckpointPosition(**{f.name: saved[f.name] for f in dataclasses.fields(CheckpointPosition)})
        small_state = load_small_state(path)
        if tensor_state:
            dcp_load(tensor_state, path, cluster)
    return position, {**small_state, **tensor_state}


class HostCopy(Stateful):
    """An entry whose tensors are already host copies that the run will not change (a delta's rows): the
    asynchronous writer writes them as they are instead of staging them."""


class _Staged(HostCopy):
    """A state dict already copied to host memory: DCP writes it as it is; it is never loaded into."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self._state_dict = state_dict

    def state_dict(self) -> dict[str, Any]:
        return self._state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise TypeError("a staged copy is written, never loaded into")


class CheckpointWriter:
    """Writes a run's checkpoints, asynchronously when ``asynchronous``: ``save`` copies the tensor
    state to host memory (pinned and reused from one save to the next on a GPU) and snapshots the
    small state, then a background thread writes them with ``save_checkpoint``, over a control
    group of its own when there are several ranks (the training's collectives never wait behind it;
    its collectives wait as long as a checkpoint's bytes take: ``Cluster.for_checkpoint_io``). At
    most one write is in flight: ``save`` and ``wait`` wait for the previous one, and a write's error
    surfaces there. Without ``asynchronous``, ``save`` writes before it returns."""

    def __init__(self, run_dir: str | os.PathLike, keep_last: int, cluster: Cluster, asynchronous: bool) -> None:
        self.run_dir, self.keep_last, self.asynchronous = run_dir, keep_last, asynchronous
        # A collective (every rank builds its writer): the waits of a write are bounded by its bytes.
        self.cluster = cluster.for_checkpoint_io()
        # One staging copy per kind of save (whole, delta's dense state): each is reused by the next save of its kind.
        self._stagers: dict[tuple[str, ...], BlockingAsyncStager] = {}
        self._thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer") if asynchronous else None
        )
        self._pending: Future | None = None
        self.stage_seconds = 0.0  # the last save's time in the caller
        self.write_seconds = 0.0  # the last finished write's time in the background

    @property
    def writing(self) -> bool:
        """True while a background write is in flight."""
        return self._pending is not None and not self._pending.done()

    @property
    def failed(self) -> bool:
        """True when the background write has ended with an error (``wait`` raises it)."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def stage_ahead(self, state: dict[str, Any]) -> float:
        """Copy ``state``'s tensors once into the staging buffer, allocating (and, on a GPU, pinning) it
        now rather than in the first save; returns the seconds it took. Only asynchronous writers stage."""
        if self._thread is None:
            return 0.0
        started = time.perf_counter()
        self.wait()
        self._stage(state)
        return time.perf_counter() - started

    def _stage(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        tensor_state, small_state = _split_state(state)
        on_host = {key: value.state_dict() for key, value in tensor_state.items() if isinstance(value, HostCopy)}
        to_stage = {key: value.state_dict() for key, value in tensor_state.items() if key not in on_host}
        stager = self._stagers.get(tuple(sorted(to_stage)))
        if stager is None:
            stager = BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())
            self._stagers[tuple(sorted(to_stage))] = stager
        return {**stager.stage(to_stage), **on_host}, small_state

    def save(
        self, position: CheckpointPosition, state: dict[str, Any], rank_state: Any = None, parent: Path | None = None
    ) -> Path:
        """Write (or start writing) ``state`` as ``save_checkpoint`` does (``parent``: the checkpoint a
        delta continues); returns its final path."""
        started = time.perf_counter()
        if self._thread is None:
            path = save_checkpoint(self.run_dir, position, state, self.keep_last, self.cluster, rank_state, parent)
            self.stage_seconds = time.perf_counter() - started
            return path
        self.wait()  # the staging buffer is the previous write's until it is done
        staged, small_state = self._stage(state)
        # The run goes on changing its objects: the write gets copies as they are now.
        small_state, rank_state = pickle.loads(pickle.dumps((small_state, rank_state)))
        snapshot = {**{key: _Staged(value) for key, value in staged.items()}, **small_state}
        self._pending = self._thread.submit(self._write, position, snapshot, rank_state, parent)
        self.stage_seconds = time.perf_counter() - started
        return _checkpoints_dir(self.run_dir) / f"step-{position.step:08d}"

    def _write(self, position: CheckpointPosition, state: dict[str, Any], rank_state: Any, parent: Path | None) -> Path:
        # The lowest CPU priority for this thread and the threads it starts (they inherit it on
        # Linux): the training's own threads, and its loader workers, come first.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        started = time.perf_counter()
        path = save_checkpoint(self.run_dir, position, state, self.keep_last, self.cluster, rank_state, parent)
        self.write_seconds = time.perf_counter() - started
        return path

    def wait(self) -> Path | None:
        """Wait for the write in flight, if any; its path (None when there was none)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        self.wait()
        if self._thread is not None:
            self._thread.shutdown()


class CheckpointCadence:
    """When to checkpoint: every N steps, every N seconds, and/or at the end of each train window.

    Ask once per finished step; the answer says why one is due (``STEPS``, ``SECONDS`` or ``WINDOW``,
    in that order when several apply) or None, and a due answer is taken as a checkpoint written at
    ``now_seconds`` (the seconds clock restarts from it). The clock starts at the first question, so
    a resumed run waits a full interval before its first timed checkpoint. Ranks' clocks differ and a
    save is collective: several ranks pass ``seconds_elapsed``, whether the interval has passed on any
    of them (``seconds_elapsed`` of this clock, combined), so that all give the same answer and
    restart their clocks together.
    """

    STEPS, SECONDS, WINDOW = "steps", "seconds", "window"

    def __init__(self, cfg: TrainConfig):
        self.every_steps = cfg.checkpoint_every_steps
        self.every_seconds = cfg.checkpoint_every_seconds
        self.every_window = cfg.checkpoint_every_window
        self._last_seconds: float | None = None
        self._seconds_before: float | None = None  # the clock before the last due answer restarted it

    def seconds_elapsed(self, now_seconds: float) -> bool:
        """Whether the seconds cadence's interval has passed on this clock."""
        if self._last_seconds is None:
            self._last_seconds = now_seconds
        return self.every_seconds > 0 and now_seconds - self._last_seconds >= self.every_seconds

    def due(
        self, step: int, now_seconds: float, end_of_window: bool, seconds_elapsed: bool | None = None
    ) -> str | None:
        if seconds_elapsed is None:
            seconds_elapsed = self.seconds_elapsed(now_seconds)
        elif self._last_seconds is None:
            self._last_seconds = now_seconds  # the clock starts at the first question all the same
        reasons = (
            (self.STEPS, self.every_steps > 0 and step > 0 and step % self.every_steps == 0),
            (self.SECONDS, seconds_elapsed),
            (self.WINDOW, self.every_window and end_of_window),
        )
        reason = next((name for name, due in reasons if due), None)
        if reason is not None:
            self._seconds_before, self._last_seconds = self._last_seconds, now_seconds
        return reason

    def not_taken(self) -> None:
        """The last due answer's checkpoint was not written (a window end skipped while a write is in
        flight): the seconds clock goes on from the checkpoint before, as if it had not been asked."""
        self._last_seconds = self._seconds_before
