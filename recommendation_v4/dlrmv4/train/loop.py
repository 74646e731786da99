"""The streaming loop (SPEC §4): train windows in strict time order, evaluate at the eval cadence
on the fixed holdout window (or on window T+1 after window T), stop at the first eval that reaches
the target, checkpoint on the configured cadences and resume from the newest complete checkpoint.

Windows 0..W-2 train; window W-1 (the last day of the train span) is the holdout. One DataLoader
streams every train window (its workers live for the whole run); batches never span windows and a
window's last partial batch is dropped, so every step has the global batch size, eval points land
on multiples of the eval interval, and the loader position is just the step number.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.loader import make_window_loader
from dlrmv4.data.store import Store
from dlrmv4.mlperf.runlog import RunFacts, RunLog
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.checkpoint import (CheckpointCadence, CheckpointPosition, ModelAndOptimizers, latest_checkpoint,
                                     load_checkpoint, save_checkpoint)
from dlrmv4.train.metrics import AucAccumulator
from dlrmv4.train.optim import (FiniteMonitor, TrainingDivergedError, WarmupSchedule, clip_dense_gradients,
                                make_dense_optimizer)
from dlrmv4.train.progress import TrainProgress
from dlrmv4.train.rng import capture_rng_state, restore_rng_state
from dlrmv4.train.schedule import EvalSchedule


RUN_LOG_FILE = "mlperf_log.txt"


@dataclass
class EvalRecord:
    samples_count: int
    step: int
    window: int       # the train window the loop was in
    eval_window: int  # the window scored
    auc: float
    seconds: float    # since the run (first start) began


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_windows(store: Store) -> tuple[list[int], int]:
    """Train windows (all but the last) and the holdout window."""
    return list(range(store.num_windows - 1)), store.num_windows - 1


def sample_counts(store: Store) -> tuple[int, int]:
    """(train samples: the anchors of every train window, eval samples: the holdout's anchors)."""
    windows, holdout = split_windows(store)
    anchors = np.diff(np.asarray(store.window_offsets))
    return int(anchors[windows].sum()), int(anchors[holdout])


class StreamingTrainer:
    """One run on one device: the model, the sparse tables, both optimizers, the data stream."""

    def __init__(self, cfg: BenchmarkConfig, store: Store, model: DlrmHSTU, embeddings, device: torch.device,
                 log: Callable[[str], None] = print, progress: bool = False, runlog: RunLog | None = None,
                 config_filename: str = "python-api") -> None:
        self.cfg, self.store, self.model, self.embeddings = cfg, store, model, embeddings
        self.device, self._log, self.show_progress = device, log, progress
        self.runlog = runlog if runlog is not None else RunLog(Path(cfg.train.run_dir) / RUN_LOG_FILE)
        self.config_filename = config_filename
        self.progress: TrainProgress | None = None
        self.dense_params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_dense_optimizer(self.dense_params, cfg.train)
        self.schedule = WarmupSchedule(cfg.train)
        self.windows, self.holdout = split_windows(store)
        if not self.windows:
            raise ValueError("the store has fewer than two windows: nothing to train on")
        self.train_samples, self.eval_samples = sample_counts(store)
        self.evals = EvalSchedule(self.train_samples, cfg.loader.batch_size, cfg.train.eval_every_data_pct)
        self.cadence = CheckpointCadence(cfg.train)
        self.finite = FiniteMonitor(device)
        # The current window's running loss: checkpointed, so a resumed window reports the same mean.
        self.window_loss = torch.zeros((), dtype=torch.float64, device=device)
        self.window_steps = 0
        self.train_clock = TrainClock()

    def log(self, msg: str) -> None:
        if self.progress is None:
            self._log(msg)
        else:
            with self.progress.quiet():
                self._log(msg)

    # -- state ---------------------------------------------------------------------------
    def _state(self, history: RunHistory) -> dict[str, Any]:
        return {"dense": ModelAndOptimizers(self.model, [self.optimizer]),
                "sparse": self.embeddings.state_for_checkpoint(),
                "rng": capture_rng_state({"dropout": self.model.dropout_generator}),
                "window_accumulator": (float(self.window_loss), self.window_steps),
                "runlog": self.runlog.state(),
                "history": history}

    def save(self, history: RunHistory, window: int) -> None:
        position = CheckpointPosition(step=history.steps, samples_seen=history.samples, window=window,
                                      batch_in_window=0, evals_done=len(history.evals))
        path = save_checkpoint(self.cfg.train.run_dir, position, self._state(history),
                               self.cfg.train.keep_last_checkpoints)
        self.log(f"checkpoint {path.name} at step {history.steps}")

    def restore(self) -> RunHistory:
        """Continue from the newest complete checkpoint of run_dir, or start fresh."""
        path = latest_checkpoint(self.cfg.train.run_dir)
        if path is None:
            if not self.runlog.opened:
                self.runlog.open(0)
                self.runlog.init_start()
            self.runlog.init_stop_and_run_start(self.cfg, RunFacts(self.train_samples, self.eval_samples,
                                                                   self.config_filename))
            return RunHistory()
        template = {"dense": ModelAndOptimizers(self.model, [self.optimizer])}
        position, state = load_checkpoint(path, template)
        self.embeddings.load_from_checkpoint(state["sparse"])
        restore_rng_state(state["rng"], {"dropout": self.model.dropout_generator})
        self.runlog.resume(state["runlog"])
        loss_sum, self.window_steps = state["window_accumulator"]
        self.window_loss.fill_(loss_sum)
        history: RunHistory = state["history"]
        self.log(f"resumed from {path.name}: step {position.step}, {position.samples_seen:,} samples")
        return history

    # -- steps ---------------------------------------------------------------------------
    def step(self, batch, step: int, window: int) -> torch.Tensor:
        self.schedule.apply(step, self.optimizer, self.embeddings.set_learning_rate)
        out = self.model(batch, self.embeddings(batch))
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        clip_dense_gradients(self.dense_params, self.cfg.train.grad_clip_norm)
        self.optimizer.step()
        self.embeddings.sparse_step()
        loss = out.loss.detach()
        self.finite.update(loss, step, window)
        return loss

    @torch.no_grad()
    def evaluate(self, window: int) -> float:
        """Exact AUC over every anchor of ``window``."""
        self.model.eval()
        acc = AucAccumulator(self.device)
        for batch in make_window_loader(self.store, [window], self.cfg):
            batch = batch.to(self.device)
            acc.update(self.model(batch, self.embeddings(batch)).logits, batch.label)
        self.model.train()
        return acc.compute()

    def _eval(self, history: RunHistory, window: int, eval_window: int, started: float) -> bool:
        self.finite.check()
        auc = self.runlog.evaluation(history.samples, self.train_samples, lambda: self.evaluate(eval_window))
        history.evals.append(EvalRecord(samples_count=history.samples, step=history.steps, window=window,
                                        eval_window=eval_window, auc=auc,
                                        seconds=history.seconds + time.perf_counter() - started))
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
        if history.status != "running":
            self.log(f"run already finished ({history.status}); nothing to do")
            return history
        loader = make_window_loader(self.store, self.windows, self.cfg, start_batch=history.steps, drop_last=True)
        self.progress = TrainProgress(len(loader.dataset.plan) * self.cfg.loader.batch_size, history.samples,
                                      self.show_progress)
        try:
            self._stream(history, loader)
        except TrainingDivergedError:
            self.runlog.run_stop(history.samples, self.train_samples, "aborted")
            raise
        finally:
            self.progress.close()
            self.progress = None
        return history

    def _stream(self, history: RunHistory, loader) -> None:
        cfg = self.cfg
        plan = loader.dataset.plan
        started = tick = time.perf_counter()
        self.model.train()
        for i, batch in enumerate(loader, start=history.steps):
            window = plan[i].window
            batch = batch.to(self.device, non_blocking=True)
            self.window_loss += self.step(batch, history.steps, window)
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
            if finished or self.cadence.due(history.steps, time.perf_counter(), last_of_window):
                self.finite.check()  # never log RUN_STOP for, or checkpoint, a diverged state
                if finished:  # before the save: the checkpoint records the log with RUN_STOP in it
                    self.runlog.run_stop(history.samples, self.train_samples, history.status)
                history.seconds += time.perf_counter() - started
                started = time.perf_counter()
                self.save(history, window)
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
        mean_loss = float(self.window_loss) / self.window_steps
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
