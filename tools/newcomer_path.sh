#!/usr/bin/env bash
# A newcomer's path, timed: a fresh clone of this checkout, then the README's commands as a new user
# types them (quick start 1, the docs built strict, the mistake of a run without --scale, a layout
# tuned, a published table put beside measured runs, every record listed; on the local SLURM cluster,
# when one is up, a site file and a 2-node sweep of a matrix that names it). Each step's wall time and exit code in OUT/steps.tsv, its output in
# OUT/logs/STEP.log; the table at the end. reports/user-path-*.md quote it.
#
#   bash tools/newcomer_path.sh [OUT]      # default /tmp/newcomer; ~10 minutes on 2 cores (setup included)
#
# The clone's .venv is built from nothing by scripts/setup.sh (pip's cache, where warm, speeds it).
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-/tmp/newcomer}" && cd "${1:-/tmp/newcomer}" && pwd)
CLONE="$OUT/echobench"
rm -rf "$CLONE" "$OUT/logs" "$OUT/steps.tsv"
mkdir -p "$OUT/logs"
printf 'step\tseconds\texit\tcommand\n' > "$OUT/steps.tsv"

step() {  # step NAME COMMAND...: runs COMMAND in the clone, timed, its output logged
  local name=$1; shift
  local start end rc
  start=$(date +%s.%N)
  (cd "$CLONE" && "$@") > "$OUT/logs/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  printf '%s\t%.1f\t%s\t%s\n' "$name" "$(echo "$end - $start" | bc)" "$rc" "$*" >> "$OUT/steps.tsv"
  echo "newcomer: $name: exit $rc, $(tail -1 "$OUT/steps.tsv" | cut -f2) s (load $(cut -d' ' -f1 /proc/loadavg))" >&2
}

git clone -q "$SRC" "$CLONE"
step quickstart bash scripts/quickstart.sh
EB=.venv/bin/echobench
step docs .venv/bin/python -m mkdocs build --strict -d "$OUT/site"
step run-without-scale $EB run --out runs/x
step calibrate-comm $EB calibrate --comm --scale tiny --audio-frames 100 --text-tokens 32 --speaker-frames 80
step tune $EB tune tunes/cpu-tiny.yaml
step tune-report $EB report runs/tune-cpu-tiny -o runs/tune-cpu-tiny/report.html
step reference $EB report runs/smoke --table md --reference validation/reference-example.csv
step results $EB results runs/
if command -v sinfo > /dev/null && sinfo -h > /dev/null 2>&1; then
  # The cluster guide's path: the cluster's settings once in a site file (the clone's venv names the
  # ranks' interpreter: nothing of the submitting checkout reaches the jobs), a matrix naming it.
  PARTITION=$(sinfo -h -o %P | head -1 | tr -d '*')
  mkdir -p "$CLONE/sites"
  printf '%s\n' "executor: slurm" "slurm: {partition: $PARTITION, time: '00:10:00', gpus_per_node: 2, request_gpus: false," \
    "        env: {OMP_NUM_THREADS: 1}, venv: $CLONE/.venv}" > "$CLONE/sites/local.yaml"
  printf '%s\n' "name: mine" "site: ../sites/local.yaml" \
    "defaults: {scale: tiny, steps: 3, warmup_steps: 2, micro_batch: 2, device: cpu, audio_frames: 100," \
    "           text_tokens: 32, speaker_frames: 80}" "axes: {parallelism: [ddp, fsdp2], nodes: [2]}" \
    > "$CLONE/matrices/mine.yaml"
  step slurm-plan $EB plan matrices/mine.yaml
  step slurm-scripts $EB plan matrices/mine.yaml --write-scripts runs/mine-scripts
  step slurm-preflight $EB preflight matrices/mine.yaml
  step slurm-sweep $EB sweep matrices/mine.yaml
  step slurm-status $EB status runs/mine
  step slurm-report $EB report runs/mine runs/smoke -o runs/mine/report.html
fi
column -t -s $'\t' "$OUT/steps.tsv"
