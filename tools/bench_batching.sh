#!/bin/bash
# batching: pad vs bucket on synthetic shards of 2-20 s clips (lognormal, median 8 s), on this
# machine: samples/s over the measured window and the padded shares, each mode run REPEATS times,
# interleaved (pad, bucket, pad, ...) so that both see the same machine load.
#   bash tools/bench_batching.sh [OUT_DIR] [REPEATS]     (default /tmp/echobench-batching, 4)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/echobench-batching}
REPEATS=${2:-4}
PY=${PYTHON:-.venv/bin/python}
[ -d "$OUT/shards" ] || "$PY" -m echobench data synth --out "$OUT/shards" --shards 4 --samples-per-shard 256 --max-seconds 20
for r in $(seq 0 $((REPEATS - 1))); do
  for b in pad bucket; do
    rm -rf "$OUT/$b-$r"
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$PY" -m echobench run --scale tiny --data "$OUT/shards" --audio-frames 500 \
      --text-tokens 128 --speaker-frames 250 --micro-batch 8 --steps 20 --warmup-steps 4 --batching "$b" \
      --peak-tflops 1 --out "$OUT/$b-$r" >"$OUT/$b-$r.log" 2>&1 || { echo "run $b-$r failed: $OUT/$b-$r.log" >&2; exit 1; }
  done
done
"$PY" - "$OUT" "$REPEATS" <<'PY'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
print("| batching | samples/s (median; each run) | padded share of matmul FLOPs | padded tokens latent / text / speaker | steps per bucket |")
print("| --- | --- | --- | --- | --- |")
for b in ("pad", "bucket"):
    rs = [json.load(open(f"{out}/{b}-{r}/result.json")) for r in range(repeats)]
    assert all(r["status"] == "ok" for r in rs), [r["error"] for r in rs]
    sps = [r["samples_per_s"] for r in rs]
    r = rs[0]
    print(f"| {b} | {statistics.median(sps):.1f} ({', '.join(f'{x:.1f}' for x in sps)}) | {r['padded_flops_frac']:.1%} | "
          f"{r['padded_frac_latent']:.1%} / {r['padded_frac_text']:.1%} / {r['padded_frac_speaker']:.1%} | "
          f"{r.get('bucket_steps') or '-'} |")
PY
