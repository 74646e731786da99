"""Checkpoints: exact resume, pruning, skipping damaged ones, surviving kill -9, cadence."""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dlrmv4.checkpoint import chain
from dlrmv4.checkpoint import writer as checkpoint_writer
from dlrmv4.checkpoint.cadence import CheckpointCadence
from dlrmv4.checkpoint.loading import load_checkpoint, load_small_state
from dlrmv4.checkpoint.newest import resume_point
from dlrmv4.checkpoint.rng import capture_rng_state, restore_rng_state
from dlrmv4.checkpoint.state import CheckpointPosition, ModelAndOptimizers
from dlrmv4.checkpoint.writer import CheckpointWriter, save_checkpoint
from dlrmv4.config import TrainConfig
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


def _seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )

    def forward(self, ids, noise):
        return self.body(self.emb(ids) + noise).squeeze(-1)


def _build(seed):
    gen = _seed_all(seed)
    net = _Net()
    # Two optimizers like the trainer's: Adam on the dense part, Adagrad on the table.
    dense = torch.optim.Adam(net.body.parameters(), lr=1e-2, betas=(0.95, 0.999))
    sparse = torch.optim.Adagrad(net.emb.parameters(), lr=1e-2)
    return net, [dense, sparse], gen


def _train(net, opts, gen, steps):
    """Each step draws from all four sources: numpy (ids), Python (labels), the named generator
    (noise) and torch's global generator (dropout)."""
    for _ in range(steps):
        ids = torch.from_numpy(np.random.randint(0, 10, size=6))
        labels = torch.tensor([float(random.random() < 0.5) for _ in range(6)])
        noise = torch.randn(6, 8, generator=gen)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(net(ids, noise), labels)
        for opt in opts:
            opt.zero_grad()
        loss.backward()
        for opt in opts:
            opt.step()


def _flat_state(net, opts):
    tensors = [t.clone() for t in net.state_dict().values()]
    for opt in opts:
        for per_param in opt.state_dict()["state"].values():
            tensors.extend(v.clone() for v in per_param.values() if torch.is_tensor(v))
    return tensors


def _assert_bit_equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


