"""What users run: ``python -m dlrmv4 train`` itself at the reference model on a synthetic store at the
reference shape, against the bare training step on the same store's batches, in one call.

The store is ``synthetic-50m`` (about 48 M events over 300 days, min history 4,086, sequences up to
4,096 tokens: the real length mix at the reference budget), its last ``--train-days`` days as the
train windows. The run is the real command: the loader
with its worker processes, the device prefetcher, TorchRec (or plain) embeddings, evals on the
holdout window at a cadence that gives ``--evals`` of them, checkpoints every ``--checkpoint-every``
steps (one kept; not at every window's end: at these table sizes one checkpoint takes tens of
seconds and the short windows of this store would make them most of the run), and a profiler
window. The run directory is removed afterwards (a checkpoint here is about 16 GiB; ``--keep-traces DIR``
keeps the profiled windows' traces, host threads included). Its contextual tables are
``--table-rows`` rows each (the full 278 M rows do not fit one GPU); item, artist and album come
from the store. Reported:

- training samples/s of the loop (the run's own per-window clock: waiting for batches plus steps,
  evals and checkpoints left out), over the windows that start after ``--warmup-samples``
  (compilation, autotuning, the loader's start), and over every window;
- the bare step (``TrainStep`` on batches of the same store already in device memory, same
  config) and the ratio loop / bare;
- eval samples/s (the holdout window over each eval's own time) and its ratio to the per-sample
  training rate;
- where the wall time went: training, evals, checkpoints, the rest (start-up inside the timed
  region);
- two profiled windows of ``PROFILE_STEPS`` steps: the steady step (the latest steps before the first
  checkpoint with no checkpoint, eval or window end after any of them or the step before) and the
  first checkpoint's neighbours (the step before it, its staging copy and the first steps of its
  background write): the GPU's busy share in each (union of kernel time over the window) and its
  milliseconds a step; and the loop's rate in the windows that train while the first checkpoint is
  written against those before it; how the checkpoints were staged (a device snapshot or not) and
  where the step's wait at the first save went;
- MFU by the reference's yardstick (every layer in full) and by the FLOPs executed.

    python benchmarks/step/bench_train.py                                      # on a GPU (store in data/bench50m)
    python benchmarks/step/bench_train.py --smoke --data-path data/benchtiny     # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

import numpy as np
import torch
from bench_end_to_end import start_single_process_group
from harness import (
    DATASHEET_BF16_TFLOPS,
    command_line,
    device_name,
    git_commit,
    matmul_peak_tflops,
    sync,
    write_results,
)
from kernel_parts import PART_NAMES, step_part

from dlrmv4.config_loading import config_from_args
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES, NUM_CONTEXTUAL
from dlrmv4.data.loader import BatchSlice, make_window_loader
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import open_store
from dlrmv4.data.windows import split_windows
from dlrmv4.model.embeddings import looks_up_distinct_ids, store_table_counts, table_specs
from dlrmv4.model.flops import batch_flops
from dlrmv4.ops.attention_kernels import ATTENTION_KERNEL_CHOICES
from dlrmv4.train.schedule import EvalSchedule
from dlrmv4.train.trainer import build_step

WARM_STEPS = 5
PROFILE_STEPS = 5
TOP_KERNELS = 15
TOP_CUDA_CALLS = 3  # the training thread's CUDA runtime calls shown beside a checkpoint and in the steady window
DEVICE_EVENT_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
# The trainer's lines for a save made ("... at step N") and for a background write that ended.
SAVE_LINE = re.compile(r"\[dlrmv4\] checkpoint step-\d{8}.* at step (\d+)")
WRITTEN_LINE = re.compile(r"\[dlrmv4\] checkpoint step-\d{8} written \(([\d.]+) s in the background\)")
STAGING_LINE = re.compile(
    r"\[dlrmv4\] checkpoint staging copy in host memory allocated before the run starts .*?; (.*)"
)
WAITED = re.compile(r"\[dlrmv4\] checkpoint step-\d{8}.* at step \d+: .*\(the step waited ([\d.]+) s(?:: ([^)]*))?")


def say(text: str) -> None:
    print(f"[bench_train] {text}", file=sys.stderr, flush=True)


def overrides(args: argparse.Namespace) -> list[str]:
    """The flags both the run and the bare step use (the bare step reads them back through load_config)."""
    flags = [
        "--num-train-days",
        str(args.train_days),
        "--batch-size",
        str(args.batch_size),
        "--embedding-backend",
        args.backend,
        "--chunks",
        "1",
        "--recompute",
        args.recompute,
        "--last-layer",
        args.last_layer,
        "--seed",
        "1",
        "--sparse-pipeline",
        args.sparse_pipeline,
        "--dedup-ids",
        args.dedup_ids,
        "--async-checkpoints",
        args.async_checkpoints,
        "--attention-kernels",
        args.attention_kernels,
    ]
    for name in CONTEXTUAL_FEATURES:
        if name != "uid":
            flags += [f"--{name.replace('_', '-')}-rows", str(args.table_rows)]
    if args.smoke:
        flags += [
            "--d-model",
            "32",
            "--embedding-dim",
            "32",
            "--num-heads",
            "2",
            "--qk-dim",
            "16",
            "--v-dim",
            "16",
            "--num-layers",
            "2",
            "--sequence-dtype",
            "float32",
            "--input-dropout",
            "0",
            "--linear-dropout",
            "0",
        ]
    return flags


def cli(args: argparse.Namespace, command: str, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrmv4",
            command,
            "--preset",
            args.preset,
            "--data-path",
            args.data_path,
            "--no-progress",
            *flags,
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"dlrmv4 {command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc, time.perf_counter() - started


def run_config(args: argparse.Namespace):
    """The run's config as the CLI resolves it (preset + the shared flags)."""
    from dlrmv4.cli import build_parser

    parsed = build_parser().parse_args(
        ["train", "--preset", args.preset, "--data-path", args.data_path, *overrides(args)]
    )
    return config_from_args(parsed)


