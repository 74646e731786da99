"""Convergence runs of a synthetic preset, read back from their MLPerf logs: each log checked by the
official compliance checker under the project rules for its dataset (``python -m dlrmv4 check-log``),
its ``RESULT`` line, the samples and the seconds to the target, next to the preset's RCP
(``rcp/rcps_dlrmv4_<preset>.json``). The runs themselves are made by ``rcp/generate_rcps.py`` or
``run_and_time.sh``; this script needs only their logs and the preset's store (it reads the sample
counts the rules check).

    python benchmarks/projections/convergence_runs.py --preset synthetic-medium --data-path data/medium \\
        --logs ../rcp/synthetic-medium/512/result_*.txt --label medium_h100 \\
        --ran-on "NVIDIA H100 80GB HBM3 (2-GPU host), one run per GPU" --runs-commit <commit> \\
        --run-command "python rcp/generate_rcps.py --preset synthetic-medium ..."
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the shared helpers in benchmarks/

from harness import HERE, write_results

RCP_DIR = HERE.parent.parent / "rcp"


def read_log(path: Path) -> dict:
    """seed, status, samples at RUN_STOP's eval, the AUC curve and RUN_START -> RUN_STOP seconds of one log."""
    run = {"log": path.name, "curve": [], "status": None, "seed": None}
    times = {}
    for line in path.read_text().splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        record = json.loads(line[len(":::MLLOG ") :])
        key = record["key"]
        if key == "seed":
            run["seed"] = int(record["value"])
        elif key == "eval_accuracy":
            run["curve"].append((int(record["metadata"]["samples_count"]), round(float(record["value"]), 4)))
        elif key in ("run_start", "run_stop"):
            times[key] = record["time_ms"] / 1000
            if key == "run_stop":
                run["status"] = record["metadata"]["status"]
    run["samples_to_target"] = run["curve"][-1][0] if run["status"] == "success" and run["curve"] else None
    run["seconds_to_target"] = round(times["run_stop"] - times["run_start"], 1) if len(times) == 2 else None
    return run


def check(args: argparse.Namespace, log: Path, seed: int) -> tuple[bool, str]:
    """(passed, RESULT line) from ``python -m dlrmv4 check-log`` on a copy of ``log`` (the checker writes its
    rules and its verdict beside the log it reads)."""
    with tempfile.TemporaryDirectory() as work:
        copy = Path(work) / log.name
        shutil.copyfile(log, copy)
        cmd = [sys.executable, "-m", "dlrmv4", "check-log", "--preset", args.preset, "--data-path", args.data_path,
               "--seed", str(seed), "--log", str(copy), *args.flags]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
    result = re.search(r"^RESULT,.*$", proc.stdout, re.MULTILINE)
    return proc.returncode == 0 and "PASSED" in proc.stdout, result.group(0) if result else ""


def rcp_record(preset: str) -> dict | None:
    path = RCP_DIR / f"rcps_dlrmv4_{preset}.json"
    if not path.exists():
        return None
    records = list(json.loads(path.read_text()).values())
    return records[0] if records else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--data-path", required=True, help="where the preset's store is (the rules read its counts)")
    parser.add_argument("--logs", nargs="+", required=True, type=Path)
    parser.add_argument("--label", required=True, help="results/convergence_<label>.md")
    parser.add_argument("--ran-on", required=True, help="the machine the runs ran on")
    parser.add_argument("--runs-commit", required=True, help="the commit the runs ran")
    parser.add_argument("--run-command", required=True, help="the command that made the runs")
    parser.add_argument("flags", nargs="*", help="the runs' own trainer flags beyond the preset's, after --")
    args = parser.parse_args()
    runs = []
    for log in sorted(args.logs):
        run = read_log(log)
        run["checker_passed"], run["result_line"] = check(args, log, run["seed"])
        runs.append(run)
        print(f"{log.name}: seed {run['seed']}, {run['status']}, samples to target {run['samples_to_target']}, "
              f"{run['seconds_to_target']} s, checker {'PASSED' if run['checker_passed'] else 'FAILED'}")  # fmt: skip
    rcp = rcp_record(args.preset)
    rows = "\n".join(
        f"| {r['seed']} | {r['status']} | {r['samples_to_target'] or '-':,} | {r['seconds_to_target']} | "
        f"{format(r['curve'][-1][1], '.4f') if r['curve'] else '-'} | {'PASSED' if r['checker_passed'] else 'FAILED'} | "
        f"`{r['result_line']}` |"
        for r in runs
    )
    converged = [r["samples_to_target"] for r in runs if r["samples_to_target"] is not None]
    band = ""
    if rcp is not None:
        points = rcp["Epochs to converge"]
        band = (
            f"\n\nThe preset's RCP at GBS {rcp['BS']:,}: {len(points)} runs, samples to the target "
            f"{min(points):,} to {max(points):,}, mean {sum(points) / len(points):,.0f}."
        )
    markdown = (
        f"Convergence runs of `{args.preset}` on {args.ran_on} (commit {args.runs_commit}), read back from their "
        f"MLPerf logs; each log checked by the official compliance checker with the project rules for the "
        f"dataset (`python -m dlrmv4 check-log`). Seconds to the target: RUN_START to RUN_STOP.\n\n"
        "| seed | status | samples to target | seconds to target | AUC at the stop | checker | RESULT |\n"
        "|---:|---|---:|---:|---:|---|---|\n"
        f"{rows}{band}\n\nRuns made by: `{args.run_command}`"
    )
    write_results(
        f"convergence_{args.label}",
        {
            "preset": args.preset,
            "ran_on": args.ran_on,
            "runs_commit": args.runs_commit,
            "run_command": args.run_command,
            "runs": runs,
            "samples_to_target": converged,
            "rcp": rcp,
        },
        markdown,
    )
    print(markdown)


if __name__ == "__main__":
    main()
