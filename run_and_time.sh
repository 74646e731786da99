#!/usr/bin/env bash
# The benchmark's main job. With no arguments it runs the embedded default (synthetic-tiny) on
# this machine: generate -> preprocess -> verify -> assemble batches, and prints the time taken.
# Until the trainer lands this runs the data path end to end; flags are those of
# `python -m dlrmv4 pipeline --help` (for example --preset synthetic-small, --data-path DIR).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${repo_root}/tools/ensure_env.sh"
start=$(date +%s)
python -m dlrmv4 pipeline --reference-md5s "${repo_root}/md5sums" "$@"
end=$(date +%s)
echo "[dlrmv4] data path finished in $((end - start)) s ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
