#!/usr/bin/env bash
# The linter, the formatter check, the type checker and the import contract (pyproject.toml) over
# the package, its tests and benchmarks
# (sets up .venv on first use, like the other entry points). CI runs it before the tests.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "${repo_root}/tools/ensure_env.sh"
cd "${repo_root}/recommendation_v4"
ruff check .
ruff format --check .
mypy
lint-imports
