#!/usr/bin/env bash
# The main job on any machine: set up, measure this device's GEMM ceiling, run a tiny benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. "${ECHOBENCH_VENV:-.venv}/bin/activate"
echobench calibrate
echobench run --scale tiny --steps 10 --warmup-steps 3 --micro-batch 4 --out runs/quickstart
