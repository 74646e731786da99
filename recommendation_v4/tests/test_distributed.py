"""Multi-process training on the CPU (gloo) under the real launcher (torchrun): several ranks
train like one process on the same global batches, checkpoints move between world sizes, and a
lost rank ends every rank with a clear error instead of a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multi_process import (
    PAUSE,
    QCOMM_LOSS_RTOL,
    REPO,
    STEPS,
    assert_same_trajectory,
    free_port,
    launch_env,
    lookups_sent_ahead,
    make_data,
    rank_env,
    run_flags,
    run_with_rank_1_out_of_memory,
    start_injected_ranks,
    torchrun,
    train_report,
)

pytestmark = pytest.mark.slow  # every test launches several processes

pytest.importorskip("torchrec")


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="module")
def one_process(data_path, tmp_path_factory):
    """The reference: one process (TorchRec over a one-rank gloo group) on the whole global batches."""
    run_dir = tmp_path_factory.mktemp("one")
    return train_report(1, data_path, run_dir, **{"train.max_steps": STEPS, "embeddings.embedding_backend": "torchrec"})


@pytest.mark.parametrize(
    "backend, sharding, qcomm, slicing",
    [
        ("torchrec", "*=row_wise", "none", "strided"),
        ("torchrec", "*=table_wise", "none", "strided"),
        ("torchrec", "*=row_wise", "bf16", "strided"),
        ("torchrec", "*=row_wise", "fp16", "strided"),
        ("torchrec", "*=row_wise", "none", "balanced"),
        ("plain", "", "none", "strided"),
        ("plain", "", "fp16", "strided"),
    ],
)
def test_two_processes_follow_the_one_process_trajectory(
    data_path, tmp_path, one_process, backend, sharding, qcomm, slicing
):
    report = train_report(
        2,
        data_path,
        tmp_path / "run",
        **{
            "train.max_steps": STEPS,
            "embeddings.embedding_backend": backend,
            "embeddings.sharding_types": sharding,
            "embeddings.qcomm": qcomm,
            "loader.rank_slicing": slicing,
        },
    )
    assert report["world_size"] == 2 and report["embedding_backend"] == backend
    if backend == "torchrec":
        kinds = {row["sharding_type"] for row in report["sharding_plan"]}
        assert kinds == {sharding.split("=")[1]}
        if sharding == "*=table_wise":  # whole tables on different ranks
            assert {tuple(row["ranks"]) for row in report["sharding_plan"]} == {(0,), (1,)}
        else:
            assert all(row["ranks"] == [0, 1] for row in report["sharding_plan"])
    assert len(report["history"]["evals"]) >= 2 and len(report["history"]["window_losses"]) >= 2
    if qcomm == "none":
        assert_same_trajectory(report, one_process)
    else:  # a half-precision all-to-all: close to the fp32 trajectory, and visibly not it
        assert_same_trajectory(report, one_process, loss_rtol=QCOMM_LOSS_RTOL)
        got = [loss for *_, loss in report["history"]["window_losses"]]
        assert got != [loss for *_, loss in one_process["history"]["window_losses"]]
    log = (tmp_path / "run" / "mlperf_log.txt").read_text()
    assert '"key": "global_batch_size", "value": 16' in log and '"key": "micro_batch_size", "value": 8' in log
    assert log.count('"key": "run_start"') == 1  # rank 0 alone writes


@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resume_on_another_world_size(data_path, tmp_path, one_process, first, second):
    run_dir = tmp_path / "run"
    torchrec = {"embeddings.embedding_backend": "torchrec", "embeddings.sharding_types": "*=row_wise"}
    paused = train_report(first, data_path, run_dir, **{"train.max_steps": PAUSE, **torchrec})
    assert (paused["history"]["status"], paused["history"]["steps"]) == ("stopped", PAUSE)
    proc = torchrun(second, run_flags(data_path, run_dir, **{"train.max_steps": STEPS, **torchrec}))
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert f"checkpoint written by {first} process(es), resuming on {second}" in proc.stdout
    resumed = json.loads((run_dir / "report.json").read_text())
    assert_same_trajectory(resumed, one_process)
    log = (run_dir / "mlperf_log.txt").read_text()
    assert log.count('"key": "run_start"') == 1 and log.count('"key": "run_stop"') == 1


def test_resume_on_the_same_world_size_is_bit_exact(data_path, tmp_path):
    torchrec = {"embeddings.embedding_backend": "torchrec", "embeddings.sharding_types": "*=table_wise"}
    whole = train_report(2, data_path, tmp_path / "whole", **{"train.max_steps": STEPS, **torchrec})
    train_report(2, data_path, tmp_path / "split", **{"train.max_steps": PAUSE, **torchrec})
    split = train_report(2, data_path, tmp_path / "split", **{"train.max_steps": STEPS, **torchrec})
    assert split["history"]["window_losses"] == whole["history"]["window_losses"]
    assert [e["auc"] for e in split["history"]["evals"]] == [e["auc"] for e in whole["history"]["evals"]]
    assert split["parameters_sha256"] == whole["parameters_sha256"] is not None


def _rank_pids(launcher_pid: int, nproc: int, deadline: float) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes, read from their environment."""
    while time.time() < deadline:
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                env = (entry / "environ").read_bytes().split(b"\0")
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            # the trainer itself, not a short-lived child of the launcher (a shell's command substitution)
            if not (Path(argv[0].decode()).name.startswith("python") and b"train" in argv):
                continue
            # torchrun's workers start with RANK; srun's tasks with SLURM_PROCID (python -m dlrmv4 reads it)
            rank = next((int(v.split(b"=", 1)[1]) for v in env if v.startswith((b"RANK=", b"SLURM_PROCID="))), None)
            if rank is not None:
                found[rank] = int(entry.name)
        if len(found) == nproc:
            return found
        time.sleep(0.2)
    raise AssertionError("the launcher's workers did not appear")


