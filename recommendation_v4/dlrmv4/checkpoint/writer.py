"""Writing checkpoints: ``save_checkpoint``, the atomic save every rank takes part in, and
``CheckpointWriter``, which makes it in the background.

A checkpoint's directory is built under a temp name beside it and renamed once, so a reader sees
either no checkpoint or a whole one. With several processes every rank writes its shards into rank
0's temp directory (DCP, coordinated over the gloo control group), rank 0 gathers the per-rank small
state (RNG streams) into ``state.pkl``, writes the marker and renames; the run directory must be on
a file system every node sees. DCP reshards on load, so a checkpoint written by N ranks loads on M.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from dlrmv4.checkpoint.chain import prune, write_link
from dlrmv4.checkpoint.dcp_io import dcp_save, missing_pieces
from dlrmv4.checkpoint.device_snapshot import DeviceSnapshot, device_bytes, snapshot_layout, spare_device_memory
from dlrmv4.checkpoint.layout import (
    PICKLE_FILE,
    POSITION_FILE,
    checkpoints_dir,
    fsync_dir,
    step_dir,
    write_marker,
    write_synced,
)
from dlrmv4.checkpoint.state import CheckpointPosition, HostCopy, split_state
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.distributed.liveness import lost_rank_error, silent_ranks
from dlrmv4.errors import UserError
from dlrmv4.files import atomic_directory, remove_dead_temps, write_errors_in_one_line, write_failure


class CheckpointWriteError(UserError):
    """A checkpoint that could not be written, in one line naming it and the cause (the previous
    checkpoint stays whole)."""


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
    tensor_state, small_state = split_state(state)
    root = checkpoints_dir(run_dir)
    final = step_dir(root, position.step)
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
    fsync_dir(root)
    prune(root, keep_last, final)
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
        write_link(tmp, parent)
    write_synced(tmp / POSITION_FILE, json.dumps(dataclasses.asdict(position), indent=1).encode())
    write_synced(tmp / PICKLE_FILE, pickle.dumps(small_state, protocol=pickle.HIGHEST_PROTOCOL))
    write_marker(tmp)


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
    state to host memory (pinned and reused from one save to the next on a GPU), or only into its
    snapshot on the device where ``stage_ahead`` made one (the thread then copies that to host), and
    snapshots the small state, then a background thread writes them with ``save_checkpoint`` (same files, same
    atomic rename: a kill during the write leaves the previous checkpoint whole), over a control
    group of its own when there are several ranks (the training's collectives never wait behind it;
    its collectives wait as long as a checkpoint's bytes take: ``Cluster.for_checkpoint_io``). At
    most one write is in flight: ``save`` and ``wait`` wait for the previous one, and a write's error
    surfaces there. Without ``asynchronous``, ``save`` writes before it returns."""

    def __init__(self, run_dir: str | os.PathLike, keep_last: int, cluster: Cluster, asynchronous: bool) -> None:
        self.run_dir, self.keep_last, self.asynchronous = run_dir, keep_last, asynchronous
        # A collective (every rank builds its writer): the waits of a write are bounded by its bytes.
        self.cluster = cluster.for_checkpoint_io()
        self._peers = cluster  # the training's: its timeout paces the liveness checks of a long wait
        # One staging copy per kind of save (whole, delta's dense state): each is reused by the next save of its kind.
        self._stagers: dict[tuple[str, ...], BlockingAsyncStager] = {}
        # The kinds staged ahead with a snapshot on the device (``device_snapshot.py``).
        self._snapshots: dict[tuple[str, ...], DeviceSnapshot] = {}
        self.snapshot_note = ""  # how stage_ahead staged: on the device, or why not
        self._thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer") if asynchronous else None
        )
        self._pending: Future | None = None
        self.stage_seconds = 0.0  # the last save's time in the caller
        self.then_ran_here = False  # whether the last save's ``then`` ran in the caller
        self.write_seconds = 0.0  # the last finished write's time in the background

    @property
    def writing(self) -> bool:
        """True while a background write is in flight."""
        return self._pending is not None and not self._pending.done()

    @property
    def failed(self) -> bool:
        """True when the background write has ended with an error (``wait`` raises it)."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def stage_ahead(self, state: dict[str, Any], planned_peak: int | None = None) -> float:
        """Copy ``state``'s tensors once into the staging buffer, allocating (and, on a GPU, pinning) it
        now rather than in the first save; returns the seconds it took. Only asynchronous writers stage.
        ``planned_peak`` (the memory plan's device bytes, given after the warm-up): also make a snapshot
        on the device for the saves of this kind, of as much of the state as the room left beside the
        run's peak holds (``device_snapshot.spare_device_memory``): those bytes the step copies on the
        device only. ``snapshot_note`` says what was done."""
        if self._thread is None:
            return 0.0
        started = time.perf_counter()
        self.wait()
        kind, to_stage, _, _ = self._split(state)
        device = self.cluster.device
        needed = device_bytes(to_stage, device) / 2**30
        if planned_peak is None:
            spare, why = 0, "the run's device memory peak is not known: no warm-up or no memory plan"
        else:
            spare, why = spare_device_memory(device, planned_peak)
        held = snapshot_layout(to_stage, device, spare)[1] / 2**30
        if held == 0:
            self._stager(kind).stage(to_stage)
            self.snapshot_note = f"the step copies each save to host memory ({why})"
        else:
            snapshot = self._snapshots[kind] = DeviceSnapshot(to_stage, device, spare)
            snapshot.take(to_stage)
            snapshot.to_host()
            self.snapshot_note = f"a snapshot on the device of {held:.1f} of the state's {needed:.1f} GiB each save"
            if held < needed:
                self.snapshot_note += f", the step copies the rest to host memory ({why})"
        return time.perf_counter() - started

    def _split(self, state: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any], dict[str, Any], dict[str, Any]]:
        """The kind of save (its staged entries' names), the entries to stage, those already host copies,
        and the small state."""
        tensor_state, small_state = split_state(state)
        on_host = {key: value.state_dict() for key, value in tensor_state.items() if isinstance(value, HostCopy)}
        to_stage = {key: value.state_dict() for key, value in tensor_state.items() if key not in on_host}
        return tuple(sorted(to_stage)), to_stage, on_host, small_state

    def _stager(self, kind: tuple[str, ...]) -> BlockingAsyncStager:
        stager = self._stagers.get(kind)
        if stager is None:
            stager = BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())
            self._stagers[kind] = stager
        return stager

    def save(
        self,
        position: CheckpointPosition,
        state: dict[str, Any],
        rank_state: Any = None,
        parent: Path | None = None,
        then: tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], None]] | None = None,
    ) -> Path:
        """Write (or start writing) ``state`` as ``save_checkpoint`` does (``parent``: the checkpoint a
        delta continues); returns its final path. ``then``: (tensors of ``state``, work on them), run
        once on the tensors as they are at the save: in the writer's thread on the device snapshot's
        copies where it holds them all, else here after the copy (``then_ran_here`` says which)."""
        started = time.perf_counter()
        self.then_ran_here = then is not None
        if self._thread is None:
            path = save_checkpoint(self.run_dir, position, state, self.keep_last, self.cluster, rank_state, parent)
            if then is not None:
                then[1](then[0])
            self.stage_seconds = time.perf_counter() - started
            return path
        self.wait()  # the staging buffer (and snapshot) is the previous write's until it is done
        kind, to_stage, on_host, small_state = self._split(state)
        snapshot = self._snapshots.get(kind)
        # With a snapshot, the host copy is whole once the thread has copied the snapshot into it.
        staged = self._stager(kind).stage(to_stage) if snapshot is None else snapshot.take(to_stage)
        deferred = None
        if then is not None:
            copies = None if snapshot is None else snapshot.copies_of(then[0])
            if copies is None:
                then[1](then[0])
            else:
                deferred, self.then_ran_here = (then[1], copies), False
        # The run goes on changing its objects: the write gets copies as they are now.
        small_state, rank_state = pickle.loads(pickle.dumps((small_state, rank_state)))
        snapshot_state = {**{key: _Staged(value) for key, value in {**staged, **on_host}.items()}, **small_state}
        self._pending = self._thread.submit(
            self._write, position, snapshot_state, rank_state, parent, snapshot, deferred
        )
        self.stage_seconds = time.perf_counter() - started
        return step_dir(checkpoints_dir(self.run_dir), position.step)

    def _write(
        self,
        position: CheckpointPosition,
        state: dict[str, Any],
        rank_state: Any,
        parent: Path | None,
        snapshot: DeviceSnapshot | None,
        deferred: tuple[Callable[[list[torch.Tensor]], None], list[torch.Tensor]] | None,
    ) -> Path:
        # The lowest CPU priority for this thread and the threads it starts (they inherit it on
        # Linux): the training's own threads, and its loader workers, come first.
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        started = time.perf_counter()
        if snapshot is not None:
            snapshot.to_host()
            if deferred is not None:  # on the snapshot's stream, beside the training's
                work, copies = deferred
                with torch.cuda.stream(snapshot.stream) if snapshot.stream is not None else contextlib.nullcontext():
                    work(copies)
        path = save_checkpoint(self.run_dir, position, state, self.keep_last, self.cluster, rank_state, parent)
        self.write_seconds = time.perf_counter() - started
        return path

    def wait(self) -> Path | None:
        """Wait for the write in flight, if any; its path (None when there was none). With several ranks
        a write's collectives wait as long as its bytes take, so the wait asks, every collective timeout,
        whether every rank still gives signs of life: one that stopped answering ends it with the line
        naming that rank, instead of the hours of the write's own timeout."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if self._peers.world_size == 1:
            return pending.result()
        while True:
            try:
                return pending.result(timeout=self._peers.timeout_seconds)
            except FutureTimeout:
                if silent_ranks(self._peers) != []:  # a silent rank, or the store gone with its holder
                    waited = TimeoutError(f"the write had not ended after {self._peers.timeout_seconds:g} s")
                    raise lost_rank_error(self._peers, "a checkpoint write", waited) from None

    def abandon(self) -> None:
        """Leave the write in flight to itself (a failing rank of several: a peer may never join its
        collectives); the previous checkpoint stays the resume point."""
        self._pending = None
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self.wait()
        if self._thread is not None:
            self._thread.shutdown()
