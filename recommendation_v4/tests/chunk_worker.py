"""One rank of ``test_chunked_step.py::test_chunked_step_on_two_ranks`` (run under torchrun):
one step on this rank's half of a global batch with DDP, for 1, 2 and 3 chunks; rank 0 saves the
loss, the dense weights and the full tables of each."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from model_inputs import random_batch
from step_setup import gloo_rank
from test_chunked_step import LENGTHS, config, dense_grads
from torch.nn.parallel import DistributedDataParallel

from dlrmv4.distributed.cluster import Cluster
from dlrmv4.model.embeddings import make_embeddings, table_specs
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.optim import FiniteMonitor
from dlrmv4.train.step import TrainStep


def one_step(backend: str, chunks: int, batch, cluster: Cluster, out: Path) -> None:
    """One step with DDP; rank 0 saves the results. DDP is dropped on return, while the process group
    is alive: its reducer must not be the last owner of the gloo group, or destroying the group would
    join gloo's threads under the GIL that one of them waits for."""
    cfg = config(backend, chunks)
    torch.manual_seed(3)
    model = DlrmHSTU(cfg.model, seed=3)
    embeddings = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", seed=3, cluster=cluster)
    ddp = DistributedDataParallel(model, device_ids=None, broadcast_buffers=False, gradient_as_bucket_view=True)
    step = TrainStep(model, embeddings, cfg.train, FiniteMonitor("cpu"), ddp)
    start = embeddings.state_for_checkpoint()  # a collective: every rank calls it
    loss = step(batch, 0, 0)
    dist.all_reduce(loss)
    tables = embeddings.state_for_checkpoint()
    if cluster.is_main:
        torch.save(
            {
                "loss": loss,
                "dense": model.state_dict(),
                "grads": dense_grads(model),
                "start": start["tables"],
                "tables": tables["tables"],
            },
            out / f"chunks{chunks}.pt",
        )


def main(backend: str, out: Path) -> None:
    cluster, share = gloo_rank(len(LENGTHS))
    batch = random_batch(LENGTHS, seed=5).samples(share.start, share.stop)
    for chunks in (1, 2, 3):
        one_step(backend, chunks, batch, cluster, out)
    if cluster.rank == 0:
        (out / "world.json").write_text(json.dumps({"world_size": cluster.world_size}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
