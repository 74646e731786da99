"""MLPerf run logs against the real ``mlperf_logging`` compliance checker (training 6.1.0)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dlrmv4.config_loading import load_config
from dlrmv4.errors import UserError
from dlrmv4.mlperf.rules import check_closed_division, run_checker, write_dataset_rules
from dlrmv4.mlperf.runlog import RunFacts, RunLog
from dlrmv4.reference_counts import REFERENCE_EVAL_SAMPLES, REFERENCE_TRAIN_SAMPLES
from dlrmv4.train.schedule import EvalSchedule


def reference_config(gbs: int, lr: float):
    cfg = load_config("yambda-5b")
    return dataclasses.replace(
        cfg,
        loader=dataclasses.replace(cfg.loader, batch_size=gbs),
        train=dataclasses.replace(cfg.train, learning_rate=lr),
    )


def write_reference_log(path: Path, cfg, aucs: list[float], extra=None) -> None:
    """The schedule and logging code at the reference constants: evals on the real eval grid."""
    facts = RunFacts(REFERENCE_TRAIN_SAMPLES, REFERENCE_EVAL_SAMPLES, "yambda-5b.toml")
    schedule = EvalSchedule(REFERENCE_TRAIN_SAMPLES, cfg.loader.batch_size, cfg.train.eval_every_data_pct)
    log = RunLog(path)
    log.open(0)
    log.init_start()
    log.init_stop_and_run_start(cfg, facts)
    if extra:
        extra(log)
    samples = 0
    for samples, auc in zip(schedule.points(), aucs):
        log.evaluation(samples, REFERENCE_TRAIN_SAMPLES, lambda a=auc: a)
        if auc < cfg.train.target_auc:
            log.block_start(samples, REFERENCE_TRAIN_SAMPLES)
    log.run_stop(samples, REFERENCE_TRAIN_SAMPLES, "success" if aucs[-1] >= cfg.train.target_auc else "aborted")
    log.close()


@pytest.mark.parametrize("gbs", [8192, 16384, 32768])
def test_reference_constants_pass_the_official_closed_rules(tmp_path, gbs):
    cfg = reference_config(gbs, 1.0e-6 * gbs / 8192)
    check_closed_division(cfg, REFERENCE_TRAIN_SAMPLES, REFERENCE_EVAL_SAMPLES)  # allowed: no error
    write_reference_log(tmp_path / "log.txt", cfg, [0.70, 0.74, 0.7501])
    passed, output = run_checker(tmp_path / "log.txt")
    assert passed, output[-3000:]
    assert "closed_dlrmv4.yaml" in output


@pytest.mark.parametrize("case", ["wrong_lr", "missing_key", "second_run_start", "target_missed"])
def test_bad_logs_fail_the_checker(tmp_path, case):
    cfg = reference_config(8192, 2.0e-6 if case == "wrong_lr" else 1.0e-6)
    aucs = [0.70, 0.74] if case == "target_missed" else [0.70, 0.76]
    extra = (lambda log: log.start("run_start")) if case == "second_run_start" else None
    write_reference_log(tmp_path / "log.txt", cfg, aucs, extra)
    if case == "missing_key":
        lines = (tmp_path / "log.txt").read_text().splitlines(keepends=True)
        (tmp_path / "log.txt").write_text("".join(ln for ln in lines if '"key": "opt_adam_beta_2"' not in ln))
    passed, output = run_checker(tmp_path / "log.txt")
    assert not passed
    expected = {
        "wrong_lr": "opt_base_learning_rate",
        "missing_key": "opt_adam_beta_2",
        "second_run_start": "run_start",
        "target_missed": "target_accuracy",
    }[case]
    assert expected in output


def test_closed_division_refuses_a_forbidden_learning_rate():
    cfg = reference_config(8192, 5e-6)
    with pytest.raises(UserError, match=r"closed division forbids this run: learning rate 5e-06 is outside"):
        check_closed_division(cfg, REFERENCE_TRAIN_SAMPLES, REFERENCE_EVAL_SAMPLES)
    open_run = dataclasses.replace(cfg, mlperf=dataclasses.replace(cfg.mlperf, division="open"))
    check_closed_division(open_run, REFERENCE_TRAIN_SAMPLES, REFERENCE_EVAL_SAMPLES)  # not the closed rules
    synthetic = dataclasses.replace(load_config("synthetic-tiny"), train=cfg.train)
    assert synthetic.mlperf.division == "closed"
    check_closed_division(synthetic, 134_291, 17_483)  # another dataset: its project rules apply instead


@pytest.mark.parametrize(
    "train,evals,named",
    [
        (
            2_290_835_000,
            REFERENCE_EVAL_SAMPLES,
            ["train_samples 2,290,835,000 from the store, the closed division pins 2,290,835,423"],
        ),
        (
            REFERENCE_TRAIN_SAMPLES,
            2_058_205,
            ["eval_samples 2,058,205 from the store, the closed division pins 2,058,204"],
        ),
        (
            134_291,
            17_483,
            [
                "train_samples 134,291 from the store, the closed division pins 2,290,835,423",
                "eval_samples 17,483 from the store, the closed division pins 2,058,204",
            ],
        ),
    ],
)
def test_closed_yambda_5b_refuses_counts_other_than_the_pins(train, evals, named):
    cfg = reference_config(8192, 1e-6)
    with pytest.raises(UserError) as info:
        check_closed_division(cfg, train, evals)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("the closed division refuses this Yambda-5B store: ")
    assert all(n in msg for n in named) and msg.count("from the store") == len(named), msg
    # The open division and other datasets are not held to the pinned counts.
    check_closed_division(
        dataclasses.replace(cfg, mlperf=dataclasses.replace(cfg.mlperf, division="open")), train, evals
    )
    fifty = dataclasses.replace(cfg, dataset=dataclasses.replace(cfg.dataset, size="50m"))
    check_closed_division(fifty, train, evals)


def test_check_log_refuses_a_closed_yambda_5b_store_with_other_counts(tmp_path, capsys):
    """check-log on a yambda-5b config whose store (a tiny one) does not give the pinned counts: one
    line naming both numbers of each count, before the checker runs."""
    from store_factory import random_store

    from dlrmv4.cli import main as cli_main
    from dlrmv4.data.store import open_store
    from dlrmv4.data.windows import sample_counts

    data = tmp_path / "data"
    store = open_store(random_store(data / "processed" / "yambda-5b", seed=3, lengths=[60, 80], num_windows=3))
    train, evals = sample_counts(store)
    assert (train, evals) == (store.meta["counts"]["train_samples"], store.meta["counts"]["eval_samples"])
    log = tmp_path / "log.txt"
    write_reference_log(log, reference_config(8192, 1e-6), [0.76])  # would pass the official rules
    capsys.readouterr()
    assert (
        cli_main(["check-log", "--preset", "yambda-5b", "--data-path", str(data), "--log", str(log), "--no-progress"])
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err == (
        "[dlrmv4] error: the closed division refuses this Yambda-5B store: "
        f"train_samples {train:,} from the store, the closed division pins 2,290,835,423; "
        f"eval_samples {evals:,} from the store, the closed division pins 2,058,204 (re-run the "
        "preprocessing with the reference's defaults: python -m dlrmv4 prepare --source yambda "
        "--size 5b, or download_dataset.sh --size 5b)"
    )
    assert not log.with_suffix(".checker.txt").exists()  # refused before the checker ran


def test_project_rules_replace_only_the_benchmark_file(tmp_path):
    """A synthetic-size log passes the project rules and fails the official ones; the project rules
    still apply common.yaml and closed_common.yaml (a missing common key fails)."""
    cfg = load_config("synthetic-tiny")
    train, evals = 134_291, 17_483
    schedule = EvalSchedule(train, cfg.loader.batch_size, cfg.train.eval_every_data_pct)
    log = RunLog(tmp_path / "log.txt")
    log.open(0)
    log.init_start()
    log.init_stop_and_run_start(cfg, RunFacts(train, evals, "synthetic-tiny.toml"))
    points = list(schedule.points())[:3]
    for samples, auc in zip(points, [0.60, 0.62, 0.66]):
        log.evaluation(samples, train, lambda a=auc: a)
        if auc < cfg.train.target_auc:
            log.block_start(samples, train)
    log.run_stop(points[-1], train, "success")
    log.close()
    rules = write_dataset_rules(tmp_path / "rules", cfg, train, evals, schedule.interval, schedule.first)
    passed, output = run_checker(tmp_path / "log.txt", rules)
    assert passed, output[-3000:]
    assert "closed_common.yaml" in output and "checks.yaml" in output and "closed_dlrmv4.yaml" not in output
    assert not run_checker(tmp_path / "log.txt")[0]
    lines = (tmp_path / "log.txt").read_text().splitlines(keepends=True)
    (tmp_path / "log.txt").write_text("".join(ln for ln in lines if '"key": "submission_org"' not in ln))
    passed, output = run_checker(tmp_path / "log.txt", rules)
    assert not passed and "submission_org" in output


def test_training_refuses_a_closed_yambda_5b_store_with_other_counts(tmp_path, capsys):
    """The start check: ``train`` on a yambda-5b config whose store gives other counts stops with one line
    before any model is built."""
    from store_factory import random_store

    from dlrmv4.cli import main as cli_main

    data = tmp_path / "data"
    store = random_store(data / "processed" / "yambda-5b", seed=4, lengths=[50, 70], num_windows=3)
    meta = json.loads((store / "meta.json").read_text())
    # A store built with the preset's constants (else the settings check refuses it first), other counts.
    preset = load_config("yambda-5b").preprocess
    meta["constants"] = {name: getattr(preset, name) for name in meta["constants"]}
    (store / "meta.json").write_text(json.dumps(meta))
    counts = meta["counts"]
    capsys.readouterr()
    assert (
        cli_main(
            [
                "train",
                "--preset",
                "yambda-5b",
                "--data-path",
                str(data),
                "--run-dir",
                str(tmp_path / "run"),
                "--embedding-backend",
                "plain",
                "--no-progress",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("[dlrmv4] error: the closed division refuses this Yambda-5B store")
    assert f"train_samples {counts['train_samples']:,} from the store, the closed division pins 2,290,835,423" in err
    assert f"eval_samples {counts['eval_samples']:,} from the store, the closed division pins 2,058,204" in err
    assert not (tmp_path / "run" / "mlperf_log.txt").exists()  # no log claims the pinned counts


# Events written until the file-size limit stops one: what a full disk does, in a process of its own.
_FILL = """
import resource, sys
from pathlib import Path
from dlrmv4.errors import UserError
from dlrmv4.mlperf.runlog import RunLog
log = RunLog(Path(sys.argv[1]))
log.open(0)
log.init_start()
resource.setrlimit(resource.RLIMIT_FSIZE, (3000, 3000))
try:
    for i in range(100):
        log.event("eval_accuracy", 0.7, {"samples_count": i})
