#!/usr/bin/env bash
# Verify a processed store: every md5 in its md5sums list, the store's invariants and, where the
# repository's md5sums has them, the published sums.
#
#   ./verify_dataset.sh --data-path /data                 # the one store download_dataset.sh wrote there
#   ./verify_dataset.sh --size 5b --data-path /data       # Yambda-5B when several stores are there
#   ./verify_dataset.sh --store /data/processed/yambda-5b
#   ./verify_dataset.sh --source synthetic --size tiny
#
# Exits non-zero with one line naming the first problem.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${repo_root}/tools/ensure_env.sh"
args=("$@")
given() {  # is any of the named flags among the arguments (as "--flag value" or "--flag=value")?
    local flag
    for flag in "$@"; do
        [[ " ${args[*]-} " == *" ${flag} "* || " ${args[*]-} " == *" ${flag}="* ]] && return 0
    done
    return 1
}
if ! given --source --size --preset --store; then
    args=(--discover "${args[@]+"${args[@]}"}")
elif ! given --source --preset --store; then
    args=(--source yambda "${args[@]}")
fi
exec python -m dlrmv4 verify --reference-md5s "${repo_root}/md5sums" "${args[@]}"
