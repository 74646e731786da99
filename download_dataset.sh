#!/usr/bin/env bash
# Download Yambda from the Hugging Face hub at a pinned revision (or generate the synthetic
# twin), preprocess it into the processed store, and verify the result.
#
#   ./download_dataset.sh --size 5b --data-path /data            # the reference dataset
#   ./download_dataset.sh --size 50m --data-path /data --hub-revision <40-hex commit>
#   ./download_dataset.sh --source synthetic --size tiny          # no network needed
#
# Any configuration flag of `python -m dlrmv4 prepare --help` is accepted. A re-run after an
# interruption resumes the download and rebuilds the store from scratch (it is written atomically).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${repo_root}/tools/ensure_env.sh"
args=("$@")
if [[ " ${args[*]-} " != *" --source "* && " ${args[*]-} " != *" --source="* && " ${args[*]-} " != *" --preset"* ]]; then
    args=(--source yambda "${args[@]}")
fi
exec python -m dlrmv4 prepare --reference-md5s "${repo_root}/md5sums" "${args[@]}"
