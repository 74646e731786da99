#!/usr/bin/env bash
# Regenerate the published checksums of the synthetic stores in ./md5sums (run after a change
# to the generator or the preprocessing that is meant to change their output). The Yambda
# section is kept as it is: its sums can only be made on a machine with the real data.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "${repo_root}/tools/ensure_env.sh"
work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT
out="${work}/md5sums"
sed -n '/^# ---- synthetic/q;p' "${repo_root}/md5sums" > "${out}"
for size in tiny small; do
    python -m dlrmv4 prepare --preset "synthetic-${size}" --data-path "${work}/data" --no-progress >&2
    echo "# ---- synthetic-${size} (preset synthetic-${size}, default seed)" >> "${out}"
    sed "s|  |  synthetic-${size}/|" "${work}/data/processed/synthetic-${size}/md5sums" >> "${out}"
done
mv "${out}" "${repo_root}/md5sums"
echo "updated ${repo_root}/md5sums" >&2
