"""A preset with small tables, for tests of the training step (``train.trainer.build_step`` builds it),
a torchrun worker's gloo rank, and the rows of a step's chunks in each of its tensors."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.distributed as dist
from row_count_probe import ChunkRows

from dlrmv4.config import BenchmarkConfig
from dlrmv4.config_loading import load_config
from dlrmv4.data.batch import TorchJaggedBatch
from dlrmv4.data.hashing import CONTEXTUAL_FEATURES
from dlrmv4.data.loader import BatchSlice, rank_share
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.chunks import chunk_bounds


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


def chunk_rows(model: DlrmHSTU, batch: TorchJaggedBatch, chunk_counts: Sequence[int]) -> ChunkRows:
    """The rows of every chunk of ``batch`` split into each of ``chunk_counts`` chunks, in each kind of
    tensor the step has (``row_count_probe.ChunkRows``): samples, samples x heads (the attention's
    batched products), sequence rows (contextual tokens, history and candidate of each sample) and
    looked-up rows (history, then the candidates)."""
    n, heads = batch.num_samples, model.cfg.num_heads
    samples = [bounds for k in chunk_counts for bounds in chunk_bounds(n, k)]

    def sequence(i: int) -> int:
        return model.sequence_row(batch, i)

    def looked_up(i: int) -> int:
        return batch.history_row(i) + i

    bounds = {
        n: samples,
        heads * n: [(heads * a, heads * b) for a, b in samples],
        sequence(n): [(sequence(a), sequence(b)) for a, b in samples],
        looked_up(n): [(looked_up(a), looked_up(b)) for a, b in samples],
    }
    if len(bounds) < 4:
        raise ValueError(f"two kinds of the step's tensors have the same row count: {sorted(bounds)}")
    return ChunkRows(
        bounds,
        samples_per_row={n: torch.arange(n), heads * n: torch.arange(n).repeat_interleave(heads)},
        lengths=torch.tensor([sequence(i + 1) - sequence(i) for i in range(n)]),
        max_seq_len=batch.max_history_length + model.num_contextual + 1,
    )
