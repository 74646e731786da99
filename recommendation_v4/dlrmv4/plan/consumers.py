"""What holds device memory besides the tables and the activations: the dense model, the step's
batch, looked-up rows, their gradients and the all-to-all buffers (on the rank that serves the most
rows), and the host memory an asynchronous checkpoint stages into.
"""

from __future__ import annotations

import torch

from dlrmv4.config import BenchmarkConfig
from dlrmv4.data.hashing import NUM_CONTEXTUAL
from dlrmv4.model.embeddings.tables import TABLE_NAMES
from dlrmv4.model.embeddings.torchrec_backend.sharding import DEFAULT_SHARDING, SHARDING_TYPES, table_options
from dlrmv4.plan.activations import DTYPE_BYTES
from dlrmv4.plan.memory_plan import PHASES, Consumer, TableUse, Target

SHARED_TABLES = 3  # item, artist, album: history and candidate rows
HISTORY_RESERVED = 9  # max_seq_len = history + 8 contextual + 1 candidate


def dense_parameters(cfg: BenchmarkConfig) -> int:
    from dlrmv4.model.hstu import DlrmHSTU

    with torch.device("meta"):
        return sum(p.numel() for p in DlrmHSTU(cfg.model).parameters())


def checkpoint_staging(cfg: BenchmarkConfig, tables: tuple[TableUse, ...]) -> int:
    """Host memory an asynchronous checkpoint copies a process's state into: its tables as planned
    (a cached table's whole host copy, not its cache) and the dense weights with Adam's two moments
    (12 B a parameter)."""
    if not cfg.train.async_checkpoints:
        return 0
    table_bytes = sum(u.host_bytes if u.placement.startswith("uvm") else u.device_bytes for u in tables)
    return table_bytes + 12 * dense_parameters(cfg)


def dense_model(cfg: BenchmarkConfig, world_size: int) -> Consumer:
    """Weights, gradients and Adam's two moments in fp32 (16 B per parameter), + the DDP buckets."""
    params = dense_parameters(cfg)
    per = 16 + (4 if world_size > 1 else 0)
    what = "weights, gradients, Adam" + (", DDP buckets" if world_size > 1 else "")
    return Consumer(f"dense model: {params:,} parameters ({what})", params * per)


def _rows_served(cfg: BenchmarkConfig, world_size: int, history: int, samples: int, table_rows: dict[str, int]) -> int:
    """The most rows one rank may serve in a step's all-to-all: every rank may ask it for all of
    its ids (a table it holds alone, or ids that all fall in its row-wise block, as the popular ones
    may; seen on 4 GPUs). With the ids deduplicated (``embeddings.dedup_ids``) a rank asks for each
    row at most once, so a table's share is also at most the rows each rank holds of it."""
    sharding = table_options(cfg.embeddings.sharding_types, "sharding_types", SHARDING_TYPES, DEFAULT_SHARDING)
    served = world_size * samples * (SHARED_TABLES + NUM_CONTEXTUAL)  # candidates and contextual ids
    for name in TABLE_NAMES[:SHARED_TABLES]:
        asked = world_size * history
        if cfg.embeddings.dedup_ids:
            held = -(-table_rows[name] // world_size) if sharding[name] == "row_wise" else table_rows[name]
            asked = min(asked, world_size * held)
        served += asked
    return served


def step_consumers(cfg: BenchmarkConfig, target: Target, backend: str, table_rows: dict[str, int]) -> list[Consumer]:
    """The slice's batch, ids, looked-up rows, their gradients and the embedding communication (on
    the rank that serves the most rows)."""
    samples = cfg.loader.batch_size // target.world_size
    length, e = cfg.sampler.max_seq_len, cfg.model.embedding_dim
    history = samples * (length - HISTORY_RESERVED)
    rows = SHARED_TABLES * (history + samples) + NUM_CONTEXTUAL * samples
    s = DTYPE_BYTES[cfg.model.sequence_dtype]
    name = cfg.model.sequence_dtype
    # The batch (int64 ids and timestamps, uint8 actions) twice: the prefetcher copies the next one ahead.
    batch = 2 * (history * (SHARED_TABLES * 8 + 8 + 1) + samples * (NUM_CONTEXTUAL * 8 + SHARED_TABLES * 8 + 64))
    out = [
        Consumer("the batch (and the next one, prefetched) and the lookup's ids", batch + 2 * rows * 8, PHASES),
        Consumer(f"looked-up rows, {name} ({rows:,} rows x {e})", rows * e * s, PHASES),
        Consumer(f"their gradients, {name}", rows * e * s, ("chunks", "update")),
    ]
    if backend == "torchrec" and target.world_size > 1:
        # Without qcomm the all-to-all carries the lookup's output dtype (the sequence dtype on GPUs).
        c = 2 if cfg.embeddings.qcomm != "none" else (s if target.device_kind == "cuda" else 4)
        comm = cfg.embeddings.qcomm if cfg.embeddings.qcomm != "none" else ("fp32" if c == 4 else name)
        served = _rows_served(cfg, target.world_size, history, samples, table_rows)
        out += [
            Consumer(
                f"embedding all-to-all send buffer, {comm} (up to {served:,} rows served)", served * e * c, ("lookup",)
            ),
            Consumer(f"embedding all-to-all gradients received for them, {comm}", served * e * c, ("update",)),
        ]
    if backend == "plain":
        cand = samples * SHARED_TABLES * e * 4
        out.append(Consumer("the candidates' fp32 rows and their gradient", 2 * cand, PHASES))
        # The update sums each row's gradients in fp32; on several ranks every rank's rows are gathered.
        gathered = rows * e * 4 * (1 + (target.world_size if target.world_size > 1 else 0))
        out.append(
            Consumer(
                "the sparse update's fp32 gradients" + (" (all ranks', gathered)" if target.world_size > 1 else ""),
                gathered,
                ("update",),
            )
        )
    return out
