#!/usr/bin/env bash
# The whole suite N times in a row with a CPU-bound process beside it, as on a loaded CI machine:
# prints each run's exit code, wall time and pytest summary, then how many passed (exit 1 unless
# all did). Usage: bash scripts/suite_under_load.sh [N] [pytest args...]
# ECHOBENCH_SUITE_LAUNCH=background runs each pass as a background job of a non-interactive shell, the
# way a scheduler, nohup or many CI agents start a job: SIGINT then arrives ignored in every test
# process (POSIX), and the suite must pass all the same.
# For the SLURM and browser tests, start the cluster (scripts/slurm-local.sh up 2) and export
# ECHOBENCH_REQUIRE_SLURM=1 ECHOBENCH_REQUIRE_BROWSER=1 first, as .ci/run does.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
shift || true
mkdir -p test-artifacts
bash scripts/setup.sh >test-artifacts/setup.log 2>&1 || { cat test-artifacts/setup.log; exit 1; }
# shellcheck disable=SC1091
. "${ECHOBENCH_VENV:-.venv}/bin/activate"
python -c "while True: pass" &
hog=$!
trap 'kill $hog 2>/dev/null' EXIT
launch=${ECHOBENCH_SUITE_LAUNCH:-foreground}
case "$launch" in foreground|background) ;; *) echo "ECHOBENCH_SUITE_LAUNCH=$launch: give foreground or background" >&2; exit 2;; esac
export ECHOBENCH_SUITE_LAUNCH=$launch  # tests/test_sweep_local.py checks the launch is what it says
passed=0
for i in $(seq 1 "$runs"); do
  log="test-artifacts/suite-run-$i.log"
  start=$(date +%s)
  if [ "$launch" = background ]; then
    sh -c '"$@" & wait $!' sh python -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  else  # SIGINT at its default, even where this script itself runs in the background
    env --default-signal=INT python -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
  fi
  rc=$?
  echo "run $i of $runs ($launch): exit $rc in $(( $(date +%s) - start )) s: $(tail -n 1 "$log")"
  [ "$rc" -eq 0 ] && passed=$((passed + 1))
done
echo "$passed of $runs runs passed ($launch), each beside a CPU-bound process (logs: test-artifacts/suite-run-N.log)"
[ "$passed" -eq "$runs" ]
