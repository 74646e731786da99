"""Profiler step windows and the per-rank trace merge, with the real torch profiler."""

from __future__ import annotations

import json

import pytest
import torch

from dlrmv4.errors import UserError
from dlrmv4.train.trace import RANK_PID_STRIDE, StepProfiler, merge_traces, parse_step_windows


def test_step_windows_parse_sorted_and_checked():
    assert parse_step_windows("") == []
    assert parse_step_windows("500-505, 100-110") == [(100, 110), (500, 505)]
    for bad in ("5", "7-7", "9-3", "a-b", "1-10,5-12"):
        with pytest.raises(UserError, match="train.profile_steps"):
            parse_step_windows(bad)


def _steps(profiler: StepProfiler, first: int, last: int) -> list:
    written = []
    x = torch.randn(64, 64)
    for step in range(first, last):
        profiler.before_step(step)
        with torch.profiler.record_function(f"step {step}"):
            x = torch.tanh(x @ x)
        written.append(profiler.after_step(step))
    return written


def test_windows_record_only_their_steps_and_a_resume_inside_one_starts_at_once(tmp_path):
    profiler = StepProfiler([(2, 4), (6, 8)], tmp_path, rank=0, device=torch.device("cpu"))
    written = _steps(profiler, 0, 10)
    assert [p.name if p else None for p in written] == [
        None,
        None,
        None,
        "steps-2-4.rank0.json",
        None,
        None,
        None,
        "steps-6-8.rank0.json",
        None,
        None,
    ]
    names = {e.get("name") for e in json.loads(written[3].read_text())["traceEvents"]}
    assert {"step 2", "step 3"} <= names and not {"step 1", "step 4"} & names
    resumed = StepProfiler([(2, 4), (6, 8)], tmp_path / "resumed", rank=0, device=torch.device("cpu"))
    assert [p.name for p in _steps(resumed, 7, 10) if p] == ["steps-6-8.rank0.json"]  # 2-4 passed: skipped


def test_merge_puts_every_rank_in_one_file_with_its_own_processes(tmp_path):
    for rank in (0, 1):
        _steps(StepProfiler([(1, 3)], tmp_path, rank=rank, device=torch.device("cpu")), 0, 4)
    (merged,) = merge_traces(tmp_path / "traces")
    assert merged.name == "steps-1-3.merged.json"
    events = json.loads(merged.read_text())["traceEvents"]
    ranks = {e["pid"] // RANK_PID_STRIDE for e in events if isinstance(e.get("pid"), int)}
    assert ranks == {0, 1}
    names = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert any(n.startswith("rank 0") for n in names) and any(n.startswith("rank 1") for n in names)
    assert sum(e.get("name") == "step 1" for e in events) == 2  # one per rank


def test_merge_without_traces_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="no per-rank traces"):
        merge_traces(tmp_path)
