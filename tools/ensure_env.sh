#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment with the CPU/dev pin set.
# Sourced by run_and_time.sh, run_tests.sh and the dataset scripts. Re-installs only when the
# requirement files change. Set DLRMV4_NO_VENV=1 to use the current interpreter as it is
# (for example inside the CUDA Docker image, which installs requirements.txt itself).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "${DLRMV4_NO_VENV:-0}" == "1" ]]; then
    export PYTHONPATH="${repo_root}/recommendation_v4${PYTHONPATH:+:${PYTHONPATH}}"
    return 0 2>/dev/null || exit 0
fi
venv="${DLRMV4_VENV:-${repo_root}/.venv}"
python_bin="${PYTHON:-python3}"
stamp_src="$(cat "${repo_root}/requirements-cpu.txt" "${repo_root}/requirements-cpu-nodeps.txt" \
    "${repo_root}/recommendation_v4/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ ! -f "${venv}/.dlrmv4-stamp" || "$(cat "${venv}/.dlrmv4-stamp")" != "${stamp_src}" ]]; then
    echo "[setup] preparing ${venv} (first run or changed requirements; a few minutes)" >&2
    if [[ ! -x "${venv}/bin/python" ]]; then
        "${python_bin}" -m venv "${venv}"
    fi
    log="${venv}/setup.log"
    {
        "${venv}/bin/python" -m pip install --upgrade pip &&
        "${venv}/bin/python" -m pip install -r "${repo_root}/requirements-cpu.txt" &&
        "${venv}/bin/python" -m pip install --no-deps -r "${repo_root}/requirements-cpu-nodeps.txt" &&
        "${venv}/bin/python" -m pip install --no-deps -e "${repo_root}/recommendation_v4"
    } >"${log}" 2>&1 || { tail -n 30 "${log}" >&2; echo "[setup] failed: see ${log}" >&2; exit 1; }
    echo "${stamp_src}" > "${venv}/.dlrmv4-stamp"
fi
# shellcheck disable=SC1091
source "${venv}/bin/activate"
