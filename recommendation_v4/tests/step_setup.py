"""A training step built from a preset with small tables: the model, the tables and ``TrainStep``."""

from __future__ import annotations

import dataclasses

import torch

from dlrmv4.config import BenchmarkConfig, load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.model.embeddings import make_embeddings, table_specs
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.optim import FiniteMonitor
from dlrmv4.train.step import TrainStep


def small_table_config(preset: str, backend: str, rows: int, *, model: dict | None = None,
                       train: dict | None = None) -> BenchmarkConfig:
    """``preset`` with every table ``rows`` rows (random_batch draws ids below 100) and the given
    model / train fields changed."""
    cfg = load_config(preset)
    return dataclasses.replace(
        cfg, embeddings=dataclasses.replace(cfg.embeddings, embedding_backend=backend, item_rows=rows,
                                            artist_rows=rows, album_rows=rows),
        sampler=dataclasses.replace(cfg.sampler, **{f"{name}_rows": rows for name in CONTEXTUAL_FEATURES}),
        model=dataclasses.replace(cfg.model, **(model or {})),
        train=dataclasses.replace(cfg.train, **(train or {})))


def build_step(cfg: BenchmarkConfig, device: torch.device | str, seed: int = 0) -> TrainStep:
    """Model and tables from ``seed`` (the same numbers for either backend), and their step."""
    device = torch.device(device)
    torch.manual_seed(seed)
    model = DlrmHSTU(cfg.model, seed=seed).to(device)
    embeddings = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, device, seed=seed)
    return TrainStep(model, embeddings, cfg.train, FiniteMonitor(device))
