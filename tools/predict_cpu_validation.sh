#!/usr/bin/env bash
# The CPU validation of `echobench predict` (reports/predict-cpu-2026-12-01.md): calibrate this
# machine, measure tiny (and one 800M) runs of every layout at a few lengths and micro-batches,
# then hold the predictions against the records (about 15 minutes on the 2-core machine).
# Every profile is `echobench calibrate --comm`'s: GEMMs at every shape the model prices for the
# block's runs, AdamW over the model's own parameters (docs/reference/hardware-profiles.md).
#
#   bash tools/predict_cpu_validation.sh [OUT]        # default runs/predict-cpu
#   SLURM=0 bash tools/predict_cpu_validation.sh      # without the 2-node runs on the local SLURM cluster
#
# Single-process runs and their calibration use one thread (OMP_NUM_THREADS=1), as each rank of a
# 2-process run has (echobench's launcher gives each of N local ranks cores/N threads): on a loaded
# 2-core machine two threads of one process wait on each other whenever the other core is taken.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/predict-cpu}
PY=${PY:-.venv/bin/python}
SLURM=${SLURM:-1}
mkdir -p "$OUT"
export ECHOBENCH_CACHE="$OUT/cache"  # this validation's calibrations stay in OUT
say() { echo "predict-cpu: $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg): $*" >&2; }

# Each block of runs is calibrated just before it, at its own shapes (calibrate --comm times the
# GEMMs and attention of the run's micro-batch and lengths), on as many processes as its runs have:
# 2 (the 2-rank layouts) and 1 (single runs). The load of a shared machine drifts over minutes.
PROFILES=()
calibrate() {  # NAME NPROC SCALE MB AUDIO TEXT SPEAKER
  local env=()
  [ "$2" = 1 ] && env=(OMP_NUM_THREADS=1)
  env "${env[@]}" $PY -m echobench calibrate --comm --nproc "$2" --scale "$3" --micro-batch "$4" --audio-frames "$5" \
      --text-tokens "$6" --speaker-frames "$7" --out "$OUT/$1.yaml" > "$OUT/calibrate-$1.log"
  PROFILES+=(--profile "$OUT/$1.yaml")
}

# Runs: tiny at three shapes, single / DDP / FSDP2 / megatron TP=2 (2 processes), 2 repeats each.
COMMON=(--scale tiny --steps 10 --warmup-steps 3 --peak-tflops 1 --device cpu --repeats 2)
for shape in "2 100 32 80" "4 200 64 160" "8 400 64 160"; do
  read -r mb la lt ls <<< "$shape"
  S=(--micro-batch "$mb" --audio-frames "$la" --text-tokens "$lt" --speaker-frames "$ls")
  tag="mb$mb-a$la"
  say "tiny $tag"
  calibrate "cpu-1proc-$tag" 1 tiny "$mb" "$la" "$lt" "$ls"
  OMP_NUM_THREADS=1 $PY -m echobench run "${COMMON[@]}" "${S[@]}" --out "$OUT/runs/single-$tag" > /dev/null
  calibrate "cpu-2proc-$tag" 2 tiny "$mb" "$la" "$lt" "$ls"
  $PY -m echobench run "${COMMON[@]}" "${S[@]}" --parallelism ddp --nproc 2 --out "$OUT/runs/ddp-$tag" > /dev/null
  $PY -m echobench run "${COMMON[@]}" "${S[@]}" --parallelism fsdp2 --nproc 2 --out "$OUT/runs/fsdp2-$tag" > /dev/null
  $PY -m echobench run "${COMMON[@]}" "${S[@]}" --framework megatron --tp 2 --nproc 2 --out "$OUT/runs/tp2-$tag" \
      > /dev/null
done
say "800M single"
calibrate cpu-1proc-800m 1 800M 1 50 16 40
OMP_NUM_THREADS=1 $PY -m echobench run --scale 800M --steps 3 --warmup-steps 2 --peak-tflops 1 --device cpu \
    --repeats 2 --micro-batch 1 --audio-frames 50 --text-tokens 16 --speaker-frames 40 --out "$OUT/runs/single-800m" \
    > /dev/null

if [ "$SLURM" = 1 ]; then
  # 2 nodes of 1 process: DDP and FSDP2 through the local SLURM cluster (scripts/slurm-local.sh), one
  # job at a time (max_submitted: 1): its nodes are this machine's two cores. The sweep measures its
  # own profile first (hardware.calibrate_comm: a SLURM job on the 2 nodes, torchrun under srun as
  # the runs' jobs start theirs): the inter link class as the runs meet it.
  say "2 nodes on SLURM"
  cat > "$OUT/slurm-2node.yaml" <<'EOF'
name: predict-cpu-2node
executor: slurm
slurm: {time: "00:10:00", gpus_per_node: 1, request_gpus: false, max_submitted: 1, env: {OMP_NUM_THREADS: 1}}
hardware: {calibrate_comm: true}
repeats: 2
defaults: {scale: tiny, steps: 10, warmup_steps: 3, peak_tflops: 1, device: cpu, nodes: 2, audio_frames: 100,
           text_tokens: 32, speaker_frames: 80}
axes:
  parallelism: [ddp, fsdp2]
  micro_batch: [2, 4]
EOF
  $PY -m echobench sweep "$OUT/slurm-2node.yaml" --out "$OUT/runs/slurm-2node" > "$OUT/sweep-2node.log" 2>&1 || \
      say "the SLURM sweep failed: see $OUT/sweep-2node.log"
  if [ -f "$OUT/runs/slurm-2node/profile.yaml" ]; then PROFILES+=(--profile "$OUT/runs/slurm-2node/profile.yaml")
  else say "the sweep measured no profile: see $OUT/sweep-2node.log"; fi
fi

say "predicting"
$PY -m echobench validate measured "$OUT/runs" "${PROFILES[@]}" > "$OUT/against.txt"
$PY -m echobench validate measured "$OUT/runs" "${PROFILES[@]}" --json > "$OUT/against.json"
cat "$OUT/against.txt"