def _wait_for(path: Path, deadline: float) -> None:
    while not path.exists():
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def _launched(data_path: Path, run_dir: Path, env: dict[str, str] | None = None, **flags: str) -> subprocess.Popen:
    """Two ranks of ``python -m dlrmv4 train`` under ``python -m dlrmv4.launch`` (run_and_time.sh's
    launcher), a checkpoint every 2 steps."""
    cmd = [sys.executable, "-m", "dlrmv4.launch", "--standalone", "--nproc-per-node=2", "-m", "dlrmv4", "train",
           *run_flags(data_path, run_dir, **{"train.checkpoint_every_steps": 2, **flags})]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or launch_env())


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def test_a_two_process_job_speaks_with_one_voice(data_path, tmp_path):
    """run_and_time.sh's launcher, two gloo ranks, Python's warnings on: every console line is the
    project's (rank 0's, each once; a block's indented lines), none another library's warning."""
    env = launch_env()
    env.pop("PYTHONWARNINGS")
    proc = _launched(data_path, tmp_path / "run", **{"train.target_auc": "0.0"}, env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in (out + err).splitlines() if line.strip()]
    strangers = [line for line in lines if not line.startswith(("[dlrmv4] ", "  "))]
    assert not strangers, strangers
    ours = [line for line in lines if line.startswith("[dlrmv4] ")]
    assert len(ours) == len(set(ours)) and any("training on 2 processes" in line for line in ours), ours


