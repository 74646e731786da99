"""The streaming loop (docs/training.md): train windows in strict time order, evaluate at the eval cadence
on the fixed holdout window (or on window T+1 after window T), stop at the first eval that reaches
the target, checkpoint on the configured cadences and resume from the newest complete checkpoint.

Windows 0..W-2 train; window W-1 (the last, a partial day on Yambda-5B) is the holdout. One DataLoader
streams every train window (its workers live for the whole run); batches never span windows and a
window's last partial batch is dropped, so every step has the global batch size, eval points land
on multiples of the eval interval, and the loader position is just the step number.

Several ranks: each takes its share of every global batch; the dense model is wrapped in
DistributedDataParallel (gradients averaged, so a step equals the one-process step on the whole
global batch), the window loss, the divergence monitor and the eval scores are reduced over the
ranks, decisions that depend on the clock are shared, and only rank 0 writes the run log.

``build_trainer`` assembles a ``Trainer`` from the config (``build_model_and_tables`` the parts a
bare step needs); the components each own one concern: ``Evaluator`` (evals), ``Checkpointer``
(checkpoints and resume), ``RunLog`` (the MLPerf log), ``TrainProgress`` (the bar),
``TensorBoardScalars`` (live scalars), ``StepProfiler`` (profiler windows), ``TrainStep`` (one
optimizer step).
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from dlrmv4.checkpoint.writer import CheckpointWriteError
from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.fork_server import start_fork_server
from dlrmv4.data.loader import WindowLoader, make_window_loader
from dlrmv4.data.store import Store
from dlrmv4.data.windows import sample_counts, split_windows
from dlrmv4.distributed.cluster import Cluster, check_batch_splits
from dlrmv4.errors import UserError
from dlrmv4.mlperf.runlog import RunFacts, RunLog
from dlrmv4.model.embeddings import (
    SparseEmbeddings,
    looks_up_distinct_ids,
    make_embeddings,
    store_table_counts,
    table_specs,
)
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.ops.attention_kernels import AttentionKernels, attention_kernels
from dlrmv4.ops.compiled_kernels import CompiledKernels, compiled_kernels
from dlrmv4.ops.dispatch import resolve
from dlrmv4.train.checkpointer import Checkpointer
from dlrmv4.train.evaluator import Evaluator
from dlrmv4.train.history import RunHistory, TrainClock
from dlrmv4.train.optim import FiniteMonitor, TrainingDivergedError
from dlrmv4.train.prefetch import DevicePrefetcher, with_next
from dlrmv4.train.progress import TrainProgress
from dlrmv4.train.step import TrainStep
from dlrmv4.train.tensorboard_scalars import TensorBoardScalars
from dlrmv4.train.trace import StepProfiler, parse_step_windows
from dlrmv4.train.warm_up import warm_up, warm_up_wanted


def build_model_and_tables(
    cfg: BenchmarkConfig, table_counts: tuple[int, int, int], cluster: Cluster, seed: int | None = None
) -> tuple[DlrmHSTU, SparseEmbeddings]:
    """The dense model on the cluster's device and the sparse tables (their rows for
    ``table_counts``' item/artist/album sizes where the config sets none). From the run's seed
    (the same dropout stream on every rank), or, given ``seed``, both from it after seeding torch with it."""
    if seed is not None:
        torch.manual_seed(seed)
    # The dropout stream is the same on every rank, as the reference's (its DECORRELATE_DROPOUT=0).
    model_seed = cfg.seed if seed is None else seed
    model = DlrmHSTU(cfg.model, seed=model_seed).to(cluster.device)
    embeddings = make_embeddings(
        table_specs(cfg, *table_counts), cfg, cluster.device, cfg.seed if seed is None else seed, cluster, dense=model
    )
    return model, embeddings


def build_step(
    cfg: BenchmarkConfig, table_counts: tuple[int, int, int], device: torch.device | str, seed: int = 0
) -> TrainStep:
    """One process's model, tables and training step from ``seed`` (benchmarks and tests of the step)."""
    device = torch.device(device)
    model, embeddings = build_model_and_tables(cfg, table_counts, Cluster.single(device), seed)
    return TrainStep(model, embeddings, cfg.train, FiniteMonitor(device))


