"""A preset with small tables, for tests of the training step (``train.trainer.build_step`` builds it),
and a torchrun worker's gloo rank."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import load_config
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.data.loader import BatchSlice, rank_share
from dlrmv4.distributed import Cluster


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


def gloo_rank(num_samples: int) -> tuple[Cluster, range]:
    """This torchrun worker's gloo process group as a Cluster on the CPU, and its contiguous share
    of a batch of ``num_samples`` samples (the samples it trains)."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cluster = Cluster(
        rank, world, rank, world, torch.device("cpu"), backend="gloo", control=dist.new_group(backend="gloo")
    )
    share = rank_share(BatchSlice(0, 0, num_samples), rank, world, "contiguous")
    return cluster, range(int(share[0]), int(share[-1]) + 1)