def test_a_killed_rank_ends_the_launched_job_in_one_line(data_path, tmp_path):
    """SIGKILL one rank mid-run: the launcher stops the other and ends the job with one line naming the
    killed rank and the signal; no torchrun report, no rank saying it was terminated, no traceback."""
    run_dir = tmp_path / "run"
    proc = _launched(data_path, run_dir)
    deadline = time.time() + 300
    pids = _rank_pids(proc.pid, 2, deadline)
    _wait_for(run_dir / "checkpoints", deadline)  # training is under way
    os.kill(pids[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert _last_line(err) == (
        f"[dlrmv4] error: rank 1 was killed by SIGKILL (pid {pids[1]}); the other ranks were stopped"
    ), err[-3000:]
    for noise in ("ChildFailedError", "terminated (SIGTERM)", "Traceback", "torch.distributed.elastic"):
        assert noise not in out + err, err[-3000:]
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_failing_rank_ends_the_launched_job_naming_it(data_path, tmp_path):
    """Rank 1 fails with its own line (out of device memory at step 5: tests/failure_injection); rank 0,
    whose collective loses it, says so naming rank 1; the launcher's last line is rank 1's cause, not
    rank 0's consequence, and nothing else is printed about the failure."""
    injection = str(Path(__file__).parent / "failure_injection")
    env = dict(launch_env(), DLRMV4_TEST_OOM="1:5")
    env["PYTHONPATH"] = os.pathsep.join([injection, env["PYTHONPATH"]])
    proc = _launched(data_path, tmp_path / "run", env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    errors = [line for line in err.splitlines() if line.startswith("[dlrmv4] error:")]
    assert errors[-1] == _last_line(err) and errors[-1].startswith(
        "[dlrmv4] error: rank 1 of 2 ran out of device memory: CUDA out of memory"
    ), err[-3000:]
    assert all("rank 1 of 2" in line for line in errors), errors
    for noise in ("ChildFailedError", "terminated (SIGTERM)", "Traceback"):
        assert noise not in out + err, err[-3000:]


def test_a_terminated_launched_job_says_so_once(data_path, tmp_path):
    """SIGTERM to the launcher (a batch scheduler's time limit, passed on by run_and_time.sh): every rank
    stops and the job's one line says so; the ranks say nothing of their own stop, nor of their
    loader workers, which the agent's SIGTERM to each rank's process group stops too."""
    run_dir = tmp_path / "run"
    proc = _launched(data_path, run_dir, **{"loader.num_workers": 2})
    deadline = time.time() + 300
    pids = _rank_pids(proc.pid, 2, deadline)
    _wait_for(run_dir / "checkpoints", deadline)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    assert _last_line(err) == "[dlrmv4] terminated (SIGTERM): every rank was stopped", err[-3000:]
    for noise in ("ChildFailedError", "[dlrmv4] terminated (SIGTERM)\n", "Traceback", "error:"):
        assert noise not in out + err, err[-3000:]
    strangers = [line for line in (out + err).splitlines() if line.strip() and not line.startswith(("[dlrmv4] ", "  "))]
    assert not strangers, strangers  # the agent's "Received 15 death signal" among them before
    for pid in pids.values():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()


def test_a_rank_whose_launcher_is_killed_stops_with_its_own_line(data_path, tmp_path):
    """SIGKILL to the launcher alone (not to the job's process group): its ranks, each in a session of
    its own, would train on with nobody to stop them; each ends within seconds with one line saying
    that its launcher is gone."""
    run_dir = tmp_path / "run"
    proc = _launched(data_path, run_dir)
    deadline = time.time() + 300
    pids = _rank_pids(proc.pid, 2, deadline)
    _wait_for(run_dir / "checkpoints", deadline)  # training is under way
    proc.kill()
    killed = time.time()
    _, err = proc.communicate(timeout=60)
    for pid in pids.values():
        while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text():
            assert time.time() - killed < 30, f"rank pid {pid} still running after its launcher was killed"
            time.sleep(0.2)
    lines = [line for line in err.splitlines() if "its launcher" in line]
    for rank in range(2):
        assert any(
            line.startswith(f"[dlrmv4] error: rank {rank} of 2: its launcher (pid {proc.pid}) is gone")
            for line in lines
        ), err[-3000:]


def test_a_killed_rank_ends_the_others_without_a_launcher(data_path, tmp_path):
    """Ranks started like srun tasks (run_and_time.sh's SLURM path, no supervising launcher): when one
    is killed, the survivor fails its next collective and exits 1 with one line naming itself."""
    run_dir = tmp_path / "run"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            launch_env(),
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DLRMV4_NO_VENV="1",
        )
        cmd = [
            "bash",
            str(REPO / "run_and_time.sh"),
            *run_flags(data_path, run_dir, **{"train.checkpoint_every_steps": 2, "distributed.timeout_seconds": 20.0}),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    deadline = time.time() + 300
    trainer = _rank_pids(procs[1].pid, 1, deadline)[1]  # the python under rank 1's run_and_time.sh
    _wait_for(run_dir / "checkpoints", deadline)
    os.kill(trainer, signal.SIGKILL)
    procs[1].send_signal(signal.SIGKILL)
    started = time.time()
    _, err = procs[0].communicate(timeout=120)
    procs[1].wait()
    assert procs[0].returncode == 1
    assert time.time() - started < 60  # well within the timeout plus start-up: no hang
    errors = [line for line in err.splitlines() if line.startswith("[dlrmv4] error:")]
    assert len(errors) == 1 and "rank 0 of 2" in errors[0] and "another rank" in errors[0], err[-3000:]


def test_a_rank_out_of_memory_ends_every_rank_naming_it(data_path, tmp_path):
    """Rank 1 runs out of device memory mid-run (injected: tests/failure_injection): it exits with one
    line saying so, and rank 0, waiting in the step's collective, exits within the collective timeout
    with one line naming rank 1 and the cause (no launcher: ranks started like srun tasks). The group's
    teardown waits for every rank, as NCCL's does: the failed rank, whose peers have gone, must not
    enter it."""
    hooks = {"DLRMV4_TEST_COLLECTIVE_TEARDOWN": "20"}
    run_with_rank_1_out_of_memory(data_path, tmp_path / "run", timeout_seconds=20.0, hooks=hooks)


def test_every_rank_reads_the_failed_ranks_line_before_rank_0_takes_the_store_away(data_path, tmp_path):
    """Three ranks started like srun tasks: rank 0's process holds the rendezvous store. Rank 1 runs out
    of memory; rank 0's watch reads its line first and ends rank 0, and rank 2's watch polls half a
    second later. Every rank still names rank 1 and the cause (rank 0 used to exit at once, taking the
    store, and rank 2 said only that another rank had gone)."""
    hooks = {"DLRMV4_TEST_WATCH_DELAY": "2:0.5"}
    run_with_rank_1_out_of_memory(
        data_path, tmp_path / "run", timeout_seconds=20.0, world=3, hooks=hooks, **{"loader.batch_size": 18}
    )


def test_a_resume_check_longer_than_the_collective_timeout_is_waited_for(data_path, tmp_path):
    """Rank 0 checks the checkpoint chain before the resume point is shared (hashing hundreds of GB at
    the real job's size): here it takes 12 s against a collective timeout of 6 s, and the resume goes
    on (the other rank used to fail, saying another rank had gone)."""
    run_dir = tmp_path / "run"
    torchrec = {"embeddings.embedding_backend": "torchrec", "embeddings.sharding_types": "*=row_wise"}
    train_report(2, data_path, run_dir, **{"train.max_steps": PAUSE, **torchrec})
    hooks = {"DLRMV4_TEST_SLOW_RESUME_CHECK": "12"}
    extra = {"train.max_steps": PAUSE + 2, "distributed.timeout_seconds": 6.0, **torchrec}
    procs = start_injected_ranks(2, data_path, run_dir, hooks, **extra)
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    assert f"resumed from step-{PAUSE:08d}" in outputs[0][0], outputs[0][0][-3000:]


def test_rank_0_failing_after_the_last_collective_leaves_no_rank_waiting(data_path, tmp_path):
    """Rank 0's report cannot be written (a full disk, injected) after the run's last collective: rank
    0 exits 1 with one line saying so, and rank 1, whose run had ended, exits 0 at once. With a
    teardown that waits for every rank, as NCCL's does, rank 1 would wait there for ever (srun tasks
    have no agent to stop it)."""
    hooks = {"DLRMV4_TEST_REPORT_FAILS": "1", "DLRMV4_TEST_COLLECTIVE_TEARDOWN": "20"}
    procs = start_injected_ranks(2, data_path, tmp_path / "run", hooks, **{"train.max_steps": 12})
    (_, err0), (_, err1) = (proc.communicate(timeout=300) for proc in procs)
    assert [proc.returncode for proc in procs] == [1, 0], err0[-2000:] + err1[-2000:]
    errors = [line for line in err0.splitlines() if line.startswith("[dlrmv4] error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0], err0[-3000:]
    assert "Traceback" not in err0 + err1


def test_the_slurm_path_trains_checks_the_log_and_traces(data_path, tmp_path):
    """run_and_time.sh as two srun tasks: both train (recording a profiler window), task 0 checks
    the MLPerf log; merge-traces puts both ranks' traces in one file."""
    run_dir = tmp_path / "run"
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            launch_env(),
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2(x1)",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DLRMV4_NO_VENV="1",
        )
        cmd = [
            "bash",
            str(REPO / "run_and_time.sh"),
            *run_flags(
                data_path, run_dir, **{"train.max_steps": 0, "train.target_auc": 0.0, "train.profile_steps": "2-4"}
            ),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    assert "PASSED the MLPerf compliance checker" in outs[0][0] and "RESULT,dlrmv4," in outs[0][0]
    assert "compliance checker" not in outs[1][0]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["world_size"] == 2 and report["history"]["status"] == "success"
    assert sorted(p.name for p in (run_dir / "traces").iterdir()) == ["steps-2-4.rank0.json", "steps-2-4.rank1.json"]
    merge = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "merge-traces", "--preset=", f"--run-dir={run_dir}"],
        capture_output=True,
        text=True,
        env=launch_env(),
    )
    assert merge.returncode == 0, merge.stderr
    events = json.loads((run_dir / "traces" / "steps-2-4.merged.json").read_text())["traceEvents"]
    assert {e["pid"] >> 32 for e in events if isinstance(e.get("pid"), int)} == {0, 1}


def test_run_and_time_launches_torchrun_with_gpus_per_node(data_path, tmp_path):
    """GPUS_PER_NODE=2 on one node: run_and_time.sh prepares (here: finds the store), starts torchrun
    with two processes (gloo on the CPU) and checks the log."""
    run_dir = tmp_path / "run"
    env = dict(launch_env(), GPUS_PER_NODE="2", DLRMV4_NO_VENV="1")
    proc = subprocess.run(
        ["bash", str(REPO / "run_and_time.sh"), *run_flags(data_path, run_dir, **{"train.target_auc": 0.0})],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "nothing to prepare" in proc.stdout and "training on 2 processes" in proc.stdout
    assert "PASSED the MLPerf compliance checker" in proc.stdout and "RESULT,dlrmv4," in proc.stdout


BLOCKED_RANK = """
import sys, time
from dlrmv4.config import DistributedConfig
from dlrmv4.distributed.liveness import post_failure_and_linger, watch_failures
from dlrmv4.distributed.process_start import start_cluster
cluster = start_cluster(DistributedConfig(timeout_seconds=120.0))
cluster.barrier()
if cluster.rank == 1:
    post_failure_and_linger(cluster, "rank 1 of 2 ran out of device memory: CUDA out of memory (posted by the test)")
    sys.exit(1)
watch = watch_failures(cluster)
time.sleep(100)  # stands in for a collective blocked on the device, which no Python exception ends
print("the watch did not end the blocked rank")
"""


def test_a_posted_failure_ends_a_rank_blocked_outside_python():
    """Rank 0 is blocked where no exception can reach it (as in an NCCL collective on the device);
    rank 1 posts its failure: rank 0's failure watch ends it within seconds, with one line naming
    rank 1 and the cause, long before the collective timeout."""
    port = free_port()
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-c", BLOCKED_RANK]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=rank_env(rank, 2, port)
            )
        )
    started = time.time()
    out, err = procs[0].communicate(timeout=90)
    procs[1].wait(timeout=30)
    assert time.time() - started < 30, "rank 0 waited for the collective timeout"
    assert procs[0].returncode == 1 and "did not end" not in out, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("[dlrmv4] error:")]
    assert errors == [
        "[dlrmv4] error: rank 0 of 2: training failed because rank 1 of 2 ran out of device memory: "
        "CUDA out of memory (posted by the test)"
    ], err[-3000:]


# The sparse-dist pipeline (train.sparse_pipeline): batch i+1's ids travel while step i computes.
ROW_WISE = {"embeddings.embedding_backend": "torchrec", "embeddings.sharding_types": "*=row_wise"}


def mlperf_events(run_dir: Path) -> list[dict]:
    """The run's MLPerf log events without their clock times."""
    events = []
    for line in (run_dir / "mlperf_log.txt").read_text().splitlines():
        event = json.loads(line.split(":::MLLOG ", 1)[1])
        event.pop("time_ms")
        events.append(event)
    return events


@pytest.mark.parametrize("nproc, chunks", [(1, 1), (2, 3)])
def test_the_sparse_pipeline_changes_no_number(data_path, tmp_path, nproc, chunks):
    """Pipelined and unpipelined runs on the same batches: the same window losses, AUCs, final
    tables and dense weights (the parameter digest), bit for bit, and the same MLPerf events."""
    runs = {}
    for on in (True, False):
        extra = {"train.max_steps": STEPS, "train.chunks": chunks, "train.sparse_pipeline": on, **ROW_WISE}
        runs[on] = train_report(nproc, data_path, tmp_path / str(on), **extra)
    on, off = runs[True], runs[False]
    # Every step's lookup but the first took ids sent ahead by the step before it, and every eval
    # batch's but each eval's first ids sent ahead by the eval batch before it.
    assert on["history"]["evals"] and (on["lookups_distributed_ahead"], off["lookups_distributed_ahead"]) == (
        lookups_sent_ahead(on),
        0,
    )
    assert on["lookups_distributed_ahead"] > STEPS - 1
    assert on["history"]["window_losses"] == off["history"]["window_losses"]
    assert [e["auc"] for e in on["history"]["evals"]] == [e["auc"] for e in off["history"]["evals"]]
    assert on["parameters_sha256"] == off["parameters_sha256"] is not None
    assert mlperf_events(tmp_path / "True") == mlperf_events(tmp_path / "False")


def test_a_pipelined_run_killed_mid_run_resumes_bit_exactly(data_path, tmp_path):
    """Both ranks SIGKILLed right after the first checkpoint, with the next batch's ids on their way:
    the resumed run neither loses that batch nor trains it twice, and ends where the uninterrupted
    run ends, bit for bit."""
    extra = {"train.max_steps": STEPS, "train.chunks": 2, **ROW_WISE}
    whole = train_report(2, data_path, tmp_path / "whole", **extra)
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "dlrmv4"]
    launcher = subprocess.Popen(
        [*cmd, "train", *run_flags(data_path, run_dir, **extra)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=launch_env(),
    )
    deadline = time.time() + 300
    pids = _rank_pids(launcher.pid, 2, deadline)
    _wait_for(run_dir / "checkpoints" / "step-00000010", deadline)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    launcher.kill()
    launcher.wait()
    assert not (run_dir / "report.json").exists(), "the run ended before the kill"
    proc = torchrun(2, run_flags(data_path, run_dir, **extra))
    assert proc.returncode == 0, proc.stderr[-5000:]
    step = int(re.search(r"resumed from step-\d+: step (\d+)", proc.stdout).group(1))
    assert 10 <= step < STEPS
    resumed = json.loads((run_dir / "report.json").read_text())
    assert resumed["lookups_distributed_ahead"] == lookups_sent_ahead(resumed, step)  # the resumed process's own
    assert resumed["history"]["window_losses"] == whole["history"]["window_losses"]
    assert [e["auc"] for e in resumed["history"]["evals"]] == [e["auc"] for e in whole["history"]["evals"]]
    assert resumed["parameters_sha256"] == whole["parameters_sha256"] is not None


def test_deduplicated_ids_follow_the_full_lookup_and_resume_bit_exactly(data_path, tmp_path, one_process):
    """embeddings.dedup_ids on two ranks (row-wise, fp32 all-to-all, pipelined, 2 chunks): each
    rank asks for fewer ids than the full lookup does, the run follows the one-process trajectory,
    and a run paused and resumed on two ranks ends where the uninterrupted one does, bit for bit."""
    extra = {"train.chunks": 2, "embeddings.qcomm": "none", **ROW_WISE}
    full = train_report(
        2, data_path, tmp_path / "full", **{"train.max_steps": STEPS, **extra, "embeddings.dedup_ids": False}
    )
    dedup = {**extra, "embeddings.dedup_ids": True}
    whole = train_report(2, data_path, tmp_path / "whole", **{"train.max_steps": STEPS, **dedup})
    assert 0 < whole["ids_looked_up"] < full["ids_looked_up"]
    assert whole["lookups_distributed_ahead"] == full["lookups_distributed_ahead"] == lookups_sent_ahead(whole)
    assert_same_trajectory(whole, one_process)
    assert_same_trajectory(whole, full)
    train_report(2, data_path, tmp_path / "split", **{"train.max_steps": PAUSE, **dedup})
    split = train_report(2, data_path, tmp_path / "split", **{"train.max_steps": STEPS, **dedup})
    assert split["history"]["window_losses"] == whole["history"]["window_losses"]
    assert [e["auc"] for e in split["history"]["evals"]] == [e["auc"] for e in whole["history"]["evals"]]
    assert split["parameters_sha256"] == whole["parameters_sha256"] is not None
