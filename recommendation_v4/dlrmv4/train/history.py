"""What a run has done so far: steps, samples, evals, per-window losses and rates (checkpointed,
reported in report.json)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EvalRecord:
    samples_count: int
    step: int
    window: int  # the train window the loop was in
    eval_window: int  # the window scored
    auc: float
    seconds: float  # since the run (first start) began
    eval_seconds: float = 0.0  # this eval's own time (scoring the window and the AUC)


@dataclass
class RunHistory:
    status: str = "running"  # then "success" (target reached), "aborted" (data exhausted first) or
    # "stopped" (train.max_steps reached first)
    steps: int = 0
    samples: int = 0
    evals: list[EvalRecord] = field(default_factory=list)
    window_losses: list[tuple[int, int, float]] = field(default_factory=list)  # (window, samples, mean loss)
    throughput: list[tuple[float, float]] = field(default_factory=list)  # (seconds, samples/s) per window
    seconds: float = 0.0
    checkpoint_seconds: float = 0.0  # the steps' waits for checkpoints before RUN_STOP (this process)
    checkpoints_skipped: int = 0  # window-end checkpoints skipped while the previous one was being written

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TrainClock:
    """Seconds spent fetching batches and stepping in the current window, and the steps timed (a
    resumed window times only the steps since the resume)."""

    seconds: float = 0.0
    steps: int = 0

    def add(self, seconds: float, steps: int = 1) -> None:
        self.seconds += seconds
        self.steps += steps
