"""The plan for this machine and this run: the [plan] fields, 0s filled from the launcher's
environment, the GPU's memory, /proc/meminfo and the run directory's free disk, and the tables' sizes
from the prepared store.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import META_FILE, open_store
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings import resolve_backend, store_table_counts
from dlrmv4.plan.costs import GIB
from dlrmv4.plan.disk import free_bytes
from dlrmv4.plan.memory_plan import MemoryPlan
from dlrmv4.plan.search import make_memory_plan
from dlrmv4.reference_counts import YAMBDA_5B_TABLE_COUNTS


def table_counts_for(cfg: BenchmarkConfig) -> tuple[int, int, int]:
    """(items, artists, albums): from the prepared store, else Yambda-5B's published counts, else
    the configured row counts."""
    path = store_dir(cfg.dataset)
    if (path / META_FILE).exists():
        return store_table_counts(open_store(path))
    if cfg.dataset.name == "yambda-5b":
        return YAMBDA_5B_TABLE_COUNTS
    emb = cfg.embeddings
    if emb.item_rows and emb.artist_rows and emb.album_rows:
        return emb.item_rows, emb.artist_rows, emb.album_rows
    raise UserError(
        f"no prepared store at {path} to size the item/artist/album tables: prepare the data "
        "(python -m dlrmv4 prepare with the same flags) or set --item-rows, --artist-rows and --album-rows"
    )


def plan_for_config(cfg: BenchmarkConfig, table_counts: tuple[int, int, int] | None = None) -> MemoryPlan:
    """The plan the ``plan`` command prints: the [plan] fields, 0s filled from the launcher's
    environment and this machine. A device memory given in the config means a GPU target."""
    p = cfg.plan
    world = p.plan_world_size or int(os.environ.get("WORLD_SIZE", "1") or 1)
    per_node = (
        p.plan_gpus_per_node
        or (int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) if not p.plan_world_size else 0)
        or min(world, 8)
    )
    kind = "cuda" if torch.cuda.is_available() or p.plan_device_memory_gib > 0 else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device(kind)
    return _plan_on(cfg, world, per_node, kind, device, table_counts or table_counts_for(cfg), None)


def plan_for_run(cfg: BenchmarkConfig, cluster: Cluster, table_counts: tuple[int, int, int]) -> MemoryPlan:
    """The plan of this run: its world size, processes per node, device and embedding backend;
    memory sizes from the [plan] fields where set, else this machine's."""
    backend = resolve_backend(cfg, cluster.device)
    return _plan_on(
        cfg, cluster.world_size, cluster.local_world_size, cluster.device.type, cluster.device, table_counts, backend
    )


def _plan_on(
    cfg: BenchmarkConfig,
    world: int,
    per_node: int,
    kind: str,
    device: torch.device,
    table_counts: tuple[int, int, int],
    backend: str | None,
) -> MemoryPlan:
    p = cfg.plan
    if p.plan_device_memory_gib > 0:
        device_memory = int(p.plan_device_memory_gib * GIB)
    elif kind == "cuda":
        device_memory = torch.cuda.get_device_properties(device).total_memory
    else:  # the local processes share this machine's RAM
        device_memory = _meminfo("MemAvailable") // max(per_node, 1)
    host = int(p.plan_host_memory_gib * GIB) if p.plan_host_memory_gib > 0 else host_memory()
    disk = int(p.plan_disk_gib * GIB) if p.plan_disk_gib > 0 else free_bytes(cfg.train.run_dir)
    return make_memory_plan(
        cfg,
        world_size=world,
        gpus_per_node=per_node,
        device_kind=kind,
        device_memory_bytes=device_memory,
        host_memory_bytes=host,
        table_counts=table_counts,
        backend=backend,
        disk_free_bytes=disk,
    )


# Where a container's or a SLURM job's memory limit is read: cgroup v2, then v1.
CGROUP_MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory(cgroup_limits: tuple[str, ...] = CGROUP_MEMORY_LIMITS) -> int:
    """The host memory this process's node may use: the machine's, or less where a cgroup limits it
    (a SLURM job given --mem, a container)."""
    total = _meminfo("MemTotal")
    for path in cgroup_limits:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))  # v1 writes a huge number for no limit, v2 "max"
        break
    return total


def _meminfo(key: str) -> int:
    """A /proc/meminfo value in bytes (the physical memory where /proc is missing)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
