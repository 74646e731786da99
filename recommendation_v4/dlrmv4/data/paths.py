"""Where a dataset's raw files, hub cache and processed store live under ``dataset.data_path``."""

from __future__ import annotations

from pathlib import Path

from dlrmv4.config import DatasetConfig


def synthetic_raw_root(ds: DatasetConfig) -> Path:
    """Synthetic raw parquet, laid out as the hub lays out Yambda."""
    return Path(ds.data_path) / "raw" / ds.name


def hub_cache_dir(ds: DatasetConfig) -> Path:
    """The huggingface_hub cache (``cache_dir``) that downloads go to."""
    return Path(ds.data_path) / "hub_cache"


def store_dir(ds: DatasetConfig) -> Path:
    return Path(ds.data_path) / "processed" / ds.name
