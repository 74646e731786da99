"""A set of runs scored as MLPerf scores a submission, with mlperf-logging's own checkers and summarizer.

A ``dlrmv4`` score is not one run: ``benchmark_meta`` asks for 10 result files; every log must pass
the compliance checker, the seeds must differ (``package_checker``'s seed checker), the set must pass
the RCP check (``rcp_checker``'s pruned pass, which also sets the factor that scales a set converging
faster than the references allow), and the score is the olympic mean of the runs' minutes from
RUN_START to RUN_STOP (fastest and slowest dropped; a non-converged run counts as dropped) times that
factor, as ``result_summarizer.compute_score`` computes it. Its score function reads each log through
the official closed rules only, so the set's logs are checked here first with the rules that fit
their dataset (the official ones for Yambda-5B, the project's for a synthetic store, as ``check-log``
does), and the summarizer's own pieces (start and stop, olympic mean, scaling factor) make the
score. The logs are copied to a scratch folder first: the RCP check writes its ``scaling.json`` beside
them, and the submission folder stays as it was.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dlrmv4.errors import UserError
from dlrmv4.mlperf.rules import RULESET, run_checker

BENCHMARK = "dlrmv4"
USAGE = "training"
FEWEST_RUNS = 3  # the olympic mean drops the fastest and the slowest: fewer leave nothing to average


@dataclass(frozen=True)
class RunScore:
    file: str
    seed: int | None
    samples_to_target: int | None  # the last eval's samples_count where the run reached its target
    minutes: float | None  # RUN_START to RUN_STOP; None where the log is not compliant or did not converge
    problem: str  # "" for a compliant run that reached its target


@dataclass(frozen=True)
class SetScore:
    runs: list[RunScore]
    required_runs: int
    seeds_distinct: bool
    rcp_passed: bool
    rcp_message: str
    scaling_factor: float
    score_minutes: float | None  # None where too many runs were dropped
    notes: list[str]  # the checkers' and summarizer's own warnings
    mlperf_logging: str


def result_files(folder: Path) -> list[Path]:
    """The set's logs, ``result_<i>.txt`` (the checkers read every ``result_*.txt``: nothing else may match)."""
    files = sorted(Path(folder).glob("result_*.txt"), key=lambda p: (len(p.name), p.name))
    others = [f.name for f in files if not re.fullmatch(r"result_\d+\.txt", f.name)]
    if others:
        raise UserError(f"{folder} holds {others[0]}: the checkers read every result_*.txt as a run's log")
    if not files:
        raise UserError(f"no result_*.txt in {folder}: a set's MLPerf logs are named result_<i>.txt")
    return files


def score_set(folder: Path, rules: Path | None, rcp_file: Path | None) -> SetScore:
    """Check and score the ``result_*.txt`` logs of ``folder``; ``rules`` are the compliance checker's for
    their dataset (None: the official closed rules), ``rcp_file`` the RCPs (None: mlperf-logging's)."""
    from mlperf_logging.benchmark_meta import get_result_file_counts
    from mlperf_logging.compliance_checker.mlp_parser import parse_file
    from mlperf_logging.package_checker.seed_checker import SeedChecker
    from mlperf_logging.rcp_checker import rcp_checker
    from mlperf_logging.result_summarizer import result_summarizer as summarizer

    files = result_files(folder)
    if len(files) < FEWEST_RUNS:
        raise UserError(
            f"{folder} holds {len(files)} run log(s): a score is an olympic mean (the fastest and slowest dropped), "
            f"which needs at least {FEWEST_RUNS}"
        )
    notes = io.StringIO()
    with tempfile.TemporaryDirectory(prefix="dlrmv4-score-") as root:
        # The compliance checker writes a report beside each log it reads: those copies stay apart from
        # the set the RCP check globs (result_*.txt).
        scratch, checked = Path(root) / "set", Path(root) / "checked"
        scratch.mkdir()
        checked.mkdir()
        copies = [Path(shutil.copy(f, scratch)) for f in files]
        runs = [_run_score(Path(shutil.copy(f, checked)), rules, parse_file, summarizer) for f in files]
        with contextlib.redirect_stdout(notes), _checker_logging(notes), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy's, inside the checkers' means
            seeds_distinct = SeedChecker(RULESET).check_seeds([str(c) for c in copies])
            with contextlib.ExitStack() as stack:
                rcps = stack.enter_context(open(rcp_file)) if rcp_file is not None else None
                rcp_passed, rcp_message, _ = rcp_checker.check_directory(
                    str(scratch), USAGE, RULESET, False, False, rcp_file=rcps, rcp_pass="pruned_rcps", set_scaling=True
                )
            scaling = float(summarizer._get_scaling_factor(str(scratch)))
        minutes = [r.minutes for r in runs if r.minutes is not None]
        dropped = len(runs) - len(minutes)
        most_dropped = 1  # the summarizer's allowance for every benchmark but unet3d
        score = None
        if dropped <= most_dropped:
            mean = summarizer._compute_olympic_average(sorted(minutes), dropped, most_dropped)
            score = None if mean is None else mean * scaling
        required = get_result_file_counts(USAGE)[BENCHMARK]
        if len(files) < required:
            notes.write(
                f"WARNING: Not enough runs found for an official submission. Found: {len(files)}, required: {required}\n"
            )
        if dropped > most_dropped:
            notes.write(f"CRITICAL ERROR: Too many non-converging runs for {BENCHMARK}\n")
    return SetScore(
        runs=runs,
        required_runs=required,
        seeds_distinct=bool(seeds_distinct),
        rcp_passed=bool(rcp_passed),
        rcp_message=str(rcp_message),
        scaling_factor=scaling,
        score_minutes=score,
        notes=[line for line in notes.getvalue().splitlines() if line.strip()],
        mlperf_logging=metadata.version("mlperf-logging"),
    )


