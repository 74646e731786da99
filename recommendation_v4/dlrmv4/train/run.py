"""One training run from a config: open the store, build the model and tables, stream, report."""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dlrmv4.checkpoint.layout import CHECKPOINT_DIR
from dlrmv4.checkpoint.newest import resume_point
from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import to_dict
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import open_store
from dlrmv4.data.store_settings import check_store_settings
from dlrmv4.data.verify import check_verified
from dlrmv4.data.windows import sample_counts
from dlrmv4.distributed.cluster import Cluster, is_comm_failure
from dlrmv4.distributed.liveness import (
    RankLostError,
    lost_rank_error,
    own_failure_line,
    post_failure_and_linger,
    watch_failures,
)
from dlrmv4.distributed.process_start import start_cluster
from dlrmv4.errors import UserError, leave_for_launcher
from dlrmv4.files import check_writable
from dlrmv4.mlperf.rcp_band import rcp_band
from dlrmv4.mlperf.rules import check_closed_division
from dlrmv4.mlperf.runlog import RunLog
from dlrmv4.model.embeddings import needs_process_group, store_table_counts
from dlrmv4.model.embeddings.torchrec_backend.sharding import check_sharding_options
from dlrmv4.plan.disk import short_of_room
from dlrmv4.plan.explain import describe, refusal, summary
from dlrmv4.plan.machine import plan_for_run
from dlrmv4.plan.resolve import resolved_config
from dlrmv4.train.history import RunHistory
from dlrmv4.train.report import AUC_PLOT, REPORT_FILE, THROUGHPUT_PLOT, parameter_digest, write_report
from dlrmv4.train.run_lock import RunDirectoryLock
from dlrmv4.train.trainable import check_trainable, recipe_warnings
from dlrmv4.train.trainer import build_trainer

# Tables larger than this are not gathered onto one host for the report's digest.
DIGEST_TABLE_LIMIT_BYTES = 4 << 30
RUN_LOG_FILE = "mlperf_log.txt"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def clear_run_dir(run_dir: Path) -> None:
    """Forget a previous run in ``run_dir`` (checkpoints, report, plots) so the next one starts cold."""
    try:
        shutil.rmtree(run_dir / CHECKPOINT_DIR, ignore_errors=False)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise UserError(f"cannot clear the previous run in {run_dir}: {exc}") from exc
    for name in (REPORT_FILE, AUC_PLOT, THROUGHPUT_PLOT):
        (run_dir / name).unlink(missing_ok=True)


def run_log_path(cfg: BenchmarkConfig) -> Path:
    return Path(cfg.mlperf.log_file) if cfg.mlperf.log_file else Path(cfg.train.run_dir) / RUN_LOG_FILE


def start_run(cfg: BenchmarkConfig, cluster: Cluster, restart: bool = False) -> tuple[RunLog, Path | None]:
    """The one place a run's start is decided: (its MLPerf log, the checkpoint it resumes from).
    ``restart`` clears the run directory first. The resume point is found once, on rank 0 (its
    check hashes the checkpoint), and shared; a fresh run's log is opened here with INIT_START
    (before the model is built), a resumed run's is reopened by the Trainer from its checkpoint."""
    run_dir = Path(cfg.train.run_dir)
    runlog = RunLog(run_log_path(cfg), rank=cluster.rank, barrier=cluster.barrier)
    if cluster.is_main:
        runlog.check_writable(runlog.path)  # fail before any work, not at the first event
        if restart:
            clear_run_dir(run_dir)
    # Rank 0 hashes the checkpoint chain (hundreds of GB at the real job's size): the others wait the
    # checkpoint I/O bound, not the run's collective timeout.
    io = cluster.for_checkpoint_io()
    resume_from = io.broadcast(resume_point(run_dir) if cluster.is_main else None)
    cluster.release_checkpoint_io(io)
    if resume_from is None:  # the MLPerf run begins here
        runlog.open(0)
        runlog.init_start()
    return runlog, resume_from


def run_training(
    cfg: BenchmarkConfig,
    log: Callable[[str], None] = print,
    progress: bool = False,
    restart: bool = False,
    config_filename: str = "python-api",
) -> tuple[RunHistory, Path]:
    """Train until the target AUC, ``max_steps`` or the end of the data, resuming from the newest
    checkpoint of ``run_dir`` unless ``restart``; returns the history and the report path.

    Under a launcher (torchrun, or run_and_time.sh under SLURM) every process calls this; rank 0
    alone logs, writes the MLPerf log and the report."""
    check_sharding_options(cfg.embeddings)
    cluster = start_cluster(cfg.distributed, need_group=needs_process_group(cfg))
    watch = watch_failures(cluster)
    try:
        return _run(cfg, cluster, log if cluster.is_main else (lambda _: None), progress, restart, config_filename)
    except Exception as exc:
        if watch is not None:
            watch.stop()  # from here this thread reports, and only this thread
        if cluster.world_size > 1 and not isinstance(exc, RankLostError):
            # DDP's and TorchRec's own collectives fail deep in the step when a peer is gone.
            if not isinstance(exc, UserError) and is_comm_failure(exc):
                raise lost_rank_error(cluster, "a collective of the training step", exc) from exc
            # This rank's own failure: the others' watches read it and end their ranks naming it.
            line = own_failure_line(cluster, exc)
            # For a launcher first: the agent stops this rank once another rank has read the line and ended.
            leave_for_launcher(line)
            post_failure_and_linger(cluster, line)
            if isinstance(exc, torch.OutOfMemoryError):
                raise UserError(line) from exc
        raise
    finally:
        if watch is not None:
            watch.stop()
        # A rank of several leaves the group as it is and ends with os._exit (exit_process): NCCL's
        # teardown waits for every member, and a member may have gone (a failed rank's peers exit as
        # soon as they read its line; rank 0 may fail writing the report after the last collective).
        # At four GPUs a failed rank hung there and never printed its line.
        if cluster.world_size == 1:
            cluster.shutdown()


