"""The bookkeeping of scripts/device-check.sh: one JSON-lines file of everything measured, the
profiler trace packed to fit what a device call returns, and the closing summary.

  device_summary.py add RECORDS --kind run --name N --run-dir D --command C --rc RC --wall-s W --limit-s L
  device_summary.py add RECORDS --kind bare|calibrate|pytest|skipped --name N [--file F.json] ...
  device_summary.py trace RECORDS OUTDIR        # best 3B run's trace -> OUTDIR/trace-NAME.json.gz
  device_summary.py table RECORDS               # markdown: every step, then the comparisons
  device_summary.py unpack RECORDS DIR          # DIR/NAME/result.json (+ plan.json) per run, for
                                                # `echobench report DIR` and for committing

Every `add` appends one line {"kind", "name", "command", "rc", "wall_s", "limit_s", ...}: a run's line
holds its result.json as "record" and the memory estimate `echobench plan` prints for those settings
(echobench.memory.estimate_memory) as "memory_estimate_gib"; a bare-loop, calibration or test line
holds that step's JSON as "result".
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's echobench

TRACE_LIMIT = 15 * 2**20  # a device call returns files of 16 MiB at most
GPU_EVENT_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "user_annotation"}


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def memory_estimate(config: dict) -> dict | None:
    from echobench.config import RunConfig
    from echobench.memory import estimate_memory

    try:
        return estimate_memory(RunConfig.from_dict(config)).as_gib()
    except (TypeError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def add(args) -> None:
    line = {"kind": args.kind, "name": args.name, "command": args.command, "rc": args.rc,
            "wall_s": args.wall_s, "limit_s": args.limit_s}
    if args.note:
        line["note"] = args.note
    if args.kind == "run":
        path = Path(args.run_dir) / "result.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            line.update(status="no-record", error=f"{path}: {exc}")
        else:
            line.update(status=record.get("status"), record=record,
                        memory_estimate_gib=memory_estimate(record.get("config") or {}))
    elif args.file:
        try:
            line["result"] = json.loads(Path(args.file).read_text())
            line["status"] = "ok" if args.rc == 0 else "failed"
        except (OSError, ValueError) as exc:
            line.update(status="no-result", error=f"{args.file}: {exc}")
    else:
        line["status"] = "skipped" if args.kind == "skipped" else ("ok" if args.rc == 0 else "failed")
    if args.kind == "pytest":  # pytest's exit status; 124 / 137: `timeout` stopped it
        line["status"] = {0: "passed", 5: "none collected", 124: "timeout", 137: "timeout"}.get(args.rc, "failed")
    with open(args.records, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


# ---- the closing summary ----

def runs_ok(lines: list[dict]) -> list[dict]:
    return [ln for ln in lines if ln["kind"] == "run" and ln.get("status") == "ok"]


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def num(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def steps_table(lines: list[dict]) -> list[str]:
    out = ["| step | kind | status | wall s | limit s | step s | samples/s | TFLOP/s | MFU | "
           "MFU vs GEMM ceiling | peak mem GiB | est. mem GiB | est./peak |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ln in (x for x in lines if x["kind"] != "trace"):
        r = ln.get("record") or {}
        res = ln.get("result") or {}
        est = (ln.get("memory_estimate_gib") or {}).get("total")
        peak = r.get("peak_mem_gib") if r else res.get("peak_mem_gib")
        ratio = est / peak if est and peak else None
        status = ln.get("status") or "-"
        if status not in ("ok", "passed") and (r.get("error") or ln.get("error") or ln.get("note")):
            status += ": " + (r.get("error") or ln.get("error") or ln.get("note"))[:90].replace("|", "/")
        step = r.get("step_time_s", res.get("step_time_s") if isinstance(res, dict) else None)
        out.append(f"| {ln['name']} | {ln['kind']} | {status} | {num(ln.get('wall_s'), '.0f')} | "
                   f"{num(ln.get('limit_s'), '.0f')} | {num(step, '.4f')} | {num(r.get('samples_per_s'), '.2f')} | "
                   f"{num(r.get('tflops_per_gpu'), '.4g')} | {pct(r.get('mfu'))} | {pct(r.get('mfu_vs_ceiling'))} | "
                   f"{num(peak, '.1f')} | {num(est, '.1f')} | {num(ratio, '.2f')} |")
    return out


def key(r: dict, *fields) -> tuple:
    return tuple(r.get(f) for f in fields)


def pairs(runs: list[dict], field: str, a, b, same: tuple) -> list[tuple[dict, dict]]:
    """(run with field == a, run with field == b) that agree on every `same` field."""
    found = []
    for x in runs:
        for y in runs:
            if x["record"].get(field) == a and y["record"].get(field) == b and \
                    key(x["record"], *same) == key(y["record"], *same):
                found.append((x, y))
    return found


def comparisons(lines: list[dict]) -> list[str]:
    runs = runs_ok(lines)
    out = []
    cal = next((ln["result"] for ln in lines if ln["kind"] == "calibrate" and ln.get("result")), None)
    if cal:
        sheet = cal.get("datasheet_tflops")
        out.append(f"- GEMM ceiling ({cal['dtype']} {cal['size']}^3, median of {cal['iters']}): "
                   f"{cal['tflops']:.4g} TFLOP/s (min {cal['tflops_min']:.4g}, max {cal['tflops_max']:.4g})"
                   + (f", {cal['tflops'] / sheet:.1%} of the {sheet:g} datasheet peak" if sheet else ""))

    def speed(label, field, a, b, same):
        for x, y in pairs(runs, field, a, b, same):
            rx, ry = x["record"], y["record"]
            out.append(f"- {label}: {y['name']} vs {x['name']}: step {ry['step_time_s']:.4f} s vs "
                       f"{rx['step_time_s']:.4f} s = {rx['step_time_s'] / ry['step_time_s']:.2f}x speed-up; "
                       f"MFU {pct(ry['mfu'])} vs {pct(rx['mfu'])}; peak mem {ry['peak_mem_gib']:.1f} vs "
                       f"{rx['peak_mem_gib']:.1f} GiB; wall {y['wall_s']:.0f} vs {x['wall_s']:.0f} s")

    base = ("scale", "framework", "micro_batch", "precision")
    speed("compile", "compile", False, True, base + ("ac",))
    speed("selective AC", "ac", "none", "selective", base + ("compile",))
    speed("fp8", "precision", "bf16", "fp8", ("scale", "framework", "micro_batch", "compile", "ac"))
    speed("megatron vs torchtitan", "framework", "torchtitan", "megatron",
          ("scale", "micro_batch", "compile", "ac", "precision"))
    groups: dict[tuple, list[dict]] = {}
    for x in runs:
        groups.setdefault(key(x["record"], "scale", "framework", "compile", "ac", "precision"), []).append(x)
    for g, members in groups.items():
        if len({m["record"]["micro_batch"] for m in members}) > 1:
            best = max(members, key=lambda m: m["record"]["mfu"])
            out.append(f"- best micro-batch for {'/'.join(map(str, g))}: {best['record']['micro_batch']} "
                       f"(MFU {pct(best['record']['mfu'])}; tried "
                       + ", ".join(f"{m['record']['micro_batch']}: {pct(m['record']['mfu'])}" for m in members) + ")")
    for b in (ln for ln in lines if ln["kind"] == "bare" and ln.get("status") == "ok"):
        res = b["result"]
        for x in runs:
            r = x["record"]
            if (r["scale"], r["micro_batch"], r["compile"], r["framework"], r["ac"]) == \
                    (res["scale"], res["micro_batch"], res["compile"], "torchtitan", "none") and \
                    r["precision"] == {"bfloat16": "bf16", "float32": "fp32"}[res["precision"]]:
                out.append(f"- harness overhead: {x['name']} {r['step_time_s']:.4f} s vs bare loop {b['name']} "
                           f"{res['step_time_s']:.4f} s: {r['step_time_s'] / res['step_time_s'] - 1:+.2%}")
    mem = [(x["name"], x["memory_estimate_gib"]["total"], x["record"]["peak_mem_gib"]) for x in runs
           if (x.get("memory_estimate_gib") or {}).get("total") and x["record"].get("peak_mem_gib")]
    if mem:
        ratios = [e / p for _, e, p in mem]
        out.append(f"- memory estimate / measured peak (reserved): median {statistics.median(ratios):.2f}, "
                   f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(mem)} runs")
    for t in (ln for ln in lines if ln["kind"] == "trace"):
        out.append(f"- profiler trace of {t['name']}: {t.get('note', '')}")
    return out


def table(args) -> None:
    lines = read_lines(Path(args.records))
    print("\n".join(steps_table(lines)))
    print()
    print("\n".join(comparisons(lines)) or "- no comparisons: too few successful runs")


def unpack(args) -> None:
    """Each run line back into a run directory: result.json, and plan.json with the estimate's total
    (where `echobench report` reads memory_estimate_gib beside a record)."""
    root = Path(args.dir)
    n = 0
    for ln in read_lines(Path(args.records)):
        if ln["kind"] != "run" or not ln.get("record"):
            continue
        run_dir = root / ln["name"]
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "result.json").write_text(json.dumps(ln["record"], indent=2) + "\n")
        est = ln.get("memory_estimate_gib") or {}
        if est.get("total") is not None:
            plan = {"memory_estimate_gib": est["total"], "memory_estimate_parts_gib": est, "command": ln["command"]}
            (run_dir / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        n += 1
    print(f"{n} run directories under {root}")


# ---- the profiler trace ----

def trace(args) -> None:
    """Gzips the chrome trace of the best 3B run (by MFU) that has one; over the return limit it keeps
    the GPU-side events only (kernels, copies, step annotations) and says so."""
    records = Path(args.records)
    runs = [x for x in runs_ok(read_lines(records)) if x["record"].get("profile_traces")]
    scale = args.scale
    chosen = [x for x in runs if x["record"]["scale"] == scale] or runs
    if not chosen:
        print("no profiled run succeeded: no trace")
        return
    best = max(chosen, key=lambda x: x["record"]["mfu"])
    src = Path(best["record"]["profile_traces"][0])
    dst = Path(args.outdir) / f"trace-{best['name']}.json.gz"
    with open(src, "rb") as f, gzip.open(dst, "wb", compresslevel=6) as g:
        while chunk := f.read(1 << 24):
            g.write(chunk)
    note = f"{dst.name}: {src.stat().st_size / 2**20:.1f} MiB of JSON, {dst.stat().st_size / 2**20:.1f} MiB gzipped"
    if dst.stat().st_size > TRACE_LIMIT:
        data = json.loads(src.read_text())
        events = data.get("traceEvents", [])
        data["traceEvents"] = [e for e in events if e.get("ph") == "M" or e.get("cat") in GPU_EVENT_CATS]
        with gzip.open(dst, "wt", compresslevel=9) as g:
            json.dump(data, g)
        note += (f"; over the return limit, so only GPU-side events kept ({len(data['traceEvents'])} of "
                 f"{len(events)}): {dst.stat().st_size / 2**20:.1f} MiB")
    print(note)
    with open(records, "a") as f:
        f.write(json.dumps({"kind": "trace", "name": best["name"], "status": "ok", "file": dst.name,
                            "source": str(src), "note": note}) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add")
    a.add_argument("records")
    a.add_argument("--kind", required=True, choices=("run", "bare", "calibrate", "pytest", "skipped"))
    a.add_argument("--name", required=True)
    a.add_argument("--run-dir")
    a.add_argument("--file")
    a.add_argument("--command", default="")
    a.add_argument("--rc", type=int)
    a.add_argument("--wall-s", type=float)
    a.add_argument("--limit-s", type=float)
    a.add_argument("--note", default="")
    t = sub.add_parser("trace")
    t.add_argument("records")
    t.add_argument("outdir")
    t.add_argument("--scale", default="3B")
    s = sub.add_parser("table")
    s.add_argument("records")
    u = sub.add_parser("unpack")
    u.add_argument("records")
    u.add_argument("dir")
    args = p.parse_args(argv)
    {"add": add, "trace": trace, "table": table, "unpack": unpack}[args.cmd](args)


if __name__ == "__main__":
    main()
