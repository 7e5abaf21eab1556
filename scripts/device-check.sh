#!/usr/bin/env bash
# One prepared measurement pass on a single GPU (made for the lent H200; under 8 minutes there):
# records the environment, calibrates the GEMM ceiling, runs a small matrix of single-GPU
# benchmark runs, and prints a summary table last. Every run writes its result.json, failed
# runs included; a run that overstays its time budget is stopped and recorded as such.
#
#   scripts/device-check.sh OUTDIR            # on a GPU: 800M and 3B
#   DEVICE_CHECK_DRY=1 scripts/device-check.sh OUTDIR   # CPU dry run of the same script (tiny preset)
#
# Knobs: DEVICE_CHECK_BUDGET_S (total seconds for the runs, default 420), DEVICE_CHECK_RUN_S
# (per-run limit, default 150), ECHOBENCH (the command, default "python3 -m echobench").
set -uo pipefail
OUT=${1:?usage: scripts/device-check.sh OUTDIR}
mkdir -p "$OUT/runs"
cd "$(dirname "$0")/.."
EB=${ECHOBENCH:-python3 -m echobench}
BUDGET=${DEVICE_CHECK_BUDGET_S:-420}
RUN_LIMIT=${DEVICE_CHECK_RUN_S:-150}
start=$(date +%s)
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/echobench-inductor}

if [ -n "${DEVICE_CHECK_DRY:-}" ]; then
  # Same matrix shape, CPU-sized: the tiny preset at short lengths.
  BIG=tiny; MID=tiny; MB_S=2; MB_M=4; MB_L=8
  COMMON=(--steps 3 --warmup-steps 2 --audio-frames 100 --text-tokens 32 --speaker-frames 100)
else
  BIG=3B; MID=800M; MB_S=4; MB_M=8; MB_L=16
  COMMON=(--steps 10 --warmup-steps 5)
fi

{
  echo "date: $(date -u +%FT%TZ)"
  echo "host: $(hostname)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null || echo "nvidia-smi: none"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>/dev/null || echo "megatron-core: absent"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>/dev/null || echo "torchao: absent"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

$EB calibrate --json > "$OUT/calibrate.json" 2> "$OUT/calibrate.log" || echo "calibrate failed: see $OUT/calibrate.log"

run() {  # run NAME ARGS...: one benchmark run within the remaining budget
  local name=$1; shift
  local left=$(( BUDGET - ($(date +%s) - start) ))
  if [ "$left" -lt 30 ]; then
    echo "skip $name: time budget spent"; echo "$name skipped (budget)" >> "$OUT/skipped.txt"; return
  fi
  local limit=$(( left < RUN_LIMIT ? left : RUN_LIMIT ))
  echo "== $name (limit ${limit}s): $*"
  timeout --signal=INT --kill-after=15 "$limit" $EB run "${COMMON[@]}" "$@" --out "$OUT/runs/$name" \
    > "$OUT/runs/$name.log" 2>&1
  local rc=$?
  if [ ! -f "$OUT/runs/$name/result.json" ]; then
    echo "   $name left no record (exit $rc): see $OUT/runs/$name.log"
  fi
  tail -n 3 "$OUT/runs/$name.log"
}

# 3B: eager vs compile, activation checkpointing, micro-batch sizes; then 800M; fp8; megatron.
run big-compile-mb$MB_M      --scale $BIG --compile --micro-batch $MB_M
run big-eager-mb$MB_M        --scale $BIG --micro-batch $MB_M
run big-compile-sac-mb$MB_L  --scale $BIG --compile --ac selective --micro-batch $MB_L
run big-compile-mb$MB_S      --scale $BIG --compile --micro-batch $MB_S --profile
run mid-compile-mb$MB_L      --scale $MID --compile --micro-batch $MB_L
run mid-eager-mb$MB_L        --scale $MID --micro-batch $MB_L
run big-fp8-compile-mb$MB_M  --scale $BIG --compile --precision fp8 --micro-batch $MB_M
run mid-megatron-tp1-mb$MB_L --scale $MID --framework megatron --parallelism tp1 --micro-batch $MB_L

echo "runs took $(( $(date +%s) - start )) s"
$EB report "$OUT/runs" --table md > "$OUT/summary.md" 2> "$OUT/report.log" \
  || python3 - "$OUT/runs" > "$OUT/summary.md" <<'EOF'
# Fallback when the report command is unavailable: the same figures straight from the records.
import json, pathlib, sys
print("| run | status | step s | samples/s | TFLOP/s/GPU | MFU | mem GiB | error |")
print("|---|---|---|---|---|---|---|---|")
for p in sorted(pathlib.Path(sys.argv[1]).glob("*/result.json")):
    r = json.loads(p.read_text())
    f = lambda k, s: "-" if r.get(k) is None else format(r[k], s)
    print(f"| {p.parent.name} | {r['status']} | {f('step_time_s', '.3f')} | {f('samples_per_s', '.2f')} | "
          f"{f('tflops_per_gpu', '.1f')} | {f('mfu', '.1%')} | {f('peak_mem_gib', '.1f')} | {r.get('error', '')[:80]} |")
EOF
echo
cat "$OUT/summary.md"