def build_trainer(
    cfg: BenchmarkConfig,
    store: Store,
    cluster: Cluster,
    runlog: RunLog,
    resume_from: Path | None,
    log: Callable[[str], None] = print,
    progress: bool = False,
    config_filename: str = "python-api",
    planned_peak: int | None = None,
) -> "Trainer":
    """A ``Trainer`` for ``cfg`` on ``store``: the model and tables built and placed for this rank.
    ``runlog``, ``resume_from`` and ``planned_peak`` as the Trainer takes them (``run.py`` makes them)."""
    model, embeddings = build_model_and_tables(cfg, store_table_counts(store), cluster)
    return Trainer(
        cfg, store, model, embeddings, cluster, runlog, resume_from, log, progress, config_filename, planned_peak
    )


def worker_starts(tables_pinned: bool, staging_pinned: bool) -> tuple[str | None, str | None]:
    """How the training and the eval loaders' workers start: from the fork server where the rank
    holds pinned host memory a forked worker would copy (tables in host memory: both; an
    asynchronous checkpoint's staging copy, pinned before RUN_START: the evals'), else forked."""
    train = "forkserver" if tables_pinned else None
    return train, "forkserver" if staging_pinned else train


class Trainer:
    """One run on one device per rank: the model, the sparse tables, both optimizers, the data stream."""

    def __init__(
        self,
        cfg: BenchmarkConfig,
        store: Store,
        model: DlrmHSTU,
        embeddings,
        cluster: Cluster,
        runlog: RunLog,
        resume_from: Path | None,
        log: Callable[[str], None] = print,
        progress: bool = False,
        config_filename: str = "python-api",
        planned_peak: int | None = None,
    ) -> None:
        """``runlog``: the run's MLPerf log, opened by the caller for a fresh run (INIT_START
        before the model is built) and reopened here from the checkpoint for a resumed one.
        ``resume_from``: the checkpoint the run continues from, found once by the caller
        (``checkpoint.resume_point``), None for a fresh run. ``planned_peak``: the memory plan's
        device bytes for this rank (None: no plan; checkpoints then take no snapshot on the device)."""
        self.planned_peak = planned_peak
        world = cluster.world_size
        check_batch_splits(cfg.loader.batch_size, world)
        self.cfg, self.store, self.model, self.embeddings, self.cluster = cfg, store, model, embeddings, cluster
        self.device = cluster.device
        self._log, self.show_progress, self.config_filename = log, progress, config_filename
        self.progress: TrainProgress | None = None
        self.windows, self.holdout = split_windows(store)
        self.train_samples, self.eval_samples = sample_counts(store)
        self.runlog, self.resume_from = runlog, resume_from
        self.finite = FiniteMonitor(self.device, None if world == 1 else lambda t: cluster.all_reduce_(t, "min"))
        # Data parallel: as DistributedModelParallel wrapped it (TorchRec), or here (the plain backend).
        # Buffers are not synchronised: every rank builds the same ones. Inputs are already on the device.
        train_model = embeddings.dense_parallel
        if train_model is None:
            train_model = (
                model
                if world == 1
                else DistributedDataParallel(
                    model, device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True
                )
            )
        self.step = TrainStep(model, embeddings, cfg.train, self.finite, train_model)
        # The training loader's workers fork after stage_ahead has pinned the staging copy (after
        # RUN_START, where they may load data): what that fork costs is not measured yet.
        self.worker_start, eval_worker_start = worker_starts(
            embeddings.holds_pinned_host_memory, cfg.train.async_checkpoints and self.device.type == "cuda"
        )
        self.fork_server_wanted = cfg.loader.num_workers > 0 and "forkserver" in (self.worker_start, eval_worker_start)
        self.dedup_ids = looks_up_distinct_ids(cfg, embeddings.backend)  # the loader packs them
        self.evaluator = Evaluator(
            cfg,
            store,
            model,
            embeddings,
            self.step.chunks,
            cluster,
            self.runlog,
            self.train_samples,
            self.holdout,
            eval_worker_start,
            self.dedup_ids,
        )
        self.checkpointer = Checkpointer(cfg, cluster, model, self.step.optimizer, embeddings, self.log)
        self.profiler = StepProfiler(
            parse_step_windows(cfg.train.profile_steps), Path(cfg.train.run_dir), cluster.rank, self.device
        )
        self.scalars = TensorBoardScalars(
            Path(cfg.train.run_dir), cluster, self.step.schedule, cfg.train.tensorboard, self.log
        )
        # The current window's running loss: checkpointed, so a resumed window reports the same mean.
        self.window_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.window_steps = 0
        self.train_clock = TrainClock()
        # The Triton kernels compiled so far at RUN_START, and those compiled or tuned after it.
        self.compiled_at_start: CompiledKernels | None = None
        self.kernels_on_the_clock: CompiledKernels | None = None

    def log(self, msg: str) -> None:
        if self.progress is None:
            self._log(msg)
        else:
            with self.progress.quiet():
                self._log(msg)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> RunHistory:
        history = self._resume_or_start()
        if history.status != "running":
            self.log(f"run already finished ({history.status}); nothing to do")
            return history
        loader = make_window_loader(
            self.store,
            self.windows,
            self.cfg,
            start_batch=history.steps,
            drop_last=True,
            rank=self.cluster.rank,
            world_size=self.cluster.world_size,
            worker_start=self.worker_start,
            dedup_ids=self.dedup_ids,
        )
        self.progress = TrainProgress(
            len(loader.batch_plan) * self.cfg.loader.batch_size,
            history.samples,
            self.show_progress and self.cluster.is_main,
        )
        try:
            self.scalars.open(history.steps, resumed=self.resume_from is not None)
            self._stream(history, loader)
            self._compiled_on_the_clock()
        except TrainingDivergedError:
            self.runlog.run_stop(history.samples, self.train_samples, "aborted")
            raise
        finally:
            # Each is closed however the run ends; the checkpoint being written (of a state before any
            # failure) is finished, except on a failing rank of several. When the run ends by an error,
            # that error is the one reported.
            failing = sys.exc_info()[0] is not None
            # A failing rank of several leaves the write in flight: a peer that stopped would keep its
            # collectives waiting for hours (the previous checkpoint stays the resume point).
            abandon = failing and self.cluster.world_size > 1
            closes = (
                self.scalars.close,
                lambda: self._trace_written(self.profiler.close()),
                self.progress.close,
                self.checkpointer.abandon if abandon else self.checkpointer.close,
            )
            for close in closes:
                if failing:
                    with contextlib.suppress(Exception):
                        close()
                else:
                    close()
            self.progress = None
        return history

    def _resume_or_start(self) -> RunHistory:
        """The newest checkpoint's history (its MLPerf log reopened if the run goes on), or a fresh
        run's, whose MLPerf log gets INIT_STOP and RUN_START here."""
        resumed = self.checkpointer.restore(self.resume_from)
        max_steps = self.cfg.train.max_steps
        if resumed is not None and resumed.history.status == "stopped":
            if max_steps == 0 or resumed.history.steps < max_steps:
                resumed.history.status = "running"  # a max_steps stop is a pause: a larger limit continues the run
                self.log(f"continuing the stopped run from step {resumed.history.steps}")
        if resumed is None or resumed.history.status == "running":
            # Before RUN_START: outside the timed run (not for a run with nothing to do).
            if self.fork_server_wanted:  # the loaders' workers then start without importing torch
                start_fork_server()
            warmed_up = self._warm_up_kernels()
            self.checkpointer.stage_ahead(self.planned_peak if warmed_up else None)
        facts = RunFacts(
            self.train_samples, self.eval_samples, self.config_filename, self.cluster.world_size, self.step.chunks
        )
        if resumed is None:
            if not self.runlog.opened:
                raise RuntimeError("a fresh run's MLPerf log is opened (INIT_START) before its Trainer is built")
            self.runlog.init_stop_and_run_start(self.cfg, facts)
            return RunHistory()
        self.window_loss.fill_(resumed.window_loss)
        self.window_steps = resumed.window_steps
        history = resumed.history
        if history.status == "running":
            self.runlog.resume(resumed.runlog, self.cfg, facts, resumed.changed_settings)
        return history

    def _warm_up_kernels(self) -> bool:
        """Compile and autotune the step's and the eval's Triton kernels on synthetic batches (train.warm_up);
        whether the warm-up ran."""
        kernels = resolve(self.cfg.model.kernels, self.device)
        warmed_up = warm_up_wanted(self.cfg.train.warm_up, kernels)
        if warmed_up:
            rows = {spec.name: spec.rows for spec in self.embeddings.specs}
            samples = self.cfg.loader.batch_size // self.cluster.world_size
            self.log(warm_up(self.step, samples, rows, self.cfg.sampler.max_seq_len, self.dedup_ids).describe())
        if kernels != "triton" and self.cfg.model.attention_kernels == "gluon":
            raise UserError(
                f"--attention-kernels gluon needs the Triton ops on a GPU; this run takes the {kernels} ops"
            )
        if kernels == "triton":  # (the PyTorch reference ops compile nothing)
            self.log(self._attention_kernels().describe())
            self.compiled_at_start = compiled_kernels()
        return warmed_up

    def _attention_kernels(self) -> AttentionKernels:
        """The kernels the STU layers' attention runs on this device (``model.attention_kernels``)."""
        m = self.cfg.model
        dtype = getattr(torch, m.sequence_dtype)
        q = torch.empty(0, m.num_heads, m.qk_dim, dtype=dtype, device=self.device)
        v = torch.empty(0, m.num_heads, m.v_dim, dtype=dtype, device=self.device)
        try:
            return attention_kernels(m.attention_kernels, q, v)
        except ValueError as exc:
            raise UserError(f"--attention-kernels {m.attention_kernels}: {exc}") from None

    def _compiled_on_the_clock(self) -> None:
        """Say how many kernels were compiled or autotuned inside the timed run (none after a warm-up)."""
        now = compiled_kernels()
        if now is None or self.compiled_at_start is None:
            return
        self.kernels_on_the_clock = now.since(self.compiled_at_start)
        self.log(f"Triton kernels after RUN_START: {self.kernels_on_the_clock.describe()}")

    def _stream(self, history: RunHistory, loader: WindowLoader) -> None:
        plan = loader.batch_plan
        started = tick = time.perf_counter()
        self.model.train()
        batches = DevicePrefetcher(loader, self.device)
        pairs = with_next(batches) if self.step.pipelined else ((batch, None) for batch in batches)
        for i, (batch, upcoming) in enumerate(pairs, start=history.steps):
            window = plan[i].window
            writing = self.profiler.writing_seconds
            self._train_step(history, batch, window, upcoming)
            self.checkpointer.raise_if_write_failed()
            # Train time of this window: waiting for the batch plus the step; evals, checkpoints and
            # writing profiler traces are left out, so the per-window rate is the training rate.
            self.train_clock.add(time.perf_counter() - tick - (self.profiler.writing_seconds - writing))
            last_of_window = i + 1 == len(plan) or plan[i + 1].window != window
            done = self.evaluator.holdout_due(history.samples) and self._eval(history, window, self.holdout, started)
            if last_of_window:
                self._close_window(history, window, started)
                if not done and self.evaluator.after_each_window:
                    done = self._eval(history, window, window + 1, started)
            history.status = self._status(history, done, data_left=i + 1 < len(plan))
            finished = history.status != "running"
            if finished or self.checkpointer.due(history, window, last_of_window):
                now = time.perf_counter()
                history.seconds += now - started
                started = now  # the checkpoint's own time counts in the next stretch of the run's seconds
                self._checkpoint(history, window, finished)
            if finished:
                break
            tick = time.perf_counter()

    def _train_step(self, history: RunHistory, batch, window: int, upcoming=None) -> None:
        self.profiler.before_step(history.steps)
        loss = self.step(batch, history.steps, window, upcoming)
        self.window_loss += loss
        self.scalars.add_step(loss)
        self._trace_written(self.profiler.after_step(history.steps))
        self.window_steps += 1
        history.steps += 1
        history.samples += self.cfg.loader.batch_size
        assert self.progress is not None  # run() sets it for the stream
        self.progress.update(self.cfg.loader.batch_size, self._running_loss)

    def _eval(self, history: RunHistory, window: int, eval_window: int, started: float) -> bool:
        """Score ``eval_window``; True when it reached the target."""
        self.finite.check()
        self.scalars.write_steps()
        record = self.evaluator.run(history, window, eval_window, history.seconds + time.perf_counter() - started)
        self.scalars.write_eval(record)
        self.log(
            f"eval at {history.samples:,} samples (window {window}, scored window {eval_window}): AUC {record.auc:.4f}"
        )
        assert self.progress is not None  # run() sets it for the stream
        self.progress.record_auc(record.auc)
        return record.auc >= self.cfg.train.target_auc

    def _status(self, history: RunHistory, reached: bool, data_left: bool) -> str:
        if reached:
            return "success"
        if not data_left:
            return "aborted"
        if self.cfg.train.max_steps and history.steps >= self.cfg.train.max_steps:
            return "stopped"
        return "running"

    def _checkpoint(self, history: RunHistory, window: int, finished: bool) -> None:
        self.finite.check()  # never log RUN_STOP for, or checkpoint, a diverged state
        self.scalars.write_steps()  # on disk before the checkpoint: a resume from it continues the curves
        # A max_steps stop may be continued: its checkpoint records the log before RUN_STOP.
        paused_log = self.runlog.state() if history.status == "stopped" else None
        if finished:  # before the save: a finished run's checkpoint records the log with RUN_STOP in it
            self.runlog.run_stop(history.samples, self.train_samples, history.status)
            if history.status != "stopped":
                self._last_checkpoint(history, window)
                return
            if not self.cfg.train.final_checkpoint:
                self.log(f"run {history.status}: no final checkpoint (train.final_checkpoint is false)")
                return
        runlog_state = paused_log if paused_log is not None else self.runlog.state()
        started = time.perf_counter()
        self.checkpointer.save(history, window, self.window_loss, self.window_steps, runlog_state)
        waited = time.perf_counter() - started
        if not finished:  # a finished run's last save comes after RUN_STOP, outside the timed run
            history.checkpoint_seconds += waited
        self.scalars.write_checkpoint_wait(history.steps, waited)

    def _last_checkpoint(self, history: RunHistory, window: int) -> None:
        """The end of a run that has reached its target or run out of data (RUN_STOP logged: its result
        stands): its last checkpoint (train.final_checkpoint), written to the end here. A write that
        fails, this one's or the one still in flight, is said in one warning line and the run ends as it
        is (a resume goes on from the newest checkpoint that was written)."""
        try:
            if self.cfg.train.final_checkpoint:
                started = time.perf_counter()
                self.checkpointer.save(history, window, self.window_loss, self.window_steps, self.runlog.state())
                self.scalars.write_checkpoint_wait(history.steps, time.perf_counter() - started)
            else:
                self.log(f"run {history.status}: no final checkpoint (train.final_checkpoint is false)")
            self.checkpointer.wait()
        except CheckpointWriteError as exc:
            self.log(
                f"warning: the run ended ({history.status}, RUN_STOP logged), but a checkpoint was not written: {exc}"
            )

    def _trace_written(self, path: Path | None) -> None:
        if path is not None:
            self.log(f"profiler trace {path}")

    def _running_loss(self) -> float:
        """Mean loss of the current window so far (reads the device: progress refreshes only)."""
        return float(self.window_loss) / max(self.window_steps, 1)

    def _close_window(self, history: RunHistory, window: int, started: float) -> None:
        synced = time.perf_counter()
        self.finite.check()  # the one host read per window; it also waits for the window's last steps
        self.train_clock.add(time.perf_counter() - synced, steps=0)
        mean_loss = self.cluster.mean(self.window_loss) / self.window_steps
        rate = self.train_clock.steps * self.cfg.loader.batch_size / max(self.train_clock.seconds, 1e-9)
        history.window_losses.append((window, history.samples, mean_loss))
        history.throughput.append((history.seconds + time.perf_counter() - started, rate))
        self.log(f"window {window}: {self.window_steps} steps, mean loss {mean_loss:.4f}, {rate:,.0f} samples/s")
        self.scalars.write_steps()
        self.scalars.write_window(history.steps, mean_loss, rate)
        self.window_loss.zero_()
        self.window_steps = 0
        self.train_clock = TrainClock()
