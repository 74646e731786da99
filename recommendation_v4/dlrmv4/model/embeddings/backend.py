"""Which backend a run gets, and building it: TorchRec where its kernels run and a process group
exists (``auto``), else the plain-PyTorch one."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from dlrmv4.config import BenchmarkConfig
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.model.dtypes import DTYPES
from dlrmv4.model.embeddings.plain_backend.tables import PlainEmbeddings
from dlrmv4.model.embeddings.tables import SparseEmbeddings, TableSettings, TableSpec
from dlrmv4.model.embeddings.torchrec_backend import compat as torchrec_compat
from dlrmv4.model.embeddings.torchrec_backend.tables import TorchRecEmbeddings
from dlrmv4.model.embeddings.wire import WIRE_DTYPES


def choose_backend(cfg: BenchmarkConfig, has_process_group: bool, torchrec_usable: Callable[[], bool]) -> str:
    """The one rule for the backend: the config's, or for ``auto`` TorchRec where a process group
    exists (several processes always have one) and ``torchrec_usable()``, else plain."""
    choice = cfg.embeddings.embedding_backend
    if choice != "auto":
        return choice
    return "torchrec" if has_process_group and torchrec_usable() else "plain"


def needs_process_group(cfg: BenchmarkConfig) -> bool:
    """Whether a run of one process needs a process group all the same (TorchRec's sharded modules
    do; several processes always have one)."""
    return cfg.embeddings.embedding_backend == "torchrec"


def resolve_backend(cfg: BenchmarkConfig, device: torch.device) -> str:
    """The backend of this process's run (``choose_backend``): TorchRec is usable where its kernels
    run on ``device``."""
    return choose_backend(cfg, dist.is_initialized(), lambda: torchrec_compat.torchrec_works(device))


def looks_up_distinct_ids(cfg: BenchmarkConfig, backend: str) -> bool:
    """Whether the loader packs each batch's distinct history ids for the lookup
    (``embeddings.dedup_ids``): for TorchRec only; the plain backend gathers every token's row from
    its own replica, and no exchange follows."""
    return cfg.embeddings.dedup_ids and backend == "torchrec"


def make_embeddings(
    specs: list[TableSpec],
    cfg: BenchmarkConfig,
    device: torch.device | str,
    seed: int,
    cluster: Cluster | None = None,
    dense: torch.nn.Module | None = None,
) -> SparseEmbeddings:
    """The tables on the configured backend. With TorchRec, ``dense`` (the dense model) goes under the
    same DistributedModelParallel, which makes it data parallel (``dense_parallel``)."""
    device = torch.device(device)
    settings = TableSettings(
        specs=tuple(specs),
        dim=cfg.model.embedding_dim,
        lr=cfg.train.sparse_peak_lr,
        eps=cfg.train.adagrad_eps,
        seed=seed,
        device=device,
        cluster=cluster or Cluster.single(device),
        sequence_dtype=DTYPES[cfg.model.sequence_dtype],
        kernels=cfg.model.kernels,
    )
    if resolve_backend(cfg, device) == "torchrec":
        torchrec_compat.install()  # checks the installed versions once, then patches the unbucketize step
        return TorchRecEmbeddings(settings, cfg.embeddings, dense=dense)
    if cfg.embeddings.sharding_types or cfg.embeddings.placement:
        raise UserError(
            "embeddings.sharding_types and placement are TorchRec settings: the plain backend "
            "keeps a replica of every table on each rank"
        )
    return PlainEmbeddings(settings, wire_dtype=WIRE_DTYPES[cfg.embeddings.qcomm])
