#!/usr/bin/env bash
# The benchmark's main job. With no arguments it runs the embedded default (synthetic-tiny) on
# this machine from nothing: generate -> preprocess -> verify -> train the windows in time order,
# evaluating on the holdout window, until the target AUC; then runs the official MLPerf compliance
# checker on the run log it wrote (project rules for datasets other than Yambda-5B) and prints the
# verdict and the MLPerf RESULT line.
# Every flag of `python -m dlrmv4 train --help` passes through (for example --preset synthetic-small,
# --data-path DIR, --seed N). Each call is a new run (--restart). RESUME=1 continues the interrupted
# run in the run directory instead (the same flags, on every node or task): one process, torchrun
# nodes and srun tasks alike.
#
# NEXP=N (or --runs N) runs a submission's set of N runs, each with its own seed (SEEDS=1,2,... to
# choose them), its log as result_<i>.txt in --results-dir (default <run-dir>/results/<system>/dlrmv4),
# then checks and scores the set (python -m dlrmv4 score); RESUME=1 continues an interrupted set.
#
# Submission knobs from the environment (each but the launch ones is also a flag; flags win):
#   SEED, DATASET (a preset, e.g. yambda-5b), DATA_PATH, GLOBAL_BATCH_SIZE, LEARNING_RATE,
#   LOG_FILE (the MLPerf log).
# Launch (docs/distributed.md):
#   GPUS_PER_NODE (processes per node, default 1; on a machine without GPUs, gloo CPU processes),
#   NNODES (default 1), NODE_RANK, MASTER_ADDR, MASTER_PORT (multi-node torchrun rendezvous: node 0,
#   at MASTER_ADDR, holds its store), RDZV_TIMEOUT (seconds a node waits for the others, default 600).
#   With more than one process on one node the data is prepared once first, then torchrun (through
#   python -m dlrmv4.launch, which ends a failed job in one line naming the rank and cause) starts
#   one process per GPU; across nodes, prepare it beforehand on one node (PREPARE_ONLY=1). The
#   node that holds global rank 0 checks the log. Under SLURM (tools/slurm/dlrmv4.sbatch runs
#   `srun run_and_time.sh`), each task is one rank (python -m dlrmv4 reads SLURM_PROCID...
#   itself) and trains; task 0 checks the log. PREPARE_ONLY=1 prepares the data and exits (the
#   sbatch script's first step).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
knobs=()
[[ -n "${SEED:-}" ]] && knobs+=(--seed "${SEED}")
[[ -n "${DATASET:-}" ]] && knobs+=(--preset "${DATASET}")
[[ -n "${DATA_PATH:-}" ]] && knobs+=(--data-path "${DATA_PATH}")
[[ -n "${GLOBAL_BATCH_SIZE:-}" ]] && knobs+=(--batch-size "${GLOBAL_BATCH_SIZE}")
[[ -n "${LEARNING_RATE:-}" ]] && knobs+=(--learning-rate "${LEARNING_RATE}")
[[ -n "${LOG_FILE:-}" ]] && knobs+=(--log-file "${LOG_FILE}")
gpus_per_node="${GPUS_PER_NODE:-1}"
nnodes="${NNODES:-1}"
for value in "${gpus_per_node}" "${nnodes}"; do
    if ! [[ "${value}" =~ ^[1-9][0-9]*$ ]]; then
        echo "[dlrmv4] error: GPUS_PER_NODE and NNODES must be positive integers, got '${value}'" >&2
        exit 1
    fi
done
source "${repo_root}/tools/ensure_env.sh"
args=("${knobs[@]+"${knobs[@]}"}" "$@")

# A set of runs (NEXP=N or --runs N; --results-dir, --system, --seeds with it): dlrmv4.run_set runs
# this script once per run, each with its own seed, run directory and result_<i>.txt, then scores
# the set.
set_wanted=0
[[ -n "${NEXP:-}" && "${NEXP}" != "1" ]] && set_wanted=1
for arg in "$@"; do
    case "${arg}" in --runs|--runs=*|--results-dir|--results-dir=*|--system|--system=*|--seeds|--seeds=*) set_wanted=1 ;; esac
done
if [[ "${set_wanted}" == "1" && -z "${DLRMV4_SET_RUN:-}" ]]; then
    exec python -m dlrmv4.run_set --runs "${NEXP:-1}" "${args[@]+"${args[@]}"}"
fi

