#!/usr/bin/env bash
# The committed dashboard screenshots: two real sweeps of the same layouts with different step counts,
# reported together, so each layout is one line across node counts.
#   1. matrices/smoke.yaml on the local executor: 1 node, 5 steps (calibrates this CPU once)
#   2. matrices/scaling-demo.yaml on SLURM: ddp, fsdp2, tp2 on 1 and 2 nodes, 3 steps, against the
#      same calibration (needs a cluster: `bash scripts/slurm-local.sh up 2` makes one on this machine)
#   3. the dashboard of both, screenshotted in headless Chromium at 1400 and 800 px wide
# Both sweeps resume: a second call runs only what is missing, then re-renders. About 10 minutes on
# 2 CPU cores. Usage: bash scripts/report_demo.sh [OUT_DIR]   (default runs/report-demo)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-runs/report-demo}")
PY=${PYTHON:-python}
export OMP_NUM_THREADS=1  # one thread per process: 2- and 4-process runs share 2 cores fairly
"$PY" -m echobench sweep matrices/smoke.yaml --out "$OUT/smoke"
# The SLURM runs' MFU is against the smoke sweep's calibration (the nodes are this machine), so the
# two sweeps' runs of one configuration share a peak: it goes into the SLURM sweep's cache, which its
# jobs read (sbatch passes ECHOBENCH_CACHE on) and where a sweep looks before calibrating again.
mkdir -p "$OUT/scaling/cache/calibration"
# Not `cp -n`: coreutils 9.2-9.4 exit 1 when it skips a file, which would stop a rerun here.
for f in "$OUT/smoke/cache/calibration/"*.json; do
  [ -e "$OUT/scaling/cache/calibration/${f##*/}" ] || cp "$f" "$OUT/scaling/cache/calibration/"
done
export ECHOBENCH_CACHE="$OUT/scaling/cache"
"$PY" -m echobench sweep matrices/scaling-demo.yaml --out "$OUT/scaling"
"$PY" -m echobench report "$OUT/smoke" "$OUT/scaling" -o "$OUT/report.html"
"$PY" -m echobench report "$OUT/smoke" "$OUT/scaling" --table md | tee "$OUT/table.md"
mkdir -p reports
"$PY" -m echobench.report.browser "$OUT/report.html" reports/dashboard-scaling-cpu.png
"$PY" -m echobench.report.browser --width 800 "$OUT/report.html" reports/dashboard-scaling-cpu-800px.png
