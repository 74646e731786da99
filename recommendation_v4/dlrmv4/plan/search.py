"""The search: for the target machine, every (recompute, chunks) pair and every number of cross
tables moved to host memory; the fastest layout that fits the device and the host wins.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, NUM_CONTEXTUAL
from dlrmv4.distributed.cluster import check_batch_splits
from dlrmv4.errors import UserError
from dlrmv4.model.embeddings.backend import choose_backend, needs_process_group
from dlrmv4.model.embeddings.tables import TABLE_NAMES
from dlrmv4.model.embeddings.torchrec_backend.sharding import (
    DEFAULT_SHARDING,
    PLACEMENTS,
    SHARDING_TYPES,
    parse_table_options,
    table_options,
)
from dlrmv4.ops.stu_layer import RECOMPUTE_MODES
from dlrmv4.plan.activations import ActivationShape, chunk_activations
from dlrmv4.plan.consumers import checkpoint_staging, dense_model, dense_parameters, step_consumers
from dlrmv4.plan.costs import GIB, MIB, PROCESS_HOST_BYTES, RECOMPUTE_COST, UVM_COST, chunk_efficiency
from dlrmv4.plan.disk import checkpoint_disk, disk_problem
from dlrmv4.plan.explain import diagnose
from dlrmv4.plan.memory_plan import PHASES, Attempt, Candidate, Consumer, MemoryPlan, Target
from dlrmv4.plan.tables import planner_plan, table_layout

# One id per sample each: cheap to serve from host memory. item/artist/album/uid never move by themselves.
MOVABLE_TABLES = CONTEXTUAL_FEATURES[1:]


def planned_backend(cfg: BenchmarkConfig, world_size: int) -> str:
    """The backend a run of ``world_size`` processes takes (``choose_backend``, the run's own rule:
    it has a process group when it has several processes or its backend needs one), TorchRec being
    usable where it imports: the plan may be made on a machine without the GPU."""
    has_group = world_size > 1 or needs_process_group(cfg)
    return choose_backend(
        cfg, has_group, lambda: all(importlib.util.find_spec(m) is not None for m in ("torchrec", "fbgemm_gpu"))
    )


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
    disk_free_bytes: int | None = None,
) -> MemoryPlan:
    """The plan for ``world_size`` processes of ``device_kind`` ("cuda" or "cpu"); pure: nothing is
    allocated and no process group is needed. ``backend`` None: the config's, auto as a run resolves
    it (TorchRec when it imports and there are several processes). ``suggest``: search a world size
    that fits for the refusal. ``disk_free_bytes``: the run directory's free space, which a whole
    checkpoint must fit (None: the disk is not checked)."""
    from dlrmv4.model.embeddings import table_specs

    backend = backend or planned_backend(cfg, world_size)
    gbs = cfg.loader.batch_size
    check_batch_splits(gbs, world_size)
    emb = cfg.embeddings
    if backend == "plain" and (emb.sharding_types or emb.placement):
        raise UserError(
            "embeddings.sharding_types and placement are TorchRec settings: the plain backend "
            "keeps a replica of every table on each rank"
        )
    target = Target(
        world_size=world_size,
        gpus_per_node=max(1, min(gpus_per_node, world_size)),
        device_kind=device_kind,
        device_memory=int(device_memory_bytes),
        host_memory=int(host_memory_bytes),
        headroom_fraction=cfg.plan.plan_headroom_fraction,
    )
    rows = {s.name: s.rows for s in table_specs(cfg, *table_counts)}
    static = [
        dense_model(cfg, world_size),
        Consumer(
            f"headroom ({cfg.plan.plan_headroom_fraction:.0%} of the device)",
            int(cfg.plan.plan_headroom_fraction * device_memory_bytes),
        ),
    ]
    step = step_consumers(cfg, target, backend, rows)
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

    def attempt(place: dict[str, str] | None) -> Attempt:
        return _attempt(cfg, target, backend, rows, sharding, place, static, step, candidates)

    def host_bytes(tried: Attempt) -> int:
        per_process = sum(u.host_bytes for u in tried.tables) + checkpoint_staging(cfg, tried.tables)
        return target.gpus_per_node * (per_process + PROCESS_HOST_BYTES)

    def host_fits(tried: Attempt) -> bool:
        return device_kind != "cuda" or host_bytes(tried) <= host_memory_bytes

    def cost(ia: tuple[int, Attempt]) -> tuple[float, int]:
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
    nodes = -(-world_size // target.gpus_per_node)
    disk = checkpoint_disk(cfg, rows, dense_parameters(cfg), nodes, disk_free_bytes)
    fits = tried.device_fits and host_ok and disk.fits
    chosen = tried.best if tried.best is not None else tried.smallest
    runner_up = None
    if fits:
        others = [
            c for c in tried.candidates if c.device_total <= device_memory_bytes and c.recompute != chosen.recompute
        ]
        runner_up = min(others, key=_rank) if others else None
    plan = MemoryPlan(
        dataset=cfg.dataset.name,
        target=target,
        backend=backend,
        global_batch=gbs,
        max_seq_len=cfg.sampler.max_seq_len,
        tables=tried.tables,
        sharding=sharding,
        placement=tried.placement,
        static=tuple(static),
        step=tuple(step),
        candidate=chosen,
        runner_up=runner_up,
        fits=fits,
        host_needed=host_needed,
        hbm_cap=tried.hbm_cap if tried.device_fits else None,
        checkpoint_staging=checkpoint_staging(cfg, tried.tables),
        disk=disk,
    )
    if fits:
        return plan
    if tried.device_fits and host_ok:
        problem, knobs = disk_problem(disk)
        return dataclasses.replace(plan, short_of="disk", problem=problem, knobs=tuple(knobs))

    def replan(world: int, per_node: int, backend: str) -> MemoryPlan:
        return make_memory_plan(
            cfg,
            world_size=world,
            gpus_per_node=per_node,
            device_kind=device_kind,
            device_memory_bytes=device_memory_bytes,
            host_memory_bytes=host_memory_bytes,
            table_counts=table_counts,
            backend=backend,
            suggest=False,
        )

    problem, knobs = diagnose(plan, cfg, tried, host_ok, table_counts, replan if suggest else None)
    return dataclasses.replace(plan, short_of="memory", problem=problem, knobs=tuple(knobs))


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


def _attempt(cfg, target, backend, rows, sharding, placement, static, step, candidates) -> Attempt:
    tables = table_layout(cfg, target, backend, rows, sharding, placement)
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
        planner_ok = planner_plan(cfg, target, rows, sharding, placement, hbm_cap) is not None
    return Attempt(placement, tables, tuple(all_candidates), best, smallest, hbm_cap, planner_ok)
