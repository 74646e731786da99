"""The memory plan: what one process of a run needs, made before anything is allocated.

Per process (rank), in device memory unless stated: the embedding tables by placement (TorchRec's
planner lays them out for the target world size; fp32 rows + one row-wise Adagrad value per row on
the fullest rank; ``uvm`` tables live in host memory, ``uvm_caching`` ones too plus an HBM cache
of ``CACHE_LOAD_FACTOR`` of their rows; the plain backend keeps every table on every rank), the
dense model (weights, gradients, Adam state, DDP buckets), a headroom share of the device, and the
step's peak: the largest of its three phases (``lookup``: the batch, ids, looked-up rows and the
all-to-all send buffer; ``chunks``: looked-up rows, their gradients and one chunk's activations;
``update``: looked-up rows, their gradients and the all-to-all gradients received).

Choice (where ``model.recompute`` is auto or ``train.chunks`` is 0; fixed values are honoured): the
fitting (recompute, chunks) pair with the smallest estimated step time, ``RECOMPUTE_COST[mode] x
chunk_efficiency(samples per chunk)``. When the tables do not fit and the config leaves a table's
placement open, the contextual cross tables move to ``uvm`` one at a time, largest first, until a
pair fits. ``MemoryPlan.resolve`` writes the choice into the config the run goes on with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, NUM_CONTEXTUAL
from dlrmv4.distributed import check_batch_splits
from dlrmv4.errors import UserError
from dlrmv4.model.dtypes import DTYPES
from dlrmv4.model.embeddings.sharding import (
    DEFAULT_SHARDING,
    PLACEMENTS,
    SHARDING_TYPES,
    format_table_options,
    parse_table_options,
    plan_shards,
    table_options,
    target_plan,
)
from dlrmv4.model.embeddings.tables import TABLE_NAMES
from dlrmv4.ops.stu_layer import RECOMPUTE_MODES
from dlrmv4.train.activation_memory import DTYPE_BYTES, ActivationShape, ChunkActivations, chunk_activations

GIB = 1 << 30
MIB = 1 << 20
# Relative step time of each recompute mode: the reference model's whole step at batch 256 on an
# H100 (benchmarks/results/end_to_end_recompute.md: 1,665 / 1,514 / 1,388 samples/s).
RECOMPUTE_COST = {"none": 1.0, "cheap": 1.10, "layer": 1.20}
# Training samples/s of the whole step by per-GPU batch (chunk samples), the reference model on one
# H200 (benchmarks/results/end_to_end.md).
CHUNK_RATE = ((32, 1_132.0), (64, 1_626.0), (128, 1_723.0), (256, 1_755.0), (512, 1_750.0))
# One id per sample each: cheap to serve from host memory. item/artist/album/uid never move by themselves.
MOVABLE_TABLES = CONTEXTUAL_FEATURES[1:]
# Relative step time per table served from host memory: a slice's 1,024 rows of 2 KiB over the host
# link, forward and update, against a step of about 0.6 s; it only breaks ties toward HBM.
UVM_COST = 0.001
# Share of a uvm_caching table's rows cached in HBM (FBGEMM's and TorchRec's default).
CACHE_LOAD_FACTOR = 0.2
# Host memory of one process besides its uvm tables: runtime, CUDA context, loader, pinned buffers.
PROCESS_HOST_BYTES = 4 * GIB
# Yambda-5B's base tables (SPEC §9) when no store is prepared yet.
YAMBDA_5B_COUNTS = (9_390_624, 1_293_395, 3_367_692)
PHASES = ("lookup", "chunks", "update")
SHARED_TABLES = 3  # item, artist, album: history and candidate rows
HISTORY_RESERVED = 9  # max_seq_len = history + 8 contextual + 1 candidate
PLANNER_UNLIMITED = 1 << 60


def chunk_efficiency(samples: int) -> float:
    """Relative step time of a chunk of ``samples`` against the best measured batch (1.0 from 256
    samples up); log2-linear between the measured points, proportional to the batch below 32."""
    best = max(rate for _, rate in CHUNK_RATE)
    if samples >= CHUNK_RATE[3][0]:
        return 1.0
    if samples <= CHUNK_RATE[0][0]:
        return best / (CHUNK_RATE[0][1] * max(samples, 1) / CHUNK_RATE[0][0])
    for (b0, r0), (b1, r1) in zip(CHUNK_RATE, CHUNK_RATE[1:]):
        if samples <= b1:
            t = (math.log2(samples) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return best / (r0 + t * (r1 - r0))
    return 1.0


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
class _Attempt:
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


@dataclass(frozen=True)
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
    fits: bool
    host_needed: int  # per node
    hbm_cap: int | None
    problem: str  # empty when it fits
    knobs: tuple[str, ...]
    checkpoint_staging: int = 0  # host bytes per process an asynchronous checkpoint copies the state into

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

    def describe(self) -> str:
        t = self.target
        where = "GPU" if t.device_kind == "cuda" else "CPU (device memory = this process's share of RAM)"
        lines = [
            f"memory plan for {self.dataset}: {_count(t.world_size, 'process', 'processes')}, "
            f"{t.gpus_per_node:,} per node, on "
            f"{where}: {_gib(t.device_memory)} GiB per process, {_gib(t.host_memory)} GiB host per node; "
            f"{self.backend} embeddings",
            f"  global batch {self.global_batch:,}: {self.samples_per_rank:,} samples per process, at most "
            f"{self.max_seq_len:,} tokens each",
            f"  {'table':<18}{'rows':>13}  {'placement':<12}{'device GiB':>11}{'host GiB':>10}"
            "   (one process, the fullest)",
        ]
        for u in self.tables:
            lines.append(
                f"  {u.name:<18}{u.rows:>13,}  {u.placement:<12}{_gib(u.device_bytes):>11}{_gib(u.host_bytes):>10}"
            )
        lines.append(
            f"  {'all tables':<18}{sum(u.rows for u in self.tables):>13,}  {'':<12}"
            f"{_gib(sum(u.device_bytes for u in self.tables)):>11}"
            f"{_gib(sum(u.host_bytes for u in self.tables)):>10}"
        )
        lines.append("  device memory per process:")
        for use in self.consumers():
            phases = f"  [{', '.join(use.phases)}]" if use.phases else ""
            lines.append(f"    {use.name:<86}{_gib(use.bytes):>9} GiB{phases}")
        peaks = self.phase_bytes()
        lines.append(
            "    the step's peak, the largest of its phases: "
            + ", ".join(f"{p} {_gib(b)}" for p, b in peaks.items())
            + " GiB"
        )
        lines.append(
            f"    {'total: the run-long consumers + the step peak':<86}"
            f"{_gib(self.candidate.device_total):>9} GiB of {_gib(t.device_memory)}"
        )
        if t.device_kind == "cuda":
            per_rank = max((sum(u.host_bytes for u in self.tables)), 0)
            staging = f" + {_gib(self.checkpoint_staging)} GiB of checkpoint staging" if self.checkpoint_staging else ""
            lines.append(
                f"  host memory per node: {t.gpus_per_node} x ({_gib(per_rank)} GiB of tables{staging} + "
                f"{_gib(PROCESS_HOST_BYTES)} GiB per process) = {_gib(self.host_needed)} GiB of "
                f"{_gib(t.host_memory)}"
            )
        c = self.candidate
        lines.append(
            f"  choice: recompute {c.recompute}, {_count(c.chunks, 'chunk', 'chunks')} of at most "
            f"{c.activations.samples:,} samples, estimated step time {c.estimate:.3f} x the best case"
        )
        if self.runner_up is not None:
            r = self.runner_up
            lines.append(
                f"    best with another recompute mode: {r.recompute}, {_count(r.chunks, 'chunk', 'chunks')}, "
                f"{r.estimate:.3f}"
            )
        if self.hbm_cap is not None:
            lines.append(
                f"    TorchRec's planner gets the tables' share of the device: hbm_cap_gib "
                f"{self.hbm_cap / GIB:.3f}, no reservation"
            )
        if self.fits:
            lines.append(f"  verdict: fits, {_gib(t.device_memory - c.device_total)} GiB to spare per process")
        else:
            lines.append(f"  verdict: does not fit: {self.problem}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line for a run's log (``python -m dlrmv4 plan`` prints the whole plan)."""
        c, t = self.candidate, self.target
        moved = [u.name for u in self.tables if u.placement in ("uvm", "uvm_caching")]
        host = f", {', '.join(moved)} in host memory" if moved else ""
        return (
            f"memory plan: {_count(c.chunks, 'chunk', 'chunks')} of at most {c.activations.samples:,} samples, "
            f"recompute {c.recompute}{host}; {_gib(c.device_total)} of {_gib(t.device_memory)} GiB per process "
            "(python -m dlrmv4 plan with the same flags prints the whole plan)"
        )

    def refusal(self) -> str:
        """One line: why the run cannot fit and what would make it fit."""
        if self.fits:
            return ""
        return f"the memory plan does not fit: {self.problem}; to fit: {'; '.join(self.knobs)}"

    def resolve(self, cfg: BenchmarkConfig) -> BenchmarkConfig:
        """``cfg`` with the plan's choices filled in (chunks, recompute; for TorchRec the sharding,
        placement and the tables' HBM cap where the config left them open)."""
        if not self.fits:
            raise ValueError("resolve() of a memory plan that does not fit")
        model = dataclasses.replace(cfg.model, recompute=self.recompute) if cfg.model.recompute == "auto" else cfg.model
        train = dataclasses.replace(cfg.train, chunks=self.chunks) if cfg.train.chunks == 0 else cfg.train
        emb = cfg.embeddings
        if self.backend == "torchrec":
            changes: dict[str, Any] = {}
            if self.sharding and len(parse_table_options(emb.sharding_types, "sharding_types", SHARDING_TYPES)) < len(
                TABLE_NAMES
            ):
                changes["sharding_types"] = format_table_options(self.sharding)
            if self.placement and len(parse_table_options(emb.placement, "placement", tuple(PLACEMENTS))) < len(
                TABLE_NAMES
            ):
                changes["placement"] = format_table_options(self.placement)
            if self.hbm_cap is not None and emb.hbm_cap_gib == 0:
                changes["hbm_cap_gib"] = self.hbm_cap / GIB
            emb = dataclasses.replace(emb, **changes)
        return dataclasses.replace(cfg, model=model, train=train, embeddings=emb)


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


