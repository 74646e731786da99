"""The processes of one run: the launcher's environment, the process group, and the few collectives
the loop needs beyond TorchRec's and DDP's own.

A run is one process unless a launcher started several: ``torchrun`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (an srun task takes them
from SLURM's own names: ``slurm_tasks.py``); each process then joins
the group through ``env://``. Tensors travel on the main group (NCCL on GPUs, gloo on the CPU);
host-side control messages (paths, decisions, small objects) on a gloo group, so they never wait
for the device. Every collective has the configured timeout: a rank that dies or hangs makes the
others fail with ``RankLostError``, naming it, instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlrmv4.config import DistributedConfig
from dlrmv4.errors import UserError, exit_with_error

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# A file the process of global rank 0 creates once it has joined: run_and_time.sh's sign that its node
# holds rank 0, which checks the MLPerf log and prints RESULT (torchrun's c10d rendezvous may give
# rank 0 to any node).
RANK_ZERO_MARKER = "DLRMV4_RANK_ZERO_MARKER"


# How long collectives that wait on another rank's checkpoint bytes (written, read or hashed) may wait:
# a node's whole checkpoint of Yambda-5B's tables (about 600 GB) at 0.2 GB/s takes under an hour. The
# run's collective timeout (--timeout-seconds) still bounds every other wait.
CHECKPOINT_IO_TIMEOUT_SECONDS = 2 * 3600.0

FAILURE_KEY = "dlrmv4/failed_rank"  # the rendezvous store's key for a rank's own failure
FAILURE_POLL_SECONDS = 1.0  # how often every rank looks for a failure another rank posted
# A failed rank stays this long after posting its line: the store may live in its own process
# (rank 0 of a launch without torchrun), and the others must read the line before it goes.
FAILURE_LINGER_SECONDS = 3 * FAILURE_POLL_SECONDS
# Each rank's failure watch adds 1 to its own counter at every poll: a lost collective names the ranks
# whose counter stood still while it watched them this long.
ALIVE_KEY = "dlrmv4/alive/"
SILENCE_SECONDS = 3 * FAILURE_POLL_SECONDS
# How long a rank that lost a collective waits for each answer of the store: its holder may have
# stopped answering too, and the run's collective timeout would hold the line back that long.
STORE_ANSWER_SECONDS = 5.0


class RankLostError(UserError):
    """A collective failed: another rank exited, was killed, or stopped answering."""

    caused_by_another_rank = True

    def __init__(self, message: str, peer_said_why: bool) -> None:
        super().__init__(message)
        self.peer_said_why = peer_said_why  # False: the other rank left no line (stopped, killed, hung)


@dataclass(frozen=True)
class Cluster:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None = None  # None: one process, no process group
    control: Any = None  # the gloo group for host-side messages (None: one process)
    timeout_seconds: float = 600.0

    @classmethod
    def single(cls, device: torch.device) -> "Cluster":
        """One process on ``device``, no process group."""
        return cls(0, 1, 0, 1, device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def for_checkpoint_io(self) -> "Cluster":
        """This cluster with a control group of its own whose collectives wait up to
        ``CHECKPOINT_IO_TIMEOUT_SECONDS`` (or the run's timeout, if longer): for the exchanges that wait
        while a rank writes, reads or hashes a checkpoint. A collective: every rank calls it."""
        if self.world_size == 1:
            return self
        seconds = max(self.timeout_seconds, CHECKPOINT_IO_TIMEOUT_SECONDS)
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=seconds))
        return dataclasses.replace(self, control=group, timeout_seconds=seconds)

    def release_checkpoint_io(self, io: "Cluster") -> None:
        """Close the control group of ``io``, made by ``for_checkpoint_io`` and no longer used."""
        if io.control is not self.control:
            dist.destroy_process_group(io.control)

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    def describe(self) -> str:
        if not self.distributed:
            return f"one process on {self.device}"
        return (
            f"{self.world_size} processes ({self.local_world_size} per node, {self.backend}), "
            f"rank {self.rank} on {self.device}"
        )

    # -- host-side control messages --------------------------------------------------------
    def guard(self, what: str):
        """A context in which a failed collective becomes one line naming this rank."""
        return _Guard(self, what)

    def barrier(self) -> None:
        if self.world_size > 1:
            with self.guard("barrier"):
                dist.barrier(group=self.control)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if self.world_size == 1:
            return obj
        box = [obj]
        with self.guard("broadcast"):
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0, in rank order (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.is_main else None
        with self.guard("gather"):
            dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (same length on every rank), on every rank."""
        if self.world_size == 1:
            return [list(values)]
        local = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(local) for _ in range(self.world_size)]
        with self.guard("all_gather"):
            dist.all_gather(out, local, group=self.control)
        return [t.tolist() for t in out]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is True on any (a decision all ranks must share)."""
        if self.world_size == 1:
            return flag
        t = torch.tensor([int(flag)], dtype=torch.int64)
        with self.guard("all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control)
        return bool(t.item())

    # -- device tensors ----------------------------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place over every rank, on the main group (no host read)."""
        if self.world_size > 1:
            reduce_op = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
            with self.guard("all_reduce"):
                dist.all_reduce(tensor, op=reduce_op)
        return tensor

    def mean(self, tensor: torch.Tensor) -> float:
        """The mean of a scalar over the ranks, read on the host."""
        return float(self.all_reduce_(tensor.clone())) / self.world_size

    def all_gather_rows(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0, rank order; ``sizes[r]`` is rank r's row
        count, known on the host (so the exchange needs no device read)."""
        if self.world_size == 1:
            return tensor
        longest = max(sizes)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        out = tensor.new_empty((self.world_size * longest, *tensor.shape[1:]))
        with self.guard("all_gather"):
            dist.all_gather_into_tensor(out, padded)
        return torch.cat([out[r * longest : r * longest + n] for r, n in enumerate(sizes)])

    # -- a rank's own failure ---------------------------------------------------------------
    def post_failure(self, line: str) -> None:
        """Leave this rank's one-line failure in the rendezvous store, where the other ranks look
        when their next collective fails (best effort: the store may be gone too)."""
        if self.world_size > 1:
            try:
                dist.distributed_c10d._get_default_store().set(FAILURE_KEY, line)
            except Exception:  # noqa: BLE001 - reporting must never mask the failure itself
                pass

    def post_failure_and_linger(self, line: str) -> None:
        """``post_failure``, then wait until every rank's watch has had time to read it."""
        if self.world_size > 1:
            self.post_failure(line)
            time.sleep(FAILURE_LINGER_SECONDS)

    def watch_failures(self) -> "FailureWatch | None":
        """A watch that ends this rank as soon as another rank posts its failure (None: one process)."""
        return FailureWatch(self) if self.world_size > 1 else None

    def posted_failure(self) -> str | None:
        """The line a failed rank posted, if any."""
        if self.world_size == 1:
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            return store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
        except Exception:  # noqa: BLE001 - the store may have gone with the failed rank
            return None

    def beat(self) -> None:
        """A sign of life in the store (every poll of this rank's failure watch)."""
        try:
            dist.distributed_c10d._get_default_store().add(f"{ALIVE_KEY}{self.rank}", 1)
        except Exception:  # noqa: BLE001 - the store may be gone; the collective says the rest
            pass

    def hurry_the_store(self) -> None:
        """From now on, each answer of the store waits up to ``STORE_ANSWER_SECONDS``: for a rank whose
        collective failed, whose store holder may have stopped answering too."""
        try:
            dist.distributed_c10d._get_default_store().set_timeout(datetime.timedelta(seconds=STORE_ANSWER_SECONDS))
        except Exception:  # noqa: BLE001 - no store, no wait
            pass

    def silent_ranks(self, seconds: float = SILENCE_SECONDS) -> list[int] | None:
        """The other ranks that gave no sign of life in the store for ``seconds`` (ranks that never gave
        one are not counted: their watch had not started); None when the store itself is gone or does
        not answer, found after ``seconds`` all the same: under torchrun the agent reads the same store,
        notices within its monitor interval, stops this rank and says the node's line."""
        others = [r for r in range(self.world_size) if r != self.rank]
        until = time.monotonic() + seconds
        try:
            store = dist.distributed_c10d._get_default_store()
            before = [store.add(f"{ALIVE_KEY}{r}", 0) for r in others]
            time.sleep(seconds)
            after = [store.add(f"{ALIVE_KEY}{r}", 0) for r in others]
        except Exception:  # noqa: BLE001 - a store that is gone is the answer
            time.sleep(max(0.0, until - time.monotonic()))
            return None
        return [r for r, b, a in zip(others, before, after) if a == b > 0]

    def shutdown(self) -> None:
        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()


class FailureWatch:
    """A thread that ends this rank with one line as soon as another rank posts its own failure.

    The main thread cannot always do it: on GPUs it may be blocked in native code waiting for a
    collective that the failed rank will never join, and NCCL's watchdog would end the process at the
    collective timeout with a native stack trace instead of a line. ``stop`` (on this rank's own
    failure, or at the end) makes sure that at most one of the two reports. Each poll also leaves
    this rank's sign of life in the store (``Cluster.beat``), by which a lost collective names the
    rank that stopped answering."""

    def __init__(self, cluster: Cluster, poll_seconds: float = FAILURE_POLL_SECONDS) -> None:
        self._cluster, self._poll_seconds = cluster, poll_seconds
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="dlrmv4-failure-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        self._cluster.beat()
        while not self._stopped.wait(self._poll_seconds):
            self._cluster.beat()
            posted = self._cluster.posted_failure()
            if posted is None:
                continue
            with self._lock:
                if self._stopped.is_set():
                    return
                c = self._cluster
                linger = FAILURE_LINGER_SECONDS if hosts_the_store() else 0.0
                exit_with_error(f"rank {c.rank} of {c.world_size}: training failed because {posted}", linger)

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()


class _Guard:
    """Turns a failed collective into one clear line naming this rank."""

    def __init__(self, cluster: Cluster, what: str) -> None:
        self.cluster, self.what = cluster, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None and is_comm_failure(exc) and not isinstance(exc, UserError):
            raise lost_rank_error(self.cluster, self.what, exc) from exc


_COMM_FAILURE = re.compile(r"gloo|nccl|connection|timed out|timeout|peer|socket|broken pipe", re.IGNORECASE)


def check_batch_splits(global_batch: int, world_size: int) -> None:
    """Every rank takes an equal share of each global batch: refused in one line otherwise."""
    if world_size < 1 or global_batch % world_size:
        raise UserError(
            f"the global batch size {global_batch:,} does not split evenly over {world_size:,} processes: use a "
            "multiple of the world size"
        )


def is_comm_failure(exc: BaseException) -> bool:
    """A failure of the transport under a collective (not a bug in the step itself)."""
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and bool(_COMM_FAILURE.search(str(exc))))


