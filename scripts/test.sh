#!/usr/bin/env bash
# The test command: set up .venv, then run the whole suite. Extra arguments go to pytest.
# In ECHOBENCH_TEST_WORKERS (default 3) pytest-xdist workers, even on 2 cores: much of the suite waits
# (SLURM jobs, subprocesses starting torch) rather than computes. Tests sharing a fixture or the
# cluster are kept together (tests/conftest.py); `-n 0` as an argument runs it in one process.
# pytest's exit code 5 ("no tests collected") is a failure here like any other non-zero code, and the
# script's exit code is pytest's. After every run: the 20 test files that cost the most CPU seconds, from
# the run's timeline (ECHOBENCH_TEST_TIMELINE, tests/conftest.py; a fresh file unless it is set), so that
# a growing suite is seen the day it grows.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ECHOBENCH_VENV:-.venv}/bin/activate"
export PYTHONUNBUFFERED=1
ECHOBENCH_TEST_TIMELINE=${ECHOBENCH_TEST_TIMELINE:-$(mktemp --suffix .jsonl)}
export ECHOBENCH_TEST_TIMELINE
rc=0
python -m pytest -n "${ECHOBENCH_TEST_WORKERS:-3}" --dist loadgroup "$@" || rc=$?
python tools/suite_timeline.py "$ECHOBENCH_TEST_TIMELINE" --files 20 || echo "test.sh: no summary of $ECHOBENCH_TEST_TIMELINE" >&2
exit "$rc"
