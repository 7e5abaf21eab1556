"""Summarises `echobench validate measured ... --json` output by layout: mean and max absolute step-time
error, the mean signed error, and the noise of the repeats (|r0 - r1| / mean of each pair of run ids
ID / ID-r1). Used by reports/predict-cpu-2026-12-01.md:

    .venv/bin/python tools/predict_summary.py runs/predict-cpu/against.json
"""
import json, statistics, sys
rows = json.load(open(sys.argv[1]))
def group(r):
    s = r["settings"]
    if s["scale"] != "tiny":
        return f"{s['scale']} single"
    g = f"{s['framework']} {s['parallelism']}"
    return g + (f" {s['nodes']} nodes (SLURM)" if s["nodes"] > 1 else "")
groups = {}
for r in rows:
    groups.setdefault(group(r), []).append(r)
print("| runs | n | mean abs error | max abs error | mean error (sign) |")
print("| --- | --- | --- | --- | --- |")
for g, rs in sorted(groups.items()):
    e = [r["error"] for r in rs]
    print(f"| {g} | {len(e)} | {statistics.mean(map(abs, e)):.1%} | {max(map(abs, e)):.1%} | {statistics.mean(e):+.1%} |")
e = [r["error"] for r in rows]
print(f"| all | {len(e)} | {statistics.mean(map(abs, e)):.1%} | {max(map(abs, e)):.1%} | {statistics.mean(e):+.1%} |")
pairs = {}
for r in rows:
    pairs.setdefault(r["run_id"].removesuffix("-r1"), []).append(r["measured_step_time_s"])
spread = [abs(a - b) / ((a + b) / 2) for a, b in (v for v in pairs.values() if len(v) == 2)]
print(f"repeat noise: |r0 - r1| / mean over {len(spread)} pairs: median {statistics.median(spread):.1%}, max {max(spread):.1%}")
