"""Config: presets, precedence (defaults < preset < file < CLI), validation messages, flags."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from dlrmv4.config import SECTIONS, BenchmarkConfig
from dlrmv4.config_loading import add_config_arguments, config_from_args, list_presets, load_config, to_toml
from dlrmv4.errors import UserError


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def test_required_presets_exist_and_load():
    for name in ("yambda-5b", "yambda-50m", "yambda-500m", "synthetic-tiny", "synthetic-small"):
        assert name in list_presets()
    for name in list_presets():
        assert isinstance(load_config(name), BenchmarkConfig)


def test_reference_preset_carries_spec_numbers():
    cfg = load_config("yambda-5b")
    assert cfg.dataset.source == "yambda" and cfg.dataset.size == "5b"
    p = cfg.preprocess
    # last_timestamp 0: the split ends at the data's largest timestamp, exclusive (docs/data.md).
    assert (p.last_timestamp, p.test_span_seconds, p.split_gap_seconds, p.num_train_days) == (0, 86_400, 1_800, 300)
    assert p.null_ratio_policy == "skip" and cfg.sampler.uid_rows == 1_000_001
    assert cfg.dataset.hub_revision == "dd6f3a19eef5866e346c3270e098baa641a44948"
    assert (cfg.loader.window_order, cfg.loader.rank_slicing) == ("index", "strided")
    assert (p.window_seconds, p.session_gap_seconds, p.listen_threshold_pct, p.min_history) == (
        86_400,
        1_800,
        50,
        4_086,
    )
    s = cfg.sampler
    assert (s.max_seq_len, s.history_length, s.per_pool_length, s.scan_window) == (4_096, 4_087, 1_362, 20_000)
    assert (s.user_artist_rows, s.user_album_rows, s.user_hour_rows, s.item_hour_rows) == (
        100_000_000,
        40_000_000,
        24_000_000,
        40_000_000,
    )
    assert (s.artist_hour_rows, s.user_organic_rows, s.user_artist_hour_rows) == (32_000_000, 2_000_000, 40_000_000)


def test_cli_wins_over_file_over_preset(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("[loader]\nbatch_size = 77\nnum_workers = 0\n[preprocess]\nmin_history = 5\n")
    cfg = _parse(["--preset", "synthetic-tiny", "--config", str(conf), "--batch-size", "9"])
    assert cfg.loader.batch_size == 9  # CLI
    assert cfg.loader.num_workers == 0  # file over preset
    assert cfg.preprocess.min_history == 5
    assert cfg.dataset.size == "tiny"  # preset
    assert cfg.preprocess.num_train_days == load_config("synthetic-tiny").preprocess.num_train_days


def test_every_field_has_one_typed_flag():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    flags = {opt for action in parser._actions for opt in action.option_strings}
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    names += [f.name for f in dataclasses.fields(BenchmarkConfig) if f.name not in SECTIONS]
    assert len(names) == len(set(names)), "flat flag names must be unique across sections"
    for name in names:
        assert "--" + name.replace("_", "-") in flags
    cfg = _parse(["--shuffle-within-window", "true", "--seed", "3", "--hub-revision", "abc"])
    assert cfg.loader.shuffle_within_window is True and cfg.seed == 3 and cfg.dataset.hub_revision == "abc"


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({("loader", "batch_size"): 0}, r"loader.batch_size=0 is outside the allowed range \[1, inf\]"),
        ({("dataset", "source"): "kaggle"}, r"dataset.source='kaggle' is not one of synthetic, yambda"),
        ({("dataset", "source"): "yambda", ("dataset", "size"): "tiny"}, r"not valid for source 'yambda'"),
        ({("sampler", "max_seq_len"): 11}, r"leaves no history"),
        ({("preprocess", "min_history"): "10"}, r"preprocess.min_history must be int"),
        ({("loader", "shuffle_within_window"): 1}, r"loader.shuffle_within_window must be bool"),
        # NaN passes every comparison, so every range check: refused as such, as are infinities.
        ({("train", "learning_rate"): float("nan")}, r"train.learning_rate=nan must be a finite number"),
        ({("train", "target_auc"): float("nan")}, r"train.target_auc=nan must be a finite number"),
        ({("train", "grad_clip_norm"): float("inf")}, r"train.grad_clip_norm=inf must be a finite number"),
        ({("train", "adam_beta1"): float("-inf")}, r"train.adam_beta1=-inf must be a finite number"),
    ],
)
def test_validation_names_field_and_range(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config("synthetic-tiny", None, overrides)


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[loader]\nbatchsize = 3\n")
    with pytest.raises(UserError, match="unknown key loader.batchsize"):
        load_config("synthetic-tiny", str(bad))
    bad.write_text("[loader\n")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config("synthetic-tiny", str(bad))
    with pytest.raises(UserError, match="does not exist"):
        load_config("synthetic-tiny", str(tmp_path / "none.toml"))
    with pytest.raises(UserError, match="unknown preset 'nope'; available: "):
        load_config("nope")


def test_toml_round_trip(tmp_path):
    cfg = load_config("yambda-5b", None, {("loader", "batch_size"): 3})
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(None, str(path)) == cfg


def test_cli_error_is_one_line_with_exit_1():
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "show-config", "--num-train-days", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "[dlrmv4] error: config field preprocess.num_train_days=1 is outside the allowed range [2, 100000]"
    )


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--learning-rate", "nan"], "[dlrmv4] error: config field train.learning_rate=nan must be a finite number"),
        (
            ["--batch-size", "abc"],
            "[dlrmv4] error: argument --batch-size: invalid int value: 'abc' (see dlrmv4 show-config --help)",
        ),
        (["--bogus", "3"], "[dlrmv4] error: unrecognized arguments: --bogus 3 (see dlrmv4 --help)"),
    ],
)
def test_a_bad_flag_value_is_one_line(argv, line, tmp_path):
    """No usage block: one line, and where the flags are described. A NaN in a TOML file too."""
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "show-config", *argv], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode in (1, 2) and proc.stderr.strip() == line
    toml = tmp_path / "nan.toml"
    toml.write_text("[train]\nadam_eps = nan\n")
    with pytest.raises(UserError, match="train.adam_eps=nan must be a finite number"):
        load_config("synthetic-tiny", str(toml))


def test_source_and_size_select_the_matching_preset():
    proc = subprocess.run(
        [sys.executable, "-m", "dlrmv4", "show-config", "--source", "yambda", "--size", "50m"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert 'size = "50m"' in proc.stdout
    assert "dd6f3a19eef5866e346c3270e098baa641a44948" in proc.stdout  # the preset pins the revision
