"""Project the time to AUC 0.75 on 8, 16 and 32 GPUs from measured parts, next to the reference's
2 h 39 min on 8 MI350X.

Measured (files in benchmarks/results/, each naming its device and commit):
- the per-GPU training rate at the reference recipe: ``rehearsal_<gpu>.json`` (1,024 samples per
  GPU in the memory plan's chunks, Yambda-5B's per-rank tables, Zipf ids) for 8 GPUs; for 16 and
  32 GPUs (512 and 256 samples per GPU) the fastest single-chunk rate the same rehearsal measured
  at 256 samples;
- the eval rate: ``train_<gpu>.json`` (the holdout scored by ``python -m dlrmv4 train``, samples/s per GPU);
- the set-up inside the timed region: none, since the kernels' warm-up compiles and autotunes every
  Triton kernel before RUN_START (``warm_up_medium_h200.md``: 0
  kernels compiled after it); with ``--compile-on-the-clock`` (a run with ``--warm-up false``),
  ``stu.json``'s cold start (a fresh process with an empty Triton cache to the end of its first step);
- checkpoints at window ends (the trainer's default cadence) of a rank's share of the 559 GiB of
  tables, asynchronous (the default): ``checkpoint_<gpu>.json`` gives the seconds per GiB the step
  waits for the copy to host memory, how much its loop slows while a write goes on in the
  background (per GiB written), and one writer's rate; a node's ranks share its disk. A
  window-end checkpoint due while the previous write is in flight is skipped, so a save is made
  every ceil(node write / window) windows and the step waits for each save's copy (the buffer is
  pinned before RUN_START) and runs slower during its write. Without that file, blocking saves at
  ``train_<gpu>.json``'s rate;
- delta checkpoints (``train.checkpoint_full_every``, ``--full-every``): a save at every window end
  the disk allows, every K-th whole and the others holding the rows changed since the save before:
  ``delta_rows.json`` gives the share of the busiest rank's block a window changes (``synthetic-1b``'s
  windows, Yambda-5B's tables), ``delta_checkpoint_gpu.json`` (the H200's; the H100's
  ``delta_checkpoint_h100.json``) what the step waits per GiB of a rank's
  tables to find and copy the changed rows; a window end is skipped only while a write is in flight
  (after a whole one), and the next delta then holds the rows of every window since.

The embedding all-to-all: per step each rank receives the rows its samples look up, 1,024 x (mean
tokens x 3 item-side tables + 8 contextual) rows of D = 512 in fp16 (the reference's qcomm), of the
history's rows only the distinct ids' with ``embeddings.dedup_ids`` (their share as
``dedup_ids.json`` counted it at 1,024 samples per rank, ``--distinct-from``),
(W - 1)/W of them from other ranks, and sends as many gradients back. Within a node at the rate
``hot_ids_<label>.json`` measured (``--alltoall-from``: the bytes each rank put on the wire per
step over the device time of its NCCL kernels, uniform ids, two GPUs of one node) or at
``--nvlink-gbs`` GB/s per GPU and direction; across nodes (8 GPUs each) at ``--network-gbs``
(modelled: no multi-node measurement). Shown both not overlapped with compute (an upper bound)
and fully overlapped (a lower bound).

The exchange's work around the wire: TorchRec's sequence all-to-all also permutes and casts every
row and gradient a rank serves and receives, on the same GPU as the step, where nothing hides it.
``--exchange-from`` names a weak-scaling row of ``scaling.json`` at the real per-rank shape (one GPU
against the most GPUs of one node the row ran: two on the H200 row, four on the H100 row, the
defaults of ``--gpu``): the bare step's extra time per step there, less its modelled NCCL time, per
sample of the rank's batch, is counted for each GPU's batch in both totals.


    python benchmarks/projections/project_time_to_train.py                 # H200 parts
    python benchmarks/projections/project_time_to_train.py --gpu h100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

from harness import RESULTS, command_line, write_results

from dlrmv4.reference_counts import REFERENCE_EVAL_SAMPLES, REFERENCE_TRAIN_SAMPLES
from dlrmv4.train.schedule import EvalSchedule

GLOBAL_BATCH = 8_192
SAMPLES_TO_TARGET = 69_300_000  # the reference's mean convergence point (docs/mlperf.md)
REFERENCE_MINUTES = 2 * 60 + 39  # 8 MI350X
EVAL_EVERY = 0.001
TABLE_GIB = 559.0
SAMPLES_PER_WINDOW = REFERENCE_TRAIN_SAMPLES / 299
GPUS_PER_NODE = 8
ITEM_SIDE_TABLES, CONTEXTUAL, D, FP16 = 3, 8, 512, 2


def load(name: str) -> dict:
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"missing {path}: run the benchmark that writes it first")
    return json.loads(path.read_text())


def alltoall_seconds(
    world: int, per_gpu: int, mean_tokens: float, nvlink_gbs: float, network_gbs: float, history_share: float = 1.0
) -> float:
    """One step's forward rows plus backward gradients through the all-to-all, per rank; of the
    history's rows ``history_share`` (the distinct ids' share, with ``embeddings.dedup_ids``)."""
    rows = per_gpu * (mean_tokens * ITEM_SIDE_TABLES * history_share + CONTEXTUAL)
    remote = rows * D * FP16 * (world - 1) / world
    off_node = max(0, world - GPUS_PER_NODE) / world  # the share of a rank's peers on other nodes
    per_direction = remote * (1 - off_node) / (nvlink_gbs * 1e9) + remote * off_node / (network_gbs * 1e9)
    return 2 * per_direction


def measured_alltoall_gbs(hot_ids: dict) -> float:
    """GB/s per GPU and direction that the all-to-all reached: the rows and gradients a rank sent
    per step over its NCCL kernels' device time per step, the mean over the ranks of the uniform-id
    rows (with Zipf ids the hot rank's share of the traffic sets the pace instead)."""
    rates = [
        (rank["rows_bytes"] + rank["grads_bytes"]) / (rank["nccl_ms"] / 1e3) / 1e9
        for row in hot_ids["rows"]
        if row["skew"] == 0
        for rank in row["ranks"]
    ]
    if not rates:
        raise SystemExit("the hot-ids results hold no uniform-id row with NCCL times")
    return sum(rates) / len(rates)


def distinct_share(dedup_ids: dict) -> float:
    """The history rows' distinct share at 1,024 samples per rank (the real job's), over the three
    history id features."""
    rows = [row for row in dedup_ids["rows"] if row["samples_per_rank"] == 1_024]
    if not rows:
        raise SystemExit("dedup_ids.json holds no row at 1,024 samples per rank")
    shares = rows[0]["distinct_share"]
    return sum(shares.values()) / len(shares)


def exchange_work_per_sample(
    scaling: dict, label: str, nvlink_gbs: float, network_gbs: float, history_share: float = 1.0
) -> float:
    """Seconds per sample of a rank's batch that the row's widest step (the most ranks it ran) spends
    beyond the one-rank step and its modelled NCCL time: the medians over the row's repeats of the
    bare step (no loader)."""
    rows = [row for row in scaling["rows"] if row["label"] == label]
    if len(rows) != 1 or rows[0]["scaling"] != "weak":
        raise SystemExit(f"scaling.json holds no single weak-scaling row labelled {label!r}")
    results = rows[0]["results"]

    def step_seconds(world: int) -> tuple[float, dict]:
        runs = [r for r in results if r["world_size"] == world]
        if not runs:
            raise SystemExit(f"the scaling row {label!r} has no run on {world} process(es)")
        rate = statistics.median(r["bare_samples_per_s"] for r in runs)
        return runs[0]["global_batch"] / rate, runs[0]

    widest = max(r["world_size"] for r in results)
    if widest < 2:
        raise SystemExit(f"the scaling row {label!r} has no run on more than one process")
    one, _ = step_seconds(1)
    wide, run = step_seconds(widest)
    per_rank = run["per_rank_batch"]
    nccl = alltoall_seconds(widest, per_rank, run["mean_history_tokens"], nvlink_gbs, network_gbs, history_share)
    return max(0.0, wide - one - nccl) / per_rank


@dataclasses.dataclass(frozen=True)
class Run:
    """The run a projection is made for: the reference's to AUC 0.75 on Yambda-5B, or one that was
    measured (``--measured-run``)."""

    samples: float  # to the target
    global_batch: int
    evals: int
    eval_samples: int  # per eval
    table_gib: float  # every table with its optimizer state, all ranks together
    windows: float  # train windows the run goes through


def evals_to(samples: float, train_samples: int, global_batch: int, every: float) -> int:
    """Evals made up to and including the one at ``samples``, on the trainer's schedule."""
    schedule = EvalSchedule(train_samples, global_batch, every)
    return len(range(schedule.first, int(samples) + schedule.interval, schedule.interval))


REFERENCE_RUN = Run(
    SAMPLES_TO_TARGET,
    GLOBAL_BATCH,
    evals_to(SAMPLES_TO_TARGET, REFERENCE_TRAIN_SAMPLES, GLOBAL_BATCH, EVAL_EVERY),
    REFERENCE_EVAL_SAMPLES,
    TABLE_GIB,
    SAMPLES_TO_TARGET / SAMPLES_PER_WINDOW,
)


def measured_parts(
    gpu: str,
    nvlink_gbs: float,
    network_gbs: float,
    alltoall_source: str | None = None,
    exchange_s_per_sample: float = 0.0,
    exchange_source: str | None = None,
    history_share: float = 1.0,
    deltas: dict | None = None,
    full_every: int = 8,
    compile_on_the_clock: bool = False,
    inputs: str = "",
) -> dict:
    """Every measured rate a projection is made from (the results files of ``gpu``; with ``inputs``, the
    rehearsal and train command measured under that label: ``rehearsal_<gpu>_<inputs>``, ``train_<gpu>_<inputs>``)."""
    suffix = f"_{inputs}" if inputs else ""
    rehearsal, train, stu = load(f"rehearsal_{gpu}{suffix}"), load(f"train_{gpu}{suffix}"), load("stu")
    commits = {"rehearsal": rehearsal["commit"], "train": train["commit"]}
    return {
        "gpu": rehearsal["device"],
        "commits": {**commits, "stu": stu["commit"]} if compile_on_the_clock else commits,
        "rehearsal_rate": rehearsal["rehearsal"]["samples_per_s"],
        "small_batch_rate": max(r["samples_per_s"] for r in rehearsal["baseline"]),
        "eval_rate_per_gpu": train["eval_samples_per_s"],
        # With the kernels' warm-up (the default) nothing is compiled after RUN_START.
        "cold_start_s": stu["cold_start_s"] if compile_on_the_clock else 0.0,
        "setup_source": (
            f"stu's cold start ({stu['cold_start_s']:.1f} s: compilation and autotuning after RUN_START)"
            if compile_on_the_clock
            else "none: the kernels' warm-up compiles before RUN_START (warm_up_medium_h200: 0 kernels after it)"
        ),
        "checkpoint_gib_per_s": train["table_gib"] * train["checkpoints"] / train["checkpoint_seconds"],
        "checkpoint_saves": checkpoint_saves(gpu),
        "nvlink_gbs": nvlink_gbs,
        "alltoall_source": alltoall_source,
        "exchange_s_per_sample": exchange_s_per_sample,
        "exchange_ms_per_1024_samples": exchange_s_per_sample * 1_024 * 1e3,
        "exchange_source": exchange_source,
        "network_gbs": network_gbs,
        "mean_tokens": rehearsal["rehearsal"]["mean_tokens"],
        "history_share": history_share,
        "deltas": deltas,
        "full_every": full_every,
    }


def project_row(parts: dict, run: Run, world: int) -> dict:
    """The projected parts of ``run`` on ``world`` GPUs, in minutes."""
    steps = run.samples / run.global_batch
    per_gpu = run.global_batch // world
    # The rehearsal's rate at 1,024 samples per GPU; below that the best single-chunk rate at 256.
    rate = parts["rehearsal_rate"] if per_gpu >= 1_024 else parts["small_batch_rate"]
    train_s = steps * per_gpu / rate
    comm_s = steps * alltoall_seconds(
        world, per_gpu, parts["mean_tokens"], parts["nvlink_gbs"], parts["network_gbs"], parts["history_share"]
    )
    exchange_s = steps * per_gpu * parts["exchange_s_per_sample"]
    eval_s = run.evals * run.eval_samples / (world * parts["eval_rate_per_gpu"])
    setup_s = parts["cold_start_s"]
    upper = train_s + exchange_s + comm_s + eval_s + setup_s
    checkpoint_s = checkpoint_seconds(
        parts["checkpoint_saves"], parts["checkpoint_gib_per_s"], world, run.windows, upper / run.windows, run.table_gib
    )
    lower = train_s + exchange_s + eval_s + setup_s
    delta_s, unsaved = None, None
    if parts.get("deltas") and parts["checkpoint_saves"]:
        window_s = upper / run.windows
        delta_s, unsaved = delta_checkpoint_seconds(
            parts["checkpoint_saves"], parts["deltas"], world, run.windows, window_s, run.table_gib, parts["full_every"]
        )
    return {
        "gpus": world,
        "per_gpu_batch": per_gpu,
        "per_gpu_samples_per_s": rate,
        "train_min": train_s / 60,
        "alltoall_min": comm_s / 60,
        "exchange_work_min": exchange_s / 60,
        "eval_min": eval_s / 60,
        "setup_min": setup_s / 60,
        "checkpoint_min": checkpoint_s / 60,
        "total_min_overlapped": lower / 60,
        "total_min_not_overlapped": upper / 60,
        "total_min_with_checkpoints": (upper + checkpoint_s) / 60,
        "total_min_with_delta_checkpoints": None if delta_s is None else (upper + delta_s) / 60,
        "delta_checkpoint_share": None if delta_s is None else delta_s / upper,
        "window_ends_without_checkpoint": unsaved,
    }


def project(parts: dict) -> dict:
    """The reference run projected on 8, 16 and 32 GPUs from ``measured_parts``."""
    run = REFERENCE_RUN
    return {
        **{k: v for k, v in parts.items() if k not in ("rehearsal_rate", "small_batch_rate", "cold_start_s")},
        "steps": run.samples / run.global_batch,
        "evals": run.evals,
        "windows": run.windows,
        "rows": [project_row(parts, run, world) for world in (8, 16, 32)],
        "reference_minutes": REFERENCE_MINUTES,
    }


def checkpoint_saves(gpu: str) -> dict | None:
    """From ``checkpoint_<gpu>.json``: seconds per GiB the step waits at the first asynchronous save
    and at the later ones (the pinned buffer reused), the seconds per GiB written that the loop lost
    while the later ones were written in the background, and one writer's GB/s at the later ones (the
    disk, not the page cache, sets it once the run has written a few); None without the file."""
    path = RESULTS / f"checkpoint_{gpu}.json"
    if not path.exists():
        return None
    measured = json.loads(path.read_text())
    runs = [r for r in measured["rows"] if r["mode"] == "asynchronous"]
    first, later = runs[0], runs[1:] or runs
    gib = first["bytes"] / 2**30
    return {
        "first_s_per_gib": first["step_waited_s"] / gib,
        "later_s_per_gib": statistics.mean(r["step_waited_s"] for r in later) / gib,
        "slowdown_s_per_gib": statistics.mean(r["loop_slowdown_s"] for r in later) / gib,
        "write_gbps": statistics.mean(r["write_gbps"] for r in later),
        "source": f"checkpoint_{gpu}, {measured['machine']['gpu']}, commit {measured['commit']}",
    }


def checkpoint_seconds(
    saves: dict | None,
    blocking_gib_per_s: float,
    world: int,
    windows: float,
    window_s: float,
    table_gib: float = TABLE_GIB,
) -> float:
    """The time checkpoints add to the run: what the step waits for the copy of each save made, and
    what its loop loses while the save is written. A window-end save is skipped while a node's
    previous writes are in flight, so one is made every ceil(write / window) windows."""
    rank_gib = table_gib / world
    if saves is None:
        return windows * rank_gib / blocking_gib_per_s
    node_write_s = rank_gib * min(world, GPUS_PER_NODE) * 2**30 / (saves["write_gbps"] * 1e9)
    made = windows / max(1, math.ceil(node_write_s / window_s))
    return made * rank_gib * (saves["later_s_per_gib"] + saves["slowdown_s_per_gib"])


def delta_parts(rows_from: str, cost_from: str) -> dict | None:
    """The delta checkpoints' measured parts: the busiest rank's share a window changes (the largest
    over the windows measured) and the step's wait per GiB of a rank's tables at that share
    (linear between the shares measured, and past the last two); None without either file."""
    if not (RESULTS / f"{rows_from}.json").exists() or not (RESULTS / f"{cost_from}.json").exists():
        return None
    rows, cost = load(rows_from), load(cost_from)
    share = max(r["busiest_rank_share"] for r in rows["results"])
    points = sorted((r["changed_pct"] / 100, r["take_ms_per_gib"] / 1e3) for r in cost["results"])
    (x0, y0), (x1, y1) = next(
        (pair for pair in zip(points, points[1:]) if share <= pair[1][0]), (points[-2], points[-1])
    )
    return {
        "window_share": share,
        "find_s_per_gib": max(y0, y0 + (y1 - y0) * (share - x0) / (x1 - x0)),
        "source": f"{rows_from} ({rows['preset']}, commit {rows['commit']}), {cost_from} "
        f"({cost['machine'].get('gpu', 'CPU')}, commit {cost['commit']})",
    }


def delta_checkpoint_seconds(
    saves: dict, delta: dict, world: int, windows: float, window_s: float, table_gib: float, full_every: int
) -> tuple[float, int]:
    """(seconds the run loses, window ends without a checkpoint) with a save at every window end the
    disk allows: every ``full_every``-th save whole, the others deltas of the windows since the save
    before; each save costs the step's wait for its copy and the loop's slowdown while it is written."""
    rank_gib = table_gib / world
    node_bytes = rank_gib * min(world, GPUS_PER_NODE) * 2**30
    write_bps = saves["write_gbps"] * 1e9
    waited, skipped, busy_until, since_save = 0.0, 0, 0.0, 0
    since_whole: int | None = None
    for window in range(1, int(windows) + 1):
        now, since_save = window * window_s, since_save + 1
        if now < busy_until:
            skipped += 1
            continue
        if since_whole is None or since_whole + 1 >= full_every:
            waited += rank_gib * (saves["later_s_per_gib"] + saves["slowdown_s_per_gib"])
            busy_until, since_whole = now + node_bytes / write_bps, 0
        else:
            written = min(1.0, delta["window_share"] * since_save)
            waited += rank_gib * (delta["find_s_per_gib"] + written * saves["slowdown_s_per_gib"])
            busy_until = now + written * node_bytes / write_bps
            since_whole += 1
        since_save = 0
    return waited, skipped


def measured_run(report_path: Path) -> tuple[Run, int, dict]:
    """A finished run's shape (the ``Run``), its GPU count and its measured seconds, from its
    ``report.json``."""
    if not report_path.is_file():
        raise SystemExit(f"no run report at {report_path}")
    report = json.loads(report_path.read_text())
    history = report["history"]
    if history["status"] != "success":
        raise SystemExit(f"{report_path}: the run ended {history['status']!r}, not at its target")
    # Every shard's rows at fp32 with one row-wise Adagrad value each, as the memory plan counts them.
    table_bytes = sum(rows * (dim * 4 + 4) for table in report["sharding_plan"] for rows, dim in table["shards"])
    run = Run(
        history["samples"],
        report["config"]["loader"]["batch_size"],
        len(history["evals"]),
        report["eval_samples"],
        table_bytes / 2**30,
        len(history["window_losses"]),
    )
    eval_s = sum(e["eval_seconds"] for e in history["evals"])
    measured = {"total_s": history["seconds"], "eval_s": eval_s, "checkpoint_s": history["checkpoint_seconds"]}
    measured["rest_s"] = measured["total_s"] - eval_s - measured["checkpoint_s"]
    return run, report["world_size"], measured


def measured_table(p: dict, label: str) -> str:
    run, row, m = p["run"], p["projected"], p["measured"]
    projected = {
        "rest_s": 60 * (row["total_min_not_overlapped"] - row["eval_min"]),
        "eval_s": 60 * row["eval_min"],
        "checkpoint_s": 60 * row["checkpoint_min"],
        "total_s": 60 * row["total_min_with_checkpoints"],
    }
    cells = ("rest_s", "eval_s", "checkpoint_s", "total_s")
    return "\n".join(
        [
            f"The projection's model beside a measured run ({label}): {run['samples']:,} samples to the target at GBS "
            f"{run['global_batch']:,} on {row['gpus']} GPUs ({row['per_gpu_batch']:,} per GPU), {run['evals']} evals "
            f"of {run['eval_samples']:,} samples, {run['windows']} windows, {run['table_gib']:.1f} GiB of tables with "
            f"their optimizer state; projected from the parts measured on {p['gpu']} at commits "
            f"{', '.join(f'{k} {v}' for k, v in p['commits'].items())} (per GPU {row['per_gpu_samples_per_s']:,.0f} "
            f"samples/s training, {p['eval_rate_per_gpu']:,.0f} evaluating; all-to-all not overlapped). Measured: "
            "the run's report.json (RUN_START to RUN_STOP; its evals' own time and its checkpoints' waits).",
            "",
            "| seconds | training, exchange and set-up | evals | checkpoints | total |",
            "|---|---:|---:|---:|---:|",
            "| projected | " + " | ".join(f"{projected[c]:.1f}" for c in cells) + " |",
            "| measured | " + " | ".join(f"{m[c]:.1f}" for c in cells) + " |",
            "| measured / projected | "
            + " | ".join(f"{m[c] / projected[c]:.2f}x" if projected[c] else "-" for c in cells)
            + " |",
        ]
    )


def table(p: dict) -> str:
    lines = [
        f"Projected time to AUC 0.75 ({SAMPLES_TO_TARGET / 1e6:.1f} M samples at GBS {GLOBAL_BATCH:,}: "
        f"{p['steps']:,.0f} steps, {p['evals']} evals of {REFERENCE_EVAL_SAMPLES:,} samples, "
        f"{p['windows']:.1f} windows) on {p['gpu']} GPUs, from the parts measured at commits "
        f"{', '.join(f'{k} {v}' for k, v in p['commits'].items())}; all-to-all at "
        f"{p['nvlink_gbs']:,.0f} GB/s per GPU and direction in a node ({intra_node_source(p)}), "
        f"{p['network_gbs']:g} GB/s across nodes (modelled) "
        f"(fp16 rows, mean {p['mean_tokens']:,.0f} tokens, {history_rows(p)}); {exchange_source(p)}. "
        f"{checkpoint_source(p)} Set-up inside the timed run: {p['setup_source']}. "
        f"Reference: {p['reference_minutes'] // 60} h {p['reference_minutes'] % 60} min on 8 MI350X.",
        "",
        "| GPUs | per GPU batch | per GPU samples/s | train min | exchange work min | all-to-all min | eval min | "
        "set-up min | total min, all-to-all overlapped | not overlapped | + window-end checkpoints | "
        f"+ a checkpoint per window, deltas (whole every {p['full_every']}) | its share | window ends without one | "
        "vs reference (not overlapped) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in p["rows"]:
        lines.append(
            f"| {r['gpus']} | {r['per_gpu_batch']:,} | {r['per_gpu_samples_per_s']:,.0f} | "
            f"{r['train_min']:.1f} | {r['exchange_work_min']:.1f} | {r['alltoall_min']:.1f} | {r['eval_min']:.1f} | {r['setup_min']:.1f} | "
            f"{r['total_min_overlapped']:.1f} | {r['total_min_not_overlapped']:.1f} | "
            f"{r['total_min_with_checkpoints']:.1f} | "
            + (
                f"{r['total_min_with_delta_checkpoints']:.1f} | {r['delta_checkpoint_share']:.1%} | "
                f"{r['window_ends_without_checkpoint']} of {int(p['windows'])} | "
                if r.get("total_min_with_delta_checkpoints") is not None
                else "- | - | - | "
            )
            + f"{p['reference_minutes'] / r['total_min_not_overlapped']:.2f}x |"
        )
    return "\n".join(lines)


def checkpoint_source(p: dict) -> str:
    saves = p.get("checkpoint_saves")
    if not saves:
        return f"Checkpoints blocking at {p['checkpoint_gib_per_s']:.2f} GiB/s (train)."
    deltas = p.get("deltas")
    delta_text = (
        f" Delta checkpoints: a window changes {deltas['window_share']:.2%} of the busiest rank's block of the "
        f"tables; the step waits {deltas['find_s_per_gib'] * 1e3:.0f} ms per GiB of a rank's tables to find and "
        f"copy the changed rows (measured: {deltas['source']})."
        if deltas
        else ""
    )
    return (
        f"Checkpoints asynchronous at window ends, skipped while the previous write is in flight: the step waits "
        f"{saves['later_s_per_gib'] * 1e3:.0f} ms per GiB of a rank's tables for each save made (the buffer is "
        f"pinned before RUN_START) and its loop loses {saves['slowdown_s_per_gib'] * 1e3:.0f} ms per GiB written "
        f"in the background, a node's ranks write at {saves['write_gbps']:.2f} GB/s together (measured: "
        f"{saves['source']}).{delta_text}"
    )


def history_rows(p: dict) -> str:
    share = p.get("history_share", 1.0)
    if share == 1.0:
        return "every history token's rows"
    return f"the distinct history ids' rows, {share:.2%} of the tokens' (dedup_ids, synthetic-50m)"


def intra_node_source(p: dict) -> str:
    source = p.get("alltoall_source")
    return f"measured: {source}" if source else "modelled"


def exchange_source(p: dict) -> str:
    source = p.get("exchange_source")
    if not source:
        return "the exchange's permutes and casts not counted"
    return (
        f"the exchange's permutes and casts at {p['exchange_ms_per_1024_samples']:.0f} ms per 1,024 samples "
        f"of a GPU's batch (measured: {source})"
    )


# Each GPU's weak-scaling row at the real per-rank tables, each up to four ranks (the widest measured).
EXCHANGE_ROWS = {"h200": "h200x4-torchrec-real-tables-dedup", "h100": "h100x4-torchrec-real-tables-dedup"}

# Each GPU's delta find-and-copy table (each file names its commit and machine).
DELTA_COST_FROM = {"h200": "delta_checkpoint_gpu", "h100": "delta_checkpoint_h100"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h200", choices=("h200", "h100"), help="whose rehearsal to use")
    parser.add_argument(
        "--alltoall-from",
        default="hot_ids_h100x2",
        help="the hot-ids results whose measured all-to-all rate to use within a node ('' to use --nvlink-gbs)",
    )
    parser.add_argument(
        "--exchange-from",
        default=None,
        help="the weak-scaling row of scaling.json whose widest step measures the exchange's work beyond "
        "NCCL (default: the GPU's own row at four ranks, h200x4-torchrec-real-tables-dedup or "
        "h100x4-torchrec-real-tables-dedup; '' to leave it out)",
    )
    parser.add_argument(
        "--distinct-from",
        default="dedup_ids",
        help="the dedup-ids results whose distinct share of the history ids the all-to-all carries "
        "('' : every token's; must agree with the --exchange-from row's embeddings.dedup_ids)",
    )
    parser.add_argument(
        "--nvlink-gbs",
        type=float,
        default=350.0,
        help="all-to-all GB/s per GPU and direction within a node when --alltoall-from is '' (NVLink 4: 450 peak)",
    )
    parser.add_argument(
        "--network-gbs",
        type=float,
        default=45.0,
        help="GB/s per GPU and direction across nodes (400 Gb/s NDR: 50 peak)",
    )
    parser.add_argument(
        "--measured-run",
        type=Path,
        default=None,
        metavar="REPORT",
        help="a finished run's report.json: project that run's shape on its GPU count with the same "
        "model and set it beside what the run measured (results/projection_<label>)",
    )
    parser.add_argument("--label", default="run", help="with --measured-run: the results' name")
    parser.add_argument(
        "--delta-rows-from",
        default="delta_rows_1b",
        help="the share of the tables a window changes (synthetic-1b's windows: Yambda-5B's users and catalog)",
    )
    parser.add_argument(
        "--delta-cost-from",
        default=None,
        help="what finding and copying the changed rows costs (default: the GPU's own, "
        + ", ".join(DELTA_COST_FROM.values())
        + ")",
    )
    parser.add_argument("--full-every", type=int, default=8, help="every Nth checkpoint whole (the trainer's default)")
    parser.add_argument(
        "--inputs",
        default="",
        help="project from rehearsal_<gpu>_<inputs> and train_<gpu>_<inputs> (a labelled pair, e.g. measured with "
        "--attention-kernels triton) and write time_to_train_<gpu>_<inputs>",
    )
    parser.add_argument(
        "--compile-on-the-clock",
        action="store_true",
        help="count stu.json's cold start (compilation and autotuning) inside the timed run, as a run with "
        "--warm-up false has it (default: none, the warm-up compiles before RUN_START)",
    )
    args = parser.parse_args()
    if args.exchange_from is None:
        args.exchange_from = EXCHANGE_ROWS[args.gpu]
    if args.delta_cost_from is None:
        args.delta_cost_from = DELTA_COST_FROM[args.gpu]
    nvlink_gbs, source = args.nvlink_gbs, None
    if args.alltoall_from:
        hot_ids = load(args.alltoall_from)
        nvlink_gbs = measured_alltoall_gbs(hot_ids)
        source = f"{args.alltoall_from}, {hot_ids['device']}, commit {hot_ids['commit']}"
    share = distinct_share(load(args.distinct_from)) if args.distinct_from else 1.0
    exchange, exchange_from = 0.0, None
    if args.exchange_from:
        scaling = load("scaling")
        exchange = exchange_work_per_sample(scaling, args.exchange_from, nvlink_gbs, args.network_gbs, share)
        row = next(row for row in scaling["rows"] if row["label"] == args.exchange_from)
        if bool(row.get("dedup_ids")) != bool(args.distinct_from):
            raise SystemExit(
                f"the scaling row {args.exchange_from!r} ran with dedup_ids {bool(row.get('dedup_ids'))}: "
                f"{'give' if row.get('dedup_ids') else 'leave out'} --distinct-from to match"
            )
        widest = max(r["world_size"] for r in row["results"])
        exchange_from = f"scaling {args.exchange_from} at {widest} ranks, {row['device']}, commit {row['commit']}"
    deltas = delta_parts(args.delta_rows_from, args.delta_cost_from)
    parts = measured_parts(
        args.gpu,
        nvlink_gbs,
        args.network_gbs,
        source,
        exchange,
        exchange_from,
        share,
        deltas,
        args.full_every,
        args.compile_on_the_clock,
        args.inputs,
    )
    if args.measured_run is not None:
        run, world, measured = measured_run(args.measured_run)
        result = {
            "gpu": parts["gpu"],
            "commits": parts["commits"],
            "eval_rate_per_gpu": parts["eval_rate_per_gpu"],
            "run": dataclasses.asdict(run),
            "projected": project_row(parts, run, world),
            "measured": measured,
            "command": command_line(),
        }
        text = measured_table(result, args.label)
        print(text)
        write_results(f"projection_{args.label}", result, text, device="cpu")
        return
    p = project(parts)
    p["command"] = command_line()
    text = table(p)
    print(text)
    write_results(f"time_to_train_{args.gpu}" + (f"_{args.inputs}" if args.inputs else ""), p, text, device="cpu")


if __name__ == "__main__":
    main()