def lost_rank_error(cluster: Cluster, what: str, exc: BaseException) -> RankLostError:
    """The line of a rank whose collective failed: the cause another rank posted, or which rank went
    silent (watched for ``SILENCE_SECONDS``; a rank's own line posted meanwhile still wins)."""
    cluster.hurry_the_store()
    posted = cluster.posted_failure()
    silent: list[int] | None = []
    if posted is None:
        silent = cluster.silent_ranks()
        posted = cluster.posted_failure()
    if posted is not None:
        return RankLostError(f"rank {cluster.rank} of {cluster.world_size}: {what} failed because {posted}", True)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RankLostError(
        f"rank {cluster.rank} of {cluster.world_size}: {what} failed, another rank exited or "
        f"stopped answering{_which_ranks(cluster, silent)} (timeout {cluster.timeout_seconds:g} s): {first_line[:200]}",
        False,
    )


def _which_ranks(cluster: Cluster, silent: list[int] | None) -> str:
    """``silent_ranks``'s answer, for the line: the silent ranks, or where the store went."""
    if silent:
        return f": rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))}"
    if silent is None and "TORCHELASTIC_RUN_ID" in os.environ:
        return ": the rendezvous store is gone too (the node that held it stopped or failed)"
    if silent is None and cluster.rank != 0:
        return ": rank 0 (its process held the rendezvous store, which is gone too)"
    return ""


