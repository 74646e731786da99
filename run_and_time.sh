#!/usr/bin/env bash
# The benchmark's main job. With no arguments it runs the embedded default (synthetic-tiny) on
# this machine from nothing: generate -> preprocess -> verify -> train the windows in time order,
# evaluating on the holdout window, until the target AUC; then runs the official MLPerf compliance
# checker on the run log it wrote (project rules for datasets other than Yambda-5B) and prints the
# verdict and the MLPerf RESULT line.
# Every flag of `python -m dlrmv4 train --help` passes through (for example --preset synthetic-small,
# --data-path DIR, --seed N). Each call is a new run (--restart); to continue an interrupted run,
# call `python -m dlrmv4 train` with the same flags instead.
#
# Submission knobs from the environment (each is also a flag; flags given here win):
#   SEED, DATASET (a preset, e.g. yambda-5b), DATA_PATH, GLOBAL_BATCH_SIZE, LEARNING_RATE,
#   LOG_FILE (the MLPerf log), GPUS_PER_NODE (1 until multi-GPU runs land).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
knobs=()
[[ -n "${SEED:-}" ]] && knobs+=(--seed "${SEED}")
[[ -n "${DATASET:-}" ]] && knobs+=(--preset "${DATASET}")
[[ -n "${DATA_PATH:-}" ]] && knobs+=(--data-path "${DATA_PATH}")
[[ -n "${GLOBAL_BATCH_SIZE:-}" ]] && knobs+=(--batch-size "${GLOBAL_BATCH_SIZE}")  # one process: GBS = batch
[[ -n "${LEARNING_RATE:-}" ]] && knobs+=(--learning-rate "${LEARNING_RATE}")
[[ -n "${LOG_FILE:-}" ]] && knobs+=(--log-file "${LOG_FILE}")
if [[ -n "${GPUS_PER_NODE:-}" && "${GPUS_PER_NODE}" != "1" ]]; then
    echo "[dlrmv4] error: GPUS_PER_NODE=${GPUS_PER_NODE}: this version trains on one process (one GPU or the CPU)" >&2
    exit 1
fi
source "${repo_root}/tools/ensure_env.sh"
args=("${knobs[@]+"${knobs[@]}"}" "$@")
start=$(date +%s)
python -m dlrmv4 train --restart --reference-md5s "${repo_root}/md5sums" "${args[@]+"${args[@]}"}"
end=$(date +%s)
echo "[dlrmv4] run finished in $((end - start)) s ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
python -m dlrmv4 check-log "${args[@]+"${args[@]}"}"
