"""The checkpoint's snapshot (``checkpoint/device_snapshot.py``) on the CPU: a save through it holds the
state of its save while the training changes the tensors, the snapshot and its host copy are made once
and reused, the state's tensors that live elsewhere go straight to the host copy, and a state laid out
otherwise is refused. (On a GPU, tests/gpu/test_checkpoint_gpu.py runs it beside training steps.)"""

from __future__ import annotations

import threading

import pytest
import torch

from dlrmv4.checkpoint import writer as checkpoint_writer
from dlrmv4.checkpoint.device_snapshot import DeviceSnapshot, byte_pieces, device_bytes, snapshot_layout, tensor_leaves
from dlrmv4.checkpoint.loading import load_checkpoint
from dlrmv4.checkpoint.state import CheckpointPosition, ModelAndOptimizers
from dlrmv4.checkpoint.writer import CheckpointWriter
from dlrmv4.distributed.cluster import Cluster

CPU = torch.device("cpu")


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    _steps(net, opt, 2)
    return net, opt


def _steps(net: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        opt.zero_grad()
        net(torch.randn(4, 16)).square().sum().backward()
        opt.step()


def _state_of(net, opt) -> dict:
    return {name: t.clone() for name, t in {**net.state_dict(), **_moments(opt)}.items()}


def _moments(opt) -> dict:
    return {f"{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}


def test_a_save_through_the_snapshot_holds_the_state_of_its_save(tmp_path, monkeypatch):
    gate = threading.Event()
    real = checkpoint_writer.save_checkpoint
    monkeypatch.setattr(checkpoint_writer, "save_checkpoint", lambda *a, **k: gate.wait(30) and real(*a, **k))
    net, opt = _trained(0)
    writer = CheckpointWriter(tmp_path, 2, Cluster.single(CPU), asynchronous=True)
    writer.stage_ahead({"dense": ModelAndOptimizers(net, [opt])}, planned_peak=0)
    assert writer.snapshot_note.startswith("a snapshot on the device of 0.0 of the state's 0.0 GiB")
    snapshot = writer._snapshots[("dense",)]
    buffer, host = snapshot.buffer.data_ptr(), [t.data_ptr() for t in tensor_leaves(snapshot.host)]
    for step in (1, 2):
        at_save = _state_of(net, opt)
        writer.save(CheckpointPosition(step, step, 0), {"dense": ModelAndOptimizers(net, [opt])})
        _steps(net, opt, 3)  # the weights and Adam's moments (and its step count) change before the write
        gate.set()
        path = writer.wait()
        gate.clear()
        fresh_net, fresh_opt = _trained(1)
        load_checkpoint(path, {"dense": ModelAndOptimizers(fresh_net, [fresh_opt])})
        loaded = _state_of(fresh_net, fresh_opt)
        assert loaded.keys() == at_save.keys()
        for name, value in at_save.items():
            assert torch.equal(loaded[name], value), (step, name)
        assert not torch.equal(loaded["0.weight"], net.state_dict()["0.weight"])  # the training did move on
        # The same buffers at every save: made once, before the run.
        assert snapshot.buffer.data_ptr() == buffer and [t.data_ptr() for t in tensor_leaves(snapshot.host)] == host
    writer.close()


def test_a_kind_of_save_staged_without_a_snapshot_is_copied_by_the_step(tmp_path):
    net, opt = _trained(0)
    writer = CheckpointWriter(tmp_path, 2, Cluster.single(CPU), asynchronous=True)
    writer.stage_ahead({"dense": ModelAndOptimizers(net, [opt])})  # no plan: the peak is not known
    assert writer._snapshots == {} and "not known" in writer.snapshot_note
    at_save = _state_of(net, opt)
    path = writer.save(CheckpointPosition(1, 1, 0), {"dense": ModelAndOptimizers(net, [opt])})
    _steps(net, opt, 2)
    writer.close()
    fresh_net, fresh_opt = _trained(1)
    load_checkpoint(path, {"dense": ModelAndOptimizers(fresh_net, [fresh_opt])})
    loaded = _state_of(fresh_net, fresh_opt)
    assert all(torch.equal(loaded[name], value) for name, value in at_save.items())


def test_a_snapshot_holds_the_tensors_its_budget_holds_and_the_save_copies_the_rest_itself():
    a, b, c = torch.arange(10.0), torch.arange(200.0), torch.arange(4.0)  # 512, 1024 and 512 bytes aligned
    elsewhere = torch.zeros(3, device="meta")  # not on the snapshot's device: copied to host at the save
    state = {"a": a, "b": [b, elsewhere], "c": c, "n": 7}
    assert device_bytes(state, CPU) == 2048
    offsets, used = snapshot_layout(state, CPU, budget=1024)
    assert offsets == [0, None, None, 512] and used == 1024  # in order while they fit: a, then c
    snapshot = DeviceSnapshot({"a": a, "b": [b], "c": c, "n": 7}, CPU, budget=1024)
    assert snapshot.buffer.numel() == 1024 and [v is None for v in snapshot.views] == [False, True, False]
    host = snapshot.take({"a": a, "b": [b], "c": c, "n": 7})
    assert torch.equal(host["b"][0], torch.arange(200.0))  # past the budget: copied by the save itself
    for t in (a, b, c):
        t.add_(100)
    snapshot.to_host()
    assert torch.equal(host["a"], torch.arange(10.0)) and torch.equal(host["c"], torch.arange(4.0))
    assert host["n"] == 7 and torch.equal(host["b"][0], torch.arange(200.0))
    with pytest.raises(RuntimeError, match="not laid out"):
        snapshot.take({"a": a[:5], "b": [b], "c": c, "n": 7})


def test_work_on_the_saved_tensors_runs_on_the_snapshots_copies_in_the_writer_or_else_at_the_save(tmp_path):
    """``save(then=...)`` (the rows' fingerprints after a whole checkpoint): with a snapshot that holds the
    tensors, the work runs in the writer's thread on its copies, which hold the values of the save while
    the training changes the live ones; without one, at the save on the tensors themselves."""
    seen: dict[str, object] = {}

    def work(tensors):
        seen["thread"] = threading.current_thread().name
        seen["values"] = [t.clone() for t in tensors]
        seen["live"] = any(t.data_ptr() == net[0].weight.data_ptr() for t in tensors)

    net, opt = _trained(0)
    for snapshot in (True, False):
        writer = CheckpointWriter(tmp_path / str(snapshot), 2, Cluster.single(CPU), asynchronous=True)
        writer.stage_ahead({"dense": ModelAndOptimizers(net, [opt])}, planned_peak=0 if snapshot else None)
        at_save = net[0].weight.detach().clone()
        writer.save(
            CheckpointPosition(1, 1, 0), {"dense": ModelAndOptimizers(net, [opt])}, then=([net[0].weight], work)
        )
        assert writer.then_ran_here is not snapshot
        _steps(net, opt, 2)
        writer.wait()
        writer.close()
        assert seen["thread"].startswith("checkpoint-writer") is snapshot and seen["live"] is not snapshot
        assert torch.equal(seen["values"][0], at_save)
    assert not torch.equal(net[0].weight, at_save)  # the training did move on


def test_the_copy_to_host_in_pieces_gives_every_tensor_back_bit_for_bit():
    """Pieces of 48 bytes cut tensors of every width mid-element and mid-row; 0-d, empty and
    non-contiguous tensors are copied whole; the host copy equals the state at the take."""
    g = torch.Generator().manual_seed(0)
    state = {
        "f32": torch.randn(37, 5, generator=g),
        "bf16": torch.randn(3, 50, generator=g).bfloat16(),
        "i64": torch.randint(-(2**40), 2**40, (29,), generator=g),
        "flags": torch.rand(101, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 8, generator=g).t(),
    }
    at_take = {k: v.clone() for k, v in state.items()}
    snapshot = DeviceSnapshot(state, CPU, budget=1 << 20, piece_bytes=48)
    host = snapshot.take(state)
    for t in state.values():
        t.bitwise_not_() if t.dtype in (torch.bool, torch.int64) else t.add_(1)
    snapshot.to_host()
    for name, value in at_take.items():
        assert host[name].dtype == value.dtype and torch.equal(host[name], value), name
    pieces = byte_pieces(torch.empty(37, 5), state["f32"], 48)
    assert len(pieces) == -(-37 * 5 * 4 // 48) and all(d.numel() <= 48 and d.dtype == torch.uint8 for d, _ in pieces)
    assert sum(d.numel() for d, _ in pieces) == 37 * 5 * 4
    assert len(byte_pieces(torch.empty(8, 6), state["strided"], 48)) == 1  # not contiguous: whole