def own_failure_line(cluster: Cluster, exc: BaseException) -> str:
    """One line for this rank's own failure: out of device memory, a UserError, or another error."""
    text = str(exc).strip()
    first = text.splitlines()[0][:300] if text else ""
    if isinstance(exc, torch.OutOfMemoryError):
        return f"rank {cluster.rank} of {cluster.world_size} ran out of device memory: {first}"
    if isinstance(exc, UserError):
        return first
    return f"rank {cluster.rank} of {cluster.world_size} failed: {type(exc).__name__}: {first}"


def hosts_the_store() -> bool:
    """Whether this process holds the rendezvous store that the ranks read a failed rank's line from:
    rank 0 of ranks started without torchrun (srun tasks; torchrun's agent holds it otherwise). Its
    exit takes the store with it, so on a failure it stays until the others have had time to read."""
    return (
        os.environ.get("RANK") == "0"
        and int(os.environ.get("WORLD_SIZE", "1")) > 1
        and "TORCHELASTIC_RUN_ID" not in os.environ
    )


def exit_process(code: int) -> None:
    """End the process with ``code``; one of several processes leaves without the interpreter's
    teardown, in which torch's autograd and gloo threads can hang or abort the process after the
    run has ended (pytorch/pytorch#190489; seen here about once in ten two-process runs). What the
    process wrote must be closed by now."""
    if code == 1 and hosts_the_store() and dist.is_initialized():  # a store no rank joined has no reader
        time.sleep(FAILURE_LINGER_SECONDS)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def launched_world() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) from a launcher's environment, or None."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    missing = [v for v in LAUNCHER_VARIABLES if v not in os.environ]
    if missing:
        raise UserError(
            f"multi-process launch: {', '.join(missing)} not set (launch with torchrun, or srun with MASTER_ADDR set)"
        )
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except ValueError as exc:
        raise UserError(f"multi-process launch: a rank variable is not an integer ({exc})") from exc
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise UserError(
            f"multi-process launch: RANK={rank}, WORLD_SIZE={world}, LOCAL_RANK={local_rank}, "
            f"LOCAL_WORLD_SIZE={local_world} are inconsistent"
        )
    return rank, world, local_rank, local_world