def _run_score(log: Path, rules: Path | None, parse_file, summarizer) -> RunScore:
    """One log's seed, samples to target and minutes, read with mlperf-logging's parser."""
    loglines, failed = parse_file(str(log), ruleset=RULESET)
    values = lambda key: [line.value for line in loglines if line.key == key]  # noqa: E731
    seeds, stops, evals = values("seed"), values("run_stop"), values("eval_accuracy")
    converged = bool(stops) and stops[0].get("metadata", {}).get("status") == "success"
    samples = int(evals[-1]["metadata"]["samples_count"]) if converged and evals else None
    passed, _ = run_checker(log, rules)
    problem, minutes = "", None
    if not passed:
        problem = "fails the compliance checker"
    elif not converged:
        problem = "did not reach the target"
    elif failed:
        problem = "has lines the parser rejects"
    else:
        start, end = summarizer._query_run_start_stop(loglines)
        minutes = (end - start) / 60 / 1000
    return RunScore(log.name, int(seeds[0]["value"]) if seeds else None, samples, minutes, problem)


@contextlib.contextmanager
def _checker_logging(stream: io.StringIO):
    """The seed and RCP checkers report through the root logger: their lines into ``stream``."""
    root = logging.getLogger()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s:%(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def describe(result: SetScore, folder: Path) -> str:
    """The set's table: each run's seed, samples to target, minutes and verdict; then the set's verdict,
    its score and what the RCP check did to it."""
    lines = [
        f"{folder}: {len(result.runs)} runs (an official dlrmv4 set has {result.required_runs}); "
        f"mlperf-logging {result.mlperf_logging}, training {RULESET}",
        "",
        "| log | seed | samples to target | minutes | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for r in result.runs:
        samples = f"{r.samples_to_target:,}" if r.samples_to_target is not None else "-"
        minutes = f"{r.minutes:.3f}" if r.minutes is not None else "-"
        lines.append(
            f"| {r.file} | {r.seed if r.seed is not None else '-'} | {samples} | {minutes} | {r.problem or 'ok'} |"
        )
    lines.append("")
    lines.append(f"seeds: {'distinct (seed checker passed)' if result.seeds_distinct else 'the seed checker FAILED'}")
    lines.append(
        f"RCP check (pruned RCPs): {'PASSED' if result.rcp_passed else 'FAILED'} ({result.rcp_message}); "
        f"scaling factor {result.scaling_factor:.4f}"
    )
    if result.score_minutes is None:
        lines.append("score: none (more runs dropped than the olympic mean allows)")
    else:
        unscaled = result.score_minutes / result.scaling_factor
        lines.append(
            f"score: {result.score_minutes:.3f} min (olympic mean {unscaled:.3f} min x {result.scaling_factor:.4f})"
        )
    return "\n".join(lines)
