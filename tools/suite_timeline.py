"""Where the suite's wall time goes, from a timeline that tests/conftest.py writes:

    ECHOBENCH_TEST_TIMELINE=/tmp/timeline.jsonl bash scripts/test.sh
    python3 tools/suite_timeline.py /tmp/timeline.jsonl [--top 40]

Prints each pytest-xdist worker's busy time and when it finished (the last one sets the suite's
wall time), the slowest tests (setup + call + teardown, shared fixtures included), the tests that
used the most CPU (the suite's bound on a 2-core machine), and the tests of the worker that
finished last. With --files N, only the N test files that cost the most CPU seconds: what
scripts/test.sh prints after every run, so that a growing suite is seen the day it grows."""
import argparse
import collections
import json


def file_costs(rows: list[dict]) -> list[tuple[str, float, float, int]]:
    """Per test file, most CPU first: (file, CPU seconds, wall seconds, tests), summed over its tests."""
    costs = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        c = costs[r["test"].split("::")[0]]
        c[0] += r.get("cpu_s", 0.0)
        c[1] += r["end"] - r["start"]
        c[2] += 1
    return sorted(((f, cpu, wall, n) for f, (cpu, wall, n) in costs.items()), key=lambda c: (-c[1], c[0]))


def print_files(rows: list[dict], top: int) -> None:
    costs = file_costs(rows)
    total = sum(c[1] for c in costs)
    print(f"the {min(top, len(costs))} test files that cost the most CPU (of {len(costs)}; {total:.0f} CPU s in all):")
    print("  CPU s  wall s  tests  file")
    for f, cpu, wall, n in costs[:top]:
        print(f"{cpu:7.0f} {wall:7.0f} {n:6}  {f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("timeline")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--markdown", action="store_true", help="only the slowest tests, as a markdown table (reports/)")
    ap.add_argument("--files", type=int, metavar="N", help="only the N test files that cost the most CPU seconds")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.timeline) if line.strip()]
    if not rows:
        print(f"{args.timeline}: no test in the timeline")
        return
    if args.files is not None:
        print_files(rows, args.files)
        return
    if args.markdown:
        print("| wall s | CPU s | test (setup + call + teardown) |\n| ---: | ---: | --- |")
        for r in sorted(rows, key=lambda r: r["start"] - r["end"])[: args.top]:
            cpu = f"{r['cpu_s']:.1f}" if "cpu_s" in r else "-"
            print(f"| {r['end'] - r['start']:.1f} | {cpu} | `{r['test']}` |")
        return
    t0 = min(r["start"] for r in rows)
    by_worker = collections.defaultdict(list)
    for r in rows:
        by_worker[r["worker"]].append(r)
    print("worker  tests  busy s  ends at s   CPU s")
    last = max(by_worker, key=lambda w: max(r["end"] for r in by_worker[w]))
    for w, rs in sorted(by_worker.items()):
        print(f"{w:6} {len(rs):6} {sum(r['end'] - r['start'] for r in rs):7.0f} {max(r['end'] for r in rs) - t0:10.0f} {sum(r.get('cpu_s', 0) for r in rs):7.0f}")
    print(f"\nslowest {args.top}:")
    for r in sorted(rows, key=lambda r: r["start"] - r["end"])[: args.top]:
        print(f"{r['end'] - r['start']:7.1f} s  {r['worker']:5} {r['test']}")
    if any("cpu_s" in r for r in rows):
        print(f"\nmost CPU {args.top} (seconds of CPU, then wall):")
        for r in sorted(rows, key=lambda r: -r.get("cpu_s", 0))[: args.top]:
            print(f"{r.get('cpu_s', 0):7.1f} s {r['end'] - r['start']:7.1f} s  {r['worker']:5} {r['test']}")
    print(f"\nthe last worker ({last}), its tests over 10 s in order:")
    for r in sorted(by_worker[last], key=lambda r: r["start"]):
        if r["end"] - r["start"] > 10:
            print(f"{r['start'] - t0:7.0f} +{r['end'] - r['start']:5.0f} s  {r['test']}")


if __name__ == "__main__":
    main()
