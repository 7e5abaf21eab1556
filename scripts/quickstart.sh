#!/usr/bin/env bash
# The main job on any machine: set up, then run the smoke sweep (tiny runs of both backends on this
# machine's CPU, resumable: a second call runs only what is missing) into runs/smoke.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ECHOBENCH_VENV:-.venv}/bin/activate"
echobench sweep matrices/smoke.yaml --out runs/smoke
echobench status runs/smoke
# The dashboard (one self-contained HTML file, opens offline) and the publication table.
echobench report runs/smoke -o runs/smoke/report.html
echobench report runs/smoke --table md
echo "dashboard: $(pwd)/runs/smoke/report.html"
