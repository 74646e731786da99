"""The streaming loop (SPEC §4): train windows in strict time order, evaluate at the eval cadence
on the fixed holdout window (or on window T+1 after window T), stop at the first eval that reaches
the target, checkpoint on the configured cadences and resume from the newest complete checkpoint.

Windows 0..W-2 train; window W-1 (the last, a partial day on Yambda-5B) is the holdout. One DataLoader
streams every train window (its workers live for the whole run); batches never span windows and a
window's last partial batch is dropped, so every step has the global batch size, eval points land
on multiples of the eval interval, and the loader position is just the step number.

Several ranks: each takes its slice of every global batch; the dense model is wrapped in
DistributedDataParallel (gradients averaged, so a step equals the one-process step on the whole
global batch), the window loss, the divergence monitor and the eval scores are reduced over the
ranks, decisions that depend on the clock are shared, and only rank 0 writes the run log.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.loader import make_window_loader, share_size
from dlrmv4.data.store import Store
from dlrmv4.mlperf.runlog import RunFacts, RunLog
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.chunks import chunked_logits
from dlrmv4.train.checkpoint import (CheckpointCadence, CheckpointPosition, ModelAndOptimizers, latest_checkpoint,
                                     load_checkpoint, save_checkpoint)
from dlrmv4.errors import UserError
from dlrmv4.train.distributed import Cluster
from dlrmv4.train.metrics import AucAccumulator, exact_auc
from dlrmv4.train.optim import FiniteMonitor, TrainingDivergedError
from dlrmv4.train.step import TrainStep
from dlrmv4.train.prefetch import DevicePrefetcher
from dlrmv4.train.progress import TrainProgress
from dlrmv4.train.rng import capture_rng_state, restore_rng_state
from dlrmv4.train.schedule import EvalSchedule
from dlrmv4.train.trace import StepProfiler, parse_step_windows


RUN_LOG_FILE = "mlperf_log.txt"


@dataclass
class EvalRecord:
    samples_count: int
    step: int
    window: int       # the train window the loop was in
    eval_window: int  # the window scored
    auc: float
    seconds: float    # since the run (first start) began
    eval_seconds: float = 0.0  # this eval's own time (scoring the window and the AUC)


@dataclass
class RunHistory:
    status: str = "running"  # then "success" (target reached), "aborted" (data exhausted first) or
    # "stopped" (train.max_steps reached first)
    steps: int = 0
    samples: int = 0
    evals: list[EvalRecord] = field(default_factory=list)
    window_losses: list[tuple[int, int, float]] = field(default_factory=list)  # (window, samples, mean loss)
    throughput: list[tuple[float, float]] = field(default_factory=list)       # (seconds, samples/s) per window
    seconds: float = 0.0
    checkpoint_seconds: float = 0.0  # spent writing checkpoints (this process)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_windows(store: Store) -> tuple[list[int], int]:
    """Train windows (all but the last) and the holdout window (the last: a partial day on Yambda)."""
    if store.num_windows < 2:
        raise UserError(f"the store at {store.path} has {store.num_windows} window(s) of anchors; training needs at "
                        "least two (train windows and the holdout): use more data or a smaller --min-history")
    return list(range(store.num_windows - 1)), store.num_windows - 1


def sample_counts(store: Store) -> tuple[int, int]:
    """(train samples: the anchors of every train window, eval samples: the holdout's anchors)."""
    windows, holdout = split_windows(store)
    anchors = np.diff(np.asarray(store.window_offsets))
    return int(anchors[windows].sum()), int(anchors[holdout])


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s own random streams (dropout); rank 0 keeps the run's seed."""
    if rank == 0:
        return seed
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint64)[0] >> 1)