def _bound_to_one_gpu(local_world: int) -> bool:
    """Whether this process sees fewer GPUs than the node runs processes: a task a scheduler bound to
    its own GPU (or a launch with too few GPUs, which ``_device`` refuses)."""
    return torch.cuda.device_count() < local_world


def _device(local_rank: int, local_world: int) -> torch.device:
    """This process's GPU: the node's GPU of its local rank when it sees them all (torchrun, srun
    --gpus-per-node), the one it sees when bound to one (srun --gpus-per-task=1, --gpu-bind)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if not _bound_to_one_gpu(local_world):
        index = local_rank
    elif count == 1:
        index = 0  # two processes bound to one GPU are refused once the group has formed (_node_layout)
    else:
        raise UserError(
            f"{local_world} processes on this node but {count} visible GPUs: one GPU per process (every process "
            "sees all the node's GPUs, or exactly its own)"
        )
    # Before anything builds a DeviceMesh (TorchRec's sharding does): on an uninitialised CUDA it
    # would take GPU LOCAL_RANK, which a task bound to one GPU does not see.
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _gpu_id(device: torch.device) -> str:
    """The physical GPU's identity, the same whatever CUDA_VISIBLE_DEVICES numbers it ("" on the CPU)."""
    return str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""


def start_cluster(cfg: DistributedConfig, need_group: bool = False) -> Cluster:
    """Join the launcher's process group, or run as one process. ``need_group`` makes a one-process
    group where none was launched (TorchRec's DistributedModelParallel needs one)."""
    launched = launched_world()
    rank, world, local_rank, local_world = launched or (0, 1, 0, 1)
    device = _device(local_rank, local_world)
    if launched is None and not need_group:
        return Cluster(0, 1, 0, 1, device, timeout_seconds=cfg.timeout_seconds)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UserError("distributed.backend=nccl needs GPUs; use gloo (or auto) on the CPU")
    timeout = datetime.timedelta(seconds=cfg.timeout_seconds)
    if dist.is_initialized():
        raise UserError("torch.distributed is already initialised in this process")
    if launched is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
        if local_rank == 0:  # srun's tasks meet at rank 0's store with no launcher that says so: once per node
            sys.stderr.write(
                f"[dlrmv4] rank {rank}: joining the {world} ranks at {os.environ['MASTER_ADDR']}:"
                f"{os.environ['MASTER_PORT']} (waits up to {cfg.timeout_seconds:g} s, --timeout-seconds)\n"
            )
            sys.stderr.flush()
        _meet_at_rank_zero(rank, world, cfg.timeout_seconds)
    try:
        if launched is None:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            # Tasks bound to one GPU each may have been bound to the same one: _node_layout refuses
            # that in one line, over gloo, before NCCL's first use (an eager NCCL start, device_id,
            # would fail first with "invalid usage").
            bound = device.type == "cuda" and _bound_to_one_gpu(local_world)
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=device if device.type == "cuda" and not bound else None,
            )
        control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    except (RuntimeError, dist.DistError, ValueError) as exc:
        raise UserError(
            f"rank {rank} of {world}: could not join the process group at "
            f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}: "
            f"{str(exc).strip().splitlines()[0][:200]}"
        ) from exc
    cluster = Cluster(rank, world, local_rank, local_world, device, backend, control, cfg.timeout_seconds)
    if world > 1:
        _node_layout(cluster)
    if rank == 0 and os.environ.get(RANK_ZERO_MARKER):
        open(os.environ[RANK_ZERO_MARKER], "a").close()
    return cluster