def table_rows_total(cfg) -> int:
    store = open_store(store_dir(cfg.dataset))
    return sum(spec.rows for spec in table_specs(cfg, *store_table_counts(store)))


def eval_cadence(train_samples: int, batch_size: int, steps: int, evals: int) -> float:
    """The largest eval_every_data_pct (down in steps of 10 %) whose grid (the checker's, with its
    skipped start) puts ``evals`` evals within ``steps``."""
    total = steps * batch_size
    pct = min(1.0, total / evals / train_samples)
    for _ in range(100):
        schedule = EvalSchedule(train_samples, batch_size, pct)
        if len(range(schedule.first, total + 1, schedule.interval)) >= evals:
            return pct
        pct *= 0.9
    raise SystemExit(f"no eval cadence gives {evals} evals in {steps} steps of {batch_size}: run more steps")


def window_rates(history: dict) -> list[dict]:
    """Each window's samples and the loop's rate over it, as the run's history records them."""
    ends = [s for _, s, _ in history["window_losses"]]
    samples = np.diff([0] + ends)
    return [
        {"window": w, "samples": int(n), "samples_per_s": rate}
        for (w, _, _), n, (_, rate) in zip(history["window_losses"], samples, history["throughput"])
    ]


def loop_rates(windows: list[dict], warmup_samples: int) -> tuple[float, int, float]:
    """(samples/s of the loop over the windows that start after ``warmup_samples``, weighted by
    their samples; the samples those cover; samples/s over every window, warm-up included)."""
    samples, seconds = window_samples_seconds(windows)
    steady = (np.cumsum(samples) - samples) >= warmup_samples
    overall = float(samples.sum() / seconds.sum())
    if not steady.any():
        return float("nan"), 0, overall
    return float(samples[steady].sum() / seconds[steady].sum()), int(samples[steady].sum()), overall


