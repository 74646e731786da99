"""One training run from a config: open the store, build the model and tables, stream, report."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dlrmv4.config import BenchmarkConfig, to_dict
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import open_store
from dlrmv4.errors import UserError
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.mlperf.rules import check_closed_division
from dlrmv4.mlperf.runlog import RunLog
from dlrmv4.train.checkpoint import CHECKPOINT_DIR, latest_checkpoint
from dlrmv4.train.embeddings import make_embeddings, store_table_counts, table_specs
from dlrmv4.train.loop import RUN_LOG_FILE, RunHistory, StreamingTrainer, sample_counts
from dlrmv4.train.report import AUC_PLOT, REPORT_FILE, THROUGHPUT_PLOT, parameter_digest, write_report


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


def check_run_dir_writable(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"run directory {run_dir} is not writable: {exc.strerror or exc}") from exc


def run_log_path(cfg: BenchmarkConfig) -> Path:
    return Path(cfg.mlperf.log_file) if cfg.mlperf.log_file else Path(cfg.train.run_dir) / RUN_LOG_FILE


def run_training(cfg: BenchmarkConfig, log: Callable[[str], None] = print, progress: bool = False,
                 restart: bool = False, config_filename: str = "python-api") -> tuple[RunHistory, Path]:
    """Train until the target AUC, ``max_steps`` or the end of the data, resuming from the newest
    checkpoint of ``run_dir`` unless ``restart``; returns the history and the report path."""
    run_dir = Path(cfg.train.run_dir)
    check_run_dir_writable(run_dir)
    store = open_store(store_dir(cfg.dataset))
    train_samples, eval_samples = sample_counts(store)
    check_closed_division(cfg, train_samples, eval_samples)
    runlog = RunLog(run_log_path(cfg))
    runlog.check_writable(runlog.path)  # fail before any work, not at the first event
    if restart:
        clear_run_dir(run_dir)
    if latest_checkpoint(run_dir) is None:  # a cold start: the MLPerf run begins here
        runlog.open(0)
        runlog.init_start()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    seed_everything(cfg.seed)
    model = DlrmHSTU(cfg.model, seed=cfg.seed).to(device)
    embeddings = make_embeddings(table_specs(cfg, *store_table_counts(store)), cfg, device, cfg.seed)
    trainer = StreamingTrainer(cfg, store, model, embeddings, device, log, progress, runlog, config_filename)
    log(f"training on {device} with {embeddings.backend} embeddings: {len(trainer.windows)} train windows, "
        f"holdout window {trainer.holdout}, {trainer.train_samples:,} train samples, eval every "
        f"{trainer.evals.interval:,} samples from {trainer.evals.first:,}, target AUC {cfg.train.target_auc}")
    try:
        history = trainer.run()
    finally:
        runlog.close()
    sparse = {f"sparse.{name}.{part}": t for name, table in embeddings.state_for_checkpoint()["tables"].items()
              for part, t in table.items()}
    dense = {f"dense.{k}": v for k, v in model.state_dict().items()}
    report, plots = write_report(run_dir, {
        "history": history.to_dict(), "config": to_dict(cfg), "eval_interval": trainer.evals.interval,
        "first_eval_samples": trainer.evals.first, "train_samples": trainer.train_samples,
        "device": str(device), "embedding_backend": embeddings.backend,
        "parameters_sha256": parameter_digest({**dense, **sparse}), "mlperf_log": str(runlog.path),
        "eval_samples": trainer.eval_samples}, cfg.train.target_auc)
    if plots:
        log(f"plots: {', '.join(str(p) for p in plots)}")
    else:
        log("matplotlib is not installed: report written without plots")
    return history, report