def _meet_at_rank_zero(rank: int, world: int, timeout_seconds: float) -> None:
    """Ranks started without a launcher (srun's tasks) meet at the store rank 0's process opens on
    MASTER_PORT. c10d alone waits for a missing rank 0 about twice the timeout, with native stack
    dumps, and without end at a port another program holds: rank 0 first checks that the port is
    free, the others wait, up to the timeout, for a store to answer there."""
    addr = os.environ["MASTER_ADDR"]
    try:
        port = int(os.environ["MASTER_PORT"])
    except ValueError as exc:
        raise UserError(f"rank {rank} of {world}: MASTER_PORT is not a port number ({exc})") from exc
    if rank == 0:
        if not port_is_free(port):
            raise UserError(f"rank 0 of {world}: {port_held_line(addr, port, probe_port(addr, port))}")
        return
    answer = wait_for_store(addr, port, timeout_seconds)
    if answer.kind == "nothing":
        raise UserError(
            f"rank {rank} of {world}: no rendezvous store answered at {addr}:{port} within {timeout_seconds:g} s "
            "(--timeout-seconds): task 0 did not start, or MASTER_ADDR/MASTER_PORT do not name its node"
        )
    if answer.kind != "store":
        raise UserError(f"rank {rank} of {world}: {port_held_line(addr, port, answer)}")


def _node_layout(cluster: Cluster) -> None:
    """Every node runs as many processes (the plan, the memory plan and rank slicing assume it), each
    on a GPU of its own; otherwise every rank refuses, naming two of them."""
    layouts: list[tuple[int, str]] = [(0, "")] * cluster.world_size
    with cluster.guard("comparing the nodes' process counts and GPUs"):
        dist.all_gather_object(layouts, (cluster.local_world_size, _gpu_id(cluster.device)), group=cluster.control)
    problem = layout_problem(layouts)
    if problem is not None:
        raise UserError(problem)


