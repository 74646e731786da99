"""DCP's saves and loads as a checkpoint uses them: written by several threads per rank, every
thread's error brought back to the save, and a written directory checked piece by piece.

DCP's ``FileSystemWriter`` writes a rank's files on ``thread_count`` threads, its own and
``thread_count - 1`` more. An error in the calling thread reaches the save; an error in another
thread only reaches ``threading.excepthook``, and the save goes on without that thread's files:
their bytes are cut short and ``.metadata`` lists none of their entries, while every file is there
to be hashed. So the hook installed here keeps those errors for the save to raise, and
``missing_pieces`` checks a written directory against its ``.metadata`` before anything calls it
complete (and again before a resume trusts it).
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from dlrmv4.distributed.cluster import Cluster
from dlrmv4.parallel import usable_cores

WRITE_THREADS = 8
_WRITER_THREAD = "_write_files_from_queue"  # the target DCP's writer threads run (in their names)
DATA_SUFFIX = ".distcp"


def io_threads() -> int:
    """Threads a rank writes (and hashes) its checkpoint files with: one stream does not fill a disk."""
    return max(1, min(WRITE_THREADS, usable_cores()))


def writer_thread_errors() -> list[BaseException]:
    """The errors DCP's writer threads raised since the list was last cleared (the process's hook, installed
    once and left in place: a thread may end after its save). Their tracebacks are not printed: the save
    raises the error in one line instead."""
    previous = threading.excepthook
    errors = getattr(previous, "dlrmv4_writer_errors", None)
    if errors is not None:
        return errors
    kept: list[BaseException] = []

    def hook(args: Any) -> None:
        if args.thread is not None and _WRITER_THREAD in args.thread.name and args.exc_value is not None:
            kept.append(args.exc_value)
        else:
            previous(args)

    hook.dlrmv4_writer_errors = kept  # type: ignore[attr-defined]
    threading.excepthook = hook
    return kept


def dcp_save(state_dict: dict[str, Any], path: Path, cluster: Cluster | None = None) -> BaseException | None:
    """Write ``state_dict`` into ``path`` with DCP (``io_threads()`` files per rank; a collective over the
    cluster's control group with several ranks). An error of the save itself is raised; the first error
    of one of its writer threads, which the save does not see, is returned."""
    errors = writer_thread_errors()
    errors.clear()
    writer = FileSystemWriter(path, thread_count=io_threads())
    _run(dcp.save, state_dict, cluster, storage_writer=writer)
    return errors[0] if errors else None


def dcp_load(state_dict: dict[str, Any], path: Path, cluster: Cluster | None = None) -> None:
    """Load ``path`` into ``state_dict`` in place (resharded to this cluster)."""
    # Keep ShardedTensors whole: flattening drops those with no shard on this rank (table-wise plans),
    # and a key missing that way sends DCP down its pre-2.4 key format.
    planner = {"planner": DefaultLoadPlanner(flatten_sharded_tensors=False)} if _several(cluster) else {}
    _run(dcp.load, state_dict, cluster, checkpoint_id=str(path), **planner)


def _several(cluster: Cluster | None) -> bool:
    return cluster is not None and cluster.world_size > 1


def _run(fn: Any, state_dict: dict[str, Any], cluster: Cluster | None, **kwargs: Any) -> None:
    """DCP wraps whatever a rank's part raised, Ctrl-C and SIGTERM's ``Terminated`` included, in its
    ``CheckpointException``: a stop comes out as itself, so the run ends as stopped, in its own line."""
    try:
        _call(fn, state_dict, cluster, **kwargs)
    except BaseException as exc:
        stop = _stop_inside(exc)
        if stop is None or stop is exc:
            raise
        raise stop from None


def _stop_inside(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt (Ctrl-C, or SIGTERM's subclass) among DCP's per-rank failures, if any."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    for failure in getattr(exc, "failures", {}).values():  # rank -> exception, or (exception, traceback)
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, KeyboardInterrupt):
            return inner
    return None


def _call(fn: Any, state_dict: dict[str, Any], cluster: Cluster | None, **kwargs: Any) -> None:
    """Without a process group DCP works in one process (``no_dist`` is implied in torch 2.13) but warns on
    every call, which says nothing new here."""
    if _several(cluster):
        assert cluster is not None
        with cluster.guard(f"checkpoint {fn.__name__}"):
            fn(state_dict, process_group=cluster.control, **kwargs)
        return
    single = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        if single:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        fn(state_dict, no_dist=single, **kwargs)


def missing_pieces(path: Path) -> str | None:
    """What of DCP's part of the checkpoint at ``path`` is missing or cut short, or None when ``.metadata``
    places every entry it lists in a data file long enough to hold it and names every non-empty data file there."""
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # a missing, cut or foreign .metadata: pickle and DCP raise many kinds
        return f"unreadable .metadata ({type(exc).__name__})"
    stored = metadata.storage_data or {}
    for fqn, entry in metadata.state_dict_metadata.items():
        pieces = (
            [MetadataIndex(fqn)]
            if isinstance(entry, BytesStorageMetadata)
            else [MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks]
        )
        if any(piece not in stored for piece in pieces):
            return f".metadata places no data for {fqn} (a writer's files were not recorded)"
    ends: dict[str, int] = {}
    for info in stored.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = path / name
        size = file.stat().st_size if file.is_file() else -1
        if size < end:
            return f"{name} is {'missing' if size < 0 else f'{size:,} bytes'}, .metadata needs {end:,}"
    # A rank with fewer pieces than writer threads leaves the rest of its files empty: those hold nothing.
    unlisted = sorted(p.name for p in path.glob(f"*{DATA_SUFFIX}") if p.name not in ends and p.stat().st_size)
    if unlisted:
        return f"{', '.join(unlisted)} not in .metadata (its writer did not finish)"
    return None
