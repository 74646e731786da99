"""The settings a store was built from, against a run's: a store made with other preprocessing
constants or from other data is not the one the run asks for, and is refused in one line naming
each difference (``prepare`` without ``--if-missing`` rebuilds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlrmv4.config import BenchmarkConfig
from dlrmv4.errors import UserError


def store_setting_changes(meta: dict[str, Any], cfg: BenchmarkConfig) -> list[str]:
    """'setting store -> run' for every setting of ``cfg`` that differs from what ``meta`` (a store's
    meta.json) records it was built with."""
    changes = []
    for name, built in sorted(meta.get("constants", {}).items()):
        if hasattr(cfg.preprocess, name) and getattr(cfg.preprocess, name) != built:
            changes.append(f"preprocess.{name} {built!r} -> {getattr(cfg.preprocess, name)!r}")
    dataset = meta.get("dataset", {})
    compared = ["hub_repo_id", "hub_revision"] if cfg.dataset.source == "yambda" else ["synthetic_seed"]
    for name in compared:
        if name in dataset and getattr(cfg.dataset, name) != dataset[name]:
            changes.append(f"dataset.{name} {dataset[name]!r} -> {getattr(cfg.dataset, name)!r}")
    return changes


def check_store_settings(path: Path, meta: dict[str, Any], cfg: BenchmarkConfig) -> None:
    changes = store_setting_changes(meta, cfg)
    if changes:
        raise UserError(
            f"the store at {path} was built with other settings ({'; '.join(changes)}; store -> this run): "
            "run with the store's settings, or rebuild it with python -m dlrmv4 prepare and this run's flags"
        )
