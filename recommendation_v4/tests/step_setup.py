"""A preset with small tables, for tests of the training step (``train.trainer.build_step`` builds it)."""

from __future__ import annotations

import dataclasses

from dlrmv4.config import BenchmarkConfig, load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES


def small_table_config(
    preset: str,
    backend: str,
    rows: int,
    *,
    model: dict | None = None,
    train: dict | None = None,
    qcomm: str | None = None,
) -> BenchmarkConfig:
    """``preset`` with every table ``rows`` rows (random_batch draws ids below 100) and the given
    model / train fields changed (``qcomm``: the all-to-all's precision, the preset's if None)."""
    cfg = load_config(preset)
    emb = dataclasses.replace(
        cfg.embeddings, embedding_backend=backend, item_rows=rows, artist_rows=rows, album_rows=rows
    )
    return dataclasses.replace(
        cfg,
        embeddings=emb if qcomm is None else dataclasses.replace(emb, qcomm=qcomm),
        sampler=dataclasses.replace(cfg.sampler, **{f"{name}_rows": rows for name in CONTEXTUAL_FEATURES}),
        model=dataclasses.replace(cfg.model, **(model or {})),
        train=dataclasses.replace(cfg.train, **(train or {})),
    )
