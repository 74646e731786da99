"""The data path end to end through the command line, and the published synthetic sums."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "md5sums"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dlrmv4", *args, "--no-progress"], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    data = tmp_path_factory.mktemp("cli") / "data"
    proc = _run("pipeline", "--data-path", str(data), "--reference-md5s", str(PUBLISHED), "--batches", "2")
    return data, proc


def test_pipeline_runs_the_data_path(tiny):
    data, proc = tiny
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for step in (
        "generating synthetic Yambda-schema data (tiny",
        "store ready:",
        "verified ",
        "window 0 batch 1:",
        "assembled 256 samples",
    ):
        assert step in out, out
    assert (data / "processed" / "synthetic-tiny" / "meta.json").exists()


def test_store_matches_the_published_sums(tiny):
    """Generator + preprocessing are deterministic: the default tiny store is byte-identical to
    the one whose sums are published in md5sums (regenerate with tools/update_md5sums.sh)."""
    _, proc = tiny
    assert "all 22 files match the published sums for synthetic-tiny" in proc.stdout, proc.stdout


def test_verify_fails_on_a_published_sum_mismatch(tiny, tmp_path):
    data, _ = tiny
    altered = tmp_path / "md5sums"
    text = PUBLISHED.read_text()
    line = next(ln for ln in text.splitlines() if ln.endswith("synthetic-tiny/train/item_id.npy"))
    altered.write_text(text.replace(line, "0" * 32 + line[32:]))
    proc = _run("verify", "--data-path", str(data), "--reference-md5s", str(altered))
    assert proc.returncode == 1
    assert proc.stderr.startswith("[dlrmv4] error: verification failed: ")
    assert "train/item_id.npy: md5" in proc.stderr and "differs from the published" in proc.stderr


def test_verify_of_a_missing_store_is_one_line(tmp_path):
    proc = _run("verify", "--data-path", str(tmp_path / "nothing"))
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "no processed store here" in proc.stderr


def test_download_dataset_script_from_an_offline_hub_cache(tmp_path):
    """download_dataset.sh end to end through the real huggingface_hub client: files found in a local
    hub cache with HF_HUB_OFFLINE=1, preprocessed, verified, the commit recorded in meta.json."""
    import json
    import os

    from hub_fixtures import COMMIT, build_hub_cache

    from dlrmv4.data.synthetic import generate

    raw = generate(tmp_path / "raw", "tiny", 3, progress=False)
    files = {
        "flat/50m/multi_event.parquet": raw.multi_event.read_bytes(),
        "artist_item_mapping.parquet": raw.artist_mapping.read_bytes(),
        "album_item_mapping.parquet": raw.album_mapping.read_bytes(),
    }
    data = tmp_path / "data"
    build_hub_cache(data / "hub_cache", files)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DLRMV4_NO_VENV": "1"}
    # The tiny data spans 20 days: shrink the Yambda constants to fit it.
    proc = subprocess.run(
        [
            str(REPO / "download_dataset.sh"),
            "--size",
            "50m",
            "--data-path",
            str(data),
            "--hub-revision",
            COMMIT,
            "--last-timestamp",
            "0",
            "--num-train-days",
            "18",
            "--min-history",
            "100",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no published sums for yambda-50m" in proc.stdout
    meta = json.loads((data / "processed" / "yambda-50m" / "meta.json").read_text())
    assert meta["dataset"]["resolved_revision"] == COMMIT
    assert meta["dataset"]["source"] == "yambda" and meta["counts"]["anchors"] > 0


def test_verify_dataset_script_finds_the_store_under_a_data_path(tiny, tmp_path):
    """``verify_dataset.sh --data-path D`` verifies what download_dataset.sh wrote under D without
    repeating --source/--size; with two stores there it asks which, with none it says so."""
    data, _ = tiny
    script = [str(REPO / "verify_dataset.sh"), "--no-progress"]
    env = {"DLRMV4_NO_VENV": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    proc = subprocess.run([*script, "--data-path", str(data)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "all 22 files match the published sums for synthetic-tiny" in proc.stdout
    two = tmp_path / "two"
    for name in ("synthetic-tiny", "yambda-5b"):
        (two / "processed" / name).mkdir(parents=True)
        (two / "processed" / name / "meta.json").write_text("{}")
    proc = subprocess.run([*script, "--data-path", str(two)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"[dlrmv4] error: 2 processed stores under {two / 'processed'}: synthetic-tiny, yambda-5b; name one with "
        "--size (and --source synthetic) or --store"
    )
    proc = subprocess.run(
        [*script, "--data-path", str(tmp_path / "none")], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1 and "no processed store under" in proc.stderr


def test_no_bar_redraws_in_a_redirected_log(tmp_path):
    """Progress bars are on by default, but only on a terminal: with stderr redirected (a log file,
    here a pipe) the output has no carriage-return redraws."""
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "prepare", "--data-path", str(tmp_path / "data")],
        capture_output=True,
        timeout=600,
    )  # bytes: text mode would turn "\r" into "\n"
    assert proc.returncode == 0, proc.stderr
    assert b"store ready:" in proc.stdout and b"\r" not in proc.stderr + proc.stdout
    assert b"preprocess:" not in proc.stderr  # no bar at all


def test_a_killed_writers_temp_files_are_removed_by_the_next_run(tiny, tmp_path):
    """A generator or preprocessing killed mid-write leaves temp files named with its PID; the next
    prepare removes those of processes that are gone, saying so, and leaves a live writer's alone."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny[0], data)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its PID is free now
    raw = next(data.glob("raw/*/flat/*/multi_event.parquet")).parent
    dead = [
        raw / f".multi_event.parquet.tmp-{gone.pid}-0a1b2c3d",
        data / "processed" / f".synthetic-tiny.tmp-{gone.pid}",
    ]
    live = data / "processed" / f".synthetic-tiny.tmp-{os.getpid()}"
    dead[0].write_bytes(b"half a parquet")
    for folder in (dead[1], live):
        folder.mkdir()
        (folder / "meta.json").write_text("{}")
    proc = _run("prepare", "--data-path", str(data))
    assert proc.returncode == 0, proc.stderr
    for path in dead:
        assert not path.exists() and f"removed {path}, left by process {gone.pid}" in proc.stdout
    assert live.exists()


