"""One rank of ``test_embeddings_on_two_ranks.py`` (run under torchrun): three lookups, backwards and
sparse updates of this rank's half of each batch on both backends with the given all-to-all
precision; rank 0 saves the full tables of each."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from model_inputs import random_batch
from step_setup import gloo_rank, small_table_config

from dlrmv4.model.embeddings import make_embeddings, table_specs

LENGTHS = [5, 0, 9, 3, 12, 7, 1, 4]


def main(qcomm: str, out: Path) -> None:
    cluster, share = gloo_rank(len(LENGTHS))
    saved = {}
    for backend in ("plain", "torchrec"):
        cfg = small_table_config("synthetic-tiny", backend, 100, qcomm=qcomm)
        embeddings = make_embeddings(table_specs(cfg, 0, 0, 0), cfg, "cpu", seed=3, cluster=cluster)
        embeddings.set_learning_rate(0.05)
        for seed in (1, 2, 3):
            batch = random_batch(LENGTHS, seed=seed).samples(share.start, share.stop)
            emb = embeddings(batch)
            # A loss whose gradients use fp32's whole mantissa (fp16 rounds them visibly).
            g = torch.Generator().manual_seed(seed)
            loss = sum((torch.tanh(t) * torch.randn(t.shape, generator=g)).sum() for t in emb.tensors())
            loss.backward()
            embeddings.sparse_step()
        saved[backend] = embeddings.state_for_checkpoint().get("tables")  # a collective
    if cluster.rank == 0:
        torch.save(saved, out / f"tables_{qcomm}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
