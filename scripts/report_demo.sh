#!/usr/bin/env bash
# Real tiny CPU runs -> the dashboard, the publication table and a screenshot of the page.
# Produces reports/dashboard-tiny-cpu.png (committed); five CPU runs, a few minutes. Usage: bash scripts/report_demo.sh [OUT_DIR]
# (Until the sweep lands this uses `echobench run` directly; a run with an injected failure shows
# the failed-runs section.)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/report-demo}
export ECHOBENCH_CACHE="$OUT/cache"  # the calibration below is the MFU peak of these CPU runs
export OMP_NUM_THREADS=1  # one thread per process: the 2-process run and the others compare fairly
python -m echobench calibrate
common=(--steps 4 --warmup-steps 1 --text-tokens 16 --speaker-frames 40)
python -m echobench run --out "$OUT/mb1-a50" "${common[@]}" --micro-batch 1 --audio-frames 50
python -m echobench run --out "$OUT/mb2-a50" "${common[@]}" --micro-batch 2 --audio-frames 50
python -m echobench run --out "$OUT/mb4-a50" "${common[@]}" --micro-batch 4 --audio-frames 50
python -m echobench run --out "$OUT/mb2-a100" "${common[@]}" --micro-batch 2 --audio-frames 100
python -m echobench run --out "$OUT/megatron-tp2" "${common[@]}" --micro-batch 2 --audio-frames 50 \
  --framework megatron --tp 2 --nproc 2
python -m echobench run --out "$OUT/failed" "${common[@]}" --micro-batch 2 --audio-frames 50 --fail-at-step 2 || true
python -m echobench report "$OUT" -o "$OUT/report.html"
python -m echobench report "$OUT" --table md
mkdir -p reports
python -m echobench.report.browser "$OUT/report.html" reports/dashboard-tiny-cpu.png
