#!/usr/bin/env bash
# The dashboard's top as a reader first sees it: the smoke sweep on this machine's CPU, plus one run
# of its own settings with full activation checkpointing that fails at step 1 (an injected failure,
# against the sweep's calibration), reported together; the page's first 1400 x 900 px in headless
# Chromium after the layout check. Produces reports/img/dashboard-top.png (committed) and its copy
# docs/guides/img/dashboard-top.png (the docs site's); about 2 minutes on 2 CPU cores.
# Usage: [PYTHON=.venv/bin/python] bash tools/dashboard_top_demo.sh [OUT_DIR]   (default runs/dashboard-top)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-runs/dashboard-top}")
PY=${PYTHON:-python}
"$PY" -m echobench sweep matrices/smoke.yaml --out "$OUT/smoke"
if [ ! -e "$OUT/failed/result.json" ]; then
  # exits non-zero by design (the failure is the point); the record it writes is checked below
  ECHOBENCH_CACHE="$OUT/smoke/cache" "$PY" -m echobench run --out "$OUT/failed" --scale tiny --framework torchtitan \
    --parallelism ddp --ac full --nproc 2 --steps 5 --warmup-steps 2 --micro-batch 2 --precision auto --device cpu \
    --audio-frames 100 --text-tokens 32 --speaker-frames 80 --fail-at-step 1 || true
fi
test -e "$OUT/failed/result.json"
"$PY" -m echobench report "$OUT/smoke" "$OUT/failed" -o "$OUT/report.html"
mkdir -p reports/img docs/guides/img
"$PY" -m echobench.report.browser --width 1400 --height 900 --top "$OUT/report.html" reports/img/dashboard-top.png
cp reports/img/dashboard-top.png docs/guides/img/dashboard-top.png