def _run(
    cfg: BenchmarkConfig,
    cluster: Cluster,
    log: Callable[[str], None],
    progress: bool,
    restart: bool,
    config_filename: str,
) -> tuple[RunHistory, Path]:
    run_dir = Path(cfg.train.run_dir)
    store_path = store_dir(cfg.dataset)
    if cluster.world_size > 1 and not (store_path / "meta.json").exists():
        raise UserError(
            f"no prepared store at {store_path}: prepare the data once before a multi-process run "
            "(python -m dlrmv4 prepare with the same flags; run_and_time.sh does it)"
        )
    store = open_store(store_path)
    check_store_settings(store_path, store.meta, cfg)
    train_samples, eval_samples = sample_counts(store)
    check_closed_division(cfg, train_samples, eval_samples)
    check_trainable(cfg, store)
    for warning in recipe_warnings(cfg, store.meta, train_samples):
        log(warning)
    # The memory plan, before anything is allocated: a run that cannot fit stops here with one line.
    plan = plan_for_run(cfg, cluster, store_table_counts(store))
    if not plan.fits:
        log(describe(plan))
        raise UserError(refusal(plan))
    cfg = resolved_config(plan, cfg)
    log(summary(plan))
    if short_of_room(plan.disk):
        log(short_of_room(plan.disk))
    # Last of the checks: on a store changed since its verification this one takes minutes.
    check_verified(store_path, cluster.world_size, log, progress)
    if cluster.is_main:
        check_writable(run_dir, "run directory")
    held = contextlib.ExitStack()  # the run directory's lock while the run lasts
    if cluster.is_main:  # rank 0 holds it for the launch, before anything in it is read or changed
        held.enter_context(RunDirectoryLock(run_dir, log))
    with held:
        runlog, resume_from = start_run(cfg, cluster, restart)
        seed_everything(cfg.seed)
        trainer = build_trainer(
            cfg, store, cluster, runlog, resume_from, log, progress, config_filename, plan.candidate.device_total
        )
        model, embeddings = trainer.model, trainer.embeddings
        log(
            f"training on {cluster.describe()} with {embeddings.backend} embeddings: {len(trainer.windows)} train "
            f"windows, holdout window {trainer.holdout}, {trainer.train_samples:,} train samples, global batch "
            f"{cfg.loader.batch_size} ({cfg.loader.batch_size // cluster.world_size} per process), eval every "
            f"{trainer.evaluator.schedule.interval:,} samples from {trainer.evaluator.schedule.first:,}, target AUC {cfg.train.target_auc}"
        )
        sharding = embeddings.describe_sharding()
        if sharding is not None:
            log(sharding)
        try:
            history = trainer.run()
        finally:
            runlog.close()
        digest = run_digest(model, embeddings)
        if not cluster.is_main:
            return history, run_dir / REPORT_FILE
        report, plots = write_report(
            run_dir,
            {
                "history": history.to_dict(),
                "config": to_dict(cfg),
                "eval_interval": trainer.evaluator.schedule.interval,
                "first_eval_samples": trainer.evaluator.schedule.first,
                "train_samples": trainer.train_samples,
                "device": str(cluster.device),
                "world_size": cluster.world_size,
                "embedding_backend": embeddings.backend,
                "sharding_plan": embeddings.sharding_rows(),
                "memory_plan": describe(plan),
                "chunks": cfg.train.chunks,
                "lookups_distributed_ahead": embeddings.lookups_distributed_ahead,
                "ids_looked_up": embeddings.ids_looked_up,
                "recompute": cfg.model.recompute,
                "parameters_sha256": digest,
                "mlperf_log": str(runlog.path),
                "eval_samples": trainer.eval_samples,
                "triton_kernels_after_run_start": (
                    None if trainer.kernels_on_the_clock is None else trainer.kernels_on_the_clock.as_dict()
                ),
            },
            cfg.train.target_auc,
            rcp_band(cfg),
        )
        if plots:
            log(f"plots: {', '.join(str(p) for p in plots)}")
        else:
            log("matplotlib is not installed: report written without plots")
        return history, report


def run_digest(model: torch.nn.Module, embeddings) -> str | None:
    """sha256 over every dense parameter and every table (None where the tables are too large to
    gather on one host; a collective with sharded tables)."""
    table_bytes = sum(s.rows for s in embeddings.specs) * embeddings.dim * 4
    if table_bytes > DIGEST_TABLE_LIMIT_BYTES:
        return None
    tables = embeddings.state_for_checkpoint().get("tables", {})
    sparse = {f"sparse.{name}.{part}": t for name, table in tables.items() for part, t in table.items()}
    dense = {f"dense.{k}": v for k, v in model.state_dict().items()}
    return parameter_digest({**dense, **sparse}) if embeddings.cluster.is_main else None
