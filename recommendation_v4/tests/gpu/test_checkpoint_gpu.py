"""Asynchronous checkpoints on the GPU: the staging copy is pinned once, ahead of the run, and every
later save copies into the same host buffers (one staging copy per kind of save: whole, or a delta's
dense state)."""

from __future__ import annotations

import torch

from dlrmv4.checkpoint.files import CheckpointPosition, CheckpointWriter, latest_checkpoint, load_checkpoint
from dlrmv4.distributed import Cluster


def test_the_staging_copy_made_ahead_is_the_one_every_save_uses(tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Linear(1024, 512).cuda()
    writer = CheckpointWriter(tmp_path, 2, Cluster.single(torch.device("cuda")), asynchronous=True)
    assert writer.stage_ahead({"model": net}) > 0
    cache = writer._stagers[("model",)].state_dict_cache  # the staging copy of saves of this state
    staged = {name: t.data_ptr() for name, t in cache["model"].items()}
    assert all(t.is_pinned() for t in cache["model"].values())
    for step in (1, 2):
        with torch.no_grad():
            net.weight.add_(1.0)
        writer.save(CheckpointPosition(step=step, samples_seen=step, window=0), {"model": net})
        writer.wait()
        now = writer._stagers[("model",)].state_dict_cache["model"]
        assert {name: t.data_ptr() for name, t in now.items()} == staged
    writer.close()
    fresh = torch.nn.Linear(1024, 512).cuda()
    position, _ = load_checkpoint(latest_checkpoint(tmp_path), {"model": fresh})
    assert position.step == 2 and torch.equal(fresh.weight, net.weight)
