"""The streaming trainer end to end on a small real store (CPU, deterministic)."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from raw_factory import random_events, write_raw

from dlrmv4.config_loading import load_config
from dlrmv4.data.preprocess import preprocess

pytestmark = pytest.mark.slow  # whole runs in subprocesses

OVERRIDES = {
    ("preprocess", "last_timestamp"): 0,
    ("preprocess", "num_train_days"): 6,
    ("preprocess", "min_history"): 20,
    ("sampler", "max_seq_len"): 48,
    ("sampler", "scan_window"): 200,
    **{
        ("sampler", f"{name}_rows"): 1_000
        for name in (
            "uid",
            "user_artist",
            "user_album",
            "user_hour",
            "item_hour",
            "artist_hour",
            "user_organic",
            "user_artist_hour",
        )
    },
    ("loader", "batch_size"): 16,
    ("loader", "num_workers"): 0,
    ("model", "embedding_dim"): 8,
    ("model", "d_model"): 8,
    ("model", "num_layers"): 1,
    ("model", "num_heads"): 1,
    ("model", "qk_dim"): 16,
    ("model", "v_dim"): 16,
    ("model", "preprocessor_hidden"): 8,
    ("model", "action_dim"): 2,
    ("model", "item_tower_hidden"): 8,
    ("model", "head_hidden"): 8,
    ("model", "num_position_buckets"): 64,
    ("model", "num_time_buckets"): 16,
    ("model", "sequence_dtype"): "float32",
    ("model", "kernels"): "pytorch",
    ("embeddings", "embedding_backend"): "plain",
    ("train", "learning_rate"): 0.01,
    ("train", "warmup_steps"): 5,
    ("train", "eval_every_data_pct"): 0.1,
    ("train", "target_auc"): 1.0,
    ("train", "checkpoint_every_window"): False,
    ("train", "checkpoint_every_steps"): 7,
}

# A training run in a child process (so it can be SIGKILLed); overrides come as {"section.field": value}.
RUNNER = """
import json, sys, torch
torch.use_deterministic_algorithms(True)
from dlrmv4.config_loading import load_config
from dlrmv4.train.run import run_training
overrides = {tuple(key.split(".")): value for key, value in json.loads(sys.argv[1]).items()}
run_training(load_config(None, None, overrides), log=lambda m: print(m, flush=True))
"""


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    cfg = load_config(None, None, OVERRIDES)
    raw = write_raw(root / "raw", random_events(21, num_users=40, max_events=300, span_days=9))
    preprocess(raw, root / "data" / "processed" / "synthetic-tiny", cfg.dataset, cfg.preprocess, progress=False)
    return root / "data"


def _overrides(data_path: Path, run_dir: Path) -> dict:
    values = {f"{s}.{k}": v for (s, k), v in OVERRIDES.items()}
    values.update({"dataset.data_path": str(data_path), "train.run_dir": str(run_dir)})
    return values


def _run(data_path: Path, run_dir: Path, kill_after: float | None = None) -> subprocess.CompletedProcess | None:
    cmd = [sys.executable, "-c", RUNNER, json.dumps(_overrides(data_path, run_dir))]
    if kill_after is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return None


def _cli_flags(values: dict) -> list[str]:
    """The same overrides as ``python -m dlrmv4 train`` flags (no preset, like the runner)."""
    return ["--preset=", "--no-progress"] + [f"--{k.split('.')[1].replace('_', '-')}={v}" for k, v in values.items()]


def _report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())["history"]


def _final_tables(run_dir: Path) -> dict:
    """The sparse tables of the final checkpoint (written when the run ends), read back through DCP: the
    whole tables at the start of its chain with every delta's rows written over them."""
    import warnings

    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from dlrmv4.checkpoint.chain import checkpoint_chain
    from dlrmv4.checkpoint.newest import resume_point

    whole, *deltas = checkpoint_chain(resume_point(run_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's one-process warning
        tables = _load_state_dict_from_keys("sparse", checkpoint_id=whole)["sparse"]["tables"]
        for delta in deltas:
            rows = _load_state_dict_from_keys("sparse_delta", checkpoint_id=delta).get("sparse_delta", {})
            for name, by_rank in rows.get("rows", {}).items():
                for parts in by_rank.values():
                    tables[name]["weight"][parts["ids"]] = parts["weight"]
                    tables[name]["momentum"][parts["ids"]] = parts["momentum"]
    return tables


def test_run_streams_windows_and_evaluates(data_path, tmp_path):
    proc = _run(data_path, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    hist = _report(tmp_path / "run")
    assert hist["status"] == "aborted"  # target 1.0 is never reached: the data runs out
    assert hist["evals"] and all(0.0 <= e["auc"] <= 1.0 for e in hist["evals"])
    windows = [w for w, _, _ in hist["window_losses"]]
    assert windows == sorted(windows), "windows must stream in time order"
    assert len(hist["throughput"]) == len(windows) and all(rate > 0 for _, rate in hist["throughput"])
    # Each eval's own time and the time spent writing checkpoints (one at every window's end here)
    # are recorded apart from the training clock, and both fit inside the run's time.
    assert all(0 < e["eval_seconds"] < e["seconds"] for e in hist["evals"])
    assert 0 < hist["checkpoint_seconds"] and sum(e["eval_seconds"] for e in hist["evals"]) < hist["seconds"]
    for plot in ("auc_vs_samples.png", "throughput_vs_time.png"):
        data = (tmp_path / "run" / plot).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5_000, plot


def test_next_window_mode_scores_the_window_after_each_train_window(data_path, tmp_path):
    """--eval-mode next_window: after train window T closes, window T + 1 is scored, and no holdout
    evals happen in between."""
    from dlrmv4.train.run import run_training

    values = _overrides(data_path, tmp_path / "run")
    values["train.eval_mode"] = "next_window"
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
    history, _ = run_training(cfg, log=lambda m: None)
    ends = {window: samples for window, samples, _ in history.window_losses}
    assert history.evals and len(history.evals) == len(history.window_losses)
    for record in history.evals:
        assert record.eval_window == record.window + 1 and record.samples_count == ends[record.window]


def test_writing_a_profiler_trace_is_left_out_of_the_training_rate(data_path, tmp_path, monkeypatch):
    """The first window's profiled steps take 4 s more to write their trace here: the run's time
    holds them, the window's training rate does not (as with evals and checkpoints)."""
    from dlrmv4.train.run import run_training

    export = torch.profiler.profile.export_chrome_trace

    def slow_export(self, path):
        export(self, path)
        time.sleep(4.0)

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", slow_export)
    values = _overrides(data_path, tmp_path / "run")
    values.update({"train.profile_steps": "2-4"})
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
    history, _ = run_training(cfg, log=lambda m: None)
    assert (tmp_path / "run" / "traces" / "steps-2-4.rank0.json").exists()
    ends = [samples for _, samples, _ in history.window_losses]
    train_seconds = [(b - a) / rate for a, b, (_, rate) in zip([0] + ends, ends, history.throughput)]
    assert history.seconds > 4.0 and train_seconds[0] < 3.0, train_seconds


# RUNNER, saying when the run stages its checkpoints' host copy ahead (pinning tens of GiB on a GPU).
STAGING_RUNNER = RUNNER.replace(
    "from dlrmv4.train.run import run_training",
    "from dlrmv4.train.run import run_training\n"
    "from dlrmv4.train.checkpointer import Checkpointer\n"
    "stage_ahead = Checkpointer.stage_ahead\n"
    "Checkpointer.stage_ahead = lambda self, peak: (print('staging ahead', flush=True), stage_ahead(self, peak))",
)


def test_max_steps_stops_the_run(data_path, tmp_path):
    """A max_steps stop is a pause: called again with the same limit the run has nothing to do (and
    stages no checkpoint copy for it); a larger limit continues it."""
    values = _overrides(data_path, tmp_path / "run")
    for max_steps, staged in ((9, True), (9, False), (10, True)):
        values["train.max_steps"] = max_steps
        proc = subprocess.run(
            [sys.executable, "-c", STAGING_RUNNER, json.dumps(values)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr
        assert ("staging ahead" in proc.stdout) == staged, proc.stdout
        hist = _report(tmp_path / "run")
        assert (hist["status"], hist["steps"], hist["samples"]) == ("stopped", max_steps, max_steps * 16)
    assert "continuing the stopped run from step 9" in proc.stdout


def test_kill_and_resume_is_bit_exact(data_path, tmp_path):
    """SIGKILL at random moments (mid-step, mid-checkpoint, mid-eval), resume each time: the final
    evals, losses and sparse tables equal an uninterrupted run's bit for bit."""
    base = tmp_path / "uninterrupted"
    assert _run(data_path, base).returncode == 0
    killed = tmp_path / "killed"
    rng = random.Random(os.urandom(8))
    kills = 5 if os.environ.get("DLRMV4_KILLS") is None else int(os.environ["DLRMV4_KILLS"])
    for _ in range(kills):
        _run(data_path, killed, kill_after=rng.uniform(3.0, 9.0))
    proc = _run(data_path, killed)
    assert proc.returncode == 0, proc.stderr
    a, b = _report(base), _report(killed)
    assert [(e["samples_count"], e["auc"]) for e in a["evals"]] == [(e["samples_count"], e["auc"]) for e in b["evals"]]
    assert [loss for *_, loss in a["window_losses"]] == [loss for *_, loss in b["window_losses"]]
    ta, tb = _final_tables(base), _final_tables(killed)
    for name in ta:
        assert torch.equal(ta[name]["weight"], tb[name]["weight"]), name
        assert torch.equal(ta[name]["momentum"], tb[name]["momentum"]), name
    # Every dense parameter and table too, through the report's digest of the final parameters.
    digests = [json.loads((d / "report.json").read_text())["parameters_sha256"] for d in (base, killed)]
    assert digests[0] == digests[1]
    # The MLPerf log continued the same run: the same events in the same order, one INIT_START/RUN_START.
    events = [_events(d / "mlperf_log.txt") for d in (base, killed)]
    assert events[0] == events[1]
    assert [k for k, _, _ in events[1]].count("init_start") == 1 == [k for k, _, _ in events[1]].count("run_start")


def _events(path: Path) -> list[tuple]:
    """(key, value, samples_count) of every MLPerf log line: what must not depend on kills."""
    out = []
    for line in path.read_text().splitlines():
        assert line.startswith(":::MLLOG {"), line
        record = json.loads(line[len(":::MLLOG ") :])
        out.append((record["key"], record["value"], record["metadata"].get("samples_count")))
    return out


def test_crash_mid_eval_then_resume_gives_a_log_the_checker_passes(data_path, tmp_path, monkeypatch):
    """A crash inside an eval (after checkpoints were written) leaves EVAL_START without EVAL_STOP
    in the log; the resumed run cuts that off and its log passes the project rules."""
    from dlrmv4.cli import main as cli_main
    from dlrmv4.train.evaluator import Evaluator
    from dlrmv4.train.run import run_training

    values = _overrides(data_path, tmp_path / "run")
    values.update({"train.target_auc": 0.0, "train.checkpoint_every_steps": 2})
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
    auc = Evaluator.auc

    def crash(self, window):
        raise RuntimeError("simulated crash mid-eval")

    monkeypatch.setattr(Evaluator, "auc", crash)
    with pytest.raises(RuntimeError, match="mid-eval"):
        run_training(cfg, log=lambda m: None)
    log_text = (tmp_path / "run" / "mlperf_log.txt").read_text()
    assert '"eval_start"' in log_text and '"eval_stop"' not in log_text
    monkeypatch.setattr(Evaluator, "auc", auc)
    history, _ = run_training(cfg, log=lambda m: None)
    assert history.status == "success" and len(history.evals) == 1
    keys = [k for k, _, _ in _events(tmp_path / "run" / "mlperf_log.txt")]
    assert keys.count("init_start") == keys.count("run_start") == keys.count("eval_start") == 1
    assert cli_main(["check-log", *_cli_flags(values)]) == 0


def test_non_finite_loss_stops_with_the_step_and_window(data_path, tmp_path, monkeypatch, capsys):
    """The model's loss turns NaN at training step 11: ``python -m dlrmv4 train`` must stop with one
    line naming step 11 and its window, exit 1, and never checkpoint the diverged state."""
    from dlrmv4 import cli
    from dlrmv4.checkpoint.layout import CHECKPOINT_DIR
    from dlrmv4.data.loader import make_window_loader
    from dlrmv4.data.store import open_store
    from dlrmv4.model.hstu import DlrmHSTU

    bad_step, calls = 11, {"train": 0}
    forward = DlrmHSTU.forward

    def poisoned(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls["train"] += 1
            if calls["train"] == bad_step + 1:  # the 12th training forward is step 11
                return dataclasses.replace(out, loss=out.loss * float("nan"))
        return out

    monkeypatch.setattr(DlrmHSTU, "forward", poisoned)
    run_dir = tmp_path / "run"
    code = cli.main(["train", *_cli_flags(_overrides(data_path, run_dir))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in _overrides(data_path, run_dir).items()})
    loader = make_window_loader(open_store(data_path / "processed" / "synthetic-tiny"), range(5), cfg, drop_last=True)
    window = loader.dataset.plan[bad_step].window
    assert err[0] == (
        f"[dlrmv4] error: training diverged: non-finite loss at step {bad_step} (window {window}); "
        "lower the learning rate or resume from an earlier checkpoint"
    )
    steps = [int(p.name.split("-")[1]) for p in (run_dir / CHECKPOINT_DIR).glob("step-*")]
    assert steps and all(s <= bad_step for s in steps), steps


def test_restart_starts_cold_and_an_unwritable_run_dir_is_one_line(data_path, tmp_path):
    run_dir = tmp_path / "run"
    values = _overrides(data_path, run_dir)
    values["train.max_steps"] = 3
    flags = _cli_flags(values)
    first = subprocess.run([sys.executable, "-m", "dlrmv4", "train", *flags], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    again = subprocess.run([sys.executable, "-m", "dlrmv4", "train", *flags], capture_output=True, text=True)
    assert "run already finished (stopped)" in again.stdout
    cold = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "train", *flags, "--restart"], capture_output=True, text=True
    )
    assert cold.returncode == 0 and "resumed" not in cold.stdout and "already finished" not in cold.stdout
    assert _report(run_dir)["steps"] == 3
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    bad = [f for f in flags if not f.startswith("--run-dir=")] + [f"--run-dir={blocker / 'run'}"]
    proc = subprocess.run([sys.executable, "-m", "dlrmv4", "train", *bad], capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("[dlrmv4] error: run directory") and "not writable" in proc.stderr


def test_an_unwritable_mlperf_log_fails_before_training(data_path, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    values = _overrides(data_path, tmp_path / "run")
    values["mlperf.log_file"] = str(blocker / "mlperf_log.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "train", *_cli_flags(values)], capture_output=True, text=True
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"[dlrmv4] error: MLPerf log file {blocker / 'mlperf_log.txt'} is not writable")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_resume_with_other_run_settings_stops_naming_them(data_path, tmp_path):
    """The resume contract: a checkpoint records the settings that shape the run; resuming it with
    another learning rate and seed stops with one line naming both (nothing trained, the checkpoint
    kept), a changed layout knob (workers, chunks) resumes, and --allow-changed-settings continues
    with the changed ones, named in the log."""
    run_dir = tmp_path / "run"
    values = _overrides(data_path, run_dir)
    values["train.max_steps"] = 4
    train = [sys.executable, "-m", "dlrmv4", "train"]
    first = subprocess.run([*train, *_cli_flags(values)], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    values["train.max_steps"] = 6
    flags = _cli_flags({**values, "train.learning_rate": 0.02}) + ["--seed=7"]
    refused = subprocess.run([*train, *flags], capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    line = refused.stderr
    assert line.startswith("[dlrmv4] error: the checkpoint") and "was written with other settings" in line
    assert "seed 0 -> 7" in line and f"train.learning_rate {values['train.learning_rate']!r} -> 0.02" in line
    assert "--allow-changed-settings" in line
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == checkpoints
    assert _report(run_dir)["steps"] == 4

    layout = subprocess.run(
        [*train, *_cli_flags({**values, "loader.num_workers": 1, "train.chunks": 2})], capture_output=True, text=True
    )
    assert layout.returncode == 0, layout.stderr
    assert "resumed from step-00000004" in layout.stdout and _report(run_dir)["steps"] == 6

    allowed = subprocess.run(
        [*train, *flags, "--max-steps=8", "--allow-changed-settings=true"], capture_output=True, text=True
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "resuming with changed settings (--allow-changed-settings): seed 0 -> 7;" in allowed.stdout
    assert _report(run_dir)["steps"] == 8
    # The MLPerf log states the values in force, each once, and records the change.
    events = [json.loads(line[len(":::MLLOG ") :]) for line in (run_dir / "mlperf_log.txt").read_text().splitlines()]
    values_of = {key: [e["value"] for e in events if e["key"] == key] for key in ("seed", "opt_base_learning_rate")}
    assert values_of == {"seed": [7], "opt_base_learning_rate": [0.02]}
    changes = [e["value"] for e in events if e["key"] == "resumed_with_changed_settings"]
    assert len(changes) == 1 and "seed 0 -> 7" in changes[0] and "train.learning_rate" in changes[0]


def test_run_settings_leave_out_the_resumable_knobs():
    from dlrmv4.checkpoint.resume_contract import RESUMABLE_FIELDS, changed_settings, run_settings

    cfg = load_config(None, None, {})
    settings = run_settings(cfg)
    assert "seed" in settings and "train.learning_rate" in settings and "model.d_model" in settings
    assert "embeddings.qcomm" in settings and "loader.batch_size" in settings
    assert not RESUMABLE_FIELDS & set(settings)
    assert not any(name.startswith(("distributed.", "plan.")) for name in settings)
    for name in RESUMABLE_FIELDS:  # every resumable knob names a real field
        section, field = name.split(".")
        assert hasattr(getattr(cfg, section), field), name
    assert changed_settings({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4}) == ["b 2 -> 3", "c (not recorded) -> 4"]


def test_one_run_per_run_directory(data_path, tmp_path):
    """A live run holds its run directory: a second run, with or without --restart, refuses in one
    line naming the holder and touches nothing. A lock left by a killed run is taken over, saying so,
    and a run that ends releases it."""
    import socket

    from dlrmv4.train.run_lock import LOCK_FILE, RunDirectoryLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    values = _overrides(data_path, run_dir)
    values["train.max_steps"] = 3
    flags = _cli_flags(values)
    with RunDirectoryLock(run_dir, log=lambda _: None):  # this process plays the live run
        for extra in ([], ["--restart"]):
            proc = subprocess.run(
                [sys.executable, "-m", "dlrmv4", "train", *flags, *extra], capture_output=True, text=True
            )
            assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
            assert (
                f"run directory {run_dir} is in use by a live run (pid {os.getpid()} on {socket.gethostname()}"
                in proc.stderr
            )
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing of the live run touched
    assert (run_dir / LOCK_FILE).read_text() == ""
    (run_dir / LOCK_FILE).write_text("pid 4242 on elsewhere, started 2026-01-01T00:00:00")  # a killed run's
    proc = subprocess.run([sys.executable, "-m", "dlrmv4", "train", *flags], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "its run (pid 4242 on elsewhere, started 2026-01-01T00:00:00) ended without releasing it" in proc.stdout
    assert (run_dir / LOCK_FILE).read_text() == "" and _report(run_dir)["steps"] == 3


def test_a_store_built_with_other_settings_is_refused(data_path, tmp_path):
    """Preprocessing constants or a data seed other than the store's: one line naming each, nothing
    trained (the run's report would otherwise record settings the store was not built with)."""
    values = _overrides(data_path, tmp_path / "run")
    values["train.max_steps"] = 1
    values["preprocess.num_train_days"] = 5
    values["dataset.synthetic_seed"] = 99
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "train", *_cli_flags(values)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "was built with other settings (preprocess.num_train_days 6 -> 5; dataset.synthetic_seed " in proc.stderr
    assert "-> 99; store -> this run)" in proc.stderr and not (tmp_path / "run" / "report.json").exists()


def test_a_damaged_store_is_not_trained_on(data_path, tmp_path):
    """A store changed since it was verified is verified again before training: random bytes in
    one array stop the run in one line naming the file (they used to train to a passing result)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(data_path, data)
    (data / "processed" / ".synthetic-tiny.verified.json").unlink(missing_ok=True)  # an earlier test's run
    values = {**_overrides(data, tmp_path / "run"), "train.max_steps": 1}
    first = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(values)], capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0 and "was never verified: verifying it before training" in first.stdout
    item = data / "processed" / "synthetic-tiny" / "train" / "item_id.npy"
    raw = bytearray(item.read_bytes())
    raw[-64:] = os.urandom(64)
    item.write_bytes(bytes(raw))
    values["train.run_dir"] = str(tmp_path / "second")
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "train", *_cli_flags(values)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    assert "changed train/item_id.npy since it was verified" in proc.stdout
    assert f"fails verification: {item}: md5 mismatch" in proc.stderr
    assert not (tmp_path / "second" / "report.json").exists()


def test_a_checkpoint_that_cannot_be_written_is_one_line(data_path, tmp_path):
    """A write that fails for want of room (here: a file-size limit, EFBIG, as a full disk gives
    ENOSPC) ends the run in one line naming the checkpoint and the cause, where torch's zip writer
    said only "unexpected pos"; the previous checkpoint stays whole and the run resumes from it."""
    import resource

    run_dir = tmp_path / "run"
    values = {**_overrides(data_path, run_dir), "train.max_steps": 7}
    flags = [sys.executable, "-m", "dlrmv4", "train"]
    assert subprocess.run([*flags, *_cli_flags(values)], capture_output=True, timeout=300).returncode == 0
    values["train.max_steps"] = 14

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    proc = subprocess.run(
        [*flags, *_cli_flags(values)], capture_output=True, text=True, timeout=300, preexec_fn=small_files
    )
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
    checkpoints = run_dir / "checkpoints"
    assert f"cannot write {checkpoints / 'step-00000014'}: File too large" in proc.stderr
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000007"]
    resumed = subprocess.run([*flags, *_cli_flags(values)], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "resumed from step-00000007: step 7" in resumed.stdout, resumed.stderr


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_reached_target_survives_a_last_checkpoint_that_cannot_be_written(data_path, tmp_path, asynchronous):
    """A run that reaches its target while its last checkpoint cannot be written (a file-size limit: EFBIG,
    as a full disk gives ENOSPC) ends with its result: exit 0, RUN_STOP success in a log the compliance
    checker passes, its report, and one warning line naming the checkpoint and the cause."""
    import resource

    run_dir = tmp_path / "run"
    values = {
        **_overrides(data_path, run_dir),
        "train.target_auc": 0.0,
        "train.checkpoint_every_steps": 0,
        "train.async_checkpoints": asynchronous,
    }

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    train = [sys.executable, "-m", "dlrmv4", "train", *_cli_flags(values)]
    proc = subprocess.run(train, capture_output=True, text=True, timeout=300, preexec_fn=small_files)
    assert proc.returncode == 0, proc.stderr
    steps = _report(run_dir)["steps"]
    (warning,) = [line for line in proc.stdout.splitlines() if "a checkpoint was not written" in line]
    assert warning == (
        "[dlrmv4] warning: the run ended (success, RUN_STOP logged), but a checkpoint was not written: "
        f"cannot write {run_dir / 'checkpoints' / f'step-{steps:08d}'}: File too large"
    )
    assert _events(run_dir / "mlperf_log.txt")[-1][0] == "run_stop"
    check = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "check-log", *_cli_flags(values)], capture_output=True, text=True, timeout=300
    )
    assert check.returncode == 0 and "PASSED the MLPerf compliance checker" in check.stdout, check.stdout + check.stderr


def test_a_background_write_that_fails_is_said_at_the_next_step(data_path, tmp_path, monkeypatch):
    """The step-7 checkpoint's background write fails: the run ends with its line at the next step
    boundary or the one after (the writer thread's own timing), not at the next save, 7 steps later."""
    from dlrmv4.checkpoint import writer as checkpoint_files
    from dlrmv4.errors import UserError
    from dlrmv4.train.run import run_training
    from dlrmv4.train.step import TrainStep

    real = checkpoint_files.save_checkpoint

    def failing(run_dir, position, *args, **kwargs):
        if position.step == 7:
            raise checkpoint_files.CheckpointWriteError(
                f"cannot write step-{position.step:08d}: No space left on device"
            )
        return real(run_dir, position, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "save_checkpoint", failing)
    steps: list[int] = []
    step_call = TrainStep.__call__
    monkeypatch.setattr(
        TrainStep, "__call__", lambda self, batch, step, *a: (steps.append(step), step_call(self, batch, step, *a))[1]
    )
    values = {**_overrides(data_path, tmp_path / "run"), "train.async_checkpoints": True}
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
    with pytest.raises(UserError, match="^cannot write step-00000007: No space left on device$"):
        run_training(cfg, log=lambda _: None)
    assert 7 < len(steps) <= 9, len(steps)


def test_a_window_end_checkpoint_never_waits_for_the_previous_write(data_path, tmp_path, monkeypatch):
    """Writes made slow (1.5 s each, in the background): the window-end checkpoints that come while one
    is in flight are skipped and said in the log, so the run's saves wait for no write; the steps cadence
    is never skipped (each of its saves waits for the one before), and the last checkpoint resumes."""
    from dlrmv4.checkpoint import writer as checkpoint_files
    from dlrmv4.train.run import run_training

    real = checkpoint_files.save_checkpoint

    def slow(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoint_files, "save_checkpoint", slow)

    def run(run_dir: Path, **train) -> tuple:
        values = _overrides(data_path, run_dir)
        values.update({f"train.{k}": v for k, v in train.items()})
        cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
        lines: list[str] = []
        history, _ = run_training(cfg, log=lines.append)
        return history, lines

    history, lines = run(tmp_path / "window", checkpoint_every_window=True, checkpoint_every_steps=0)
    skipped = [line for line in lines if "checkpoint skipped: the previous one is still being written" in line]
    saves = [line for line in lines if "writing in the background" in line]
    assert history.checkpoints_skipped == len(skipped) > 0 and len(saves) >= 2, lines
    # The saves before the last waited only for their copies: no 1.5 s write among them.
    assert history.checkpoint_seconds < 1.5 * (len(saves) - 1), (history.checkpoint_seconds, lines)
    assert _report(tmp_path / "window")["checkpoints_skipped"] == history.checkpoints_skipped

    # Every checkpoint whole: the newest two alone are kept (deltas keep their chains too: test_delta_checkpoints).
    history, lines = run(
        tmp_path / "steps", checkpoint_every_window=False, checkpoint_every_steps=7, checkpoint_full_every=1
    )
    assert history.checkpoints_skipped == 0 and not [line for line in lines if "skipped" in line]
    saved = sorted(p.name for p in (tmp_path / "steps" / "checkpoints").iterdir())
    assert saved[-1] == f"step-{history.steps:08d}" and len(saved) == 2  # keep_last_checkpoints
    saves = [line for line in lines if "writing in the background" in line]
    assert len(saves) == -(-history.steps // 7)  # every 7th step's and the last: none skipped
    # The 1.5-s writes went one after another (each save waited for its predecessor's): the run lasted
    # at least as long as the in-run saves' writes but the last one (the last comes after RUN_STOP).
    assert history.seconds > 1.5 * (history.steps // 7 - 1), (history.seconds, lines)


def test_a_run_without_its_final_checkpoint_ends_as_one_with_it(data_path, tmp_path):
    """train.final_checkpoint=false: the finished run writes no last checkpoint (the newest is the last
    cadence's), its MLPerf log and report are the same as a run that wrote one, and calling it again
    replays from that newest checkpoint to the same end."""
    with_it, without = tmp_path / "with", tmp_path / "without"
    assert _run(data_path, with_it).returncode == 0
    values = _overrides(data_path, without)
    values["train.final_checkpoint"] = False

    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", RUNNER, json.dumps(values)], capture_output=True, text=True, timeout=600
        )

    proc = run()
    assert proc.returncode == 0, proc.stderr
    assert "no final checkpoint (train.final_checkpoint is false)" in proc.stdout
    a, b = _report(with_it), _report(without)
    assert a["status"] == b["status"] == "aborted" and a["steps"] == b["steps"]
    assert [e["auc"] for e in a["evals"]] == [e["auc"] for e in b["evals"]]
    assert 0 < a["checkpoint_seconds"] and 0 < b["checkpoint_seconds"]  # the cadence's saves, before RUN_STOP
    newest = lambda d: sorted(p.name for p in (d / "checkpoints").iterdir())[-1]  # noqa: E731
    assert newest(with_it) == f"step-{a['steps']:08d}"
    assert newest(without) == f"step-{7 * ((b['steps'] - 1) // 7):08d}"  # the every-7-steps cadence's last
    events = [_events(d / "mlperf_log.txt") for d in (with_it, without)]
    assert events[0] == events[1] and events[1][-1][0] == "run_stop"

    proc = run()  # continuing the finished run replays its tail from the newest checkpoint
    assert proc.returncode == 0, proc.stderr
    assert _events(without / "mlperf_log.txt") == events[0]
    assert [e["auc"] for e in _report(without)["evals"]] == [e["auc"] for e in a["evals"]]


def test_a_max_steps_stop_without_its_final_checkpoint_writes_none(data_path, tmp_path):
    """train.final_checkpoint=false holds at a max_steps stop too (a run whose checkpoint the disk cannot
    hold): no checkpoint at all without a cadence, the MLPerf log ends with its RUN_STOP, and calling it
    again starts over."""
    values = {
        **_overrides(data_path, tmp_path / "run"),
        "train.max_steps": 3,
        "train.final_checkpoint": False,
        "train.checkpoint_every_steps": 0,
        "train.checkpoint_every_window": False,
    }
    cmd = [sys.executable, "-c", RUNNER, json.dumps(values)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "run stopped: no final checkpoint (train.final_checkpoint is false)" in proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    assert _report(tmp_path / "run")["steps"] == 3
    assert _events(tmp_path / "run" / "mlperf_log.txt")[-1][0] == "run_stop"


@pytest.mark.slow  # three runs, each stopped mid-training
def test_a_sigterm_to_the_process_group_ends_the_run_in_its_one_line(data_path, tmp_path):
    """torchrun stops a rank, and a scheduler a job, by signalling its whole process group: the loader's
    workers get the SIGTERM too and die of it. The run still ends as stopped, with its one line and
    143, not with the loader's 'worker killed by signal' error and a traceback."""
    for attempt in range(3):
        run_dir = tmp_path / f"run{attempt}"
        values = {**_overrides(data_path, run_dir), "loader.num_workers": 2, "train.checkpoint_every_steps": 2}
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlrmv4", "train", *_cli_flags(values)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.time() + 120
        while not (run_dir / "checkpoints").exists():  # training is under way, the workers loading
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert (proc.returncode, err.strip().splitlines()[-1:]) == (143, ["[dlrmv4] terminated (SIGTERM)"]), err
        assert "Traceback" not in err and "Exception ignored" not in err, err


def test_worker_starts_follow_the_pinned_host_memory():
    """Workers come from the fork server where a forked one would copy pinned host memory: the
    tables' (both loaders) or an asynchronous checkpoint's staging copy (the evals')."""
    from dlrmv4.train.trainer import worker_starts

    assert worker_starts(False, False) == (None, None)
    assert worker_starts(False, True) == (None, "forkserver")
    assert worker_starts(True, False) == ("forkserver", "forkserver")
    assert worker_starts(True, True) == ("forkserver", "forkserver")


def test_the_fork_server_starts_before_run_start(data_path, tmp_path, monkeypatch):
    """A run whose loaders' workers come from the fork server starts it, with torch imported, before
    RUN_START (the workers then start inside the timed run without importing it), and its training
    and evals run on workers from it."""
    import dlrmv4.train.trainer as trainer_module
    from dlrmv4.mlperf.runlog import RunLog
    from dlrmv4.train.run import run_training

    order: list[str] = []
    start_server, run_start = trainer_module.start_fork_server, RunLog.init_stop_and_run_start
    monkeypatch.setattr(trainer_module, "worker_starts", lambda *pinned: ("forkserver", "forkserver"))
    monkeypatch.setattr(trainer_module, "start_fork_server", lambda: (order.append("fork server"), start_server()))
    monkeypatch.setattr(
        RunLog, "init_stop_and_run_start", lambda self, *a: (order.append("RUN_START"), run_start(self, *a))
    )
    values = {**_overrides(data_path, tmp_path / "run"), "loader.num_workers": 1}
    cfg = load_config(None, None, {tuple(k.split(".")): v for k, v in values.items()})
    history, _ = run_training(cfg, log=lambda m: None)
    assert order == ["fork server", "RUN_START"]
    assert history.steps > 0 and len(history.evals) > 0