class StreamingTrainer:
    """One run on one device per rank: the model, the sparse tables, both optimizers, the data stream."""

    def __init__(self, cfg: BenchmarkConfig, store: Store, model: DlrmHSTU, embeddings, device: torch.device,
                 log: Callable[[str], None] = print, progress: bool = False, runlog: RunLog | None = None,
                 config_filename: str = "python-api", cluster: Cluster | None = None) -> None:
        self.cfg, self.store, self.model, self.embeddings = cfg, store, model, embeddings
        self.device, self._log, self.show_progress = device, log, progress
        self.cluster = cluster or Cluster(0, 1, 0, 1, device)
        world = self.cluster.world_size
        if cfg.loader.batch_size % world:
            raise UserError(f"the global batch size {cfg.loader.batch_size} does not split evenly over {world} "
                            "processes: use a multiple of the world size")
        # Buffers are not synchronised: every rank builds the same ones. Inputs are already on the device.
        train_model = model if world == 1 else DistributedDataParallel(
            model, device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True)
        self.runlog = runlog if runlog is not None else RunLog(Path(cfg.train.run_dir) / RUN_LOG_FILE)
        self.config_filename = config_filename
        self.progress: TrainProgress | None = None
        self.windows, self.holdout = split_windows(store)
        self.train_samples, self.eval_samples = sample_counts(store)
        self.evals = EvalSchedule(self.train_samples, cfg.loader.batch_size, cfg.train.eval_every_data_pct)
        self.cadence = CheckpointCadence(cfg.train)
        self.finite = FiniteMonitor(device, None if world == 1 else lambda t: self.cluster.all_reduce_(t, "min"))
        self.step = TrainStep(model, embeddings, cfg.train, self.finite, train_model)
        self.optimizer = self.step.optimizer
        # The current window's running loss: checkpointed, so a resumed window reports the same mean.
        self.window_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.window_steps = 0
        self.train_clock = TrainClock()
        self.saved_runlog: dict[str, Any] | None = None
        self.profiler = StepProfiler(parse_step_windows(cfg.train.profile_steps), Path(cfg.train.run_dir),
                                     self.cluster.rank, device)

    def log(self, msg: str) -> None:
        if self.progress is None:
            self._log(msg)
        else:
            with self.progress.quiet():
                self._log(msg)

    # -- state ---------------------------------------------------------------------------
    def _state(self, history: RunHistory, runlog_state: dict[str, Any]) -> dict[str, Any]:
        return {"dense": ModelAndOptimizers(self.model, [self.optimizer]),
                "sparse": self.embeddings.checkpoint_state(),
                # The mean over ranks: a resume on another world size continues the same number.
                "window_accumulator": (self._global_window_loss(), self.window_steps),
                "runlog": runlog_state,
                "history": history}

    def _global_window_loss(self) -> float:
        total = self.cluster.all_reduce_(self.window_loss.clone())
        return float(total) / self.cluster.world_size

    def save(self, history: RunHistory, window: int, runlog_state: dict[str, Any] | None = None) -> None:
        position = CheckpointPosition(step=history.steps, samples_seen=history.samples, window=window,
                                      batch_in_window=0, evals_done=len(history.evals))
        # This rank's own streams and loss sum: a resume on the same world size continues them exactly.
        own = {"rng": capture_rng_state({"dropout": self.model.dropout_generator}),
               "window_loss": float(self.window_loss)}
        state = self._state(history, runlog_state if runlog_state is not None else self.runlog.state())
        path = save_checkpoint(self.cfg.train.run_dir, position, state,
                               self.cfg.train.keep_last_checkpoints, self.cluster, rank_state=own)
        self.log(f"checkpoint {path.name} at step {history.steps}")

    def restore(self) -> RunHistory:
        """Continue from the newest complete checkpoint of run_dir, or start fresh."""
        path = self.cluster.broadcast(latest_checkpoint(self.cfg.train.run_dir) if self.cluster.is_main else None)
        if path is None:
            if not self.runlog.opened:
                self.runlog.open(0)
                self.runlog.init_start()
            self.runlog.init_stop_and_run_start(self.cfg, RunFacts(self.train_samples, self.eval_samples,
                                                                   self.config_filename, self.cluster.world_size,
                                                                   self.step.chunks))
            return RunHistory()
        template = {"dense": ModelAndOptimizers(self.model, [self.optimizer]),
                    "sparse": self.embeddings.checkpoint_state()}
        position, state = load_checkpoint(path, template, self.cluster)
        saved_world = len(state["rank_states"])
        loss_sum, self.window_steps = state["window_accumulator"]
        if saved_world == self.cluster.world_size:
            own = state["rank_states"][self.cluster.rank]
            restore_rng_state(own["rng"], {"dropout": self.model.dropout_generator})
            loss_sum = own["window_loss"]
        else:
            # Other ranks, other streams: re-derive them from (seed, step, rank). The data stream and
            # every table and weight continue exactly; only dropout masks differ from an unbroken run.
            reseed = rank_seed(int(np.random.SeedSequence([self.cfg.seed, position.step]).generate_state(1)[0]),
                               self.cluster.rank)
            torch.manual_seed(reseed)
            self.model.dropout_generator.manual_seed(reseed)
            self.log(f"checkpoint written by {saved_world} process(es), resuming on {self.cluster.world_size}: "
                     "random streams re-derived from the seed and the step")
        self.saved_runlog = state["runlog"]  # reopened by run() only if the run goes on
        self.window_loss.fill_(loss_sum)
        history: RunHistory = state["history"]
        self.log(f"resumed from {path.name}: step {position.step}, {position.samples_seen:,} samples")
        return history

    # -- evaluation ----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, window: int) -> float:
        """Exact AUC over every anchor of ``window`` (each rank scores its slices, then all gather)."""
        self.model.eval()
        acc = AucAccumulator(self.device)
        rank, world = self.cluster.rank, self.cluster.world_size
        loader = make_window_loader(self.store, [window], self.cfg, rank=rank, world_size=world)
        plan = loader.dataset.plan
        slicing = self.cfg.loader.rank_slicing
        # The next batch's copy overlaps this one's forward, as in training.
        for batch, part in zip(DevicePrefetcher(loader, self.device), plan):
            mine = share_size(part.stop - part.start, rank, world, slicing)
            logits = chunked_logits(self.model, batch, self.embeddings(batch), self.step.chunks)
            acc.update(logits[:mine], batch.label[:mine])  # a stand-in sample (no share) adds nothing
        self.model.train()
        if world == 1:
            return acc.compute()
        sizes = [sum(share_size(p.stop - p.start, r, world, slicing) for p in plan) for r in range(world)]
        state = acc.state_dict()
        return exact_auc(self.cluster.all_gather_rows(state["scores"], sizes),
                         self.cluster.all_gather_rows(state["labels"], sizes))

    def _eval(self, history: RunHistory, window: int, eval_window: int, started: float) -> bool:
        self.finite.check()
        eval_started = time.perf_counter()
        auc = self.runlog.evaluation(history.samples, self.train_samples, lambda: self.evaluate(eval_window))
        history.evals.append(EvalRecord(samples_count=history.samples, step=history.steps, window=window,
                                        eval_window=eval_window, auc=auc,
                                        seconds=history.seconds + time.perf_counter() - started,
                                        eval_seconds=time.perf_counter() - eval_started))
        self.log(f"eval at {history.samples:,} samples (window {window}, scored window {eval_window}): AUC {auc:.4f}")
        if self.progress is not None:
            self.progress.record_auc(auc)
        reached = auc >= self.cfg.train.target_auc
        if not reached:
            self.runlog.block_start(history.samples, self.train_samples)
        return reached

    # -- the run -------------------------------------------------------------------------
    def run(self) -> RunHistory:
        history = self.restore()
        max_steps = self.cfg.train.max_steps
        if history.status == "stopped" and (max_steps == 0 or history.steps < max_steps):
            history.status = "running"  # a max_steps stop is a pause: a larger limit continues the run
            self.log(f"continuing the stopped run from step {history.steps}")
        if history.status != "running":
            self.log(f"run already finished ({history.status}); nothing to do")
            return history
        if self.saved_runlog is not None:
            self.runlog.resume(self.saved_runlog)
        loader = make_window_loader(self.store, self.windows, self.cfg, start_batch=history.steps, drop_last=True,
                                    rank=self.cluster.rank, world_size=self.cluster.world_size)
        self.progress = TrainProgress(len(loader.dataset.plan) * self.cfg.loader.batch_size, history.samples,
                                      self.show_progress and self.cluster.is_main)
        try:
            self._stream(history, loader)
        except TrainingDivergedError:
            self.runlog.run_stop(history.samples, self.train_samples, "aborted")
            raise
        finally:
            self._trace_written(self.profiler.close())
            self.progress.close()
            self.progress = None
        return history

    def _trace_written(self, path: Path | None) -> None:
        if path is not None:
            self.log(f"profiler trace {path}")

    def _stream(self, history: RunHistory, loader) -> None:
        cfg = self.cfg
        plan = loader.dataset.plan
        started = tick = time.perf_counter()
        self.model.train()
        for i, batch in enumerate(DevicePrefetcher(loader, self.device), start=history.steps):
            window = plan[i].window
            self.profiler.before_step(history.steps)
            self.window_loss += self.step(batch, history.steps, window)
            self._trace_written(self.profiler.after_step(history.steps))
            self.window_steps += 1
            history.steps += 1
            history.samples += cfg.loader.batch_size
            # Train time of this window: waiting for the batch plus the step; evals and checkpoints
            # are left out, so the per-window rate is the training rate.
            self.train_clock.add(time.perf_counter() - tick)
            self.progress.update(cfg.loader.batch_size, self._running_loss)
            last_of_window = i + 1 == len(plan) or plan[i + 1].window != window
            done = False
            if cfg.train.eval_mode == "holdout" and self.evals.should_eval(history.samples):
                done = self._eval(history, window, self.holdout, started)
            if last_of_window:
                self._close_window(history, window, started)
                if cfg.train.eval_mode == "next_window" and not done:
                    done = self._eval(history, window, window + 1, started)
            if done:
                history.status = "success"
            elif i + 1 == len(plan):
                history.status = "aborted"
            elif cfg.train.max_steps and history.steps >= cfg.train.max_steps:
                history.status = "stopped"
            finished = history.status != "running"
            due = self.cadence.due(history.steps, time.perf_counter(), last_of_window)
            if self.cadence.every_seconds > 0:
                due = self.cluster.any(due)  # clocks differ between ranks; the save is collective
            if finished or due:
                self.finite.check()  # never log RUN_STOP for, or checkpoint, a diverged state
                # A max_steps stop may be continued: its checkpoint records the log before RUN_STOP.
                paused_log = self.runlog.state() if history.status == "stopped" else None
                if finished:  # before the save: the checkpoint records the log with RUN_STOP in it
                    self.runlog.run_stop(history.samples, self.train_samples, history.status)
                history.seconds += time.perf_counter() - started
                started = time.perf_counter()
                self.save(history, window, paused_log)
                history.checkpoint_seconds += time.perf_counter() - started
            if finished:
                break
            tick = time.perf_counter()

    def _running_loss(self) -> float:
        """Mean loss of the current window so far (reads the device: progress refreshes only)."""
        return float(self.window_loss) / max(self.window_steps, 1)

    def _close_window(self, history: RunHistory, window: int, started: float) -> None:
        synced = time.perf_counter()
        self.finite.check()  # the one host read per window; it also waits for the window's last steps
        self.train_clock.add(time.perf_counter() - synced, steps=0)
        mean_loss = self._global_window_loss() / self.window_steps
        rate = self.train_clock.steps * self.cfg.loader.batch_size / max(self.train_clock.seconds, 1e-9)
        history.window_losses.append((window, history.samples, mean_loss))
        history.throughput.append((history.seconds + time.perf_counter() - started, rate))
        self.log(f"window {window}: {self.window_steps} steps, mean loss {mean_loss:.4f}, {rate:,.0f} samples/s")
        self.window_loss.zero_()
        self.window_steps = 0
        self.train_clock = TrainClock()


@dataclass
class TrainClock:
    """Seconds spent fetching batches and stepping in the current window, and the steps timed (a
    resumed window times only the steps since the resume)."""

    seconds: float = 0.0
    steps: int = 0

    def add(self, seconds: float, steps: int = 1) -> None:
        self.seconds += seconds
        self.steps += steps
