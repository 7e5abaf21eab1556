#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite. Extra arguments go to pytest.
# pytest's exit code 5 ("no tests collected") is a failure here like any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ECHOBENCH_VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1
python -m pytest "$@"
