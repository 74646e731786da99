"""The run's checkpoints: when one is due, what goes into it, and continuing from one (the resume
contract included)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from dlrmv4.checkpoint.cadence import CheckpointCadence
from dlrmv4.checkpoint.loading import load_chain, load_small_state
from dlrmv4.checkpoint.resume_contract import changed_settings, run_settings
from dlrmv4.checkpoint.rng import capture_rng_state, restore_rng_state, resume_seed
from dlrmv4.checkpoint.state import CheckpointPosition, ModelAndOptimizers
from dlrmv4.checkpoint.table_deltas import (
    ENTRY,
    ChangedRows,
    TableRowsDelta,
    delta_bytes,
    split_by_columns,
)
from dlrmv4.checkpoint.writer import CheckpointWriter
from dlrmv4.config import BenchmarkConfig
from dlrmv4.distributed.cluster import Cluster
from dlrmv4.errors import UserError
from dlrmv4.model.hstu import DlrmHSTU
from dlrmv4.train.history import RunHistory


@dataclass
class Resumed:
    """What a checkpoint gives back besides the tensors it restored in place."""

    history: RunHistory
    runlog: dict[str, Any]  # the MLPerf log's state, reopened only if the run goes on
    window_loss: float  # this rank's running loss of the current window
    window_steps: int
    changed_settings: list[str]  # the contract's settings --allow-changed-settings let change


class Checkpointer:
    """Writes and reads ``run_dir/checkpoints`` for one rank (collectively over the ranks)."""

    def __init__(
        self,
        cfg: BenchmarkConfig,
        cluster: Cluster,
        model: DlrmHSTU,
        optimizer: torch.optim.Optimizer,
        embeddings,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.cluster, self.model, self.optimizer, self.embeddings = cfg, cluster, model, optimizer, embeddings
        self.log = log
        self.cadence = CheckpointCadence(cfg.train)
        self.clock: Callable[[], float] = time.perf_counter  # the seconds cadence's (each rank its own)
        train = cfg.train
        self.writer = CheckpointWriter(train.run_dir, train.keep_last_checkpoints, cluster, train.async_checkpoints)
        # Delta checkpoints: the rows changed since ``parent`` (the last checkpoint written or resumed from),
        # ``deltas_since_whole`` of them since the chain's whole checkpoint.
        self.changed_rows = ChangedRows()
        self.parent: Path | None = None
        self.deltas_since_whole = 0
        self.full_every = train.checkpoint_full_every
        split = split_by_columns(embeddings) if self.full_every > 1 else []
        if split:
            self.full_every = 1
            log(
                f"every checkpoint holds the whole tables: {', '.join(split)} split by columns (column_wise "
                "sharding), and a delta checkpoint needs whole rows on a rank"
            )

    def due(self, history: RunHistory, window: int, last_of_window: bool) -> bool:
        """Whether a checkpoint is due after ``history.steps``. A window-end checkpoint (and no other cadence's)
        is skipped while the previous one is still being written in the background, on every rank
        alike: the run never waits for a write to make the next one, and the next window's end tries
        again. A skipped one is said in the log and counted in ``history.checkpoints_skipped``."""
        now = self.clock()
        elapsed = None
        if self.cadence.every_seconds > 0 and self.cluster.world_size > 1:
            # Clocks differ between ranks and the save is collective: every rank the same answer.
            elapsed = self.cluster.any(self.cadence.seconds_elapsed(now))
        reason = self.cadence.due(history.steps, now, last_of_window, elapsed)
        if reason == CheckpointCadence.WINDOW and self.writer.asynchronous:
            if self.cluster.any(self.writer.writing):
                self.cadence.not_taken()
                history.checkpoints_skipped += 1
                self.log(
                    f"window {window}'s checkpoint skipped: the previous one is still being written in the "
                    f"background ({history.checkpoints_skipped} skipped so far; the next window's end tries again)"
                )
                return False
        return reason is not None

    def stage_ahead(self, planned_peak: int | None) -> None:
        """Allocate (and pin) the asynchronous checkpoints' staging copy now, before the run's clock
        starts, instead of in its first save: pinning tens of GiB takes tens of seconds. ``planned_peak``:
        the memory plan's device bytes, given once the warm-up has run the step and the eval (None
        otherwise): with both known, a snapshot on the device may take the room left beside them
        (``checkpoint/device_snapshot.py``)."""
        cadence = self.cadence
        in_run = cadence.every_window or cadence.every_steps > 0 or cadence.every_seconds > 0
        if not (in_run and self.writer.asynchronous and self.cluster.device.type == "cuda"):
            return  # (the final checkpoint alone comes after RUN_STOP: staging it then costs the run nothing)
        state = self._state(RunHistory(), torch.zeros(()), 0, {})
        seconds = self.writer.stage_ahead(state, planned_peak)
        self.log(
            f"checkpoint staging copy in host memory allocated before the run starts ({seconds:.1f} s); "
            f"{self.writer.snapshot_note}"
        )

    def save(
        self,
        history: RunHistory,
        window: int,
        window_loss: torch.Tensor,
        window_steps: int,
        runlog_state: dict[str, Any],
    ) -> None:
        position = CheckpointPosition(step=history.steps, samples_seen=history.samples, window=window)
        clock = time.perf_counter
        started = clock()
        # This rank's own streams and loss sum: a resume on the same world size continues them exactly.
        own = {"rng": capture_rng_state({"dropout": self.model.dropout_generator}), "window_loss": float(window_loss)}
        # The mean over ranks: a resume on another world size continues the same number.
        state = self._state(history, self.cluster.mean(window_loss), window_steps, runlog_state)
        self.wait()  # a delta is written against the checkpoint before it: that one must be written
        parts = {"the state": clock() - started}  # where the step's wait went, for the log line
        every = self.full_every
        parent = self.parent if every > 1 and self.changed_rows.ready and self.deltas_since_whole + 1 < every else None
        what = "whole"
        if parent is not None:
            began = clock()
            rows = self.changed_rows.take(self.embeddings)
            del state["sparse"]
            state[ENTRY] = TableRowsDelta(rows, self.cluster.rank)
            count, size = self._totals(sum(p["ids"].numel() for p in rows.values()), delta_bytes(rows))
            what = f"a delta of {parent.name}: {count:,} changed rows, {size / 2**20:,.1f} MiB"
            parts["the changed rows"] = clock() - began
        then = None
        if parent is None and every > 1:  # the next deltas are written against this state
            blocks = self.changed_rows.blocks(self.embeddings)
            then = ([t for _, w, m in blocks for t in (w, m)], partial(_reset_to, self.changed_rows, blocks))
        path = self.writer.save(position, state, rank_state=own, parent=parent, then=then)
        copied = "the copy" + (" and the rows' fingerprints" if self.writer.then_ran_here else "")
        parts[copied] = self.writer.stage_seconds
        self.parent, self.deltas_since_whole = path, (0 if parent is None else self.deltas_since_whole + 1)
        kind = f" ({what})" if every > 1 else ""
        if self.writer.asynchronous:
            spent = ", ".join(f"{name} {seconds:.2f}" for name, seconds in parts.items())
            self.log(
                f"checkpoint {path.name}{kind} at step {history.steps}: writing in the background "
                f"(the step waited {clock() - started:.2f} s: {spent})"
            )
        else:
            self.log(f"checkpoint {path.name}{kind} at step {history.steps}")

    def _totals(self, *counts: int) -> list[int]:
        """Counts summed over the ranks (one collective)."""
        summed = self.cluster.all_reduce_(torch.tensor(counts, dtype=torch.int64, device=self.cluster.device))
        return [int(n) for n in summed.tolist()]

    def _state(
        self, history: RunHistory, mean_loss: torch.Tensor | float, window_steps: int, runlog_state: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "dense": ModelAndOptimizers(self.model, [self.optimizer]),
            "sparse": self.embeddings.checkpoint_state(),
            "window_accumulator": (mean_loss, window_steps),
            "runlog": runlog_state,
            "history": history,
            "settings": run_settings(self.cfg),
        }

    def wait(self) -> None:
        """Wait for a checkpoint being written in the background, if any."""
        path = self.writer.wait()
        if path is not None:
            self.log(f"checkpoint {path.name} written ({self.writer.write_seconds:.1f} s in the background)")

    def raise_if_write_failed(self) -> None:
        """Raise a background write's error as soon as it has ended with one (each step boundary asks),
        not at the next save or the run's end."""
        if self.writer.failed:
            self.wait()

    def close(self) -> None:
        self.wait()
        self.writer.close()

    def abandon(self) -> None:
        """End without waiting for the write in flight (a failing rank of several)."""
        self.writer.abandon()

    def restore(self, path: Path | None) -> Resumed | None:
        """Continue from the checkpoint at ``path`` (the run's resume point, found once by the
        caller on rank 0 and shared); None for a fresh run."""
        if path is None:
            return None
        changed = self.check_settings(Path(path))
        dense = {"dense": ModelAndOptimizers(self.model, [self.optimizer])}
        sparse = {"sparse": self.embeddings.checkpoint_state()}
        io = self.writer.cluster  # reads wait on the slowest rank's bytes, as writes do (before any write)
        position, state, deltas = load_chain(path, dense, sparse, self.embeddings, io, self.log)
        if self.full_every > 1:
            self.changed_rows.reset(self.embeddings)
        self.parent, self.deltas_since_whole = Path(path), deltas
        saved_world = len(state["rank_states"])
        mean_loss, window_steps = state["window_accumulator"]
        if saved_world == self.cluster.world_size:
            own = state["rank_states"][self.cluster.rank]
            restore_rng_state(own["rng"], {"dropout": self.model.dropout_generator})
            window_loss = own["window_loss"]
        else:
            # Every rank draws the same dropout stream (the reference's), so rank 0's continues on any
            # world size exactly; the other streams are re-derived from (seed, step). The data stream
            # and every table and weight continue exactly.
            self.model.dropout_generator.set_state(state["rank_states"][0]["rng"]["extra"]["dropout"])
            torch.manual_seed(resume_seed(self.cfg.seed, position.step))
            self.log(
                f"checkpoint written by {saved_world} process(es), resuming on {self.cluster.world_size}: "
                "the dropout stream continues, the other random streams are re-derived from the seed and the step"
            )
            window_loss = mean_loss
        self.log(f"resumed from {Path(path).name}: step {position.step}, {position.samples_seen:,} samples")
        return Resumed(state["history"], state["runlog"], window_loss, window_steps, changed)

    def check_settings(self, path: Path) -> list[str]:
        """The resume contract: stop when the settings that shape the run differ from the
        checkpoint's, unless allowed; returns those that changed."""
        saved = load_small_state(path).get("settings")
        if saved is None:
            self.log(f"{path.name} records no settings: the resume contract is not checked")
            return []
        changed = changed_settings(saved, run_settings(self.cfg))
        if not changed:
            return []
        listed = "; ".join(changed)
        if not self.cfg.train.allow_changed_settings:
            raise UserError(
                f"the checkpoint {path} was written with other settings ({listed}): resume with the "
                "same flags, start over with --restart, or continue anyway with "
                "--allow-changed-settings true"
            )
        self.log(f"resuming with changed settings (--allow-changed-settings): {listed}")
        return changed


def _reset_to(changed_rows: ChangedRows, blocks: list, tensors: list[torch.Tensor]) -> None:
    """``changed_rows`` reset to ``tensors``: the weight and momentum of each of ``blocks`` in turn (the
    live ones, or the device snapshot's copies of them taken at the save)."""
    changed_rows.reset_to([(key, tensors[2 * i], tensors[2 * i + 1]) for i, (key, _, _) in enumerate(blocks)])
