"""The memory plan in words: the whole plan (``python -m dlrmv4 plan``), one line for a run's log,
and, when it does not fit, why and what would make it fit.
"""

from __future__ import annotations

from typing import Callable

from dlrmv4.config import BenchmarkConfig
from dlrmv4.errors import UserError
from dlrmv4.plan.costs import GIB, PROCESS_HOST_BYTES
from dlrmv4.plan.disk import describe_disk
from dlrmv4.plan.memory_plan import Attempt, MemoryPlan

# Makes the plan again at (world size, processes per node, backend), without a search of its own.
Replan = Callable[[int, int, str], MemoryPlan]


def describe(plan: MemoryPlan) -> str:
    t = plan.target
    where = "GPU" if t.device_kind == "cuda" else "CPU (device memory = this process's share of RAM)"
    lines = [
        f"memory plan for {plan.dataset}: {_count(t.world_size, 'process', 'processes')}, "
        f"{t.gpus_per_node:,} per node, on "
        f"{where}: {_gib(t.device_memory)} GiB per process, {_gib(t.host_memory)} GiB host per node; "
        f"{plan.backend} embeddings",
        f"  global batch {plan.global_batch:,}: {plan.samples_per_rank:,} samples per process, at most "
        f"{plan.max_seq_len:,} tokens each",
        f"  {'table':<18}{'rows':>13}  {'placement':<12}{'device GiB':>11}{'host GiB':>10}"
        "   (one process, the fullest)",
    ]
    for u in plan.tables:
        lines.append(
            f"  {u.name:<18}{u.rows:>13,}  {u.placement:<12}{_gib(u.device_bytes):>11}{_gib(u.host_bytes):>10}"
        )
    lines.append(
        f"  {'all tables':<18}{sum(u.rows for u in plan.tables):>13,}  {'':<12}"
        f"{_gib(sum(u.device_bytes for u in plan.tables)):>11}"
        f"{_gib(sum(u.host_bytes for u in plan.tables)):>10}"
    )
    lines.append("  device memory per process:")
    for use in plan.consumers():
        phases = f"  [{', '.join(use.phases)}]" if use.phases else ""
        lines.append(f"    {use.name:<86}{_gib(use.bytes):>9} GiB{phases}")
    peaks = plan.phase_bytes()
    lines.append(
        "    the step's peak, the largest of its phases: "
        + ", ".join(f"{p} {_gib(b)}" for p, b in peaks.items())
        + " GiB"
    )
    lines.append(
        f"    {'total: the run-long consumers + the step peak':<86}"
        f"{_gib(plan.candidate.device_total):>9} GiB of {_gib(t.device_memory)}"
    )
    if t.device_kind == "cuda":
        per_rank = max((sum(u.host_bytes for u in plan.tables)), 0)
        staging = f" + {_gib(plan.checkpoint_staging)} GiB of checkpoint staging" if plan.checkpoint_staging else ""
        lines.append(
            f"  host memory per node: {t.gpus_per_node} x ({_gib(per_rank)} GiB of tables{staging} + "
            f"{_gib(PROCESS_HOST_BYTES)} GiB per process) = {_gib(plan.host_needed)} GiB of "
            f"{_gib(t.host_memory)}"
        )
    lines.append(describe_disk(plan.disk))
    c = plan.candidate
    lines.append(
        f"  choice: recompute {c.recompute}, {_count(c.chunks, 'chunk', 'chunks')} of at most "
        f"{c.activations.samples:,} samples, estimated step time {c.estimate:.3f} x the best case"
    )
    if plan.runner_up is not None:
        r = plan.runner_up
        lines.append(
            f"    best with another recompute mode: {r.recompute}, {_count(r.chunks, 'chunk', 'chunks')}, "
            f"{r.estimate:.3f}"
        )
    if plan.hbm_cap is not None:
        lines.append(
            f"    TorchRec's planner gets the tables' share of the device: hbm_cap_gib "
            f"{plan.hbm_cap / GIB:.3f}, no reservation"
        )
    if plan.fits:
        lines.append(f"  verdict: fits, {_gib(t.device_memory - c.device_total)} GiB to spare per process")
    else:
        lines.append(f"  verdict: does not fit: {plan.problem}")
    return "\n".join(lines)


def summary(plan: MemoryPlan) -> str:
    """One line for a run's log (``python -m dlrmv4 plan`` prints the whole plan)."""
    c, t = plan.candidate, plan.target
    moved = [u.name for u in plan.tables if u.placement in ("uvm", "uvm_caching")]
    host = f", {', '.join(moved)} in host memory" if moved else ""
    return (
        f"memory plan: {_count(c.chunks, 'chunk', 'chunks')} of at most {c.activations.samples:,} samples, "
        f"recompute {c.recompute}{host}; {_gib(c.device_total)} of {_gib(t.device_memory)} GiB per process "
        "(python -m dlrmv4 plan with the same flags prints the whole plan)"
    )


def refusal(plan: MemoryPlan) -> str:
    """One line: why the run cannot fit and what would make it fit."""
    if plan.fits:
        return ""
    what = "the run's checkpoints do not fit its disk" if plan.short_of == "disk" else "the memory plan does not fit"
    return f"{what}: {plan.problem}; to fit: {'; '.join(plan.knobs)}"


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def _count(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def diagnose(
    plan: MemoryPlan,
    cfg: BenchmarkConfig,
    tried: Attempt,
    host_ok: bool,
    table_counts: tuple[int, int, int],
    replan: Replan | None,
) -> tuple[str, list[str]]:
    """Why ``plan`` does not fit, in one line, and what would make it fit. ``replan`` (None: no
    search) makes the plan at another world size, to name the smallest that fits."""
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
            _more_gpus(cfg, plan, table_counts, replan)
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
        knobs += _more_gpus(cfg, plan, table_counts, replan, backend="torchrec")
    else:
        knobs += _more_gpus(cfg, plan, table_counts, replan)
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
    cfg: BenchmarkConfig, plan: MemoryPlan, table_counts, replan: Replan | None, backend: str | None = None
) -> list[str]:
    """ "more GPUs", with the smallest world size that fits (doubling, at most 64 x) when found."""
    t = plan.target
    unit = "GPUs" if t.device_kind == "cuda" else "processes"
    switch = "--embedding-backend torchrec with " if backend else ""
    if replan is not None:
        world = t.world_size
        for _ in range(6):
            world *= 2
            if cfg.loader.batch_size % world:
                break
            try:
                bigger = replan(world, min(world, max(t.gpus_per_node, 8)), backend or plan.backend)
            except UserError:
                break
            if bigger.fits:
                return [f"{switch}{world:,} {unit} or more (--plan-world-size {world}; launch {world} processes)"]
    return [f"{switch}more {unit} (--plan-world-size N; launch more processes)"]
