"""A submission's set of runs, one after the other, then its checks and score (``run_and_time.sh --runs N``).

    NEXP=10 ./run_and_time.sh [train flags]          # or: ./run_and_time.sh --runs 10 [train flags]
    RESUME=1 NEXP=10 ./run_and_time.sh [train flags] # continue an interrupted set

Each run is ``run_and_time.sh`` itself (every launch mode it has), from a cold start in its own run
directory ``<run-dir>/set/run_<i>``, with its own seed (``SEEDS=1,2,...`` or ``--seeds``, else drawn
from the operating system's randomness and logged by the run as MLPerf's ``seed``); its MLPerf log,
written and checked in its run directory, is copied when the run ends as ``result_<i>.txt`` into the
results folder (``--results-dir``, default ``<run-dir>/results/<system>/dlrmv4``, the submission
layout, which holds nothing else; ``--system`` names it, default the host name). The system's
description, ``systems/<system>.json`` beside ``results/`` (``python -m dlrmv4 system-desc``), is
drafted from this machine when it is not there and checked with ``system_desc_checker`` at the
set's start and end: the fields left to fill are named, and the set goes on. Before each run the
page cache is dropped where this process may (root); otherwise that is said once. The set's seeds and folders are kept in ``<run-dir>/set/set.json``: with ``RESUME=1`` the runs
whose log ends in RUN_STOP are kept, the interrupted one resumes from its newest checkpoint (or starts
again without one), the rest start. Each run's ``RESULT`` line is kept in ``<run-dir>/set/RESULT.txt``.
After the last run, ``python -m dlrmv4 score`` checks and scores the folder.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from dlrmv4.errors import ERROR_PREFIX, UserError

REPO = Path(__file__).resolve().parents[2]
RUN_AND_TIME = REPO / "run_and_time.sh"
SET_FILE = "set.json"
# A run's own flags, set here for each run: a set's flags may not give them.
PER_RUN_FLAGS = ("--seed", "--log-file", "--restart")


def say(text: str) -> None:
    print(f"[dlrmv4] {text}", flush=True)


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="run_and_time.sh --runs N", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument("--runs", type=int, required=True, help="runs in the set")
    parser.add_argument("--seeds", default=os.environ.get("SEEDS", ""), help="the runs' seeds, comma-separated")
    parser.add_argument("--results-dir", default="", help="default: <run-dir>/results/<system>/dlrmv4")
    parser.add_argument("--system", default="", help="the system's name in the results layout (default: host)")
    args, train_flags = parser.parse_known_args(argv)
    if args.runs < 1:
        raise UserError(f"--runs must be at least 1, got {args.runs}")
    given = [f for f in train_flags if f.split("=", 1)[0] in PER_RUN_FLAGS]
    if given:
        raise UserError(
            f"{given[0].split('=', 1)[0]} (or its knob) is set for each run of a set: the seeds come from SEEDS=1,2,... "
            "(or --seeds), the logs go to --results-dir as result_<i>.txt"
        )
    return args, train_flags


def base_run_dir(train_flags: list[str]) -> Path:
    """The run directory the train flags resolve to (the set's runs live under it)."""
    from dlrmv4.cli import build_parser
    from dlrmv4.config_loading import config_from_args

    parsed = build_parser().parse_args(["train", *train_flags])
    return Path(config_from_args(parsed).train.run_dir)


def seeds_for(args: argparse.Namespace, runs: int) -> list[int]:
    if args.seeds:
        try:
            seeds = [int(s) for s in args.seeds.replace(",", " ").split()]
        except ValueError:
            raise UserError(f"SEEDS / --seeds must be integers, got {args.seeds!r}") from None
        if len(seeds) != runs or len(set(seeds)) != runs:
            raise UserError(f"{runs} runs need {runs} distinct seeds, got {args.seeds!r}")
        return seeds
    if int(os.environ.get("NNODES", "1")) > 1 or int(os.environ.get("SLURM_NNODES", "1")) > 1:
        raise UserError("a set across nodes needs its seeds given (SEEDS=1,2,...): each node runs the same list")
    drawn: list[int] = []
    while len(drawn) < runs:  # drawn from the OS's randomness, as the rules ask; distinct
        seed = secrets.randbelow(2**31 - 1) + 1
        if seed not in drawn:
            drawn.append(seed)
    return drawn


def finished(log: Path) -> bool:
    return log.is_file() and '"key": "run_stop"' in log.read_text()


def drop_page_cache() -> bool:
    """Drop the page cache (the rules' cold start for each run); False where this process may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def run_one(command: list[str], env: dict[str, str], kept: Path) -> int:
    """One run through run_and_time.sh, its output passed through and its RESULT line kept. SIGINT and
    SIGTERM go on to the run (which stops and checkpoints as it does on its own)."""
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    forward = lambda signum, frame: child.send_signal(signum)  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert child.stdout is not None
        for line in child.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.startswith("RESULT,"):
                with kept.open("a") as out:
                    out.write(line)
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def system_description(results: Path, system: str, base: Path) -> None:
    """Draft (where missing) and check the set's system description; its report, never a stop."""
    from dlrmv4.cli import nodes_of_the_job
    from dlrmv4.mlperf.system_desc import describe, systems_dir, write_system_desc

    report = write_system_desc(systems_dir(results, system, base), system, nodes_of_the_job(), base)
    for line in describe(report):
        say(line)


def main(argv: list[str]) -> int:
    args, train_flags = parse(argv)
    base = base_run_dir(train_flags)
    set_dir = base / "set"
    state_file = set_dir / SET_FILE
    resume = os.environ.get("RESUME", "0") == "1"
    if resume:
        if not state_file.is_file():
            raise UserError(f"RESUME=1: no set to continue in {set_dir} (no {SET_FILE})")
        state = json.loads(state_file.read_text())
        if state["runs"] != args.runs:
            raise UserError(f"RESUME=1: the set in {set_dir} has {state['runs']} runs, not {args.runs}")
    else:
        system = args.system or socket.gethostname().split(".")[0]
        results = Path(args.results_dir) if args.results_dir else base / "results" / system / "dlrmv4"
        state = {
            "runs": args.runs,
            "seeds": seeds_for(args, args.runs),
            "results_dir": str(results),
            "system": system,
        }
        set_dir.mkdir(parents=True, exist_ok=True)
        results.mkdir(parents=True, exist_ok=True)
        stale = sorted(results.glob("result_*.txt"))
        for log in stale:  # a new set: the previous set's logs would mix with it
            log.unlink()
        if stale:
            say(f"a new set: removed {len(stale)} earlier result files from {results}")
        (set_dir / "RESULT.txt").unlink(missing_ok=True)
        state_file.write_text(json.dumps(state, indent=2) + "\n")
    results = Path(state["results_dir"])
    say(f"a set of {args.runs} runs, seeds {', '.join(map(str, state['seeds']))}; logs in {results}")
    if not resume:
        system_description(results, state["system"], base)
    cache_said = False
    for i, seed in enumerate(state["seeds"], start=1):
        result = results / f"result_{i}.txt"
        run_dir = set_dir / f"run_{i}"
        if finished(result):
            say(f"run {i} of {args.runs} (seed {seed}): finished before, kept")
            continue
        again = resume and (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
        if not again and not drop_page_cache() and not cache_said:
            say("the page cache is not dropped before each run: that needs root (/proc/sys/vm/drop_caches)")
            cache_said = True
        say(f"run {i} of {args.runs} (seed {seed}){': resuming from its checkpoint' if again else ''}")
        log = run_dir / "mlperf_log.txt"
        flags = [*train_flags, "--seed", str(seed), "--run-dir", str(run_dir), "--log-file", str(log)]
        env = {**os.environ, "RESUME": "1" if again else "0", "DLRMV4_SET_RUN": "1"}
        status = run_one(["bash", str(RUN_AND_TIME), *flags], env, set_dir / "RESULT.txt")
        if status != 0:
            say(f"run {i} of {args.runs} ended with status {status}: RESUME=1 with the same command continues the set")
            return status
        if not finished(log):
            say(
                f"run {i} of {args.runs} left no finished log at {log}: RESUME=1 with the same command continues the set"
            )
            return 1
        shutil.copyfile(log, result)
    say(f"the set's {args.runs} runs are done; scoring {results}")
    system_description(results, state.get("system") or results.parent.name, base)
    score = [sys.executable, "-m", "dlrmv4", "score", str(results), *train_flags]
    say("score: python " + " ".join(shlex.quote(c) for c in score[1:]))
    return subprocess.call(score)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as exc:
        print(f"{ERROR_PREFIX}{exc}", file=sys.stderr)
        sys.exit(1)
