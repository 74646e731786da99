"""The newest checkpoint a run can trust: the run's ``resume_point``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dlrmv4.checkpoint.chain import chain_problem
from dlrmv4.checkpoint.layout import checkpoints_dir, step_dirs
from dlrmv4.errors import UserError


def resume_point(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint a run resumes from, None for a run directory without checkpoints; each newer
    one skipped gets one warning line. Checkpoints none of which is sound are refused in one line
    (and no warnings): starting over would rewrite the run's MLPerf log, which only ``--restart``
    may do. A run looks this up once (``run.start_run``): each check hashes the checkpoint's files."""
    steps = step_dirs(checkpoints_dir(run_dir))
    skipped: list[tuple[Path, str]] = []
    checked: dict[Path, str | None] = {}
    for ckpt in reversed(steps):
        problem = chain_problem(ckpt, True, checked)
        if problem is None:
            for path, why in skipped:
                print(f"[dlrmv4] warning: skipping checkpoint {path}: {why}", file=sys.stderr)
            return ckpt
        skipped.append((ckpt, problem))
    if skipped:
        raise UserError(
            f"{checkpoints_dir(run_dir)} holds {len(steps)} checkpoint(s) but none is usable (the newest, "
            f"{steps[-1].name}: {skipped[0][1]}); pass --restart to start the run over"
        )
    return None