# -- the plan -------------------------------------------------------------------------------------


def make_memory_plan(
    cfg: BenchmarkConfig,
    *,
    world_size: int,
    gpus_per_node: int,
    device_kind: str,
    device_memory_bytes: int,
    host_memory_bytes: int,
    table_counts: tuple[int, int, int],
    backend: str | None = None,
    suggest: bool = True,
) -> MemoryPlan:
    """The plan for ``world_size`` processes of ``device_kind`` ("cuda" or "cpu"); pure: nothing is
    allocated and no process group is needed. ``backend`` None: the config's, auto as a run resolves
    it (TorchRec when it imports and there are several processes). ``suggest``: search a world size
    that fits for the refusal."""
    from dlrmv4.model.embeddings import table_specs

    backend = backend or target_backend(cfg, world_size)
    gbs = cfg.loader.batch_size
    check_batch_splits(gbs, world_size)
    emb = cfg.embeddings
    if backend == "plain" and (emb.sharding_types or emb.placement):
        raise UserError(
            "embeddings.sharding_types and placement are TorchRec settings: the plain backend "
            "keeps a replica of every table on each rank"
        )
    target = Target(
        world_size,
        max(1, min(gpus_per_node, world_size)),
        device_kind,
        int(device_memory_bytes),
        int(host_memory_bytes),
        cfg.plan.plan_headroom_fraction,
    )
    rows = {s.name: s.rows for s in table_specs(cfg, *table_counts)}
    static = [
        _dense(cfg, world_size),
        Consumer(
            f"headroom ({cfg.plan.plan_headroom_fraction:.0%} of the device)",
            int(cfg.plan.plan_headroom_fraction * device_memory_bytes),
        ),
    ]
    step = _step_consumers(cfg, target, backend, rows)
    candidates = _candidate_settings(cfg, gbs // world_size)
    sharding = (
        table_options(emb.sharding_types, "sharding_types", SHARDING_TYPES, DEFAULT_SHARDING)
        if backend == "torchrec"
        else None
    )
    fixed = parse_table_options(emb.placement, "placement", tuple(PLACEMENTS)) if backend == "torchrec" else {}
    placement = None
    if backend == "torchrec" and device_kind == "cuda":
        placement = {name: fixed.get(name, "hbm") for name in TABLE_NAMES}
    movable = sorted((n for n in MOVABLE_TABLES if n not in fixed), key=lambda n: -rows[n])

    def attempt(place: dict[str, str] | None) -> _Attempt:
        return _attempt(cfg, target, backend, rows, sharding, place, static, step, candidates)

    def host_bytes(tried: _Attempt) -> int:
        per_process = sum(u.host_bytes for u in tried.tables) + _checkpoint_staging(cfg, tried.tables)
        return target.gpus_per_node * (per_process + PROCESS_HOST_BYTES)

    def host_fits(tried: _Attempt) -> bool:
        return device_kind != "cuda" or host_bytes(tried) <= host_memory_bytes

    def cost(ia: tuple[int, _Attempt]) -> tuple[float, int]:
        i, a = ia
        assert a.best is not None  # only attempts that fit are ranked
        return a.best.estimate * (1 + UVM_COST * i), i

    # Every number of cross tables moved to host memory (largest first); the fastest fitting
    # layout wins, a layout that moves fewer tables on a tie (UVM_COST per table moved).
    attempts = [attempt(placement)]
    if placement is not None and not attempts[0].device_fits:
        for k in range(1, len(movable) + 1):
            attempts.append(attempt({**placement, **{name: "uvm" for name in movable[:k]}}))
    fitting = [(i, a) for i, a in enumerate(attempts) if a.device_fits and host_fits(a)]
    if fitting:
        tried = min(fitting, key=cost)[1]
    else:
        tried = next((a for a in attempts if a.device_fits), attempts[-1])
    host_needed = host_bytes(tried)
    host_ok = host_fits(tried)
    fits = tried.device_fits and host_ok
    chosen = tried.best if tried.best is not None else tried.smallest
    runner_up = None
    if fits:
        others = [
            c for c in tried.candidates if c.device_total <= device_memory_bytes and c.recompute != chosen.recompute
        ]
        runner_up = min(others, key=_rank) if others else None
    plan = MemoryPlan(
        cfg.dataset.name,
        target,
        backend,
        gbs,
        cfg.sampler.max_seq_len,
        tried.tables,
        sharding,
        tried.placement,
        tuple(static),
        tuple(step),
        chosen,
        runner_up,
        fits,
        host_needed,
        tried.hbm_cap if tried.device_fits else None,
        "",
        (),
        checkpoint_staging=_checkpoint_staging(cfg, tried.tables),
    )
    if fits:
        return plan
    problem, knobs = _diagnose(plan, cfg, tried, host_ok, table_counts, suggest)
    return dataclasses.replace(plan, problem=problem, knobs=tuple(knobs))


def target_backend(cfg: BenchmarkConfig, world_size: int) -> str:
    """The embedding backend a run of ``world_size`` processes resolves (model/embeddings/backend.py
    ``resolve_backend``: auto is TorchRec where it imports and a process group exists)."""
    choice = cfg.embeddings.embedding_backend
    if choice != "auto":
        return choice
    importable = all(importlib.util.find_spec(m) is not None for m in ("torchrec", "fbgemm_gpu"))
    return "torchrec" if world_size > 1 and importable else "plain"


def _rank(c: Candidate) -> tuple:
    return (round(c.estimate, 9), c.chunks, RECOMPUTE_MODES.index(c.recompute))


def _candidate_settings(cfg: BenchmarkConfig, samples: int) -> list[tuple[str, int]]:
    """(recompute, chunks) pairs to try: fixed values as given, else every mode and every chunk
    count that changes the largest chunk's size."""
    modes = RECOMPUTE_MODES if cfg.model.recompute == "auto" else (cfg.model.recompute,)
    if cfg.train.chunks:
        counts = [cfg.train.chunks]
    else:
        counts, seen = [], set()
        for n in range(1, samples + 1):
            size = -(-samples // n)
            if size not in seen:
                seen.add(size)
                counts.append(n)
    return [(m, n) for m in modes for n in counts]


def _candidate(
    cfg: BenchmarkConfig, target: Target, backend: str, mode: str, chunks: int, run_long: int, step: list[Consumer]
) -> Candidate:
    samples = cfg.loader.batch_size // target.world_size
    chunk_samples = -(-samples // max(1, min(chunks, samples)))
    shape = ActivationShape.from_config(cfg.model)
    # TorchRec hands the candidates' rows over in the sequence dtype: the item tower copies them to fp32.
    copy = backend == "torchrec" and shape.dtype_bytes != 4
    act = chunk_activations(
        shape, mode, chunk_samples, cfg.sampler.max_seq_len, NUM_CONTEXTUAL, chunks > 1 and samples > 1, copy
    )
    peak = max(sum(c.bytes for c in step if p in c.phases) + (act.total if p == "chunks" else 0) for p in PHASES)
    return Candidate(mode, chunks, act, run_long + peak, RECOMPUTE_COST[mode] * chunk_efficiency(chunk_samples))


def _attempt(cfg, target, backend, rows, sharding, placement, static, step, candidates) -> _Attempt:
    tables = _table_layout(cfg, target, backend, rows, sharding, placement)
    table_device = sum(u.device_bytes for u in tables)
    run_long = table_device + sum(c.bytes for c in static)
    all_candidates = [_candidate(cfg, target, backend, m, n, run_long, step) for m, n in candidates]
    fitting = [c for c in all_candidates if c.device_total <= target.device_memory]
    best = min(fitting, key=_rank) if fitting else None
    smallest = min(all_candidates, key=lambda c: (c.device_total, _rank(c)))
    hbm_cap, planner_ok = None, True
    if best is not None and backend == "torchrec" and target.device_kind == "cuda":
        # TorchRec's planner in the run gets the device memory the other consumers leave to the
        # tables (or the configured cap), and no reservation: check that it finds the same plan.
        hbm_cap = (
            int(cfg.embeddings.hbm_cap_gib * GIB)
            if cfg.embeddings.hbm_cap_gib > 0
            else (target.device_memory - (best.device_total - table_device)) // MIB * MIB
        )
        planner_ok = _planner_plan(cfg, target, rows, sharding, placement, hbm_cap) is not None
    return _Attempt(placement, tables, tuple(all_candidates), best, smallest, hbm_cap, planner_ok)


def _planner_plan(cfg, target: Target, rows, sharding, placement, hbm_cap: int | None):
    out = DTYPES[cfg.model.sequence_dtype] if target.device_kind == "cuda" else torch.float32
    return target_plan(
        rows,
        cfg.model.embedding_dim,
        sharding,
        placement,
        world_size=target.world_size,
        local_world_size=target.gpus_per_node,
        compute_device=target.device_kind,
        hbm_cap_bytes=hbm_cap if target.device_kind == "cuda" else None,
        ddr_cap_bytes=PLANNER_UNLIMITED,
        output_dtype=out,
    )


def _table_layout(cfg, target: Target, backend: str, rows: dict[str, int], sharding, placement) -> tuple[TableUse, ...]:
    """Per table, the fullest rank's device and host bytes (fp32 rows + row-wise Adagrad state)."""
    dim = cfg.model.embedding_dim
    if backend == "plain":
        return tuple(TableUse(n, r, "replicated", r * dim * 4 + r * 4, 0) for n, r in rows.items())
    plan = _planner_plan(cfg, target, rows, sharding, placement, PLANNER_UNLIMITED)
    if plan is None:
        raise UserError(
            f"TorchRec's planner found no layout for these tables on {target.world_size:,} rank(s) "
            "(embeddings.sharding_types)"
        )
    kernels = {v: k for k, v in PLACEMENTS.items()}
    device: dict[int, dict[str, int]] = {}
    host: dict[int, dict[str, int]] = {}
    for shard in plan_shards(plan):
        where = kernels.get(shard.kernel, "hbm") if target.device_kind == "cuda" else "memory"
        on_device = {"uvm": 0, "uvm_caching": math.ceil(CACHE_LOAD_FACTOR * shard.rows) * shard.cols * 4}
        dev = on_device.get(where, shard.bytes)
        device.setdefault(shard.rank, {}).setdefault(shard.table, 0)
        device[shard.rank][shard.table] += dev
        host.setdefault(shard.rank, {}).setdefault(shard.table, 0)
        host[shard.rank][shard.table] += shard.bytes if where in ("uvm", "uvm_caching") else 0
    fullest = max(range(target.world_size), key=lambda r: (sum(device.get(r, {}).values()), -r))
    host_rank = max(range(target.world_size), key=lambda r: (sum(host.get(r, {}).values()), -r))
    return tuple(
        TableUse(
            n,
            rows[n],
            placement[n] if placement else "memory",
            device.get(fullest, {}).get(n, 0),
            host.get(host_rank, {}).get(n, 0),
        )
        for n in rows
    )


def _dense_parameters(cfg: BenchmarkConfig) -> int:
    from dlrmv4.model.hstu import DlrmHSTU

    with torch.device("meta"):
        return sum(p.numel() for p in DlrmHSTU(cfg.model).parameters())


def _checkpoint_staging(cfg: BenchmarkConfig, tables: tuple[TableUse, ...]) -> int:
    """Host memory an asynchronous checkpoint copies a process's state into: its tables as planned
    (a cached table's whole host copy, not its cache) and the dense weights with Adam's two moments
    (12 B a parameter)."""
    if not cfg.train.async_checkpoints:
        return 0
    table_bytes = sum(u.host_bytes if u.placement.startswith("uvm") else u.device_bytes for u in tables)
    return table_bytes + 12 * _dense_parameters(cfg)


def _dense(cfg: BenchmarkConfig, world_size: int) -> Consumer:
    """Weights, gradients and Adam's two moments in fp32 (16 B per parameter), + the DDP buckets."""
    params = _dense_parameters(cfg)
    per = 16 + (4 if world_size > 1 else 0)
    what = "weights, gradients, Adam" + (", DDP buckets" if world_size > 1 else "")
    return Consumer(f"dense model: {params:,} parameters ({what})", params * per)


def _rows_served(cfg: BenchmarkConfig, world_size: int, history: int, samples: int, table_rows: dict[str, int]) -> int:
    """The most rows one rank may serve in a step's all-to-all: every rank may ask it for all of
    its ids (a table it holds alone, or ids that all fall in its row-wise block, as the popular ones
    may; seen on 4 GPUs). With the ids deduplicated (``embeddings.dedup_ids``) a rank asks for each
    row at most once, so a table's share is also at most the rows each rank holds of it."""
    sharding = table_options(cfg.embeddings.sharding_types, "sharding_types", SHARDING_TYPES, DEFAULT_SHARDING)
    served = world_size * samples * (SHARED_TABLES + NUM_CONTEXTUAL)  # candidates and contextual ids
    for name in TABLE_NAMES[:SHARED_TABLES]:
        asked = world_size * history
        if cfg.embeddings.dedup_ids:
            held = -(-table_rows[name] // world_size) if sharding[name] == "row_wise" else table_rows[name]
            asked = min(asked, world_size * held)
        served += asked
    return served


def _step_consumers(cfg: BenchmarkConfig, target: Target, backend: str, table_rows: dict[str, int]) -> list[Consumer]:
    """The slice's batch, ids, looked-up rows, their gradients and the embedding communication (on
    the rank that serves the most rows)."""
    samples = cfg.loader.batch_size // target.world_size
    length, e = cfg.sampler.max_seq_len, cfg.model.embedding_dim
    history = samples * (length - HISTORY_RESERVED)
    rows = SHARED_TABLES * (history + samples) + NUM_CONTEXTUAL * samples
    s = DTYPE_BYTES[cfg.model.sequence_dtype]
    name = cfg.model.sequence_dtype
    # The batch (int64 ids and timestamps, uint8 actions) twice: the prefetcher copies the next one ahead.
    batch = 2 * (history * (SHARED_TABLES * 8 + 8 + 1) + samples * (NUM_CONTEXTUAL * 8 + SHARED_TABLES * 8 + 64))
    out = [
        Consumer("the batch (and the next one, prefetched) and the lookup's ids", batch + 2 * rows * 8, PHASES),
        Consumer(f"looked-up rows, {name} ({rows:,} rows x {e})", rows * e * s, PHASES),
        Consumer(f"their gradients, {name}", rows * e * s, ("chunks", "update")),
    ]
    if backend == "torchrec" and target.world_size > 1:
        # Without qcomm the all-to-all carries the lookup's output dtype (the sequence dtype on GPUs).
        c = 2 if cfg.embeddings.qcomm != "none" else (s if target.device_kind == "cuda" else 4)
        comm = cfg.embeddings.qcomm if cfg.embeddings.qcomm != "none" else ("fp32" if c == 4 else name)
        served = _rows_served(cfg, target.world_size, history, samples, table_rows)
        out += [
            Consumer(
                f"embedding all-to-all send buffer, {comm} (up to {served:,} rows served)", served * e * c, ("lookup",)
            ),
            Consumer(f"embedding all-to-all gradients received for them, {comm}", served * e * c, ("update",)),
        ]
    if backend == "plain":
        cand = samples * SHARED_TABLES * e * 4
        out.append(Consumer("the candidates' fp32 rows and their gradient", 2 * cand, PHASES))
        # The update sums each row's gradients in fp32; on several ranks every rank's rows are gathered.
        gathered = rows * e * 4 * (1 + (target.world_size if target.world_size > 1 else 0))
        out.append(
            Consumer(
                "the sparse update's fp32 gradients" + (" (all ranks', gathered)" if target.world_size > 1 else ""),
                gathered,
                ("update",),
            )
        )
    return out


def _diagnose(
    plan: MemoryPlan,
    cfg: BenchmarkConfig,
    tried: _Attempt,
    host_ok: bool,
    table_counts: tuple[int, int, int],
    suggest: bool,
) -> tuple[str, list[str]]:
    t = plan.target
    unit = "GPU" if t.device_kind == "cuda" else "process"
    in_host = [u.name for u in plan.tables if u.host_bytes]
    if tried.device_fits and not host_ok:
        per_rank = sum(u.host_bytes for u in plan.tables)
        consumers = {"tables in host memory": per_rank, "checkpoint staging": plan.checkpoint_staging}
        largest = max(consumers, key=lambda name: consumers[name])
        where = f" with {', '.join(in_host)} in host memory" if in_host else ""
        staging = ["blocking checkpoints, which need no staging copy (--async-checkpoints false)"]
        return (
            f"{plan.dataset} fits the GPUs{where}, but that needs {_gib(plan.host_needed)} GiB of host "
            f"memory per node of {_gib(t.host_memory)} GiB (the largest consumer: {largest}, "
            f"{_gib(consumers[largest])} GiB per process x {t.gpus_per_node} per node)",
            _more_gpus(cfg, plan, table_counts, suggest)
            + ["fewer processes per node (--plan-gpus-per-node) or more host memory (--plan-host-memory-gib)"]
            + (staging if plan.checkpoint_staging else []),
        )
    c = plan.candidate
    big = plan.largest_consumer()
    problem = (
        f"{plan.dataset} needs {_gib(c.device_total)} GiB per {unit} of {_gib(t.device_memory)} GiB "
        f"({_count(t.world_size, unit, unit + 'es' if unit == 'process' else unit + 's')}, "
        f"{plan.samples_per_rank:,} samples each; at best: recompute {c.recompute}, "
        f"{_count(c.chunks, 'chunk', 'chunks')}"
        + (f", {', '.join(in_host)} in host memory" if in_host else "")
        + f"); the largest consumer: {big.name}, {_gib(big.bytes)} GiB"
    )
    if tried.best is not None and not tried.planner_ok:
        problem += (
            f"; TorchRec's planner finds no layout within the tables' HBM cap {_gib(tried.hbm_cap or 0)} GiB "
            "(embeddings.hbm_cap_gib)"
        )
    knobs = []
    if plan.backend == "plain":
        knobs += _more_gpus(cfg, plan, table_counts, suggest, backend="torchrec")
    else:
        knobs += _more_gpus(cfg, plan, table_counts, suggest)
        if t.device_kind == "cuda":
            in_hbm = sorted(
                (u for u in plan.tables if u.placement == "hbm" and u.device_bytes), key=lambda u: -u.device_bytes
            )[:3]
            if in_hbm:
                knobs.append(
                    "--placement '" + ",".join(f"{u.name}=uvm_caching" for u in in_hbm) + "' (tables in host memory)"
                )
    if cfg.train.chunks:
        knobs.append(f"--chunks 0 (the plan picks) or more than {cfg.train.chunks:,}")
    if cfg.model.recompute not in ("auto", "layer"):
        knobs.append("--recompute layer (or auto)")
    if t.device_kind == "cpu":
        knobs.append(f"a machine with more memory ({_gib(t.device_memory)} GiB available per process here)")
    return problem, knobs


def _more_gpus(
    cfg: BenchmarkConfig, plan: MemoryPlan, table_counts, suggest: bool, backend: str | None = None
) -> list[str]:
    """ "more GPUs", with the smallest world size that fits (doubling, at most 64 x) when found."""
    t = plan.target
    unit = "GPUs" if t.device_kind == "cuda" else "processes"
    switch = "--embedding-backend torchrec with " if backend else ""
    if suggest:
        world = t.world_size
        for _ in range(6):
            world *= 2
            if cfg.loader.batch_size % world:
                break
            try:
                bigger = make_memory_plan(
                    cfg,
                    world_size=world,
                    gpus_per_node=min(world, max(t.gpus_per_node, 8)),
                    device_kind=t.device_kind,
                    device_memory_bytes=t.device_memory,
                    host_memory_bytes=t.host_memory,
                    table_counts=table_counts,
                    backend=backend or plan.backend,
                    suggest=False,
                )
            except UserError:
                break
            if bigger.fits:
                return [f"{switch}{world:,} {unit} or more (--plan-world-size {world}; launch {world} processes)"]
    return [f"{switch}more {unit} (--plan-world-size N; launch more processes)"]


# -- defaults from the config and this machine ---------------------------------------------------


def table_counts_for(cfg: BenchmarkConfig) -> tuple[int, int, int]:
    """(items, artists, albums): from the prepared store, else Yambda-5B's published counts, else
    the configured row counts."""
    from dlrmv4.data.paths import store_dir
    from dlrmv4.data.store import META_FILE, open_store
    from dlrmv4.model.embeddings import store_table_counts

    path = store_dir(cfg.dataset)
    if (path / META_FILE).exists():
        return store_table_counts(open_store(path))
    if cfg.dataset.name == "yambda-5b":
        return YAMBDA_5B_COUNTS
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


def plan_for_run(cfg: BenchmarkConfig, cluster, table_counts: tuple[int, int, int]) -> MemoryPlan:
    """The plan of this run: its world size, processes per node, device and embedding backend;
    memory sizes from the [plan] fields where set, else this machine's."""
    from dlrmv4.model.embeddings import resolve_backend

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
    host = int(p.plan_host_memory_gib * GIB) if p.plan_host_memory_gib > 0 else _meminfo("MemTotal")
    return make_memory_plan(
        cfg,
        world_size=world,
        gpus_per_node=per_node,
        device_kind=kind,
        device_memory_bytes=device_memory,
        host_memory_bytes=host,
        table_counts=table_counts,
        backend=backend,
    )


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
