#!/usr/bin/env bash
# One prepared measurement pass on a single GPU, made for the lent H200 (one device call, under
# 9 minutes whatever happens). In order: installs the carried wheels (.whl/, from
# scripts/device-wheels.sh), records the environment, runs the `gpu`-marked tests, calibrates the
# bf16 GEMM ceiling, then the measurement runs, most informative first:
#   3B compile mb8 (profiled) | 3B eager mb8 | bare PyTorch loop, 3B compile mb8 (harness overhead)
#   | 800M compile / eager mb16 | 3B fp8 compile mb8 | megatron TP=1 3B mb8 | 3B compile selective
#   AC mb8 | 3B compile mb16 (profiled) | bare loop 3B eager mb8 | 3B eager selective mb8 | 3B eager mb16
# and last the tables. One global deadline: every step gets min(its own limit, time left), a step
# that cannot get its minimum is skipped and listed; compile runs get a longer limit than eager ones
# (a cold compile of the 3B blocks takes 1-2 min) and share one inductor cache, so the bare loop
# right after the same compiled run finds its graphs compiled.
#
#   scripts/device-wheels.sh                              # here, once: the wheels into .whl/
#   device call (carry .whl):  scripts/device-check.sh $OUT/h200
#   DEVICE_CHECK_DRY=1 scripts/device-check.sh /tmp/dry   # CPU dry run: the same steps, tiny model
#
# What lands in OUTDIR (at most 8 files, no subfolders: what a device call returns):
#   summary.md        every step (status, wall time, step time, MFU vs datasheet and vs the measured
#                     GEMM ceiling, peak memory beside the plan's estimate), the comparisons (compile,
#                     AC, fp8, micro-batch, megatron vs torchtitan, harness overhead), the publication
#                     table (`echobench report --table md`); printed last
#   records.jsonl     one line per step, appended as each ends: run lines hold their result.json
#   env.txt           device, driver, versions, carried wheels, knobs, the command
#   trace-NAME.json.gz  the best profiled 3B run's chrome trace
#   logs.tar.gz       every step's log, the calibration, the plan of matrices/h200-single.yaml
#   device-check.log  this script's whole output
#
# Knobs (seconds): DEVICE_CHECK_DEADLINE_S (whole script, default 510; dry run 2400),
# DEVICE_CHECK_RESERVE_S (kept for the tables and packing, 45), DEVICE_CHECK_RUN_S / _MIN_S (eager
# run limit / least worth starting, 100 / 45), DEVICE_CHECK_COMPILE_S / _COMPILE_MIN_S (240 / 110),
# DEVICE_CHECK_TESTS_S (the gpu tests, 90); DEVICE_CHECK_ONLY="NAME ..." runs only those runs;
# DEVICE_CHECK_WORK (scratch, default a new /tmp folder); ECHOBENCH (default "python3 -m echobench").
set -uo pipefail
OUT=${1:?usage: scripts/device-check.sh OUTDIR}
cd "$(dirname "$0")/.."
start=$(date +%s)
DRY=${DEVICE_CHECK_DRY:-}
DEADLINE=${DEVICE_CHECK_DEADLINE_S:-$([ -n "$DRY" ] && echo 2400 || echo 510)}
END=$(( start + DEADLINE ))
RESERVE=${DEVICE_CHECK_RESERVE_S:-45}
RUN_S=${DEVICE_CHECK_RUN_S:-$([ -n "$DRY" ] && echo 400 || echo 100)}
RUN_MIN=${DEVICE_CHECK_RUN_MIN_S:-45}
COMPILE_S=${DEVICE_CHECK_COMPILE_S:-$([ -n "$DRY" ] && echo 600 || echo 240)}
COMPILE_MIN=${DEVICE_CHECK_COMPILE_MIN_S:-110}
TESTS_S=${DEVICE_CHECK_TESTS_S:-90}
WORK=${DEVICE_CHECK_WORK:-$(mktemp -d /tmp/echobench-device.XXXXXX)}
EB=${ECHOBENCH:-python3 -m echobench}
RECORDS=$OUT/records.jsonl
SUMMARY="python3 scripts/device_summary.py"
mkdir -p "$OUT" "$WORK/runs" "$WORK/logs" "$WORK/bare"
rm -f "$RECORDS"
exec > >(tee -a "$OUT/device-check.log") 2>&1
TEE_PID=$!
export PYTHONUNBUFFERED=1 ECHOBENCH_CACHE=$WORK/cache
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$WORK/triton}