def test_a_rank_that_loses_a_silent_peer_while_the_launcher_stops_the_job_stays_silent(monkeypatch):
    """The launcher sends every rank its SIGTERM at once: a rank whose collective lost a peer that left no
    line waits for its own signal and ends as stopped (143, no line of its own). A peer that said why, or
    no launcher, is reported at once."""
    import signal
    import threading

    from dlrmv4 import cli
    from dlrmv4.distributed.liveness import RankLostError
    from dlrmv4.errors import LAUNCHER_ENV

    lost = RankLostError("rank 1 of 2: a collective of the training step failed, another rank exited", False)
    sigterm = cli.TerminationSignal()
    previous = signal.signal(signal.SIGTERM, sigterm)
    try:
        monkeypatch.setenv(LAUNCHER_ENV, "1")
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert cli._ended_by_sigterm(lost, cli.TerminationSignal())
        said = RankLostError("rank 1 of 2: a collective failed because rank 0 ran out of device memory", True)
        assert not cli._ended_by_sigterm(said, cli.TerminationSignal())
        monkeypatch.delenv(LAUNCHER_ENV)
        assert not cli._ended_by_sigterm(lost, cli.TerminationSignal())
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_whose_exception_was_lost_still_ends_the_rank_as_stopped():
    """SIGTERM's handler ran inside a collective's backward that then failed (its peer stopped by the
    same scheduler): the autograd engine re-raised the collective's error and the handler's
    ``Terminated`` was lost (seen under load on two ranks). The rank still ends as stopped, with or
    without a launcher, at once; a peer that said why is still reported."""
    from dlrmv4 import cli
    from dlrmv4.distributed.liveness import RankLostError

    sigterm = cli.TerminationSignal()
    with pytest.raises(cli.Terminated):
        sigterm(15, None)
    lost = RankLostError("rank 0 of 2: a collective of the training step failed, another rank exited", False)
    assert cli._ended_by_sigterm(lost, sigterm)
    said = RankLostError("rank 0 of 2: a collective failed because rank 1 ran out of device memory", True)
    assert not cli._ended_by_sigterm(said, sigterm)
    assert not cli._ended_by_sigterm(lost, cli.TerminationSignal())  # no signal, no launcher: reported


def test_a_second_preparation_of_a_missing_store_waits_for_the_first_and_uses_its_store(tiny, tmp_path):
    """Two run_and_time.sh on one missing data path: the second `prepare --if-missing` finds the first
    holding the store's prepare lock, says so in one line, waits, and then uses the store the first
    left instead of building it again. The first is this test holding the lock (the real lock
    class) while it puts a prepared store in place."""
    import select
    import shutil

    from dlrmv4.data.prepare_lock import PrepareLock

    data = tmp_path / "data"
    store = data / "processed" / "synthetic-tiny"
    with PrepareLock(store, lambda _: None):
        second = subprocess.Popen(
            [sys.executable, "-m", "dlrmv4", "prepare", "--if-missing", "--data-path", str(data), "--no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            ready, _, _ = select.select([second.stdout], [], [], 120)
            first_line = second.stdout.readline() if ready else "(nothing said in 120 s)"
            waiting = f"[dlrmv4] waiting for another preparation of {store} to finish (pid {os.getpid()} on "
            assert first_line.startswith(waiting) and first_line.endswith(f"; lock {store}.prepare.lock)\n"), first_line
            # What the first one leaves: a store, verified.
            shutil.copytree(tiny[0] / "processed" / "synthetic-tiny", store)
            assert _run("verify", "--data-path", str(data)).returncode == 0
        except BaseException:
            second.kill()
            raise
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert f"store ready at {store}: nothing to prepare" in out and "preprocessing" not in out, out
    assert (data / "processed" / "synthetic-tiny.prepare.lock").read_text() == ""  # released: it names no one


def test_two_preparations_started_together_build_the_store_once(tmp_path):
    """Two real `prepare --if-missing` on one missing data path, started at once: one generates,
    preprocesses and verifies; the other waits for it (saying so, naming it) and uses its store."""
    data = tmp_path / "data"
    cmd = [sys.executable, "-m", "dlrmv4", "prepare", "--if-missing", "--data-path", str(data), "--no-progress"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        outs.append(out)
    built = [i for i, out in enumerate(outs) if "preprocessing into" in out]
    assert len(built) == 1, outs
    other = outs[1 - built[0]]
    assert "preprocessing" not in other and "generating" not in other, other
    assert f"store ready at {data / 'processed' / 'synthetic-tiny'}: nothing to prepare" in other, other
    if "waiting for another preparation" in other:  # it came while the first held the lock
        assert f"(pid {procs[built[0]].pid} on " in other, other
