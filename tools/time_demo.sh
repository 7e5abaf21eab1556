#!/usr/bin/env bash
# The smoke sweep (trace: true) -> where each run's step time went: `echobench explain` of every run
# and the dashboard's "Where the time goes" section rendered in headless Chromium.
# Produces reports/dashboard-time-smoke-cpu.png (committed); a few minutes on 2 CPU cores.
# Usage: [PYTHON=.venv/bin/python] bash tools/time_demo.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/time-demo}
PY=${PYTHON:-python}
"$PY" -m echobench sweep matrices/smoke.yaml --out "$OUT"
for bd in "$OUT"/*/breakdown.json; do
  "$PY" -m echobench explain "$(dirname "$bd")"
done
"$PY" -m echobench report "$OUT" -o "$OUT/report.html"
mkdir -p reports
"$PY" -m echobench.report.browser "$OUT/report.html" reports/dashboard-time-smoke-cpu.png "#time"
