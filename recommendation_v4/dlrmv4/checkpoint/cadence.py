"""The checkpoint cadence: when a run writes its next checkpoint."""

from __future__ import annotations

from dlrmv4.config import TrainConfig


class CheckpointCadence:
    """When to checkpoint: every N steps, every N seconds, and/or at the end of each train window.

    Ask once per finished step; the answer says why one is due (``STEPS``, ``SECONDS`` or ``WINDOW``,
    in that order when several apply) or None, and a due answer is taken as a checkpoint written at
    ``now_seconds`` (the seconds clock restarts from it). The clock starts at the first question, so
    a resumed run waits a full interval before its first timed checkpoint. Ranks' clocks differ and a
    save is collective: several ranks pass ``seconds_elapsed``, whether the interval has passed on any
    of them (``seconds_elapsed`` of this clock, combined), so that all give the same answer and
    restart their clocks together.
    """

    STEPS, SECONDS, WINDOW = "steps", "seconds", "window"

    def __init__(self, cfg: TrainConfig):
        self.every_steps = cfg.checkpoint_every_steps
        self.every_seconds = cfg.checkpoint_every_seconds
        self.every_window = cfg.checkpoint_every_window
        self._last_seconds: float | None = None
        self._seconds_before: float | None = None  # the clock before the last due answer restarted it

    def seconds_elapsed(self, now_seconds: float) -> bool:
        """Whether the seconds cadence's interval has passed on this clock."""
        if self._last_seconds is None:
            self._last_seconds = now_seconds
        return self.every_seconds > 0 and now_seconds - self._last_seconds >= self.every_seconds

    def due(
        self, step: int, now_seconds: float, end_of_window: bool, seconds_elapsed: bool | None = None
    ) -> str | None:
        if seconds_elapsed is None:
            seconds_elapsed = self.seconds_elapsed(now_seconds)
        elif self._last_seconds is None:
            self._last_seconds = now_seconds  # the clock starts at the first question all the same
        reasons = (
            (self.STEPS, self.every_steps > 0 and step > 0 and step % self.every_steps == 0),
            (self.SECONDS, seconds_elapsed),
            (self.WINDOW, self.every_window and end_of_window),
        )
        reason = next((name for name, due in reasons if due), None)
        if reason is not None:
            self._seconds_before, self._last_seconds = self._last_seconds, now_seconds
        return reason

    def not_taken(self) -> None:
        """The last due answer's checkpoint was not written (a window end skipped while a write is in
        flight): the seconds clock goes on from the checkpoint before, as if it had not been asked."""
        self._last_seconds = self._seconds_before
