#!/usr/bin/env bash
# Verify a processed store: every md5 in its md5sums list and the store's invariants.
#
#   ./verify_dataset.sh --size 5b --data-path /data
#   ./verify_dataset.sh --store /data/processed/yambda-5b
#   ./verify_dataset.sh --source synthetic --size tiny
#
# Exits non-zero with one line naming the first problem.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${repo_root}/tools/ensure_env.sh"
args=("$@")
if [[ " ${args[*]-} " != *" --source "* && " ${args[*]-} " != *" --source="* && " ${args[*]-} " != *" --preset"* \
      && " ${args[*]-} " != *" --store"* ]]; then
    args=(--source yambda "${args[@]}")
fi
exec python -m dlrmv4 verify --reference-md5s "${repo_root}/md5sums" "${args[@]}"