def layout_problem(layouts: list[tuple[int, str]]) -> str | None:
    """What is wrong with the ranks' (processes on their node, GPU identity) pairs, or None."""
    counts = [count for count, _ in layouts]
    other = next((rank for rank, count in enumerate(counts) if count != counts[0]), None)
    if other is not None:
        return (
            f"the nodes run different numbers of processes: rank 0's node {counts[0]}, rank {other}'s node "
            f"{counts[other]} (set GPUS_PER_NODE / --nproc-per-node alike on every node)"
        )
    first_on: dict[str, int] = {}
    for rank, (_, gpu) in enumerate(layouts):
        if gpu and gpu in first_on:
            return (
                f"ranks {first_on[gpu]} and {rank} run on the same GPU ({gpu}): one GPU per process (bind one to "
                "each task, srun --gpus-per-task=1, or let every process see all the node's GPUs)"
            )
        first_on.setdefault(gpu, rank)
    return None


# -- the rendezvous port -------------------------------------------------------------------------
# c10d's TCPStore protocol (QueryType and the magic number in torch's c10d/TCPStoreBackend.hpp): a
# client first sends VALIDATE with the magic number; PING then has the store send back the nonce it
# carries. Whatever else holds the port answers otherwise, or not at all.
_STORE_VALIDATE, _STORE_PING, _STORE_MAGIC = 0, 13, 0x3C85F7CE
_PROBE_NONCE = 0x6D726C64  # no newline byte: a line-based server (HTTP) keeps waiting, it does not answer
STORE_PROBE_SECONDS = 2.0  # a store answers a ping within milliseconds
STORE_RETRY_SECONDS = 0.5


@dataclass(frozen=True)
class PortAnswer:
    """What is at a rendezvous address: ``"store"`` (a c10d store answered), ``"nothing"`` (refused,
    unreachable), ``"silent"`` (a program that took the connection but gave no store's answer) or
    ``"other"`` (a program that answered otherwise); ``said``: how, for the line."""

    kind: str
    said: str = ""


def probe_port(addr: str, port: int, seconds: float = STORE_PROBE_SECONDS) -> PortAnswer:
    """Ask ``addr:port`` for a store's answer to a ping, waiting up to ``seconds`` for each step."""
    try:
        conn = socket.create_connection((addr, port), timeout=seconds)
    except OSError:
        return PortAnswer("nothing")
    with conn:
        try:
            conn.sendall(struct.pack("=BIBI", _STORE_VALIDATE, _STORE_MAGIC, _STORE_PING, _PROBE_NONCE))
            answer = b""
            while len(answer) < 4:
                chunk = conn.recv(64)
                if not chunk:
                    return PortAnswer("silent", "it closed the connection without answering as a rendezvous store")
                answer += chunk
        except socket.timeout:
            return PortAnswer("silent", "it accepted a connection but never answered as a rendezvous store")
        except OSError as exc:
            return PortAnswer("silent", f"it broke the connection ({exc.strerror or exc})")
    if struct.unpack("=I", answer[:4])[0] == _PROBE_NONCE:
        return PortAnswer("store")
    text = " ".join(answer.decode("ascii", "replace").split())[:60]
    return PortAnswer("other", f"it answered {text!r}")


def wait_for_store(addr: str, port: int, seconds: float) -> PortAnswer:
    """Probe ``addr:port`` until a store answers, another program answers something, or ``seconds``
    have passed (the last answer then: nothing, or a program silent as a store)."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        answer = probe_port(addr, port, max(min(STORE_PROBE_SECONDS, left), 0.1))
        if answer.kind in ("store", "other"):
            return answer
        left = deadline - time.monotonic()
        if left <= 0:
            return answer
        time.sleep(min(STORE_RETRY_SECONDS, left))


def port_is_free(port: int) -> bool:
    """Whether this machine can listen on ``port``, as a c10d store does (every address, the same
    SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def port_held_line(addr: str, port: int, answer: PortAnswer) -> str:
    """The line for a rendezvous port that another program holds."""
    said = (
        "it answers as a rendezvous store: another job's, or an earlier run's still going"
        if answer.kind == "store"
        else answer.said
    )
    return (
        f"MASTER_PORT {port} on {addr} is held by another program{f' ({said})' if said else ''}: stop it, or "
        "give every node another MASTER_PORT"
    )
