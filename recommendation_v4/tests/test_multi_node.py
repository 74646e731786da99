"""Two nodes on one machine (two process trees meeting at 127.0.0.1, gloo), launched as a submitter
launches several nodes: ``run_and_time.sh`` with NNODES=2 and a NODE_RANK each, or as two srun tasks
on two nodes (SLURM's variables, no launcher). A node killed mid-run and both started again with
RESUME=1 finish bit-exactly as an uninterrupted run; the node that holds global rank 0 alone checks
the log; nodes with different process counts are refused. Each failure ends a node with one line
that names its cause, within its stated timeout and a few seconds, with no native stack dump: peers
that never come, the node that holds the rendezvous store stopped, a rendezvous port that another
program holds, a rank that stops answering."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multi_process import REPO, free_port, launch_env, make_data, run_flags, train_report

pytestmark = pytest.mark.slow  # every test launches several process trees

pytest.importorskip("torchrec")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("nodes"))


def _node(node_rank: int, port: int, flags: list[str], gpus_per_node: int = 1, **env: str) -> subprocess.Popen:
    """One node's run_and_time.sh, in its own process group (a node is killed as a whole)."""
    node_env = dict(
        launch_env(),
        NNODES="2",
        NODE_RANK=str(node_rank),
        GPUS_PER_NODE=str(gpus_per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DLRMV4_NO_VENV="1",
        **env,
    )
    return _run_and_time(flags, node_env)


def _task(task: int, port: int, flags: list[str], **env: str) -> subprocess.Popen:
    """One of two srun tasks, each on a node of its own: run_and_time.sh's SLURM path."""
    task_env = dict(
        launch_env(),
        SLURM_PROCID=str(task),
        SLURM_LOCALID="0",
        SLURM_NODEID=str(task),
        SLURM_NTASKS="2",
        SLURM_STEP_TASKS_PER_NODE="1(x2)",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DLRMV4_NO_VENV="1",
        **env,
    )
    return _run_and_time(flags, task_env)


def _run_and_time(flags: list[str], env: dict[str, str]) -> subprocess.Popen:
    """run_and_time.sh in a session of its own (a node is killed as a process tree), its output piped."""
    return subprocess.Popen(
        ["bash", str(REPO / "run_and_time.sh"), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's workers leave their launcher's process group)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo.extend(children.get(found[-1], []))
    return found


def _kill_node(node: subprocess.Popen) -> None:
    for pid in _tree(node.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.communicate()


def _trainer(node: subprocess.Popen, deadline: float) -> int:
    """The pid of the ``python -m dlrmv4 train`` under a task's run_and_time.sh."""
    while time.time() < deadline:
        for pid in _tree(node.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode()).name.startswith("python") and b"train" in argv:
                return pid
        time.sleep(0.2)
    raise AssertionError("the task's trainer did not appear")


def _until(node: subprocess.Popen, text: str, stdout: bool = False) -> float:
    """Read the node's stderr (or stdout) up to the line holding ``text``; the time it came."""
    stream = node.stdout if stdout else node.stderr
    assert stream is not None
    seen = []
    for line in stream:
        if text in line:
            return time.time()
        seen.append(line)
    raise AssertionError(f"{text!r} never came: {''.join(seen)[-3000:]}")


def _ended(node: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """The rest of the node's stderr and when it ended; a node still running after ``timeout`` is
    killed and fails the test."""
    try:
        _, err = node.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_node(node)
        raise AssertionError(f"still running after {timeout:g} s") from None
    return err, time.time()


def _one_clean_line(err: str) -> str:
    """The node's one error line, its last, with no native stack dump or traceback around it."""
    errors = [line for line in err.splitlines() if "[dlrmv4] error:" in line]
    assert len(errors) == 1 and errors[0] == _last_line(err) and errors[0].startswith("[dlrmv4] error:"), err[-3000:]
    for noise in ("frame #", "Exception raised from", "Traceback", "ChildFailedError"):
        assert noise not in err, err[-3000:]
    assert not [line for line in err.splitlines() if line.startswith(("[W", "[E"))], err[-3000:]  # c10d's log lines
    return errors[0]


@pytest.fixture
def port_held_by_a_web_server():
    """A port that another program (Python's HTTP server) listens on."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and server.poll() is None, "the web server did not start"
                time.sleep(0.1)
        yield port
    finally:
        server.kill()
        server.wait()


def _both(flags: list[str], **env: str) -> list[tuple[int, str, str]]:
    port = free_port()
    nodes = [_node(rank, port, flags, **env) for rank in range(2)]
    return [(node.wait(timeout=600), *node.communicate()) for node in nodes]


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_two_nodes_killed_then_resumed_with_resume_1_are_bit_exact(data_path, tmp_path):
    # Target 0: the run succeeds at its first eval (about step 19), which the compliance checker passes.
    flags = run_flags(data_path, tmp_path / "run", **{"train.checkpoint_every_steps": 2, "train.target_auc": 0.0})
    port = free_port()
    nodes = [_node(rank, port, flags) for rank in range(2)]
    deadline = time.time() + 300
    while not list((tmp_path / "run" / "checkpoints").glob("step-*/COMPLETE")):  # a checkpoint to resume
        assert time.time() < deadline and nodes[0].poll() is None, nodes[0].communicate()
        time.sleep(0.05)
    _kill_node(nodes[1])
    _, err = nodes[0].communicate(timeout=180)
    assert nodes[0].returncode != 0 and _last_line(err).startswith("[dlrmv4] error: "), err[-3000:]

    resumed = _both(flags, RESUME="1")
    for status, out, err in resumed:
        assert status == 0, out[-2000:] + err[-3000:]
    assert sum("RESULT,dlrmv4," in out for _, out, _ in resumed) == 1  # rank 0's node alone checks the log
    said = [line for _, out, _ in resumed for line in out.splitlines() if "resumed from step-" in line]
    final = json.loads((tmp_path / "run" / "report.json").read_text())["history"]["steps"]
    assert len(said) == 1 and int(said[0].split("step-")[1][:8]) < final, said  # resumed mid-run
    log = tmp_path / "run" / "mlperf_log.txt"
    assert [json.loads(line[9:])["key"] for line in log.read_text().splitlines()].count("run_start") == 1

    whole = train_report(2, data_path, tmp_path / "whole", **{"train.target_auc": 0.0})  # never interrupted
    got = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [e["auc"] for e in got["history"]["evals"]] == [e["auc"] for e in whole["history"]["evals"]]
    assert got["history"]["window_losses"] == whole["history"]["window_losses"]
    assert got["parameters_sha256"] == whole["parameters_sha256"]


def test_nodes_with_different_process_counts_are_refused(data_path, tmp_path):
    flags = run_flags(data_path, tmp_path / "run")
    port = free_port()
    nodes = [_node(0, port, flags, gpus_per_node=2), _node(1, port, flags, gpus_per_node=1)]
    for node in nodes:
        _, err = node.communicate(timeout=300)
        assert node.returncode != 0
        assert "the nodes run different numbers of processes: rank 0's node" in _last_line(err), err[-3000:]
        assert "set GPUS_PER_NODE / --nproc-per-node alike on every node" in _last_line(err)


def test_each_node_says_its_refusal_once_on_a_line_of_its_own(data_path, tmp_path):
    """Nodes with different process counts: every rank refuses, and each node says so in one line
    (node 0's two ranks printed theirs, at times run together on one line, then its launcher a copy)."""
    flags = run_flags(data_path, tmp_path / "run")
    port = free_port()
    nodes = [_node(0, port, flags, gpus_per_node=2), _node(1, port, flags, gpus_per_node=1)]
    for node in nodes:
        err, _ = _ended(node, 300)
        assert node.returncode == 1 and "the nodes run different numbers of processes" in _one_clean_line(err)


def test_a_node_whose_peers_never_come_gives_up_in_one_line(data_path, tmp_path):
    node = _node(0, free_port(), run_flags(data_path, tmp_path / "run"), RDZV_TIMEOUT="5")
    started = time.time()
    _, err = node.communicate(timeout=120)
    assert node.returncode == 1 and time.time() - started < 60
    waiting = [line for line in err.splitlines() if "waiting for 2 nodes at 127.0.0.1:" in line]
    assert len(waiting) == 1 and waiting[0].startswith("[dlrmv4] node 0: ") and "(up to 5 s)" in waiting[0]
    assert _last_line(err).startswith("[dlrmv4] error: node 0: the nodes did not all join: waited for 2 nodes")
    assert "Traceback" not in err, err[-3000:]


def test_a_node_whose_node_0_never_comes_gives_up_in_one_line(data_path, tmp_path):
    """Node 1 alone: no store ever answers at MASTER_PORT (node 0's launcher would hold it); the node
    says so within its join timeout and a few seconds."""
    port = free_port()
    node = _node(1, port, run_flags(data_path, tmp_path / "run"), RDZV_TIMEOUT="5")
    try:
        waiting = _until(node, "waiting for 2 nodes")
        err, ended = _ended(node, 60)
    finally:
        if node.poll() is None:
            _kill_node(node)
    assert node.returncode == 1 and ended - waiting < 5 + 5, err[-3000:]
    assert _one_clean_line(err) == (
        f"[dlrmv4] error: node 1: the nodes did not all join: waited for 2 nodes at 127.0.0.1:{port} (up to 5 s): no "
        "rendezvous store answered there (the node that hosts it, NODE_RANK 0, has not started, or the endpoint "
        "does not name it)"
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_node_stopped_while_it_waits_for_its_peers_says_so_in_one_line(data_path, tmp_path, sig):
    """A scheduler's SIGTERM (or Ctrl-C) while the node waits in the rendezvous, before any rank has
    started: the job's one line and 128 + the signal (SIGINT left a traceback, SIGTERM no line)."""
    node = _node(0, free_port(), run_flags(data_path, tmp_path / "run"), RDZV_TIMEOUT="120")
    assert node.stderr is not None
    for line in node.stderr:
        if "waiting for 2 nodes" in line:
            break
    time.sleep(1.0)  # into the rendezvous itself
    os.killpg(node.pid, sig)
    _, err = node.communicate(timeout=120)
    assert node.returncode == 128 + sig, err[-3000:]
    name = signal.Signals(sig).name
    assert _last_line(err) == f"[dlrmv4] terminated ({name}): every rank was stopped", err[-3000:]
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("task", [0, 1])
def test_a_slurm_task_whose_peer_never_comes_gives_up_in_one_line_within_its_timeout(data_path, tmp_path, task):
    """One srun task of two, the other never starts: the task says one line within the timeout it
    announced and a few seconds (task 1 waited twice the timeout, with two native stack dumps)."""
    flags = run_flags(data_path, tmp_path / "run", **{"distributed.timeout_seconds": 10.0})
    node = _task(task, free_port(), flags)
    joining = _until(node, f"[dlrmv4] rank {task}: joining the 2 ranks at 127.0.0.1:")
    err, ended = _ended(node, 120)
    assert node.returncode == 1 and ended - joining < 10 + 5, err[-3000:]
    line = _one_clean_line(err)
    if task == 0:
        assert "rank 0 of 2: could not join the process group at 127.0.0.1:" in line and "1/2 clients joined" in line
    else:
        assert "rank 1 of 2: no rendezvous store answered at 127.0.0.1:" in line and "within 10 s" in line, line


def test_sigterm_to_the_node_that_holds_the_store_ends_the_other_in_one_line(data_path, tmp_path):
    """A scheduler stops node 0 mid-run (its launcher holds the rendezvous store): node 1 says in one
    line that the store went with the node that held it, not that the nodes did not all join, and no
    c10d warning or stack frame comes with it."""
    flags = run_flags(data_path, tmp_path / "run", **{"train.checkpoint_every_steps": 2})
    port = free_port()
    nodes = [_node(rank, port, flags) for rank in range(2)]
    try:
        deadline = time.time() + 300
        while not list((tmp_path / "run" / "checkpoints").glob("step-*/COMPLETE")):  # training is under way
            assert time.time() < deadline and nodes[0].poll() is None and nodes[1].poll() is None
            time.sleep(0.05)
        os.killpg(nodes[0].pid, signal.SIGTERM)
        stopped = time.time()
        err0, _ = _ended(nodes[0], 120)
        err1, ended = _ended(nodes[1], 120)
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
    assert nodes[0].returncode == 143 and _last_line(err0) == "[dlrmv4] terminated (SIGTERM): every rank was stopped"
    assert nodes[1].returncode == 1 and ended - stopped < 30, err1[-3000:]
    assert _one_clean_line(err1) == (
        f"[dlrmv4] error: node 1: lost the rendezvous store at 127.0.0.1:{port}: the node that holds it stopped or "
        "failed (its output says why); this node's ranks were stopped"
    )


def _stop_one_node_mid_run(data_path, tmp_path, first: int) -> tuple[list[subprocess.Popen], str]:
    """Two nodes, node ``first`` started (and waiting for its peer) before the other, so that it holds
    global rank 0 and, under this torch, its launcher the ranks' store; once training is under way,
    SIGTERM to node 1. The other node's stderr, which must end within 30 s."""
    flags = run_flags(data_path, tmp_path / "run", **{"train.checkpoint_every_steps": 2})
    port = free_port()
    nodes: list[subprocess.Popen] = [None, None]  # type: ignore[list-item]
    try:
        nodes[first] = _node(first, port, flags)
        _until(nodes[first], "waiting for 2 nodes")
        nodes[1 - first] = _node(1 - first, port, flags)
        deadline = time.time() + 300
        while not list((tmp_path / "run" / "checkpoints").glob("step-*/COMPLETE")):  # training is under way
            assert time.time() < deadline and all(node.poll() is None for node in nodes)
            time.sleep(0.05)
        os.killpg(nodes[1].pid, signal.SIGTERM)
        stopped = time.time()
        err, ended = _ended(nodes[0], 120)
        _ended(nodes[1], 120)
    finally:
        for node in nodes:
            if node is not None and node.poll() is None:
                _kill_node(node)
    assert nodes[0].returncode == 1 and ended - stopped < 30, err[-3000:]
    return nodes, err


def test_the_node_that_holds_the_rendezvous_store_names_the_node_that_left(data_path, tmp_path):
    """Node 1 joins first and takes global rank 0 (its launcher holds the ranks' store); SIGTERM to it:
    node 0, whose rendezvous store is alive, names the node of rank 0 and its store, with no timeout
    (nothing timed out) and no word cut short."""
    _, err = _stop_one_node_mid_run(data_path, tmp_path, first=1)
    line = _one_clean_line(err)
    # The collective that fails first depends on where rank 1 is in its step: the step's, or an all_reduce.
    assert line.startswith("[dlrmv4] error: rank 1 of 2: ") and (
        " failed, the node of rank 0 stopped or failed (its launcher held the ranks' store, gone with it)" in line
    ), line
    assert "timeout" not in line and "rendezvous store is gone" not in line, line
    assert len(line.split(": ", 3)[-1]) <= 200 or line.endswith(" ..."), line


def test_a_rank_that_left_is_named_without_a_timeout(data_path, tmp_path):
    """SIGTERM to node 1, which holds rank 1 only: node 0 names rank 1 and says its connection closed,
    not the collective timeout (nothing waited for it)."""
    _, err = _stop_one_node_mid_run(data_path, tmp_path, first=0)
    line = _one_clean_line(err)
    assert (
        line.startswith("[dlrmv4] error: rank 0 of 2: ") and "stopped answering: rank 1 (its connection closed)" in line
    ), line
    assert "timeout" not in line, line


def test_a_rendezvous_port_held_by_another_program_is_named_on_every_node(
    data_path, tmp_path, port_held_by_a_web_server
):
    """MASTER_PORT is held by a web server: node 0, which would host the store there, says so at once;
    node 1, which finds something there that never answers as a store, within its join timeout (both
    waited for minutes, deaf to SIGTERM, and said nothing of the port)."""
    port = port_held_by_a_web_server
    flags = run_flags(data_path, tmp_path / "run")
    nodes = [_node(rank, port, flags, RDZV_TIMEOUT="10") for rank in range(2)]
    try:
        waiting = [_until(node, "waiting for 2 nodes") for node in nodes]
        ends = [_ended(node, 60) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                _kill_node(node)
    for rank, (node, (err, ended)) in enumerate(zip(nodes, ends)):
        assert node.returncode == 1 and ended - waiting[rank] < (5 if rank == 0 else 10 + 5), err[-3000:]
        line = _one_clean_line(err)
        assert line.startswith(
            f"[dlrmv4] error: node {rank}: MASTER_PORT {port} on 127.0.0.1 is held by another program"
        )
        assert line.endswith("stop it, or give every node another MASTER_PORT"), line


@pytest.fixture
def port_held_by_a_stale_store():
    """A port that a c10d store of an earlier attempt still holds (TCPStore, is_master=True)."""
    port = free_port()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import datetime, sys, time\n"
            "from torch.distributed import TCPStore\n"
            "store = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, timeout=datetime.timedelta(seconds=600))\n"
            "print('listening', flush=True)\n"
            "time.sleep(600)\n",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "listening"
        yield port
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("first", [0, 1], ids=["node-0-first", "node-1-first"])
def test_a_stale_store_on_the_port_is_named_on_every_node_at_once(
    data_path, tmp_path, port_held_by_a_stale_store, first
):
    """An earlier attempt's store still holds MASTER_PORT: node 0 names it at once and leaves its refusal
    in that store, where node 1, which joined it, reads it: node 1 ends within seconds, naming the stale
    store, instead of waiting out the whole join timeout for a node 0 that never comes."""
    port = port_held_by_a_stale_store
    flags = run_flags(data_path, tmp_path / "run")
    nodes: list[subprocess.Popen] = [None, None]  # type: ignore[list-item]
    try:
        nodes[first] = _node(first, port, flags, RDZV_TIMEOUT="120")
        _until(nodes[first], "waiting for 2 nodes")
        nodes[1 - first] = _node(1 - first, port, flags, RDZV_TIMEOUT="120")
        ends = [_ended(node, 60) for node in nodes]
    finally:
        for node in nodes:
            if node is not None and node.poll() is None:
                _kill_node(node)
    held = f"MASTER_PORT {port} on 127.0.0.1 is held by another program (it answers as a rendezvous store"
    line0, line1 = (_one_clean_line(err) for err, _ in ends)
    assert nodes[0].returncode == 1 and line0.startswith(f"[dlrmv4] error: node 0: {held}"), line0
    assert nodes[1].returncode == 1 and line1.startswith(
        f"[dlrmv4] error: node 1: the store at the rendezvous port is not the run's: node 0 refused it: {held}"
    ), line1
    assert abs(ends[1][1] - ends[0][1]) < 10  # node 1 did not wait out its join timeout


def test_sigterm_reaches_a_node_that_waits_at_a_port_another_program_holds(
    data_path, tmp_path, port_held_by_a_web_server
):
    """Node 1 waits for a store at a port a web server holds: a SIGTERM ends it at once, in one line."""
    node = _node(1, port_held_by_a_web_server, run_flags(data_path, tmp_path / "run"), RDZV_TIMEOUT="120")
    try:
        _until(node, "waiting for 2 nodes")
        time.sleep(2.0)  # into the wait itself
        os.killpg(node.pid, signal.SIGTERM)
        stopped = time.time()
        err, ended = _ended(node, 60)
    finally:
        if node.poll() is None:
            _kill_node(node)
    assert node.returncode == 143 and ended - stopped < 10, err[-3000:]
    assert _last_line(err) == "[dlrmv4] terminated (SIGTERM): every rank was stopped", err[-3000:]


@pytest.mark.parametrize(
    "every_steps, stop_at",
    [(1000, "training on 2 processes"), (1, "writing in the background")],
    ids=["training", "writing-checkpoints"],
)
def test_a_rank_that_stops_answering_is_named_within_the_collective_timeout(data_path, tmp_path, every_steps, stop_at):
    """Two srun tasks on two nodes; task 1 stops (SIGSTOP) as training starts, or once they write a
    checkpoint every step in the background: task 0 waits in a step's collective, or for the write in
    flight (whose own collectives wait for hours), and ends within the collective timeout (and the
    silence check) in one line naming rank 1, whose failure watch no longer gives a sign of life."""
    flags = run_flags(
        data_path,
        tmp_path / "run",
        **{"train.checkpoint_every_steps": every_steps, "distributed.timeout_seconds": 10.0},
    )
    port = free_port()
    tasks = [_task(rank, port, flags) for rank in range(2)]
    try:
        trainer = _trainer(tasks[1], time.time() + 300)
        _until(tasks[0], stop_at, stdout=True)
        os.kill(trainer, signal.SIGSTOP)
        stopped = time.time()
        err, ended = _ended(tasks[0], 120)
    finally:
        for task in tasks:
            if task.poll() is None:
                _kill_node(task)
    assert tasks[0].returncode == 1 and ended - stopped < 10 + 25, (ended - stopped, err[-3000:])
    line = _one_clean_line(err)
    assert line.startswith("[dlrmv4] error: rank 0 of 2: ") and "stopped answering: rank 1 (timeout 10 s)" in line, line
