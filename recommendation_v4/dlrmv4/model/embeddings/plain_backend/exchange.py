"""The plain backend's gradient exchange between ranks.

The plain backend keeps a replica of every table on each rank (data parallel), so every rank must
apply the same update to the same bits: before the update each rank gets every rank's gradient
rows (a dense all-reduce for tables smaller than the batch's gradient rows, an all-gather of
(id, row) pairs for the others), and the update sums each row's gradients in a fixed order.
"""

from __future__ import annotations

from typing import Any

import torch

from dlrmv4.distributed.cluster import Cluster
from dlrmv4.model.embeddings.tables import TableSpec
from dlrmv4.ops.gather_rows import segment_sum


def exchange_gradients(
    grads: dict[str, tuple[torch.Tensor, list[torch.Tensor]]],
    specs: list[TableSpec],
    dim: int,
    cluster: Cluster,
    device: torch.device,
) -> dict[str, Any]:
    """Every rank's gradient of every table; values / world size, as each rank's loss is the mean
    over its own slice. Row counts are host-side shapes (one small gloo message between ranks).
    A table with fewer rows than the gradient rows of all ranks goes dense: the rows summed into
    [rows, E] in a fixed order on every device (then one all-reduce, identical sums on every rank);
    the others as (id, row) pairs, all-gathered in rank order. One rank keeps its own (ids, gradient
    pieces): the update reads them in place."""
    world = cluster.world_size
    if world == 1:
        return grads
    local = {
        s.name: (grads[s.name][0], torch.cat([g.float() for g in grads[s.name][1]]))
        if s.name in grads
        else (torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dim, dtype=torch.float32, device=device))
        for s in specs
    }
    counts = cluster.all_gather_ints([local[s.name][0].numel() for s in specs])
    out: dict[str, Any] = {}
    gathered = []
    for k, spec in enumerate(specs):
        ids, values = local[spec.name]
        if spec.rows < sum(rank_counts[k] for rank_counts in counts):
            out[spec.name] = cluster.all_reduce_(segment_sum(values / world, ids, spec.rows))
        else:
            gathered.append(k)
    if gathered:
        totals = [sum(rank_counts[k] for k in gathered) for rank_counts in counts]
        ids = cluster.all_gather_rows(torch.cat([local[specs[k].name][0] for k in gathered]), totals)
        values = cluster.all_gather_rows(torch.cat([local[specs[k].name][1] for k in gathered]) / world, totals)
        # Rank-major, table-minor pieces -> per table, in rank order.
        sizes = [rank_counts[k] for rank_counts in counts for k in gathered]
        id_parts, value_parts = ids.split(sizes), values.split(sizes)
        t = len(gathered)
        for j, k in enumerate(gathered):
            out[specs[k].name] = (torch.cat(id_parts[j::t]), torch.cat(value_parts[j::t]))
    return out
