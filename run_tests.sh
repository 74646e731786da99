#!/usr/bin/env bash
# Run the test suite on the CPU (sets up .venv on first use). Extra arguments go to pytest.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${repo_root}/tools/ensure_env.sh"
cd "${repo_root}/recommendation_v4"
exec python -m pytest "$@"
