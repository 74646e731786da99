"""The benchmarks' results writer (benchmarks/harness.py): every .json and .md names the command as
run, the commit, the machine and the package versions; rows kept by label stay one file. And one
cheap benchmark end to end: bench_sampler.py on a tiny store, writing to a temporary --out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import harness
import pytest

BENCHMARKS = Path(harness.__file__).resolve().parent


@pytest.fixture
def argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / "step" / "bench_x.py"), "--label", "a b", "--steps", "3"])
    monkeypatch.setenv("DLRMV4_COMMIT", "abc1234")
    for name in harness.MEASURED_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    harness.git_commit.cache_clear()
    yield
    harness.git_commit.cache_clear()


def test_command_line_is_relative_and_quoted(argv):
    assert harness.command_line() == "python benchmarks/step/bench_x.py --label 'a b' --steps 3"


def test_command_line_names_the_allocator_setting_it_ran_under(argv, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    got = harness.command_line()
    assert (
        got
        == "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/step/bench_x.py --label 'a b' --steps 3"
    )


def test_command_line_leaves_out_where_the_results_go(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    script = str(BENCHMARKS / "scale" / "bench_x.py")
    for out in (["--results-dir", "/x/res"], ["--results-dir=/x/res"]):
        argv = [script, "--worlds", "1", "2", *out, "--repeats", "2"]
        got = harness.command_line(argv, without=("--results-dir",))
        assert got == "python benchmarks/scale/bench_x.py --worlds 1 2 --repeats 2"


def test_commit_from_the_environment_else_git(monkeypatch, argv):
    assert harness.git_commit() == "abc1234"
    monkeypatch.delenv("DLRMV4_COMMIT")
    harness.git_commit.cache_clear()
    commit = harness.git_commit()
    assert commit and commit != "abc1234"  # git's short hash, or "unknown" in a tree without .git


def test_facts_and_versions():
    facts = harness.device_facts("cpu")
    assert facts["cpu"] and facts["cpu_cores"] >= 1 and "gpu" not in facts
    versions = harness.package_versions()
    assert versions["python"].count(".") == 2 and "numpy" in versions and "torch" in versions


def test_write_results_stamps_both_files(tmp_path, argv):
    stamped = harness.write_results(
        "demo",
        {"rows": [{"x": 1}], "device": "my device"},
        "| x |\n|---|\n| 1 |\n",
        device="cpu",
        out=tmp_path / "results",
    )
    data = json.loads((tmp_path / "results" / "demo.json").read_text())
    assert data == stamped
    assert data["rows"] == [{"x": 1}] and data["device"] == "my device"
    assert data["command"] == "python benchmarks/step/bench_x.py --label 'a b' --steps 3"
    assert data["commit"] == "abc1234"
    assert data["machine"]["cpu"] and data["versions"]["python"]
    md = (tmp_path / "results" / "demo.md").read_text()
    assert md.startswith("| x |\n|---|\n| 1 |\n\n")
    footer = md.splitlines()[-1]
    assert f"Command: `{data['command']}`" in footer and "commit abc1234" in footer
    assert data["machine"]["cpu"] in footer and f"python {data['versions']['python']}" in footer
    assert not list((tmp_path / "results").glob("*.tmp*"))


def test_the_footer_leaves_out_what_the_text_shows(tmp_path, argv):
    versions = ", ".join(f"{k} {v}" for k, v in harness.package_versions().items())
    text = (
        f"Run `{harness.command_line()}` at commit abc1234 on {harness.cpu_model()} ({versions}).\n\n"
        "| x |\n|---|\n| 1 |"
    )
    harness.write_results("shown", {}, text, device="cpu", out=tmp_path)
    assert (tmp_path / "shown.md").read_text() == text + "\n"


def test_labelled_rows_keep_one_row_per_label(tmp_path, argv, monkeypatch):
    def table(rows):
        return "\n".join(f"| {r['label']} | {r['value']} |" for r in rows)

    old = {"label": "old", "value": 0, "command": "python benchmarks/step/bench_x.py --label old"}  # before stamps
    (tmp_path / "demo.json").write_text(json.dumps({"rows": [old]}))
    harness.save_labelled_row("demo", {"label": "a", "value": 1}, "Intro.", table, device="cpu", out=tmp_path)
    monkeypatch.setenv("DLRMV4_COMMIT", "def5678")
    harness.git_commit.cache_clear()
    harness.save_labelled_row("demo", {"label": "b", "value": 2}, "Intro.", table, device="cpu", out=tmp_path)
    harness.save_labelled_row("demo", {"label": "a", "value": 3}, "Intro.", table, device="cpu", out=tmp_path)
    rows = json.loads((tmp_path / "demo.json").read_text())["rows"]
    assert [(r["label"], r["value"]) for r in rows] == [("old", 0), ("b", 2), ("a", 3)]
    assert rows[0] == old and rows[1]["commit"] == rows[2]["commit"] == "def5678"
    md = (tmp_path / "demo.md").read_text()
    assert md.startswith("Intro.\n\n| old | 0 |\n| b | 2 |\n| a | 3 |\n\nCommands:\n")
    assert "- old: `python benchmarks/step/bench_x.py --label old`\n" in md
    assert "- a: `python benchmarks/step/bench_x.py --label 'a b' --steps 3` (commit def5678; " in md


def test_sampler_benchmark_writes_stamped_results(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent), DLRMV4_COMMIT="feed123")
    args = [
        "--users",
        "4",
        "--batches",
        "1",
        "--batch-size",
        "8",
        "--repeats",
        "1",
        "--reference-samples",
        "1",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "data" / "bench_sampler.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "sampler.json").read_text())
    command = "python benchmarks/data/bench_sampler.py " + " ".join(args)
    assert data["command"] == command and data["commit"] == "feed123"
    assert data["machine"]["cpu"] and "numpy" in data["versions"]
    assert [r["config"] for r in data["rows"]] == ["reference (max_seq_len 4096)", "history 1,024"]
    assert all(r["samples_per_s"] > 0 and r["python_reference_samples_per_s"] > 0 for r in data["rows"])
    md = (tmp_path / "sampler.md").read_text()
    assert md.startswith(f"# Sampler throughput (`{command}`)")
    assert "| config | history | tokens/sample |" in md and "commit feed123" in md.splitlines()[-1]


def _run_on_a_small_store(tmp_path, script: str, *args: str) -> dict:
    """``script`` (its path under benchmarks/) on the small multi-process store (GBS 16), writing to
    ``tmp_path``; its results."""
    from multi_process import make_data

    data = make_data(tmp_path / "store")
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent), DLRMV4_COMMIT="feed123")
    common = ["--preset", "synthetic-tiny", "--data-path", str(data), "--global-batch", "16", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *common, *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    name = Path(script).stem.removeprefix("bench_")
    return json.loads((tmp_path / f"{name}.json").read_text())


def test_dedup_ids_benchmark_counts_the_distinct_ids(tmp_path):
    """bench_dedup_ids.py on a small store: rank 0's distinct history ids are a share of its tokens,
    fewer than all of them (the store's users repeat items), and the table says so per feature."""
    data = _run_on_a_small_store(tmp_path, "data/bench_dedup_ids.py", "--worlds", "1", "2", "--batches", "3")
    assert [(r["world"], r["samples_per_rank"]) for r in data["rows"]] == [(1, 16), (2, 8)]
    for row in data["rows"]:
        assert all(0 < share < 1 for share in row["distinct_share"].values()), row
        assert row["pack_dedup_ms"] > 0 and row["tokens_per_rank"] > 0
    md = (tmp_path / "dedup_ids.md").read_text()
    assert "| ranks | samples per rank |" in md and "commit feed123" in md


def test_loader_benchmark_times_a_worker_and_the_node(tmp_path):
    """bench_loader.py on a small store: one worker cold and warm, then two ranks' workers at once."""
    data = _run_on_a_small_store(
        tmp_path, "data/bench_loader.py", "--ranks", "2", "--workers-per-rank", "1", "--batches", "2"
    )
    rows = data["rows"]
    assert rows["cold"]["samples"] == rows["warm"]["samples"] > 0
    assert rows["node"]["processes"] == 2 and rows["node"]["samples"] == 2 * rows["warm"]["samples"]
    assert all(row["samples_per_s"] > 0 for row in rows.values())
    md = (tmp_path / "loader.md").read_text()
    assert "| the node | 2 |" in md and "commit feed123" in md