# Each step runs as a child that SIGTERM (a batch scheduler's time limit) and SIGINT reach: the
# script passes either on to the step in flight and ends with its status. Job control (set -m)
# keeps SIGINT live in background children, which a script's shell would otherwise ignore.
set -m
step_pid=""
pass_on() { if [[ -n "${step_pid}" ]]; then kill -s "$1" "${step_pid}" 2>/dev/null || true; fi; }
trap 'pass_on INT' INT
trap 'pass_on TERM' TERM
step() {
    "$@" &
    step_pid=$!
    local status=0
    while :; do
        wait "${step_pid}" && status=0 || status=$?
        kill -0 "${step_pid}" 2>/dev/null || break  # a trapped signal interrupts wait, not the step
    done
    step_pid=""
    return "${status}"
}
md5s=(--reference-md5s "${repo_root}/md5sums")
restart=(--restart)
if [[ "${RESUME:-0}" == "1" ]]; then
    restart=()  # continue the run in the run directory from its newest checkpoint
fi

if [[ "${PREPARE_ONLY:-0}" == "1" ]]; then
    exec python -m dlrmv4 prepare --if-missing "${md5s[@]}" "${args[@]+"${args[@]}"}"
fi

if [[ -n "${SLURM_PROCID:-}" && -z "${RANK:-}" && "${SLURM_NTASKS:-1}" != "1" ]]; then
    # One task of an srun step: this process is one rank (python -m dlrmv4 reads SLURM's variables).
    # Its threads: the CPUs srun gave the task (--cpus-per-task), else its share of the node's cores.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-$(( $(nproc) / gpus_per_node > 0 ? $(nproc) / gpus_per_node : 1 ))}}
    step python -m dlrmv4 train "${restart[@]+"${restart[@]}"}" "${args[@]+"${args[@]}"}"
    if [[ "${SLURM_PROCID}" == "0" ]]; then
        step python -m dlrmv4 check-log "${args[@]+"${args[@]}"}"
    fi
    exit 0
fi

world=$((gpus_per_node * nnodes))
start=$(date +%s)
if (( world == 1 )); then
    step python -m dlrmv4 train "${restart[@]+"${restart[@]}"}" "${md5s[@]}" "${args[@]+"${args[@]}"}"
else
    if (( nnodes == 1 )); then
        step python -m dlrmv4 prepare --if-missing "${md5s[@]}" "${args[@]+"${args[@]}"}"
        rendezvous=(--standalone)
    else  # the nodes would race to write one store: it is prepared beforehand, once (PREPARE_ONLY=1)
        # Node 0's launcher hosts the rendezvous store at MASTER_ADDR:MASTER_PORT, the others join it.
        is_host=0
        [[ "${NODE_RANK:?NODE_RANK must be set on each node}" == "0" ]] && is_host=1
        rendezvous=(--nnodes "${nnodes}" --node-rank "${NODE_RANK}"
                    --rdzv-backend c10d --rdzv-endpoint "${MASTER_ADDR:?}:${MASTER_PORT:-29500}"
                    --rdzv-conf "join_timeout=${RDZV_TIMEOUT:-600},is_host=${is_host}")
    fi
    start=$(date +%s)
    # torchrun would give each rank one CPU thread; a rank's host work (pinning, TorchRec's input
    # distribution) gets its share of the node's cores instead.
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / gpus_per_node > 0 ? $(nproc) / gpus_per_node : 1 ))}
    # dlrmv4.launch is torchrun with one line for a failed job (the rank and its cause) instead of
    # torchrun's report of fifty.
    # The process of global rank 0 creates this file: the rendezvous may give rank 0 to any node.
    export DLRMV4_RANK_ZERO_MARKER
    DLRMV4_RANK_ZERO_MARKER="$(mktemp -u "${TMPDIR:-/tmp}/dlrmv4-rank-zero.XXXXXX")"
    step python -m dlrmv4.launch "${rendezvous[@]}" --nproc-per-node "${gpus_per_node}" -m dlrmv4 train \
        "${restart[@]+"${restart[@]}"}" "${args[@]+"${args[@]}"}"
    if [[ ! -e "${DLRMV4_RANK_ZERO_MARKER}" ]]; then
        exit 0  # another node holds rank 0: it checks the log
    fi
    rm -f "${DLRMV4_RANK_ZERO_MARKER}"
fi
end=$(date +%s)
echo "[dlrmv4] run finished in $((end - start)) s ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
step python -m dlrmv4 check-log "${args[@]+"${args[@]}"}"
