"""Asynchronous checkpoints on the GPU: the staging copy is pinned once, ahead of the run, and every
later save copies into the same host buffers (one staging copy per kind of save: whole, or a delta's
dense state)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrmv4.checkpoint.loading import load_checkpoint
from dlrmv4.checkpoint.newest import resume_point
from dlrmv4.checkpoint.state import CheckpointPosition
from dlrmv4.checkpoint.writer import CheckpointWriter
from dlrmv4.distributed.cluster import Cluster


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
    position, _ = load_checkpoint(resume_point(tmp_path), {"model": fresh})
    assert position.step == 2 and torch.equal(fresh.weight, net.weight)


class _CudaTables:
    """Plain fp32 tables on the GPU, the part of a backend that checkpoints read."""

    def __init__(self, seed: int) -> None:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        self.cluster, self.dim = Cluster.single(torch.device("cuda")), 512
        self.tables = {
            name: {
                "weight": torch.rand(rows, 512, device="cuda", generator=generator),
                "momentum": torch.rand(rows, device="cuda", generator=generator),
            }
            for name, rows in (("item", 300_000), ("uid", 5_000))
        }

    def live_tables(self) -> dict:
        return self.tables


def _assert_same_tables(restored: _CudaTables, tables: _CudaTables) -> None:
    for name, parts in tables.tables.items():
        for part, tensor in parts.items():
            assert torch.equal(restored.tables[name][part], tensor), (name, part)


def test_a_delta_of_gpu_tables_applied_over_its_whole_checkpoint_gives_them_back(tmp_path):
    from dlrmv4.checkpoint.chain import checkpoint_chain
    from dlrmv4.checkpoint.table_deltas import ENTRY, ChangedRows, TableRowsDelta, apply_delta
    from dlrmv4.checkpoint.tables import TableState
    from dlrmv4.checkpoint.writer import save_checkpoint

    tables, tracker = _CudaTables(0), ChangedRows()
    parent = save_checkpoint(tmp_path, CheckpointPosition(1, 1, 0), {"sparse": TableState(tables)}, keep_last=3)
    tracker.reset(tables)
    item = tables.tables["item"]
    rows = torch.randint(0, 300_000, (3_000,), device="cuda")
    item["momentum"][rows] += 1e-3
    item["weight"][rows] -= 1e-3
    item["weight"][7, 5] = torch.nextafter(item["weight"][7, 5], torch.tensor(2.0, device="cuda"))  # one ulp
    changed = tracker.take(tables)
    assert set(changed) == {"item"} and 7 in changed["item"]["ids"].tolist()
    entry = {ENTRY: TableRowsDelta(changed, 0)}
    newest = save_checkpoint(tmp_path, CheckpointPosition(2, 2, 0), entry, keep_last=3, parent=parent)
    restored = _CudaTables(1)
    whole, delta = checkpoint_chain(newest)
    load_checkpoint(whole, {"sparse": TableState(restored)})
    apply_delta(delta, restored, restored.cluster)
    _assert_same_tables(restored, tables)


def test_deltas_of_different_sizes_through_the_pinned_staging_copy(tmp_path):
    """The asynchronous writer reuses its pinned staging copy for the dense state; the deltas' rows (other
    rows, other sizes at every save) are written as they are."""
    from dlrmv4.checkpoint.chain import checkpoint_chain
    from dlrmv4.checkpoint.table_deltas import ENTRY, ChangedRows, TableRowsDelta, apply_delta
    from dlrmv4.checkpoint.tables import TableState

    tables, tracker, net = _CudaTables(0), ChangedRows(), torch.nn.Linear(64, 32).cuda()
    writer = CheckpointWriter(tmp_path, 5, tables.cluster, asynchronous=True)
    writer.save(CheckpointPosition(1, 1, 0), {"model": net, "sparse": TableState(tables)})
    parent = writer.wait()
    tracker.reset(tables)
    for step, count in ((2, 3_000), (3, 5_000)):
        rows = torch.randint(0, 300_000, (count,), device="cuda")
        tables.tables["item"]["momentum"][rows] += 1e-3
        tables.tables["item"]["weight"][rows] -= 1e-3
        with torch.no_grad():
            net.weight.add_(1.0)
        delta = TableRowsDelta(tracker.take(tables), 0)
        writer.save(CheckpointPosition(step, step, 0), {"model": net, ENTRY: delta}, parent=parent)
        parent = writer.wait()
    writer.close()
    restored, fresh = _CudaTables(1), torch.nn.Linear(64, 32).cuda()
    whole, *deltas = checkpoint_chain(parent)
    load_checkpoint(whole, {"sparse": TableState(restored)})
    for delta in deltas:
        apply_delta(delta, restored, restored.cluster)
    load_checkpoint(deltas[-1], {"model": fresh})
    assert torch.equal(fresh.weight, net.weight)
    _assert_same_tables(restored, tables)


@pytest.mark.parametrize("room", ["whole", "half"])
@pytest.mark.parametrize("backend", ["plain", "torchrec"])
def test_a_snapshot_on_the_device_holds_its_save_while_the_next_steps_run(
    tmp_path, backend, room, process_group, monkeypatch
):
    """The save queues a device copy and returns; the thread copies it to host on its own stream while
    the next steps change the tables (FBGEMM's fused update for TorchRec) and the dense weights: the
    checkpoint holds the state of the save, tables (sharded tensors for TorchRec) and weights alike;
    with room for half the state, the save copies the rest to host itself."""
    from model_inputs import random_batch
    from step_setup import small_table_config

    from dlrmv4.checkpoint import writer as checkpoint_writer
    from dlrmv4.checkpoint.device_snapshot import device_bytes
    from dlrmv4.checkpoint.state import ModelAndOptimizers
    from dlrmv4.checkpoint.tables import gather_full_tables
    from dlrmv4.train.trainer import build_step

    if backend == "torchrec":
        pytest.importorskip("torchrec")
    cfg = small_table_config("yambda-5b", backend, 200_000, train={"warmup_steps": 2, "learning_rate": 1e-3})
    step = build_step(cfg, (0, 0, 0), "cuda", seed=0)
    batches = [random_batch(np.full(32, 400), seed=i).to("cuda") for i in range(8)]

    def state(s):
        return {"dense": ModelAndOptimizers(s.model, [s.optimizer]), "sparse": s.embeddings.checkpoint_state()}

    for i in range(2):
        step(batches[i], i, 0)
    writer = CheckpointWriter(tmp_path, 2, step.embeddings.cluster, asynchronous=True)
    if room == "half":
        half = device_bytes({k: v.state_dict() for k, v in state(step).items()}, torch.device("cuda")) // 2
        monkeypatch.setattr(checkpoint_writer, "spare_device_memory", lambda device, peak: (half, "half, for the test"))
    writer.stage_ahead(state(step), planned_peak=0)
    assert "snapshot on the device" in writer.snapshot_note, writer.snapshot_note
    assert ("the step copies the rest" in writer.snapshot_note) == (room == "half"), writer.snapshot_note
    weights = {k: v.clone() for k, v in step.model.state_dict().items()}
    tables = gather_full_tables(step.embeddings)
    path = writer.save(CheckpointPosition(2, 64, 0), state(step))
    for i in range(2, 8):  # queued at once, beside the thread's copy to host
        step(batches[i], i, 0)
    writer.close()
    fresh = build_step(cfg, (0, 0, 0), "cuda", seed=1)
    load_checkpoint(path, state(fresh))
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    restored = gather_full_tables(fresh.embeddings)["tables"]
    for name, parts in tables["tables"].items():
        for part, tensor in parts.items():
            assert torch.equal(restored[name][part], tensor), (name, part)
    assert not torch.equal(
        gather_full_tables(step.embeddings)["tables"]["item"]["weight"], tables["tables"]["item"]["weight"]
    )


def test_fingerprints_taken_from_the_snapshot_in_the_writer_make_the_next_delta_whole(tmp_path):
    """After a whole checkpoint through a device snapshot the rows' fingerprints are taken in the writer's
    thread from the snapshot: rows changed right after the save (before the thread gets to them) are in
    the next delta, and the chain gives the tables back."""
    from dlrmv4.checkpoint.chain import checkpoint_chain
    from dlrmv4.checkpoint.table_deltas import ENTRY, ChangedRows, TableRowsDelta, apply_delta
    from dlrmv4.checkpoint.tables import TableState
    from dlrmv4.train.checkpointer import _reset_to

    tables, tracker = _CudaTables(0), ChangedRows()
    writer = CheckpointWriter(tmp_path, 5, tables.cluster, asynchronous=True)
    writer.stage_ahead({"sparse": TableState(tables)}, planned_peak=0)
    blocks = tracker.blocks(tables)
    then = ([t for _, w, m in blocks for t in (w, m)], lambda ts: _reset_to(tracker, blocks, ts))
    writer.save(CheckpointPosition(1, 1, 0), {"sparse": TableState(tables)}, then=then)
    assert not writer.then_ran_here
    rows = torch.randint(0, 300_000, (4_000,), device="cuda")
    tables.tables["item"]["weight"][rows] -= 1e-3  # queued at once: before the thread's fingerprints run
    parent = writer.wait()
    delta = TableRowsDelta(tracker.take(tables), 0)
    assert set(rows.tolist()) <= set(delta.rows["item"]["ids"].tolist())
    writer.save(CheckpointPosition(2, 2, 0), {ENTRY: delta}, parent=parent)
    newest = writer.wait()
    writer.close()
    restored = _CudaTables(1)
    whole, last = checkpoint_chain(newest)
    load_checkpoint(whole, {"sparse": TableState(restored)})
    apply_delta(last, restored, restored.cluster)
    _assert_same_tables(restored, tables)