def _position(step):
    return CheckpointPosition(step=step, samples_seen=6 * step, window=step // 2)


def test_resume_is_bit_exact(tmp_path, deterministic):
    net, opts, gen = _build(0)
    _train(net, opts, gen, 6)
    uninterrupted = _flat_state(net, opts)

    net, opts, gen = _build(0)
    _train(net, opts, gen, 3)
    at_save = _flat_state(net, opts)
    state = {
        "train": ModelAndOptimizers(net, opts),
        "rng": capture_rng_state({"noise": gen}),
        "metrics": {"auc_sum": 1.5},
    }
    save_checkpoint(tmp_path, _position(3), state, keep_last=2)

    # A "new process": other init, other RNG positions, optimizers that never stepped.
    net, opts, gen = _build(123)
    _train(net, opts, gen, 1)
    net, opts, gen = _build(99)
    path = resume_point(tmp_path)
    assert path is not None and path.name == "step-00000003"
    position, loaded = load_checkpoint(path, {"train": ModelAndOptimizers(net, opts), "rng": None})
    assert position == _position(3)
    assert loaded["metrics"] == {"auc_sum": 1.5}
    _assert_bit_equal(_flat_state(net, opts), at_save)
    assert opts[0].param_groups[0]["betas"] == (0.95, 0.999)
    restore_rng_state(loaded["rng"], {"noise": gen})
    _train(net, opts, gen, 3)
    _assert_bit_equal(_flat_state(net, opts), uninterrupted)


def test_a_position_with_the_dropped_counters_still_loads(tmp_path):
    """Checkpoints from before batch_in_window and evals_done were dropped (never read) still resume."""
    net, opts, _ = _build(0)
    path = save_checkpoint(tmp_path, _position(4), {"train": ModelAndOptimizers(net, opts)}, keep_last=1)
    old = {**json.loads((path / "position.json").read_text()), "batch_in_window": 0, "evals_done": 1}
    (path / "position.json").write_text(json.dumps(old))
    position, _ = load_checkpoint(path, {"train": ModelAndOptimizers(net, opts)})
    assert position == _position(4)


def test_rng_round_trip_and_mismatch():
    gen = torch.Generator().manual_seed(5)
    state = capture_rng_state({"loader": gen})

    def draw():
        return (
            random.random(),
            np.random.rand(3).tolist(),
            torch.rand(3).tolist(),
            torch.rand(3, generator=gen).tolist(),
        )

    first = draw()
    draw()
    restore_rng_state(state, {"loader": gen})
    assert draw() == first
    with pytest.raises(ValueError, match="generators"):
        restore_rng_state(state, {"dropout": gen})


def test_a_resume_sees_its_own_gpu_whatever_the_node_shape(monkeypatch):
    """A rank saves its own device's CUDA state: a resume where another number of GPUs is visible (8 per
    node then 4, a one-GPU machine) restores it to the resuming process's device, and a GPU
    checkpoint resumed without CUDA (or a CPU one with CUDA) restores everything else."""
    saved, restored = torch.arange(16, dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    gen = torch.Generator().manual_seed(5)
    on_gpu = capture_rng_state({"dropout": gen})
    for count in (8, 4, 1):
        monkeypatch.setattr(torch.cuda, "device_count", lambda count=count: count)
        restore_rng_state(on_gpu, {"dropout": gen})
    assert len(restored) == 3 and all(torch.equal(state, saved) for state in restored)
    first = torch.rand(3, generator=gen).tolist()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restore_rng_state(on_gpu, {"dropout": gen})  # no CUDA here: the rest still comes back
    assert torch.rand(3, generator=gen).tolist() == first and len(restored) == 3
    on_cpu = capture_rng_state({"dropout": gen})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    restore_rng_state(on_cpu, {"dropout": gen})
    assert on_cpu["cuda"] is None and len(restored) == 3


def test_bare_optimizer_is_refused(tmp_path):
    _, opts, _ = _build(0)
    with pytest.raises(TypeError, match="ModelAndOptimizers"):
        save_checkpoint(tmp_path, _position(1), {"opt": opts[0]}, keep_last=1)


def test_keep_last_pruning(tmp_path):
    net = torch.nn.Linear(2, 2)
    for step in range(1, 6):
        save_checkpoint(tmp_path, _position(step), {"model": net}, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000005"]
    # The one just written survives even when it is not the newest on disk.
    save_checkpoint(tmp_path, _position(2), {"model": net}, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]


def test_a_checkpoint_being_pruned_leaves_the_step_names_first(tmp_path, monkeypatch):
    """A kill while a pruned checkpoint's files are deleted leaves a dead writer's temp (removed at the
    next start), not a step directory without its marker that every resume warns about."""
    net = torch.nn.Linear(2, 2)
    removed: list[Path] = []
    monkeypatch.setattr(chain.shutil, "rmtree", lambda path, **_: removed.append(Path(path)))  # killed
    for step in (1, 2):
        save_checkpoint(tmp_path, _position(step), {"model": net}, keep_last=1)
    root = tmp_path / "checkpoints"
    assert [p.name for p in removed] == [f".step-00000001.old-{os.getpid()}"]
    assert sorted(p.name for p in root.iterdir()) == [f".step-00000001.old-{os.getpid()}", "step-00000002"]


def _damage_marker(path):
    (path / "COMPLETE").unlink()


def _largest_tensor_file(path):
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)  # a rank writes several


def _truncate_tensors(path):
    tensor_file = _largest_tensor_file(path)
    tensor_file.write_bytes(tensor_file.read_bytes()[:-7])


def _flip_byte(path):
    tensor_file = _largest_tensor_file(path)
    data = bytearray(tensor_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tensor_file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_damage_marker, _truncate_tensors, _flip_byte])
def test_damaged_newest_is_skipped(tmp_path, capsys, damage):
    net = torch.nn.Linear(4, 3)
    first = [t.clone() for t in net.state_dict().values()]
    save_checkpoint(tmp_path, _position(1), {"model": net}, keep_last=3)
    with torch.no_grad():
        net.weight.add_(1.0)
    newest = save_checkpoint(tmp_path, _position(2), {"model": net}, keep_last=3)
    damage(newest)
    capsys.readouterr()
    path = resume_point(tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "warning" in lines[0] and "step-00000002" in lines[0]
    assert path is not None and path.name == "step-00000001"
    fresh = torch.nn.Linear(4, 3)
    position, _ = load_checkpoint(path, {"model": fresh})
    assert position.step == 1
    _assert_bit_equal([t.clone() for t in fresh.state_dict().values()], first)


def test_no_checkpoint(tmp_path):
    assert resume_point(tmp_path) is None


def test_checkpoints_none_of_which_is_usable_are_refused(tmp_path, capsys):
    """A run directory whose every checkpoint is damaged: no silent start-over (it would rewrite
    the run's MLPerf log); one line naming the newest's problem and --restart, and no warnings. A
    resume point past damaged checkpoints warns once of each it skips."""
    net = torch.nn.Linear(4, 3)
    for step in (1, 2):
        _damage_marker(save_checkpoint(tmp_path, _position(step), {"model": net}, keep_last=3))
    capsys.readouterr()
    with pytest.raises(UserError) as info:
        resume_point(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "holds 2 checkpoint(s) but none is usable (the newest, step-00000002: " in message
    assert message.endswith("pass --restart to start the run over")
    assert capsys.readouterr().err == ""
    save_checkpoint(tmp_path, _position(3), {"model": net}, keep_last=3)
    assert resume_point(tmp_path).name == "step-00000003"
    _damage_marker(save_checkpoint(tmp_path, _position(4), {"model": net}, keep_last=3))
    capsys.readouterr()
    assert resume_point(tmp_path).name == "step-00000003"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "warning" in lines[0] and "step-00000004" in lines[0]


def _held_writes(monkeypatch):
    """save_checkpoint behind a gate the test opens, counting the writes in flight."""
    gate, state = threading.Event(), {"in_flight": 0, "most": 0, "started": 0}
    real = checkpoint_writer.save_checkpoint

    def held(*args, **kwargs):
        state["started"] += 1
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        gate.wait(30)
        try:
            return real(*args, **kwargs)
        finally:
            state["in_flight"] -= 1

    monkeypatch.setattr(checkpoint_writer, "save_checkpoint", held)
    return gate, state


def test_async_checkpoint_holds_the_state_of_its_save(tmp_path, monkeypatch):
    """The save returns before the write; training that changes the weights and the small state
    meanwhile does not reach the checkpoint, which is the one a blocking save writes."""
    gate, _ = _held_writes(monkeypatch)
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 32)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    counters = {"seen": [1, 2]}
    writer = CheckpointWriter(tmp_path / "async", 2, Cluster.single(torch.device("cpu")), asynchronous=True)
    path = writer.save(_position(1), {"model": net, "counters": counters}, rank_state={"rng": 7})
    assert not path.exists()  # the write waits behind the gate: the save did not
    with torch.no_grad():
        net.weight.fill_(99.0)
    counters["seen"].append(3)
    gate.set()
    assert writer.wait() == path and resume_point(tmp_path / "async") == path
    writer.close()
    blocking = CheckpointWriter(tmp_path / "blocking", 2, Cluster.single(torch.device("cpu")), asynchronous=False)
    restored = torch.nn.Linear(64, 32)
    with torch.no_grad():
        restored.weight.copy_(before["weight"])
        restored.bias.copy_(before["bias"])
    blocking.save(_position(1), {"model": restored, "counters": {"seen": [1, 2]}}, rank_state={"rng": 7})
    for run in ("async", "blocking"):
        fresh = torch.nn.Linear(64, 32)
        position, state = load_checkpoint(resume_point(tmp_path / run), {"model": fresh})
        assert position == _position(1) and state["counters"] == {"seen": [1, 2]}, run
        assert state["rank_states"] == [{"rng": 7}], run
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, before[k]), (run, k)


def test_async_checkpoints_write_one_at_a_time(tmp_path, monkeypatch):
    gate, state = _held_writes(monkeypatch)
    net = torch.nn.Linear(8, 8)
    writer = CheckpointWriter(tmp_path, 3, Cluster.single(torch.device("cpu")), asynchronous=True)
    writer.save(_position(1), {"model": net})
    second = threading.Thread(target=writer.save, args=(_position(2), {"model": net}))
    second.start()
    time.sleep(0.3)
    assert second.is_alive() and state["started"] == 1  # the second save waits for the first write
    gate.set()
    second.join(30)
    writer.close()
    assert state["most"] == 1 and state["started"] == 2
    assert [p.name for p in sorted((tmp_path / "checkpoints").iterdir())] == ["step-00000001", "step-00000002"]


def test_async_write_error_surfaces_at_the_next_wait_in_one_line(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the checkpoints folder goes")
    writer = CheckpointWriter(tmp_path, 2, Cluster.single(torch.device("cpu")), asynchronous=True)
    writer.save(_position(1), {"model": torch.nn.Linear(2, 2)})
    with pytest.raises(UserError) as err:
        writer.wait()
    assert "\n" not in str(err.value) and "checkpoints" in str(err.value)
    writer.close()


def _two_ranks(script: str, tmp_path: Path) -> list[tuple[int, str, str]]:
    """``script`` run by two ranks started like srun tasks (gloo), ``tmp_path`` its argument:
    (status, stdout, stderr) by rank."""
    from multi_process import free_port, rank_env

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=rank_env(rank, 2, port),
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    return [(proc.returncode, out, err) for proc, (out, err) in zip(procs, outputs)]


# Two ranks build their writers (a collective): the timeout of the writer's own control group.
_WRITER_GROUP_TIMEOUT = textwrap.dedent("""
    import os, sys, torch
    from dlrmv4.checkpoint.writer import CheckpointWriter
    from dlrmv4.config import DistributedConfig
    from dlrmv4.distributed.process_start import start_cluster
    cluster = start_cluster(DistributedConfig(timeout_seconds=5.0))
    for asynchronous in (True, False):
        writer = CheckpointWriter(sys.argv[1], 2, cluster, asynchronous)
        gloo = writer.cluster.control._get_backend(torch.device("cpu"))
        print(gloo.options._timeout.total_seconds(), writer.cluster.timeout_seconds, flush=True)
    cluster.barrier()  # neither rank leaves while the other still connects a group
    os._exit(0)  # as a rank of several ends (distributed.exit_process): gloo's teardown can abort
""")


@pytest.mark.slow  # two processes
def test_the_writers_collectives_wait_as_long_as_a_checkpoints_bytes_take(tmp_path):
    """A save's collectives wait while the slowest rank writes its files and rank 0 hashes them all
    (a node's whole checkpoint of the real job: about 600 GB on one disk): the writer's own group waits
    the checkpoint I/O bound, not the run's collective timeout (5 s here) nor torch's default."""
    from dlrmv4.distributed.cluster import CHECKPOINT_IO_TIMEOUT_SECONDS

    outputs = _two_ranks(_WRITER_GROUP_TIMEOUT, tmp_path)
    for status, out, err in outputs:
        assert status == 0, err[-3000:]
        assert out.split() == [str(CHECKPOINT_IO_TIMEOUT_SECONDS)] * 4, out


# Two ranks save one checkpoint; rank 0's own part (the small files, the marker) fails as a full disk would.
_RANK_0_FILES_FAIL = textwrap.dedent("""
    import sys, time, torch
    from dlrmv4.checkpoint import writer
    from dlrmv4.checkpoint.state import CheckpointPosition
    from dlrmv4.config import DistributedConfig
    from dlrmv4.distributed.process_start import start_cluster
    cluster = start_cluster(DistributedConfig(timeout_seconds=30.0))
    if cluster.rank == 0:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device")
        writer._write_small_files = full_disk
    started = time.time()
    try:
        writer.save_checkpoint(sys.argv[1], CheckpointPosition(1, 1, 0), {"m": torch.nn.Linear(2, 2)}, 2, cluster)
        print("saved", flush=True)
    except Exception as exc:
        print(f"{time.time() - started:.1f} {type(exc).__name__}: {exc}", flush=True)
""")


@pytest.mark.slow  # two processes
def test_rank_0_failing_its_own_part_of_a_save_ends_every_rank_with_its_line(tmp_path):
    """Every rank's tensors are written; then rank 0 cannot write the checkpoint's small files. The
    other ranks end at once with rank 0's line, not after the collective timeout (30 s here) with a
    lost-rank line; no checkpoint is left."""
    outputs = _two_ranks(_RANK_0_FILES_FAIL, tmp_path)
    for _, out, err in outputs:
        seconds, line = out.strip().split(" ", 1)
        assert (
            line
            == f"CheckpointWriteError: cannot write {tmp_path / 'checkpoints' / 'step-00000001'}: No space left on device"
        ), out + err[-3000:]
        assert float(seconds) < 15
    assert resume_point(tmp_path) is None


# Writes ~24 MB checkpoints in a loop, each tensor filled with its step, until it is killed.
_WRITER = textwrap.dedent("""
    import sys, torch
    from dlrmv4.checkpoint.state import CheckpointPosition
    from dlrmv4.checkpoint.writer import CheckpointWriter
    from dlrmv4.distributed.cluster import Cluster
    net = torch.nn.ModuleList(torch.nn.Linear(1000, 2000) for _ in range(3))
    writer = CheckpointWriter(sys.argv[1], 2, Cluster.single(torch.device("cpu")), sys.argv[2] == "async")
    print("ready", flush=True)
    for step in range(1, 10_000):
        with torch.no_grad():
            for p in net.parameters():
                p.fill_(step)
        writer.save(CheckpointPosition(step, step, 0), {"model": net, "step": step})
""")


@pytest.mark.slow  # kills writer processes
@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_kill_during_write_never_leaves_a_partial_checkpoint(tmp_path, mode):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    temp_dirs_seen = 0
    for attempt in range(5):
        run_dir = tmp_path / f"run{attempt}"
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(run_dir), mode], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        where = f"(seed {seed}, attempt {attempt}, killed after {delay:.3f}s)"
        root = run_dir / "checkpoints"
        temp_dirs_seen += root.is_dir() and any(p.name.startswith(".") for p in root.iterdir())

        path = resume_point(run_dir)
        if path is not None:
            net = torch.nn.ModuleList(torch.nn.Linear(1000, 2000) for _ in range(3))
            position, state = load_checkpoint(path, {"model": net})
            assert state["step"] == position.step == int(path.name[5:]), where
            assert all(bool((p == position.step).all()) for p in net.parameters()), where

        save_checkpoint(run_dir, CheckpointPosition(10_000, 0, 0), {"model": torch.nn.Linear(2, 2)}, keep_last=2)
        assert resume_point(run_dir).name == "step-00010000", where
        assert not [p.name for p in root.iterdir() if p.name.startswith(".")], where
    # The writes take most of the child's time: some kill must have landed inside one.
    assert temp_dirs_seen > 0, f"no kill landed during a write (seed {seed})"


def _cadence(**kw):
    base = dict(checkpoint_every_steps=0, checkpoint_every_seconds=0.0, checkpoint_every_window=False)
    return CheckpointCadence(TrainConfig(**{**base, **kw}))


def test_cadence_steps():
    c = _cadence(checkpoint_every_steps=3)
    assert [s for s in range(0, 10) if c.due(s, 0.0, False)] == [3, 6, 9]


def test_cadence_seconds_restarts_after_each_checkpoint():
    c = _cadence(checkpoint_every_seconds=10.0)
    times = [100.0, 105.0, 110.0, 115.0, 119.9, 120.0, 135.0]
    assert [c.due(i, t, False) for i, t in enumerate(times)] == [
        None,
        None,
        "seconds",
        None,
        None,
        "seconds",
        "seconds",
    ]


def test_cadence_window_and_off():
    c = _cadence(checkpoint_every_window=True)
    assert c.due(5, 0.0, True) == "window" and c.due(6, 1e9, False) is None
    off = _cadence()
    assert not any(off.due(s, float(s), s % 2 == 0) for s in range(1, 20))


def test_cadence_names_the_explicit_cadence_before_the_window():
    """A window end that is also a step of the step cadence is due by the steps: only window-end-only
    checkpoints may be skipped while a write is in flight."""
    c = _cadence(checkpoint_every_steps=4, checkpoint_every_window=True)
    assert [c.due(s, 0.0, s in (3, 4)) for s in range(1, 6)] == [None, None, "window", "steps", None]


def test_cadence_seconds_elapsed_elsewhere_restarts_this_clock_too():
    """A rank whose own clock has not reached the interval saves with the rank whose clock has, and
    restarts its clock then: it does not ask for a second save a step later."""
    c = _cadence(checkpoint_every_seconds=10.0)
    assert c.due(1, 100.0, False, seconds_elapsed=False) is None
    assert c.due(2, 109.5, False, seconds_elapsed=True) == "seconds"
    assert c.due(3, 110.5, False, seconds_elapsed=c.seconds_elapsed(110.5)) is None
    assert c.due(4, 119.6, False) == "seconds"


def test_a_skipped_window_checkpoint_leaves_the_seconds_clock_running():
    """A window end at 9 s whose save is skipped (a write in flight) is no checkpoint: the timed one is
    still due at 10 s, not 10 s after the skipped one."""
    c = _cadence(checkpoint_every_seconds=10.0, checkpoint_every_window=True)
    assert c.due(1, 0.0, False) is None
    assert c.due(2, 9.0, True) == "window"
    c.not_taken()
    assert [c.due(3, 9.5, False), c.due(4, 10.0, False)] == [None, "seconds"]
    assert c.due(5, 12.0, True) == "window" and c.due(6, 20.0, False) is None  # a save taken restarts it


# Two ranks ask their Checkpointer at each step, rank 1's clock 0.5 s behind from its second step on,
# a checkpoint every 10.2 s and at the end of window 0 (step 11); a due answer does what a save
# does first (a collective on the main group).
_SECONDS_CADENCE = textwrap.dedent("""
    import os, sys, torch
    from dlrmv4.config import DistributedConfig
    from dlrmv4.config_loading import load_config
    from dlrmv4.distributed.process_start import start_cluster
    from dlrmv4.train.checkpointer import Checkpointer
    from dlrmv4.train.history import RunHistory
    cluster = start_cluster(DistributedConfig(timeout_seconds=10.0))
    train = {"run_dir": sys.argv[1], "checkpoint_every_seconds": 10.2, "checkpoint_every_window": True,
             "checkpoint_every_steps": 0, "checkpoint_full_every": 1, "async_checkpoints": True}
    cfg = load_config(None, None, {("train", key): value for key, value in train.items()})
    checkpointer = Checkpointer(cfg, cluster, None, None, None, lambda line: None)
    clock = {"now": 0.0}
    checkpointer.clock = lambda: clock["now"]
    history, saves = RunHistory(), []
    for step in range(1, 30):
        clock["now"] = step + (0.5 if cluster.rank == 1 and step >= 2 else 0.0)
        history.steps = step
        if checkpointer.due(history, 0, step == 11):
            saves.append(step)
            cluster.mean(torch.zeros(()))
    print(saves, flush=True)
    cluster.barrier()  # neither rank leaves while the other still needs it
    os._exit(0)  # as a rank of several ends (distributed.exit_process): gloo's teardown can abort
""")


@pytest.mark.slow  # two processes
def test_ranks_whose_clocks_differ_save_together_once_per_interval(tmp_path):
    """Every rank saves at the same steps, once per interval (a rank restarting only its own clock
    made every timed save a pair at adjacent steps), and a window end where one rank's interval has
    passed and the other's has not is one decision (the ranks took different branches and waited in
    different collectives until the timeout)."""
    outputs = _two_ranks(_SECONDS_CADENCE, tmp_path)
    for status, out, err in outputs:
        assert status == 0 and out.strip() == "[11, 22]", out + err[-3000:]


def test_a_stop_inside_the_tensor_write_comes_out_as_itself(tmp_path, monkeypatch):
    """SIGTERM (its Terminated, a KeyboardInterrupt) or Ctrl-C while DCP writes: DCP wraps it in its own
    exception, and the save gives it back as it was, so the run ends as stopped in its own line; no
    checkpoint is left."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class Stopped(KeyboardInterrupt):
        pass

    def stopped(self, *args, **kwargs):
        raise Stopped()

    monkeypatch.setattr(FileSystemWriter, "write_data", stopped)
    with pytest.raises(Stopped):
        save_checkpoint(tmp_path, _position(1), {"model": torch.nn.Linear(2, 2)}, keep_last=2)
    assert resume_point(tmp_path) is None


def test_a_read_failure_of_a_checkpoint_is_one_line(tmp_path, monkeypatch):
    """An I/O error while DCP reads a checkpoint back (a resume): one line naming the file and the cause."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    path = save_checkpoint(tmp_path, _position(1), {"model": torch.nn.Linear(2, 2)}, keep_last=2)

    def failing(self, *args, **kwargs):
        raise OSError(5, "Input/output error", str(path / "__0_0.distcp"))

    monkeypatch.setattr(FileSystemReader, "read_data", failing)
    with pytest.raises(UserError) as refused:
        load_checkpoint(path, {"model": torch.nn.Linear(2, 2)})
    assert str(refused.value) == f"cannot read {path / '__0_0.distcp'}: Input/output error"


def test_a_write_failure_names_the_path_and_the_cause(tmp_path):
    """write_failure finds the OSError under the wrappers (an exception's cause, DCP's per-rank
    failures) and names its cause; an exception with no I/O cause is left to be raised as it is."""
    import errno

    from dlrmv4.files import write_failure

    path = tmp_path / "checkpoints" / "step-00000009"
    full = OSError(errno.ENOSPC, "No space left on device")
    wrapped = RuntimeError("unexpected pos 704 vs 598")
    wrapped.__cause__ = full

    class PerRank(BaseException):  # the shape of DCP's CheckpointException
        failures = {0: (OSError(errno.EFBIG, "File too large"), None)}

    assert str(write_failure(path, wrapped)) == f"cannot write {path}: No space left on device"
    assert str(write_failure(path, PerRank())) == f"cannot write {path}: File too large"
    assert write_failure(path, RuntimeError("a bug, not a write")) is None


def test_a_file_written_whole_names_itself_when_the_write_fails(tmp_path):
    """write_atomically (reports, plots, the verified stamp): one line naming the final file, no
    temp file left, the previous content kept."""
    import errno

    from dlrmv4.errors import UserError
    from dlrmv4.files import write_atomically

    final = tmp_path / "report.json"
    final.write_text("previous")

    def full(tmp):
        tmp.write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(UserError, match=f"cannot write {final}: No space left on device"):
        write_atomically(final, full)
    assert final.read_text() == "previous" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_writer_thread_errors_are_kept_for_the_save_and_stay_silent(monkeypatch, capsys):
    """DCP's writer threads' errors reach only threading.excepthook: the hook keeps them for the save to
    raise, prints no traceback of theirs (other threads' still print), and is installed once."""
    from dlrmv4.checkpoint.dcp_io import writer_thread_errors

    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    kept = writer_thread_errors()
    installed = threading.excepthook
    assert writer_thread_errors() is kept and threading.excepthook is installed

    def fail() -> None:
        raise OSError("File too large")

    for name in ("Thread-3 (_write_files_from_queue)", "some other thread"):
        thread = threading.Thread(target=fail, name=name)
        thread.start()
        thread.join()
    err = capsys.readouterr().err
    assert "some other thread" in err and "_write_files_from_queue" not in err
    assert len(kept) == 1 and str(kept[0]) == "File too large"


# Two files per save (8 MB and 2 MB of tensors), the second save under a file-size limit between them:
# one of the two writer threads' files is cut, whichever thread writes it.
_CUT_SAVE = textwrap.dedent("""
    import resource, sys, torch
    from dlrmv4.checkpoint import dcp_io
    from dlrmv4.checkpoint.state import CheckpointPosition
    from dlrmv4.checkpoint.writer import CheckpointWriter, save_checkpoint
    from dlrmv4.distributed.cluster import Cluster
    from dlrmv4.errors import UserError
    dcp_io.io_threads = lambda: 2
    run_dir, mode = sys.argv[1], sys.argv[2]
    state = {"model": torch.nn.ParameterDict({"big": torch.nn.Parameter(torch.rand(2_000_000)),
                                               "small": torch.nn.Parameter(torch.rand(500_000))})}
    def save(step):
        position = CheckpointPosition(step=step, samples_seen=step, window=0)
        if mode == "blocking":
            return save_checkpoint(run_dir, position, state, keep_last=3)
        writer = CheckpointWriter(run_dir, 3, Cluster.single(torch.device("cpu")), asynchronous=True)
        try:
            writer.save(position, state)
            return writer.wait()
        finally:
            writer.close()
    save(1)
    resource.setrlimit(resource.RLIMIT_FSIZE, (5_000_000, 5_000_000))
    try:
        save(2)
    except UserError as exc:
        print(exc)
        sys.exit(1)
""")


@pytest.mark.parametrize("mode", ["blocking", "asynchronous"])
def test_a_checkpoint_cut_short_is_never_marked_complete(tmp_path, mode):
    """The issue's reproduction (a file-size limit that cuts one of a save's files): the save ends in one
    line naming the checkpoint and the cause, whichever writer thread met it; no COMPLETE marker covers a
    cut file, and the previous checkpoint stays the resume point."""
    for attempt in range(3):  # which thread writes the cut file varies: a few tries meet both
        run_dir = tmp_path / f"{mode}{attempt}"
        proc = subprocess.run(
            [sys.executable, "-c", _CUT_SAVE, str(run_dir), mode], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 1, (proc.stdout, proc.stderr)
        assert proc.stdout.strip() == f"cannot write {run_dir / 'checkpoints' / 'step-00000002'}: File too large"
        assert proc.stderr == ""
        assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step-00000001"]
        assert resume_point(run_dir).name == "step-00000001"


def test_a_save_with_more_writer_threads_than_pieces_is_complete(tmp_path, monkeypatch):
    """Eight writer threads (a machine with many cores) and two tensors: six of the rank's files stay empty
    and are in no .metadata entry; that is a whole checkpoint, not a writer that did not finish."""
    from dlrmv4.checkpoint import dcp_io

    monkeypatch.setattr(dcp_io, "io_threads", lambda: 8)
    net = torch.nn.Linear(64, 32)
    save_checkpoint(tmp_path, _position(1), {"model": net}, keep_last=2)
    ckpt = tmp_path / "checkpoints" / "step-00000001"
    assert sorted(p.stat().st_size > 0 for p in ckpt.glob("*.distcp")) == [False] * 6 + [True] * 2
    assert dcp_io.missing_pieces(ckpt) is None and resume_point(tmp_path) == ckpt
    (ckpt / "__0_7.distcp").write_bytes(b"x")  # an unlisted file with bytes in it is still refused
    assert dcp_io.missing_pieces(ckpt) == "__0_7.distcp not in .metadata (its writer did not finish)"


def _cut_under_a_new_marker(ckpt) -> None:
    """What code before the writes were checked left: a data file cut short, its marker made over it."""
    data = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as fh:
        fh.truncate(data.stat().st_size // 2)
    checkpoint_writer._write_small_files(ckpt, _position(int(ckpt.name[5:])), load_small_state(ckpt))


def test_a_resume_falls_back_from_a_checkpoint_whose_marker_covers_cut_files(tmp_path, capsys):
    net = torch.nn.Linear(256, 256)
    for step in (1, 2):
        save_checkpoint(tmp_path, _position(step), {"model": net}, keep_last=3)
    _cut_under_a_new_marker(tmp_path / "checkpoints" / "step-00000002")
    capsys.readouterr()
    assert resume_point(tmp_path).name == "step-00000001"
    (warning,) = capsys.readouterr().err.strip().splitlines()
    assert "skipping checkpoint" in warning and "step-00000002" in warning and ".metadata needs" in warning
    _cut_under_a_new_marker(tmp_path / "checkpoints" / "step-00000001")
    with pytest.raises(UserError) as err:
        resume_point(tmp_path)
    assert "none is usable" in str(err.value) and ".metadata needs" in str(err.value)
    assert "--restart" in str(err.value) and "\n" not in str(err.value)
