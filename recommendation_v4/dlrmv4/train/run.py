"""One training run from a config: open the store, build the model and tables, stream, report."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from dlrmv4.config import BenchmarkConfig, to_dict
from dlrmv4.data.paths import store_dir
from dlrmv4.data.store import open_store, write_json
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.embeddings import make_embeddings, store_table_counts, table_specs
from dlrmv4.train.loop import RunHistory, StreamingTrainer

REPORT_FILE = "report.json"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_training(cfg: BenchmarkConfig, log: Callable[[str], None] = print) -> tuple[RunHistory, Path]:
    """Train until the target AUC or the end of the data; returns the history and the report path."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    store = open_store(store_dir(cfg.dataset))
    seed_everything(cfg.seed)
    model = DlrmHSTU(cfg.model, seed=cfg.seed).to(device)
    embeddings = make_embeddings(table_specs(cfg, *store_table_counts(store)), cfg, device, cfg.seed)
    trainer = StreamingTrainer(cfg, store, model, embeddings, device, log)
    log(f"training on {device} with {embeddings.backend} embeddings: {len(trainer.windows)} train windows, "
        f"holdout window {trainer.holdout}, {trainer.train_samples:,} train samples, eval every "
        f"{trainer.evals.interval:,} samples from {trainer.evals.first:,}, target AUC {cfg.train.target_auc}")
    history = trainer.run()
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    report = run_dir / REPORT_FILE
    write_json(report, {"history": history.to_dict(), "config": to_dict(cfg),
                        "eval_interval": trainer.evals.interval, "first_eval_samples": trainer.evals.first,
                        "train_samples": trainer.train_samples, "device": str(device),
                        "embedding_backend": embeddings.backend})
    return history, report
