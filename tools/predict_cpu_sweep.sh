#!/usr/bin/env bash
# The CPU check of `echobench predict` (issue 42, item 5; reports/predict-cpu-2026-12-03.md): a plain
# `echobench calibrate --comm` (2 processes, the tiny preset's default shapes), the local sweep of
# matrices/predict-cpu-tiny.yaml (tiny: single, DDP, FSDP2, megatron TP2; micro-batch 4; 200 / 64 /
# 160 frames; 12 steps), then every run predicted on that profile and held against its record.
#
#   bash tools/predict_cpu_sweep.sh [OUT]        # default runs/predict-cpu-sweep; a few minutes on 2 cores
#   MATRIX=matrices/predict-cpu-cards.yaml bash tools/predict_cpu_sweep.sh OUT   # the same for card runs
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/predict-cpu-sweep}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
export ECHOBENCH_CACHE="$OUT/cache"  # this check's calibration and counts stay in OUT
# One thread per process, as the calibration's 2 processes have (echobench's launcher gives each of N
# local ranks cores / N threads): a single run's 2 threads on a 2-core host that others load wait on
# each other at every op (measured here: 2.7 s a step against 0.042 s with one thread, load 2.5).
export OMP_NUM_THREADS=1
say() { echo "predict-cpu-sweep: $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*" >&2; }
say "calibrate --comm"
# A matrix given: the profile measured at its runs' own shapes (a card run's GEMMs and causal attention).
$PY -m echobench calibrate --comm ${MATRIX:+--matrix "$MATRIX"} --out "$OUT/profile.yaml" > "$OUT/calibrate.log"
say "sweep"
$PY -m echobench sweep "${MATRIX:-matrices/predict-cpu-tiny.yaml}" --out "$OUT/runs" > "$OUT/sweep.log" 2>&1
say "predicting"
$PY -m echobench predict --against "$OUT/runs" --profile "$OUT/profile.yaml" > "$OUT/against.txt"
$PY -m echobench predict --against "$OUT/runs" --profile "$OUT/profile.yaml" --json > "$OUT/against.json"
cat "$OUT/against.txt"
