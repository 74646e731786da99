"""The launcher's one line (dlrmv4/launch.py): which rank is the job's cause when torchrun's agent stops
the others, and a rank that stopped answering (SIGSTOP) ended by the agent's SIGTERM at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

from multi_process import launch_env
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from dlrmv4.errors import CAUSED_BY_ANOTHER_RANK
from dlrmv4.launch_failures import AGENT_KILL_AFTER_SECONDS, AgentStops, failure_line

SURVIVOR = "rank 0 of 2: a collective of the training step failed, another rank exited or stopped answering: rank 1"


def _failure(tmp_path, rank: int, pid: int, exitcode: int, line: str | None = None, follows: bool = False):
    error_file = tmp_path / f"error_{rank}.json"
    if line is not None:
        error_file.write_text(json.dumps({"message": line, "timestamp": 100 + rank, CAUSED_BY_ANOTHER_RANK: follows}))
    return ProcessFailure(local_rank=rank, pid=pid, exitcode=exitcode, error_file=str(error_file))


def test_a_rank_the_agent_had_to_kill_is_not_the_cause(tmp_path):
    # Rank 1 stopped answering; rank 0's collective lost it and said so; the agent's SIGTERM did not
    # end rank 1, its SIGKILL did.
    stops = AgentStops()
    stops.sent = {2001: {int(signal.SIGTERM), int(signal.SIGKILL)}, 2000: {int(signal.SIGTERM)}}
    failures = {0: _failure(tmp_path, 0, 2000, 1, SURVIVOR, follows=True), 1: _failure(tmp_path, 1, 2001, -9)}
    assert failure_line(failures, stops) == (
        f"{SURVIVOR}; the launcher killed rank 1 (SIGKILL) after {AGENT_KILL_AFTER_SECONDS} s without an end on "
        "its SIGTERM"
    )


def test_a_rank_killed_by_someone_else_is_the_cause(tmp_path):
    # An out-of-memory killer's SIGKILL (not the agent's): that rank is the cause; the other was stopped.
    stops = AgentStops()
    stops.sent = {2000: {int(signal.SIGTERM)}}
    failures = {0: _failure(tmp_path, 0, 2000, -15), 1: _failure(tmp_path, 1, 2001, -9)}
    assert failure_line(failures, stops) == "rank 1 was killed by SIGKILL (pid 2001); the other ranks were stopped"


def test_a_ranks_own_line_wins_over_the_line_of_a_rank_that_lost_it(tmp_path):
    failures = {
        0: _failure(tmp_path, 0, 2000, 1, SURVIVOR, follows=True),
        1: _failure(tmp_path, 1, 2001, 1, "rank 1 of 2 ran out of device memory: CUDA out of memory"),
    }
    assert failure_line(failures, AgentStops()) == "rank 1 of 2 ran out of device memory: CUDA out of memory"


# Rank 1 stops itself (as a hung rank would stop answering); rank 0 then fails with the line a rank
# whose collective lost rank 1 leaves.
_RANKS = textwrap.dedent(f"""
    import os, signal, sys, time
    from dlrmv4.errors import report_failure
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
    else:
        time.sleep(2)
        report_failure({SURVIVOR!r}, caused_by_another_rank=True)
        sys.exit(1)
""")


def test_a_stopped_rank_ends_on_the_launchers_sigterm_and_the_line_is_the_survivors(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4.launch", "--standalone", "--nproc-per-node", "2", str(script)],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    took = time.monotonic() - started
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == f"[dlrmv4] error: {SURVIVOR}", proc.stderr[-3000:]
    assert "SIGKILL" not in proc.stderr
    assert took < AGENT_KILL_AFTER_SECONDS, took  # no wait for the agent's SIGKILL
