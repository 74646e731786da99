"""Profiler traces as a feature: capture chosen step windows on every rank, merge the ranks' files.

``train.profile_steps`` is a list of half-open step windows, ``"100-110,500-505"``; every rank
records each window with ``torch.profiler`` (CPU, and CUDA where present) and writes
``<run_dir>/traces/steps-<a>-<b>.rank<r>.json`` (Chrome trace format). ``merge_traces`` puts the
ranks of one window into one file Perfetto (ui.perfetto.dev) or chrome://tracing opens, each
rank's processes renamed ``rank <r> ...`` so they sort together.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import torch

from dlrmv4.errors import UserError

TRACE_DIR = "traces"
_RANK_FILE = re.compile(r"^steps-(\d+)-(\d+)\.rank(\d+)\.json$")
# Per-rank pid offset in a merged file: far above any real pid, so ranks never collide.
RANK_PID_STRIDE = 1 << 32


def parse_step_windows(text: str) -> list[tuple[int, int]]:
    """``"100-110,500-505"`` -> [(100, 110), (500, 505)]: sorted, non-overlapping, end > start."""
    windows = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)-(\d+)", part)
        if not match or int(match.group(2)) <= int(match.group(1)):
            raise UserError(
                f"config field train.profile_steps: {part!r} is not a step window 'start-end' with end > start"
            )
        windows.append((int(match.group(1)), int(match.group(2))))
    windows.sort()
    for (a0, a1), (b0, _) in zip(windows, windows[1:]):
        if b0 < a1:
            raise UserError(f"config field train.profile_steps: windows {a0}-{a1} and {b0}-... overlap")
    return windows


class StepProfiler:
    """Starts the profiler before the first step of a window and writes the trace after its last.

    Ask ``before_step(step)`` ahead of every step and ``after_step(step)`` after it; windows that a
    resumed run has already passed are skipped, one that it is inside of starts at once. The host's
    work of stopping the profiler and writing the trace, after the window's device work has ended,
    adds up in ``writing_seconds``: the trainer leaves it out of the training rate, as it does
    checkpoints.
    """

    def __init__(self, windows: list[tuple[int, int]], run_dir: Path, rank: int, device: torch.device) -> None:
        self.windows = list(windows)
        self.out_dir = Path(run_dir) / TRACE_DIR
        self.rank = rank
        self.device = device
        self.writing_seconds = 0.0
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._active: tuple[tuple[int, int], Any] | None = None

    def before_step(self, step: int) -> None:
        if self._active is not None or not self.windows:
            return
        while self.windows and self.windows[0][1] <= step:
            self.windows.pop(0)
        if self.windows and self.windows[0][0] <= step:
            window = self.windows.pop(0)
            prof = torch.profiler.profile(activities=self.activities)
            prof.__enter__()
            self._active = (window, prof)

    def after_step(self, step: int) -> Path | None:
        """The trace written when ``step`` ended a window, else None."""
        if self._active is None or step + 1 < self._active[0][1]:
            return None
        return self.close()

    def close(self) -> Path | None:
        """Stop a window early (the run ended inside it) and write what it recorded."""
        if self._active is None:
            return None
        (start, end), prof = self._active
        self._active = None
        if self.device.type == "cuda":  # the window's steps end here, on the training clock
            torch.cuda.synchronize(self.device)
        began = time.perf_counter()
        prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"steps-{start}-{end}.rank{self.rank}.json"
        prof.export_chrome_trace(str(path))
        self.writing_seconds += time.perf_counter() - began
        return path


def merge_traces(trace_dir: Path) -> list[Path]:
    """One ``steps-<a>-<b>.merged.json`` per window from its per-rank files; returns the files written."""
    groups: dict[tuple[int, int], dict[int, Path]] = {}
    for path in sorted(Path(trace_dir).glob("steps-*.rank*.json")):
        match = _RANK_FILE.match(path.name)
        if match:
            groups.setdefault((int(match.group(1)), int(match.group(2))), {})[int(match.group(3))] = path
    if not groups:
        raise UserError(f"no per-rank traces (steps-<a>-<b>.rank<r>.json) in {trace_dir}: set train.profile_steps")
    written = []
    for (start, end), ranks in sorted(groups.items()):
        merged: dict[str, Any] | None = None
        events: list[dict[str, Any]] = []
        for rank, path in sorted(ranks.items()):
            try:
                trace = json.loads(path.read_text())
            except (OSError, ValueError) as exc:
                raise UserError(f"{path} is not a readable Chrome trace: {exc}") from exc
            if merged is None:
                merged = {k: v for k, v in trace.items() if k != "traceEvents"}
            events.extend(_rank_events(trace.get("traceEvents", []), rank))
        out = Path(trace_dir) / f"steps-{start}-{end}.merged.json"
        out.write_text(json.dumps({**(merged or {}), "traceEvents": events}))
        written.append(out)
    return written


def _rank_events(events: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
    """A rank's events with its own pid range and 'rank <r>' process names."""
    out, named = [], set()
    for event in events:
        event = dict(event)
        pid = event.get("pid")
        new_pid = rank * RANK_PID_STRIDE + pid if isinstance(pid, int) else f"rank {rank} {pid}"
        event["pid"] = new_pid
        if event.get("ph") == "M" and event.get("name") == "process_name":
            event["args"] = {**event.get("args", {}), "name": f"rank {rank} {event.get('args', {}).get('name', '')}"}
            named.add(new_pid)
        out.append(event)
    for pid in sorted({e["pid"] for e in out if "pid" in e} - named, key=str):
        out.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {rank}"}})
    return out
