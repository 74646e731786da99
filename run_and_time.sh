#!/usr/bin/env bash
# The benchmark's main job. With no arguments it runs the embedded default (synthetic-tiny) on
# this machine from nothing: generate -> preprocess -> verify -> train the windows in time order,
# evaluating on the holdout window, until the target AUC; then runs the official MLPerf compliance
# checker on the run log it wrote (project rules for datasets other than Yambda-5B) and prints the
# verdict and the MLPerf RESULT line.
# Every flag of `python -m dlrmv4 train --help` passes through (for example --preset synthetic-small,
# --data-path DIR, --seed N). Each call is a new run (--restart); to continue an interrupted run,
# call `python -m dlrmv4 train` with the same flags instead.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${repo_root}/tools/ensure_env.sh"
start=$(date +%s)
python -m dlrmv4 train --restart --reference-md5s "${repo_root}/md5sums" "$@"
end=$(date +%s)
echo "[dlrmv4] run finished in $((end - start)) s ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
python -m dlrmv4 check-log "$@"