def window_samples_seconds(windows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Each window's samples and its training seconds (samples over its loop rate)."""
    samples = np.array([w["samples"] for w in windows])
    return samples, samples / np.array([w["samples_per_s"] for w in windows])


@dataclasses.dataclass(frozen=True)
class LoopEvents:
    """What the train loop does after a step besides training, by the step's index (0-based)."""

    window_ends: frozenset[int]
    evals: frozenset[int]
    checkpoints: tuple[int, ...]  # the saves inside the run (not the final one, after RUN_STOP)

    def after(self, step: int) -> bool:
        return step in self.window_ends or step in self.evals or step in self.checkpoints


def loop_events(plan: list[BatchSlice], schedule: EvalSchedule, checkpoint_every: int, steps: int) -> LoopEvents:
    """The run's window ends, holdout evals and checkpoints by step, as the trainer decides them: a
    window ends at its plan's last batch, an eval follows the step whose samples the schedule names,
    a checkpoint every ``checkpoint_every`` steps until the last step."""
    steps = min(steps, len(plan))
    batch = schedule.global_batch_size
    return LoopEvents(
        window_ends=frozenset(i for i in range(steps) if i + 1 == len(plan) or plan[i + 1].window != plan[i].window),
        evals=frozenset(i for i in range(steps) if schedule.should_eval((i + 1) * batch)),
        checkpoints=tuple(i for i in range(checkpoint_every - 1, steps - 1, checkpoint_every))
        if checkpoint_every
        else (),
    )


def profile_windows(events: LoopEvents, steps: int, earliest: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The profiled step windows [a, b): the steady one, the latest ``PROFILE_STEPS`` steps from
    ``earliest`` on that end before the first checkpoint (before the run's middle where it has none) with
    nothing else after any of them or the step before; and a checkpoint's, from the step the save
    follows (its staging copy and the first steps of its write inside): the first checkpoint with no
    eval, window end or other checkpoint after any of those steps, None where there is none."""
    last_start = (events.checkpoints[0] + 1 if events.checkpoints else steps // 2 + PROFILE_STEPS) - PROFILE_STEPS
    for a in range(last_start, earliest - 1, -1):
        if not any(events.after(s) for s in range(max(a - 1, 0), a + PROFILE_STEPS)):
            quiet = (a, a + PROFILE_STEPS)
            break
    else:
        raise SystemExit(
            f"no {PROFILE_STEPS} steps from step {earliest} to {last_start + PROFILE_STEPS} without a checkpoint, an "
            "eval or a window end: run more --steps, fewer --evals or a later --checkpoint-every"
        )
    for c in events.checkpoints:
        after = range(c, c + PROFILE_STEPS)
        if after[-1] < steps - 1 and not any(
            s in events.evals or s in events.window_ends or (s != c and s in events.checkpoints) for s in after
        ):
            return quiet, (c, c + PROFILE_STEPS)
    return quiet, None


def window_profile(trace: Path, steps: int) -> dict | None:
    """A profiled window's GPU busy share and its milliseconds a step (first kernel's start to the last
    one's end, over its steps), where its device time went (milliseconds a step by part of the step,
    and the ``TOP_KERNELS`` kernels or device memcpy/memset by time) and its host threads' time in
    torch ops (``host_threads``); None without a trace."""
    if not trace.exists():
        return None
    trace_events = json.loads(trace.read_text()).get("traceEvents", [])
    events = device_events(trace_events)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "kernel")
    if not spans:
        return None
    span_us = max(e for _, e in spans) - spans[0][0]
    parts = dict.fromkeys(PART_NAMES, 0.0)
    kernels: dict[str, dict] = {}
    for e in events:
        part = step_part(e["name"])
        parts[part] += e["dur"] / 1e3 / steps
        k = kernels.setdefault(e["name"], {"name": e["name"][:120], "part": part, "ms_per_step": 0.0, "launches": 0})
        k["ms_per_step"] += e["dur"] / 1e3 / steps
        k["launches"] += 1
    top = sorted(kernels.values(), key=lambda k: -k["ms_per_step"])[:TOP_KERNELS]
    for k in top:
        k["launches_per_step"] = k.pop("launches") / steps
    return {
        "busy": busy_share(spans),
        "ms_per_step": span_us / 1e3 / steps,
        "parts_ms": parts,
        "top_kernels": top,
        "host": host_threads(trace_events, steps),
    }


def host_threads(events: list[dict], steps: int) -> dict | None:
    """Milliseconds a step the host's threads spent inside torch ops: the thread that launched the most
    kernels (the training's) and the other threads together (the checkpoint writer's among them); and
    what the training thread's CUDA runtime calls took (``training_cuda``: the ``TOP_CUDA_CALLS`` calls
    by time, milliseconds a step and microseconds a call, and the op that made most of that time,
    ``by``, with its share), which tells time spent launching from waits on the device or on the
    driver, and whose waits they are. A training thread inside ops for less of the step than the
    device works waits for the GIL or the loader; None where the trace holds no kernel launch."""
    launches: dict[int, int] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "LaunchKernel" in e.get("name", ""):
            launches[e["tid"]] = launches.get(e["tid"], 0) + 1
    if not launches:
        return None
    training = max(launches, key=lambda tid: launches[tid])
    spans: dict[int, list[tuple[float, float]]] = {}
    calls: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            spans.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        elif e.get("cat") == "cuda_runtime" and e["tid"] == training:
            calls.setdefault(e["name"], []).append(e["dur"])
    inside = {tid: union_us(sorted(s)) / 1e3 / steps for tid, s in spans.items()}
    top = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:TOP_CUDA_CALLS]
    by = callers([e for e in events if e.get("tid") == training], {name for name, _ in top})
    training_cuda = []
    for name, durations in top:
        total = sum(durations)
        caller, caller_us = max(by[name].items(), key=lambda kv: kv[1])
        training_cuda.append(
            {
                "name": name,
                "ms_per_step": total / 1e3 / steps,
                "us_per_call": total / len(durations),
                "by": caller,
                "by_share": caller_us / total if total else 0.0,
            }
        )
    return {"training_ms": inside.pop(training, 0.0), "others_ms": sum(inside.values()), "training_cuda": training_cuda}


def callers(events: list[dict], names: set[str]) -> dict[str, dict[str, float]]:
    """For the CUDA runtime calls named ``names`` among one thread's ``events``: microseconds by the op
    that made them, named by its outermost and innermost enclosing ops (``record_function`` labels
    included), ``outer > inner``; ``(no op)`` outside any."""
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    wanted = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in names]
    # Ops before the calls they enclose at one time stamp, the longer (outer) op first.
    timeline = sorted(
        [(e["ts"], 0, -e["dur"], e) for e in ops] + [(e["ts"], 1, 0, e) for e in wanted], key=lambda t: t[:3]
    )
    by: dict[str, dict[str, float]] = {name: {} for name in names}
    open_ops: list[dict] = []
    for ts, is_call, _, e in timeline:
        while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] <= ts:
            open_ops.pop()
        if not is_call:
            open_ops.append(e)
            continue
        chain = [o["name"] for o in open_ops if e["ts"] + e["dur"] <= o["ts"] + o["dur"]]
        caller = "(no op)" if not chain else chain[0] if len(chain) == 1 else f"{chain[0]} > {chain[-1]}"
        by[e["name"]][caller] = by[e["name"]].get(caller, 0.0) + e["dur"]
    return by


def cuda_calls_table(r: dict) -> list[str]:
    """The training thread's costliest CUDA runtime calls in the steady window and beside the first
    checkpoint, each with the op that made most of its time (after the other tables: the docs cite
    those by their place)."""
    windows = [
        w for w in (r["profiled_steady"], r["profiled_checkpoint"]) if w and (w.get("host") or {}).get("training_cuda")
    ]
    if not windows:
        return []
    names = list(dict.fromkeys(c["name"] for w in windows for c in w["host"]["training_cuda"]))
    head = " | ".join(f"steps {w['steps'][0]}-{w['steps'][1] - 1}" for w in windows)
    lines = [
        "",
        f"The training thread's costliest CUDA runtime calls, ms a step (microseconds a call) and the op that made"
        f" most of that time, in the steady window{' and beside the first checkpoint' if len(windows) > 1 else ''}:",
        "",
        f"| call | {head} |",
        "|---|" + "---:|" * len(windows),
    ]
    by_name = [{c["name"]: c for c in w["host"]["training_cuda"]} for w in windows]
    for name in names:
        cells = [
            "-"
            if name not in calls
            else f"{calls[name]['ms_per_step']:.1f} ({calls[name]['us_per_call']:.0f}); "
            f"{calls[name]['by_share']:.0%} `{calls[name]['by']}`"
            for calls in by_name
        ]
        lines.append(f"| `{name}` | {' | '.join(cells)} |")
    return lines


def union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of sorted (start, end) spans."""
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def rates_around_checkpoint(windows: list[dict], first_save_step: int, batch: int, warmup: int) -> dict | None:
    """The loop's samples/s over the windows wholly before the first save (from ``warmup`` samples on)
    and over those that hold or follow it (its write runs in the background there); None where either
    set is empty."""
    save_samples = (first_save_step + 1) * batch
    samples, seconds = window_samples_seconds(windows)
    ends = np.cumsum(samples)
    before = (ends <= save_samples) & (ends - samples >= warmup)
    beside = ends > save_samples
    if not before.any() or not beside.any():
        return None
    rates = {
        name: float(samples[sel].sum() / seconds[sel].sum()) for name, sel in (("before", before), ("beside", beside))
    }
    return {**rates, "ratio": rates["beside"] / rates["before"]}


def device_events(events: list[dict]) -> list[dict]:
    """A trace's device work: kernels and the device's memcpy/memset events (copies between host and
    device included: they run on the copy engines beside the kernels)."""
    return [e for e in events if e.get("cat") in DEVICE_EVENT_KINDS and "dur" in e]


def busy_share(spans: list[tuple[float, float]]) -> float:
    """Union of the kernels' time over their span (first start to last end); ``spans`` sorted."""
    return union_us(spans) / (max(e for _, e in spans) - spans[0][0])


def bare_step(args: argparse.Namespace, device: torch.device) -> dict:
    """TrainStep alone on batches of the same store (the run's first windows), in device memory."""
    cfg = run_config(args)
    store = open_store(store_dir(cfg.dataset))
    windows, _ = split_windows(store)
    loader = make_window_loader(
        store,
        windows,
        dataclasses.replace(cfg, loader=dataclasses.replace(cfg.loader, num_workers=min(cfg.loader.num_workers, 4))),
        drop_last=True,
        dedup_ids=looks_up_distinct_ids(cfg, args.backend),
    )
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == args.bare_steps + WARM_STEPS:
            break
    # Sequence lengths: the history, the contextual tokens and the candidate.
    lengths = [b.host_history_lengths.astype(np.int64) + NUM_CONTEXTUAL + 1 for b in batches]
    batches = [b.to(device) for b in batches]
    if cfg.embeddings.embedding_backend == "torchrec":
        start_single_process_group(device)
    step = build_step(cfg, store_table_counts(store), device, seed=0)
    for i in range(WARM_STEPS):
        step(batches[i], i, 0)
    sync(device)
    started = time.perf_counter()
    for i in range(WARM_STEPS, len(batches)):  # with the pipeline, each step sends the next batch's ids
        step(batches[i], i, 0, batches[i + 1] if i + 1 < len(batches) else None)
    sync(device)
    seconds = time.perf_counter() - started
    step.finite.check()
    timed = lengths[WARM_STEPS:]
    return {
        "steps": len(timed),
        "samples_per_s": len(timed) * cfg.loader.batch_size / seconds,
        "step_ms": 1e3 * seconds / len(timed),
        "mean_tokens": float(np.mean(np.concatenate(timed))),
        "stu_tflops": sum(batch_flops(cfg.model, n).stu for n in timed) / seconds / 1e12,
        "stu_tflops_executed": sum(batch_flops(cfg.model, n, executed=True).stu for n in timed) / seconds / 1e12,
        "backend": step.embeddings.backend,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-path", default="data/bench50m", help="where the synthetic store is (made when missing)")
    parser.add_argument("--preset", default="synthetic-50m")
    parser.add_argument(
        "--train-days",
        type=int,
        default=30,
        help="train windows of the store: the eval cadence skips the first 2 %% of the train "
        "samples (the checker's rule), so fewer days reach evals in fewer steps",
    )
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400, help="training steps of the run")
    parser.add_argument("--evals", type=int, default=3, help="evals the cadence should give within the steps")
    parser.add_argument("--checkpoint-every", type=int, default=200, help="checkpoint cadence in steps")
    parser.add_argument("--workers", type=int, default=8, help="loader worker processes")
    parser.add_argument("--backend", default="torchrec", choices=("torchrec", "plain"))
    parser.add_argument("--recompute", default="none", choices=("none", "cheap", "layer"))
    parser.add_argument("--last-layer", default="candidates", choices=("candidates", "all"))
    parser.add_argument("--table-rows", type=int, default=1_000_000, help="rows of each contextual table")
    parser.add_argument("--bare-steps", type=int, default=30)
    parser.add_argument(
        "--sparse-pipeline",
        default="true",
        choices=("true", "false"),
        help="TorchRec: the next batch's ids distributed while a step computes (train.sparse_pipeline)",
    )
    parser.add_argument(
        "--dedup-ids",
        default="true",
        choices=("true", "false"),
        help="TorchRec: each distinct history id of a rank's batch looked up once (embeddings.dedup_ids)",
    )
    parser.add_argument(
        "--async-checkpoints",
        default="true",
        choices=("true", "false"),
        help="checkpoints written in the background (train.async_checkpoints)",
    )
    parser.add_argument(
        "--warmup-samples",
        type=int,
        default=10_240,
        help="windows starting before this many samples are warm-up (Triton autotunes each new "
        "sequence-length bucket in the first steps; the loader starts)",
    )
    parser.add_argument(
        "--warm-up",
        default="auto",
        choices=("auto", "true", "false"),
        help="the kernels' warm-up before RUN_START (train.warm_up; auto: on where Triton kernels run)",
    )
    parser.add_argument(
        "--attention-kernels",
        default="auto",
        choices=ATTENTION_KERNEL_CHOICES,
        help="kernels of the STU layers' attention (model.attention_kernels)",
    )
    parser.add_argument("--label", default="", help="suffix of the results file names")
    parser.add_argument(
        "--keep-traces",
        default="",
        help="a folder to copy the profiled windows' traces into (host threads and device) before the run "
        "directory is removed",
    )
    parser.add_argument("--smoke", action="store_true", help="synthetic-tiny and a tiny model on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.preset, args.batch_size, args.steps, args.workers, args.train_days = "synthetic-tiny", 32, 160, 1, 18
        args.backend, args.table_rows, args.bare_steps, args.checkpoint_every = "plain", 1000, 5, 80
        args.warmup_samples = 500
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    _, prepare_s = cli(args, "prepare", "--if-missing", "--num-train-days", str(args.train_days))
    say(f"prepare: {prepare_s:.0f} s")
    cfg = run_config(args)
    meta = json.loads((store_dir(cfg.dataset) / "meta.json").read_text())
    train_samples = meta["counts"]["train_samples"]
    eval_pct = eval_cadence(train_samples, args.batch_size, args.steps, args.evals)
    run_dir = Path(args.data_path) / "bench_train_run"
    store = open_store(store_dir(cfg.dataset))
    plan = make_window_loader(store, split_windows(store)[0], cfg, drop_last=True).batch_plan  # the trainer's
    events = loop_events(
        plan, EvalSchedule(train_samples, args.batch_size, eval_pct), args.checkpoint_every, args.steps
    )
    quiet, near = profile_windows(events, args.steps, -(-args.warmup_samples // args.batch_size))
    profile = ",".join(f"{a}-{b}" for a, b in filter(None, (quiet, near)))
    proc, run_s = cli(
        args,
        "train",
        *overrides(args),
        "--restart",
        "--run-dir",
        str(run_dir),
        "--num-workers",
        str(args.workers),
        "--max-steps",
        str(args.steps),
        "--eval-every-data-pct",
        repr(eval_pct),
        "--checkpoint-every-steps",
        str(args.checkpoint_every),
        "--checkpoint-every-window",
        "false",
        "--keep-last-checkpoints",
        "1",
        "--target-auc",
        "1.0",
        "--profile-steps",
        profile,
        "--warm-up",
        args.warm_up,
    )
    say(f"train: {run_s:.0f} s")
    report = json.loads((run_dir / "report.json").read_text())
    # The saves inside the run (the final one, after RUN_STOP, is not on the run's clock).
    checkpoints = sum(int(m.group(1)) < args.steps for m in SAVE_LINE.finditer(proc.stdout))
    write_seconds = [float(m.group(1)) for m in WRITTEN_LINE.finditer(proc.stdout)]
    staging = STAGING_LINE.search(proc.stdout)
    table_gib = table_rows_total(cfg) * (cfg.model.embedding_dim + 1) * 4 / 2**30  # fp32 rows + Adagrad state
    history = report["history"]
    windows = window_rates(history)
    loop, loop_samples, loop_all = loop_rates(windows, args.warmup_samples)
    evals = history["evals"]
    eval_seconds = [e["eval_seconds"] for e in evals]
    eval_rate = report["eval_samples"] / float(np.median(eval_seconds)) if evals else float("nan")
    train_seconds = sum(w["samples"] / w["samples_per_s"] for w in windows)
    traces = run_dir / "traces"
    steady = window_profile(traces / f"steps-{quiet[0]}-{quiet[1]}.rank0.json", quiet[1] - quiet[0])
    beside = window_profile(traces / f"steps-{near[0]}-{near[1]}.rank0.json", near[1] - near[0]) if near else None
    around = (
        rates_around_checkpoint(windows, events.checkpoints[0], args.batch_size, args.warmup_samples)
        if events.checkpoints
        else None
    )
    if args.keep_traces:
        shutil.copytree(traces, args.keep_traces, dirs_exist_ok=True)
    shutil.rmtree(run_dir)
    bare = bare_step(args, device)
    say(f"bare step: {bare['samples_per_s']:,.0f} samples/s")
    peak = matmul_peak_tflops(device, n=8192 if device.type == "cuda" else 256, reps=10)
    mfu_scale = loop / bare["samples_per_s"]
    result = {
        "command": command_line(),
        "device": device_name(device),
        "commit": git_commit(),
        "torch": torch.__version__,
        "preset": args.preset,
        "batch_size": args.batch_size,
        "backend": args.backend,
        "workers": args.workers,
        "recompute": args.recompute,
        "last_layer": args.last_layer,
        "table_rows": args.table_rows,
        "train_samples_in_store": train_samples,
        "eval_samples": report["eval_samples"],
        "prepare_s": prepare_s,
        "run_wall_s": run_s,
        "steps": history["steps"],
        "loop_samples_per_s": loop,
        "loop_samples_measured": loop_samples,
        "loop_samples_per_s_with_warmup": loop_all,
        "warmup_samples": args.warmup_samples,
        "bare": bare,
        "loop_vs_bare": mfu_scale,
        "evals": len(evals),
        "eval_seconds": eval_seconds,
        "eval_samples_per_s": eval_rate,
        "eval_vs_train_rate": eval_rate / loop,
        "train_seconds": train_seconds,
        "eval_seconds_total": float(sum(eval_seconds)),
        "checkpoint_seconds": history.get("checkpoint_seconds", 0.0),
        "run_seconds": history["seconds"],
        "profiled_steady": {"steps": list(quiet), **(steady or {})},
        "profiled_checkpoint": {"steps": list(near), **(beside or {})} if near else None,
        "loop_around_first_checkpoint": around,
        "checkpoint_write_seconds": write_seconds,
        "checkpoint_staging": staging.group(1) if staging else None,
        "checkpoint_step_waits": [float(m.group(1)) for m in WAITED.finditer(proc.stdout)],
        "checkpoint_wait_parts": [m.group(2) for m in WAITED.finditer(proc.stdout)],
        "matmul_peak_tflops": peak,
        "mfu_yardstick": bare["stu_tflops"] * mfu_scale / peak,
        "mfu_executed": bare["stu_tflops_executed"] * mfu_scale / peak,
        "mfu_yardstick_datasheet": bare["stu_tflops"] * mfu_scale / DATASHEET_BF16_TFLOPS,
        "checkpoint_every": args.checkpoint_every,
        "async_checkpoints": args.async_checkpoints == "true",
        "checkpoints": checkpoints,
        "table_gib": table_gib,
        "window_rates": windows,
        "warm_up": args.warm_up,
        "attention_kernels": args.attention_kernels,
        "triton_kernels_after_run_start": report.get("triton_kernels_after_run_start"),
    }
    text = table(result)
    print(text)
    if not args.smoke:
        name = "train" + (f"_{args.label}" if args.label else "")
        write_results(name, result, text, device=device)


def kernels_on_the_clock(r: dict) -> str:
    """ "compiled / autotuned" Triton kernels after RUN_START, as the run's report counted them."""
    counted = r.get("triton_kernels_after_run_start")
    if counted is None:
        return "-"
    return f"{len(counted['compiled'])} / {len(counted['autotuned'])}"


def checkpoint_mode(r: dict) -> str:
    if "async_checkpoints" not in r:
        return "blocking"
    return "written in the background" if r["async_checkpoints"] else "blocking"


def profile_rows(r: dict) -> list[str]:
    """The profiled windows' rows: the steady step's, the first checkpoint's neighbours' against it, and
    the loop's rate while that checkpoint is written against before it."""
    steady, near, around = r["profiled_steady"], r["profiled_checkpoint"], r["loop_around_first_checkpoint"]
    a, b = steady["steps"]
    rows = [
        f"| GPU busy in steps {a}-{b - 1} (no checkpoint, eval or window end) | "
        + (f"{steady['busy']:.0%} |" if "busy" in steady else "- |")
    ]
    if near is not None and "busy" in near and "busy" in steady:
        c, d = near["steps"]
        rows.append(
            f"| steps {c}-{d - 1} (the checkpoint after step {c}: its staging copy, its write begun): GPU busy; "
            f"ms a step against steps {a}-{b - 1} | {near['busy']:.0%}; {near['ms_per_step']:.1f} / "
            f"{steady['ms_per_step']:.1f} ms ({steady['ms_per_step'] / near['ms_per_step']:.2f} of the rate) |"
        )
    elif r["checkpoints"]:
        rows.append(
            f"| a checkpoint's neighbours | not profiled: no checkpoint has {PROFILE_STEPS} steps after it clear of evals and window ends |"
        )
    if near is not None:
        c, d = near["steps"]
        cells = [
            "-" if w.get("host") is None else f"{w['host']['training_ms']:.1f} / {w['host']['others_ms']:.1f}"
            for w in (steady, near)
        ]
        rows.append(
            f"| host threads inside torch ops, ms a step (the training's / the others'): steps {a}-{b - 1}; "
            f"steps {c}-{d - 1} | {cells[0]}; {cells[1]} |"
        )
    if r["checkpoints"]:  # ("-": a run whose log did not say, before the line was written)
        waits = r.get("checkpoint_step_waits") or []
        parts = (r.get("checkpoint_wait_parts") or [None])[0]
        waited = f"; the step waited {waits[0]:.2f} s at the first save" if waits else ""
        waited += f" ({parts})" if waits and parts else ""
        rows.append(f"| the checkpoints' staging | {r.get('checkpoint_staging') or '-'}{waited} |")
    if around is not None:
        written = r["checkpoint_write_seconds"]
        write = f"; written in {written[0]:.1f} s" if written else ""
        rows.append(
            "| loop samples/s in the windows from the first checkpoint on (its write in the background), against "
            f"those before it (goal >= 0.90) | {around['beside']:,.0f} / {around['before']:,.0f} "
            f"({around['ratio']:.2f}){write} |"
        )
    return rows


def step_parts_tables(r: dict) -> list[str]:
    """Where the steady window's device time went: milliseconds a step by part, then the top kernels."""
    steady = r["profiled_steady"]
    if "parts_ms" not in steady:
        return []
    a, b = steady["steps"]
    step_ms = steady["ms_per_step"]
    lines = [
        "",
        f"Where the step's device time goes, steps {a}-{b - 1} ({step_ms:.1f} ms a step, first kernel's start to "
        f"the last one's end; GPU busy {steady['busy']:.0%}; the copy engines' work runs beside the kernels):",
        "",
        "| part | ms a step | of the step |",
        "|---|---:|---:|",
    ]
    lines += [f"| {part} | {ms:.2f} | {ms / step_ms:.1%} |" for part, ms in steady["parts_ms"].items() if ms > 0]
    lines += ["", "| kernel | part | ms a step | launches a step |", "|---|---|---:|---:|"]
    lines += [
        f"| `{k['name']}` | {k['part']} | {k['ms_per_step']:.2f} | {k['launches_per_step']:g} |"
        for k in steady["top_kernels"]
    ]
    return lines


def table(r: dict) -> str:
    # The process's wall time: training, evals and checkpoints as the run timed them; the rest is
    # start-up (imports, tables, TorchRec's planner), compilation and autotuning, the profiler's
    # window and the report.
    other = r["run_wall_s"] - r["train_seconds"] - r["eval_seconds_total"] - r["checkpoint_seconds"]
    return "\n".join(
        [
            f"`python -m dlrmv4 train` on one {r['device']} (commit {r['commit']}): preset {r['preset']}, batch "
            f"{r['batch_size']}, {r['backend']} embeddings (contextual tables {r['table_rows']:,} rows each), "
            f"{r['workers']} loader workers, recompute {r['recompute']}, last layer {r['last_layer']}, attention kernels "
            f"{r.get('attention_kernels', 'auto')}, {r['steps']} steps, "
            f"{r['evals']} evals of {r['eval_samples']:,} samples, a checkpoint every "
            f"{r.get('checkpoint_every', '-')} steps ({checkpoint_mode(r)}); matmul peak measured in the same run "
            f"{r['matmul_peak_tflops']:.0f} TFLOP/s.",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| training loop samples/s (windows after the first {r['warmup_samples']:,} samples: "
            f"{r['loop_samples_measured']:,} samples) | {r['loop_samples_per_s']:,.0f} |",
            f"| training loop samples/s, every window (warm-up included) | {r['loop_samples_per_s_with_warmup']:,.0f} |",
            f"| bare step samples/s (same store's batches in device memory, {r['bare']['mean_tokens']:,.0f} mean tokens) | "
            f"{r['bare']['samples_per_s']:,.0f} |",
            f"| loop / bare step | {r['loop_vs_bare']:.2f} |",
            f"| eval samples/s (median of {r['evals']}) | {r['eval_samples_per_s']:,.0f} |",
            f"| eval rate / training rate (goal >= 3) | {r['eval_vs_train_rate']:.2f} |",
            f"| MFU, yardstick (every layer in full) / executed FLOPs, vs measured peak | {r['mfu_yardstick']:.1%} / "
            f"{r['mfu_executed']:.1%} |",
            *profile_rows(r),
            f"| the command's wall seconds: training / evals / checkpoints / rest (start-up, compilation, profiler) | "
            f"{r['run_wall_s']:.0f}: {r['train_seconds']:.1f} / {r['eval_seconds_total']:.1f} / "
            f"{r['checkpoint_seconds']:.1f} / {other:.1f} |",
            f"| data preparation (generate + preprocess + verify; not in the run) s | {r['prepare_s']:.1f} |",
            "",
            f"Each eval's seconds, in order: {' / '.join(f'{s:.1f}' for s in r['eval_seconds'])}. The kernels' warm-up "
            f"before RUN_START: `--warm-up {r.get('warm_up', 'auto')}`; Triton kernels compiled / autotuned after "
            f"RUN_START: {kernels_on_the_clock(r)}.",
            *step_parts_tables(r),
            *cuda_calls_table(r),
        ]
    )


if __name__ == "__main__":
    main()
