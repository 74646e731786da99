"""Two nodes on one machine (two process trees meeting at 127.0.0.1, gloo), launched as a submitter
launches several nodes: ``run_and_time.sh`` with NNODES=2 and a NODE_RANK each. A node killed
mid-run and both started again with RESUME=1 finish bit-exactly as an uninterrupted run; the node
that holds global rank 0 alone checks the log; nodes with different process counts are refused;
a node whose peers never come waits a bounded time and says so in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
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
    return subprocess.Popen(
        ["bash", str(REPO / "run_and_time.sh"), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=node_env,
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


def test_a_node_whose_peers_never_come_gives_up_in_one_line(data_path, tmp_path):
    node = _node(0, free_port(), run_flags(data_path, tmp_path / "run"), RDZV_TIMEOUT="5")
    started = time.time()
    _, err = node.communicate(timeout=120)
    assert node.returncode == 1 and time.time() - started < 60
    waiting = [line for line in err.splitlines() if "waiting for 2 nodes at 127.0.0.1:" in line]
    assert len(waiting) == 1 and waiting[0].startswith("[dlrmv4] node 0: ") and "(up to 5 s)" in waiting[0]
    assert _last_line(err).startswith("[dlrmv4] error: node 0: the nodes did not all join: waited for 2 nodes")
    assert "Traceback" not in err, err[-3000:]


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
