#!/usr/bin/env bash
# The CPU check of `echobench predict` (issue 42, item 5; reports/predict-cpu-2026-12-03.md): a plain
# `echobench calibrate --comm` (2 processes, the tiny preset's default shapes), the local sweep of
# matrices/predict-cpu-tiny.yaml (tiny: single, DDP, FSDP2, megatron TP2; micro-batch 4; 200 / 64 /
# 160 frames; 12 steps), then every run predicted on that profile and held against its record.
#
#   bash tools/predict_cpu_sweep.sh [OUT]        # default runs/predict-cpu-sweep; a few minutes on 2 cores
#   MATRIX=matrices/predict-cpu-cards.yaml bash tools/predict_cpu_sweep.sh OUT   # the same for card runs
#   PASSES=4 bash tools/predict_cpu_sweep.sh OUT   # 4 passes (OUT/pass-1 ...), each calibrating afresh, then
#                                                  # each pass's mean / max |error| and the median pass
# Why passes: on a shared 2-core machine one pass's error moves by +-30% with the load of the minute it
# ran in (reports/predict-cpu-2026-12-03.md); a single pass cannot tell the model's error from the load.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/predict-cpu-sweep}
PY=${PY:-.venv/bin/python}
PASSES=${PASSES:-1}
if [ "$PASSES" -gt 1 ]; then
  for k in $(seq 1 "$PASSES"); do PASSES=1 bash "$0" "$OUT/pass-$k"; done
  exec $PY tools/predict_cpu_passes.py "$OUT"/pass-*/against.json
fi
mkdir -p "$OUT"
export ECHOBENCH_CACHE="$OUT/cache"  # this check's calibration and counts stay in OUT
# One thread per process, as the calibration's 2 processes have (echobench's launcher gives each of N
# local ranks cores / N threads): a single run's 2 threads on a 2-core host that others load wait on
# each other at every op (measured here: 2.7 s a step against 0.042 s with one thread, load 2.5).
export OMP_NUM_THREADS=1
say() {  # to the terminal and OUT/pass.log (predict_cpu_passes.py reads the loads back)
  local line="predict-cpu-sweep: $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*"
  echo "$line" >&2; echo "$line" >> "$OUT/pass.log"
}
say "calibrate --comm"
# A matrix given: the profile measured at its runs' own shapes (a card run's GEMMs and causal attention).
$PY -m echobench calibrate --comm ${MATRIX:+--matrix "$MATRIX"} --out "$OUT/profile.yaml" > "$OUT/calibrate.log"
say "sweep"
$PY -m echobench sweep "${MATRIX:-matrices/predict-cpu-tiny.yaml}" --out "$OUT/runs" > "$OUT/sweep.log" 2>&1
say "predicting"
$PY -m echobench validate measured "$OUT/runs" --profile "$OUT/profile.yaml" > "$OUT/against.txt"
$PY -m echobench validate measured "$OUT/runs" --profile "$OUT/profile.yaml" --json > "$OUT/against.json"
cat "$OUT/against.txt"
