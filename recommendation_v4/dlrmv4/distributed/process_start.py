"""How a rank starts: the launcher's environment, its device, joining the process group, and the
checks that every node runs alike.

A run is one process unless a launcher started several: ``torchrun`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (an srun task takes them
from SLURM's own names: ``slurm_tasks.py``); each process then joins the group through ``env://``.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

from dlrmv4.config import DistributedConfig
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.distributed.rendezvous_port import port_held_line, port_is_free, probe_port, wait_for_store
from dlrmv4.errors import UserError

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# A file the process of global rank 0 creates once it has joined: run_and_time.sh's sign that its node
# holds rank 0, which checks the MLPerf log and prints RESULT (torchrun's c10d rendezvous may give
# rank 0 to any node).
RANK_ZERO_MARKER = "DLRMV4_RANK_ZERO_MARKER"


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