except UserError as exc:
    print(exc)
    log.close()
    sys.exit(1)
"""


def test_a_log_that_cannot_be_written_stops_the_run_in_one_line(tmp_path):
    """logging's FileHandler prints a traceback per failed event and goes on, and its buffer leaves a
    partial line (and mllog a "Failed to encode" one): the run log stops at the first event it cannot
    write, in one line naming the file and the cause, and the file ends with the last whole event."""
    import subprocess
    import sys

    path = tmp_path / "mlperf_log.txt"
    proc = subprocess.run([sys.executable, "-c", _FILL, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == f"cannot write {path}: File too large"
    data = path.read_bytes()
    assert data.endswith(b"\n") and len(data) <= 3000
    events = [json.loads(line[len(":::MLLOG ") :]) for line in data.decode().splitlines()]
    counts = [e["metadata"]["samples_count"] for e in events if e["key"] == "eval_accuracy"]
    assert counts == list(range(len(counts))) and len(counts) > 5


def _logged_run(path: Path) -> dict:
    """A run log of the embedded default's shape up to a checkpoint's moment; returns that state."""
    cfg = load_config("synthetic-tiny")
    log = RunLog(path)
    log.open(0)
    log.init_start()
    log.init_stop_and_run_start(cfg, RunFacts(135_239, 16_059, "synthetic-tiny.toml"))
    log.evaluation(17_024, 135_239, lambda: 0.6)
    log.block_start(17_024, 135_239)
    state = log.state()
    log.evaluation(34_048, 135_239, lambda: 0.62)  # after the checkpoint: a resume repeats it
    log.close()
    return state


def _delete_a_middle_line(data: bytes) -> bytes:
    lines = data.splitlines(keepends=True)
    return b"".join(lines[:5] + lines[6:])


def _overwrite_bytes(data: bytes) -> bytes:
    middle = len(data) // 2
    return data[:middle] + b"#" * 20 + data[middle + 20 :]


@pytest.mark.parametrize("edit", [_delete_a_middle_line, _overwrite_bytes, lambda data: data[: len(data) // 3]])
def test_a_resume_refuses_a_log_edited_since_its_checkpoint(tmp_path, edit):
    """A deleted line, overwritten bytes or a cut tail: one line naming the file, nothing rewritten."""
    path = tmp_path / "mlperf_log.txt"
    state = _logged_run(path)
    path.write_bytes(edit(path.read_bytes()))
    edited = path.read_bytes()
    with pytest.raises(UserError) as info:
        RunLog(path).resume(state, load_config("synthetic-tiny"), RunFacts(135_239, 16_059, "synthetic-tiny.toml"))
    assert str(info.value).startswith(f"MLPerf log {path} ") and "\n" not in str(info.value)
    assert path.read_bytes() == edited


def test_a_resume_continues_the_log_it_recorded_event_for_event(tmp_path):
    """Untouched, the log is cut back to the checkpoint and continued: the events after it appear once."""
    path = tmp_path / "mlperf_log.txt"
    state = _logged_run(path)
    log = RunLog(path)
    log.resume(state, load_config("synthetic-tiny"), RunFacts(135_239, 16_059, "synthetic-tiny.toml"))
    log.evaluation(34_048, 135_239, lambda: 0.62)
    log.close()
    keys = [json.loads(line[len(":::MLLOG ") :])["key"] for line in path.read_text().splitlines()]
    assert keys.count("eval_accuracy") == 2 and keys.count("init_start") == 1 and keys.count("run_start") == 1