left() { echo $(( END - $(date +%s) )); }
# limit OWN: seconds this step may take, keeping RESERVE for the end (may be <= 0).
limit() { local avail=$(( $(left) - RESERVE )); echo $(( $1 < avail ? $1 : avail )); }
elapsed() { echo $(( $(date +%s) - start )); }
say() { echo "[$(elapsed)s] $*"; }

# ---- 1. the carried wheels ----
SITE=$WORK/site
if ls .whl/*.whl > /dev/null 2>&1; then
  t0=$(date +%s)
  timeout -k 5 "$(limit 90)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl/*.whl > "$WORK/logs/pip-install.log" 2>&1 \
    && say "installed $(ls .whl/*.whl | wc -l) carried wheels in $(( $(date +%s) - t0 )) s" \
    || say "carried wheels did not install: see logs/pip-install.log"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  say "no .whl/ here: every run (pydantic), megatron, fp8, plan and report need its wheels (scripts/device-wheels.sh; carry .whl)"
fi

# ---- 2. the environment ----
{
  echo "date: $(date -u +%FT%TZ)"
  echo "command: ${DRY:+DEVICE_CHECK_DRY=1 }scripts/device-check.sh $OUT"
  echo "host: $(hostname)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo 'unknown (no .git here)')"
  echo "knobs: deadline ${DEADLINE}s reserve ${RESERVE}s run ${RUN_S}/${RUN_MIN}s compile ${COMPILE_S}/${COMPILE_MIN}s tests ${TESTS_S}s only='${DEVICE_CHECK_ONLY:-}'"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.sm,temperature.gpu,power.limit \
    --format=csv 2>/dev/null || echo "nvidia-smi: none"
  echo "carried wheels:"; ls -l .whl/*.whl 2>/dev/null | awk '{printf "  %7.2f MiB  %s\n", $5 / 1048576, $NF}'
  timeout 120 python3 - <<'EOF'
import importlib, platform, sys
from importlib import metadata
print("python", platform.python_version(), sys.executable)
for dist in ("torch", "triton", "transformers", "numpy", "pandas", "typer", "rich", "pyyaml", "jinja2", "narwhals",
             "megatron-core", "torchao", "plotly", "pydantic", "pydantic-core", "typing-extensions", "pytest"):
    try:
        print(f"{dist} {metadata.version(dist)}")
    except metadata.PackageNotFoundError:
        print(f"{dist} absent")
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
# What the runs and the report import: a failure here names the missing piece before the runs.
for mod in ("echobench.cli", "echobench.bench", "echobench.report", "echobench.matrix", "megatron.core", "torchao.float8"):
    try:
        importlib.import_module(mod)
        print(f"import {mod}: ok")
    except Exception as exc:  # noqa: BLE001
        print(f"import {mod}: FAILED {type(exc).__name__}: {exc}")
EOF
} > "$WORK/env.txt" 2>&1
cp "$WORK/env.txt" "$OUT/env.txt"
cat "$OUT/env.txt"

# ---- 3. the gpu-marked tests ----
# On the device a gpu test that finds no CUDA fails instead of skipping: "passed" means they ran.
if [ -z "$DRY" ]; then export ECHOBENCH_REQUIRE_GPU=1; fi
lim=$(limit "$TESTS_S")
if [ "$lim" -ge 20 ]; then
  t0=$(date +%s)
  timeout -k 5 "$lim" python3 -m pytest -m gpu -q -p no:cacheprovider tests > "$WORK/logs/pytest-gpu.log" 2>&1
  rc=$?
  $SUMMARY add "$RECORDS" --kind pytest --name pytest-gpu --command "python3 -m pytest -m gpu -q tests" --rc $rc \
    --wall-s $(( $(date +%s) - t0 )) --limit-s "$lim" --note "$(tail -n 1 "$WORK/logs/pytest-gpu.log")"
  say "gpu tests (exit $rc): $(tail -n 1 "$WORK/logs/pytest-gpu.log")"
fi

# ---- 4. the GEMM ceiling, and the plan's estimates for the h200-single matrix ----
t0=$(date +%s)
lim=$(limit 90)
timeout -k 5 "$lim" $EB calibrate --json > "$WORK/calibrate.json" 2> "$WORK/logs/calibrate.log"
rc=$?
$SUMMARY add "$RECORDS" --kind calibrate --name calibrate --command "$EB calibrate --json" --rc $rc \
  --file "$WORK/calibrate.json" --wall-s $(( $(date +%s) - t0 )) --limit-s "$lim"
say "calibrate (exit $rc): $(python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['device'], r['dtype'], format(r['tflops'], '.4g'), 'TFLOP/s')" "$WORK/calibrate.json" 2>/dev/null)"
# fp8 runs take bf16 as their peak dtype: a CPU has no datasheet entry, so the dry run calibrates it too.
[ -n "$DRY" ] && timeout -k 5 "$(limit 60)" $EB calibrate --dtype bf16 --size 256 --json > "$WORK/logs/calibrate-bf16.json" 2>&1
timeout -k 5 "$(limit 30)" $EB plan matrices/h200-single.yaml --json > "$WORK/logs/plan-h200-single.json" 2>&1 \
  || say "plan failed: see logs/plan-h200-single.json"

# ---- 5. the runs ----
if [ -n "$DRY" ]; then
  # The same steps, CPU-sized: the tiny preset at short lengths (mb 2 / 4 for "3B", 3 for "800M").
  # 96 audio frames and 128 speaker frames (32 patches): at mb 2 the fp8 step's rows are multiples
  # of 16, as 750 frames x mb 8 are on the GPU (README: the fp8 shape rule).
  S3=tiny; S8=tiny; MB=2; MB2=4; MB8=3
  COMMON=(--steps 3 --warmup-steps 2 --audio-frames 96 --text-tokens 32 --speaker-frames 128)
else
  S3=3B; S8=800M; MB=8; MB2=16; MB8=16
  COMMON=(--steps 20 --warmup-steps 5)
fi

# step NAME KIND ARGS...: KIND is eager | compile (echobench run) or bare (scripts/bare_step.py).
step() {
  local name=$1 kind=$2; shift 2
  if [ -n "${DEVICE_CHECK_ONLY:-}" ] && [[ " $DEVICE_CHECK_ONLY " != *" $name "* ]]; then return; fi
  local own=$RUN_S need=$RUN_MIN
  if [[ " $* " == *" --compile "* ]]; then own=$COMPILE_S; need=$COMPILE_MIN; fi
  local lim; lim=$(limit "$own")
  if [ "$lim" -lt "$need" ]; then
    say "skip $name: ${lim}s left for it, it needs ${need}s"
    $SUMMARY add "$RECORDS" --kind skipped --name "$name" --command "$*" --limit-s "$lim" \
      --note "time: ${lim}s left, needs ${need}s"
    return
  fi
  local cmd t0=$(date +%s) rc
  say "== $name (limit ${lim}s)"
  if [ "$kind" = bare ]; then
    cmd=(python3 scripts/bare_step.py "${COMMON[@]}" "$@" --json "$WORK/bare/$name.json")
  else
    # The run stops itself before the limit (status timeout, record written); `timeout` is the backstop.
    cmd=($EB run "${COMMON[@]}" "$@" --time-limit-s $(( lim - 15 )) --out "$WORK/runs/$name")
  fi
  timeout -k 10 "$lim" "${cmd[@]}" > "$WORK/logs/$name.log" 2>&1
  rc=$?
  if [ "$kind" = bare ]; then
    $SUMMARY add "$RECORDS" --kind bare --name "$name" --file "$WORK/bare/$name.json" --command "${cmd[*]}" \
      --rc $rc --wall-s $(( $(date +%s) - t0 )) --limit-s "$lim"
  else
    $SUMMARY add "$RECORDS" --kind run --name "$name" --run-dir "$WORK/runs/$name" --command "${cmd[*]}" \
      --rc $rc --wall-s $(( $(date +%s) - t0 )) --limit-s "$lim"
  fi
  say "   exit $rc in $(( $(date +%s) - t0 )) s: $(grep -E 'step time|median step|error|Error' "$WORK/logs/$name.log" | tail -n 1 | tr -s ' │┃' ' ' | cut -c1-160)"
}

step "${S3,,}-compile-mb$MB"        compile --scale $S3 --compile --micro-batch $MB --profile
step "${S3,,}-eager-mb$MB"          eager   --scale $S3 --micro-batch $MB
step "bare-${S3,,}-compile-mb$MB"   bare    --scale $S3 --compile --micro-batch $MB
step "${S8,,}-compile-mb$MB8"       compile --scale $S8 --compile --micro-batch $MB8
step "${S8,,}-eager-mb$MB8"         eager   --scale $S8 --micro-batch $MB8
step "${S3,,}-fp8-compile-mb$MB"    compile --scale $S3 --compile --precision fp8 --micro-batch $MB
step "${S3,,}-megatron-tp1-mb$MB"   eager   --scale $S3 --framework megatron --parallelism tp1 --micro-batch $MB
step "${S3,,}-compile-sac-mb$MB"    compile --scale $S3 --compile --ac selective --micro-batch $MB
step "${S3,,}-compile-mb$MB2"       compile --scale $S3 --compile --micro-batch $MB2 --profile
step "bare-${S3,,}-eager-mb$MB"     bare    --scale $S3 --micro-batch $MB
step "${S3,,}-eager-sac-mb$MB"      eager   --scale $S3 --ac selective --micro-batch $MB
step "${S3,,}-eager-mb$MB2"         eager   --scale $S3 --micro-batch $MB2
say "runs done"

# ---- 6. the tables and the packing (within the reserve) ----
fin() { local t=$(( END - $(date +%s) )); echo $(( t < $1 ? (t > 5 ? t : 5) : $1 )); }
timeout -k 5 "$(fin 60)" $SUMMARY trace "$RECORDS" "$OUT" --scale $S3 2>&1 | tail -n 2
timeout -k 5 "$(fin 40)" $EB report "$WORK/runs" --table md > "$WORK/report-table.md" 2> "$WORK/logs/report.log" \
  || echo "(echobench report failed: see logs/report.log)" > "$WORK/report-table.md"
cp "$WORK/calibrate.json" "$WORK/logs/" 2>/dev/null
cp "$WORK/bare/"*.json "$WORK/logs/" 2>/dev/null
tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs env.txt report-table.md 2>/dev/null
{
  echo "# echobench device check: $(hostname), $(date -u +%F)"
  echo
  echo '```'
  head -n 6 "$WORK/env.txt"
  grep -E '^(torch|megatron-core|torchao|transformers|triton|python) ' "$WORK/env.txt"
  echo "wall time: $(elapsed) s"
  echo '```'
  echo
  echo "## Steps"
  echo
  timeout -k 5 "$(fin 30)" $SUMMARY table "$RECORDS"
  echo
  echo "## echobench report --table md"
  echo
  cat "$WORK/report-table.md"
} > "$OUT/summary.md" 2>&1
echo
cat "$OUT/summary.md"
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
exec 1>&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit 0
