"""The memory plan's values: the target machine, each table's use, each consumer of device memory,
the (recompute, chunks) candidates and the plan itself (built by ``search.make_memory_plan``,
explained by ``explain.py``, written into a config by ``resolve.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlrmv4.plan.activations import ChunkActivations
from dlrmv4.plan.costs import CACHE_LOAD_FACTOR
from dlrmv4.plan.disk import CheckpointDisk

PHASES = ("lookup", "chunks", "update")


@dataclass(frozen=True)
class Target:
    world_size: int
    gpus_per_node: int
    device_kind: str  # "cuda" or "cpu" (on the CPU, device memory is this process's share of RAM)
    device_memory: int  # bytes per process
    host_memory: int  # bytes per node
    headroom_fraction: float


@dataclass(frozen=True)
class TableUse:
    name: str
    rows: int
    placement: str  # hbm, uvm, uvm_caching; "replicated" (plain), "memory" (CPU)
    device_bytes: int  # on the fullest rank
    host_bytes: int


@dataclass(frozen=True)
class Consumer:
    name: str
    bytes: int
    phases: tuple[str, ...] = ()  # empty: held for the whole run


@dataclass(frozen=True)
class Candidate:
    recompute: str
    chunks: int
    activations: ChunkActivations
    device_total: int
    estimate: float


@dataclass(frozen=True)
class Attempt:
    placement: dict[str, str] | None
    tables: tuple[TableUse, ...]
    candidates: tuple[Candidate, ...]
    best: Candidate | None  # the fitting candidate with the smallest estimate
    smallest: Candidate  # the candidate needing the least device memory
    hbm_cap: int | None  # what the run's planner gets (None: no cap is written)
    planner_ok: bool

    @property
    def device_fits(self) -> bool:
        return self.best is not None and self.planner_ok


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    dataset: str
    target: Target
    backend: str
    global_batch: int
    max_seq_len: int
    tables: tuple[TableUse, ...]
    sharding: dict[str, str] | None
    placement: dict[str, str] | None
    static: tuple[Consumer, ...]
    step: tuple[Consumer, ...]  # without the activations (those are the candidate's)
    candidate: Candidate  # the chosen one, or the smallest when nothing fits
    runner_up: Candidate | None
    fits: bool  # device, host memory and disk
    host_needed: int  # per node
    hbm_cap: int | None
    checkpoint_staging: int  # host bytes per process an asynchronous checkpoint copies the state into
    disk: CheckpointDisk  # the checkpoints against the run directory's free space
    short_of: str = ""  # what it does not fit: "memory" (device or host) or "disk"; empty when it fits
    problem: str = ""  # why it does not fit; empty when it fits
    knobs: tuple[str, ...] = ()  # what would make it fit

    @property
    def samples_per_rank(self) -> int:
        return self.global_batch // self.target.world_size

    @property
    def chunks(self) -> int:
        return self.candidate.chunks

    @property
    def recompute(self) -> str:
        return self.candidate.recompute

    def consumers(self) -> list[Consumer]:
        act = self.candidate.activations
        tables = []
        cache = sum(u.device_bytes for u in self.tables if u.placement == "uvm_caching")
        resident = sum(u.device_bytes for u in self.tables) - cache
        what = "fp32 rows + row-wise Adagrad state"
        if self.backend == "plain":
            name = f"tables, a replica of each on every process (plain backend; {what})"
        else:
            name = f"tables {'in HBM' if self.target.device_kind == 'cuda' else 'in memory'} ({what})"
        tables.append(Consumer(name, resident))
        if cache:
            tables.append(
                Consumer(f"HBM cache of the uvm_caching tables ({CACHE_LOAD_FACTOR:.0%} of their rows)", cache)
            )
        return (
            tables
            + list(self.static)
            + list(self.step)
            + [
                Consumer(
                    f"activations of one chunk ({act.samples:,} samples, {act.tokens:,} tokens, recompute "
                    f"{self.candidate.recompute})",
                    act.total,
                    ("chunks",),
                )
            ]
        )

    def phase_bytes(self) -> dict[str, int]:
        return {p: sum(c.bytes for c in self.consumers() if p in c.phases) for p in PHASES}

    def largest_consumer(self) -> Consumer:
        held = [c for c in self.consumers() if not c.name.startswith("headroom")]
        return max(held, key=lambda c: c.bytes)
