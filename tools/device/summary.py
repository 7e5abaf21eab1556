"""The bookkeeping of tools/device/check.py: one JSON-lines file of everything measured, the
profiler trace packed to fit what a device call returns, and the summary (rewritten after every step).

  python3 -m tools.device.summary table RECORDS       # markdown: the counts, every step, the comparisons
  python3 -m tools.device.summary unpack RECORDS DIR  # DIR/NAME/result.json (+ breakdown.json, plan.json)
                                                      # per run, for `echobench report DIR` / `explain` and
                                                      # for committing
  python3 -m tools.device.summary verify RECORDS [--expect-skip]  # exit 1 unless the pass is sound (the twin's test)

Every line is {"kind", "name", "command", "rc", "wall_s", "limit_s", "status", "outcome", ...}:
outcome is passed, skipped or failed; a run's line holds its result.json as "record", its
breakdown.json as "breakdown" and the memory estimate `echobench plan` prints for those settings
(echobench.predict.memory.estimate_memory) as "memory_estimate_gib"; a bare-loop or calibration line holds
that step's JSON as "result"; a test line its counts.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from pathlib import Path

import yaml

TRACE_LIMIT = 15 * 2**20  # a device call returns files of 16 MiB at most
GPU_EVENT_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation", "user_annotation"}


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def memory_estimate(config: dict) -> dict | None:
    from echobench.records.config import RunConfig
    from echobench.predict.memory import estimate_memory

    try:
        return estimate_memory(RunConfig.from_dict(config)).as_gib()
    except (TypeError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)")


def pytest_counts(log: Path | None) -> dict[str, int]:
    """pytest's closing line, e.g. '3 passed, 380 deselected, 6 skipped in 9.1s' -> counts."""
    if log is None or not Path(log).exists():
        return {}
    lines = [ln for ln in Path(log).read_text().splitlines() if PYTEST_COUNT.search(ln)]
    if not lines:
        return {}
    return {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in PYTEST_COUNT.findall(lines[-1])}


def outcome(line: dict) -> str:
    """passed, skipped or failed: what the summary counts. Tests that all skipped did not pass."""
    if line["kind"] == "skipped":
        return "skipped"
    if line["kind"] == "run":
        return "passed" if line.get("status") == "ok" else "failed"
    if line["kind"] == "pytest":
        c = line.get("counts") or {}
        if line.get("rc") not in (0, 5) or c.get("failed") or c.get("error"):
            return "failed"
        return "passed" if c.get("passed") else "skipped"
    return "passed" if line.get("rc") == 0 and line.get("status") not in ("no-result",) else "failed"


def add_line(records: Path, kind: str, name: str, command: str = "", rc: int | None = None,
             wall_s: float | None = None, limit_s: float | None = None, note: str = "",
             run_dir: Path | None = None, file: Path | None = None, log: Path | None = None) -> dict:
    """Appends one step's line (see the module's docstring) and returns it."""
    line = {"kind": kind, "name": name, "command": command, "rc": rc, "wall_s": wall_s, "limit_s": limit_s}
    if note:
        line["note"] = note
    if log is not None:
        line["log"] = f"logs/{Path(log).name}"
    if kind == "run":
        path = Path(run_dir) / "result.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            line.update(status="no-record", error=f"{path}: {exc}")
        else:
            line.update(status=record.get("status"), record=record,
                        memory_estimate_gib=memory_estimate(record.get("config") or {}))
            try:
                line["breakdown"] = json.loads((Path(run_dir) / "breakdown.json").read_text())
            except (OSError, ValueError):
                pass  # not profiled, or its breakdown failed (the record says why)
    elif file is not None:
        try:
            text = Path(file).read_text()
            line["result"] = yaml.safe_load(text) if Path(file).suffix == ".yaml" else json.loads(text)
            line["status"] = "ok" if rc == 0 else "failed"
        except (OSError, ValueError, yaml.YAMLError) as exc:
            line.update(status="no-result", error=f"{file}: {exc}")
    elif kind == "pytest":  # pytest's exit status; 124: the limit stopped it
        line["counts"] = counts = pytest_counts(log)
        line["status"] = {0: "ok", 5: "none collected", 124: "timeout"}.get(rc, "failed")
        if not counts.get("passed") and rc in (0, 5):
            line["note"] = f"none ran: {', '.join(f'{v} {k}' for k, v in counts.items()) or 'none collected'}"
    else:
        line["status"] = "skipped" if kind == "skipped" else ("ok" if rc == 0 else "failed")
    line["outcome"] = outcome(line)
    with open(records, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")
    return line


# ---- the closing summary ----

def runs_ok(lines: list[dict]) -> list[dict]:
    return [ln for ln in lines if ln["kind"] == "run" and ln.get("status") == "ok"]


def pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def num(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def allocated_peak(record: dict) -> float | None:
    """The allocator's allocated peak, which the estimate's tensors model (GPU only: on a CPU the
    record has the process's RSS, libraries and all, which no estimate models)."""
    return record.get("peak_mem_allocated_gib")


def counts_line(lines: list[dict]) -> list[str]:
    """'N steps: P passed, S skipped, F failed', then each step that did not pass and why."""
    steps = [ln for ln in lines if ln["kind"] != "trace"]
    tally = {k: sum(1 for ln in steps if ln.get("outcome", outcome(ln)) == k) for k in ("passed", "skipped", "failed")}
    out = [f"{len(steps)} steps: {tally['passed']} passed, {tally['skipped']} skipped, {tally['failed']} failed", ""]
    for ln in steps:
        state = ln.get("outcome", outcome(ln))
        if state != "passed":
            why = (ln.get("record") or {}).get("error") or ln.get("error") or ln.get("note") or ln.get("status") or ""
            out.append(f"- {ln['name']}: {state}" + (f": {why[:200]}" if why else ""))
    return out


def steps_table(lines: list[dict]) -> list[str]:
    out = ["| step | kind | status | wall s | limit s | step s | samples/s | TFLOP/s | MFU | "
           "MFU vs GEMM ceiling | peak mem GiB | peak alloc. GiB | est. tensors GiB | est./alloc. |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ln in (x for x in lines if x["kind"] != "trace"):
        r = ln.get("record") or {}
        res = ln.get("result") if isinstance(ln.get("result"), dict) else {}
        parts = ln.get("memory_estimate_gib") or {}
        est = parts.get("tensors", parts.get("total"))
        alloc = allocated_peak(r) if r else res.get("peak_mem_allocated_gib")
        peak = r.get("peak_mem_gib") if r else res.get("peak_mem_gib")  # GPU: reserved; CPU: RSS
        ratio = est / alloc if est and alloc else None
        status = ln.get("outcome", outcome(ln))
        if ln.get("status") not in ("ok", "failed", "skipped", None):
            status += f" ({ln['status']})"
        why = r.get("error") or ln.get("error") or ln.get("note")
        if status != "passed" and why:
            status += ": " + why[:90].replace("|", "/")
        step = r.get("step_time_s", res.get("step_time_s"))
        out.append(f"| {ln['name']} | {ln['kind']} | {status} | {num(ln.get('wall_s'), '.0f')} | "
                   f"{num(ln.get('limit_s'), '.0f')} | {num(step, '.4f')} | {num(r.get('samples_per_s'), '.2f')} | "
                   f"{num(r.get('tflops_per_gpu'), '.4g')} | {pct(r.get('mfu'))} | {pct(r.get('mfu_vs_ceiling'))} | "
                   f"{num(peak, '.1f')} | {num(alloc, '.1f')} | {num(est, '.1f')} | {num(ratio, '.2f')} |")
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
        shapes = cal.get("shapes") or []  # a sweep's record; an older one timed only the size^3 square
        best = next((s for s in shapes if s["name"] == cal.get("best_shape")), None)
        where = (f"{cal['dtype']} {best['name']} {best['m']}x{best['n']}x{best['k']}, best of {len(shapes)} shapes"
                 if best else f"{cal['dtype']} {cal['size']}^3")
        out.append(f"- GEMM ceiling ({where}, median of {cal['iters']}): "
                   f"{cal['tflops']:.4g} TFLOP/s (min {cal['tflops_min']:.4g}, max {cal['tflops_max']:.4g})"
                   + (f", {cal['tflops'] / sheet:.1%} of the {sheet:g} datasheet peak" if sheet else ""))

    prof = next((ln["result"] for ln in lines if ln["kind"] == "profile" and ln.get("result")), None)
    if prof:
        best = max(prof.get("gemm") or [{}], key=lambda g: g.get("tflops", 0))
        att = max(prof.get("attention") or [{}], key=lambda a: a.get("tflops", 0))
        mem = max(prof.get("memory") or [{}], key=lambda m: m.get("gbps", 0))
        out.append(f"- measured profile ({len(prof.get('gemm') or [])} GEMM shapes): best GEMM {best.get('tflops', 0):.4g} "
                   f"TFLOP/s ({best.get('name')}), best attention {att.get('tflops', 0):.4g} TFLOP/s ({att.get('name')}), "
                   f"memory {mem.get('gbps', 0):.4g} GB/s ({mem.get('op')}); profile.yaml in logs.tar.gz")
    out += window_lines(runs)
    probe = next((ln["result"] for ln in lines if ln["kind"] == "probe" and ln.get("result")), None)
    if probe:
        out += probe_lines(probe)

    def compare(label, x, y):
        rx, ry = x["record"], y["record"]
        out.append(f"- {label}: {y['name']} vs {x['name']}: step {ry['step_time_s']:.4f} s vs "
                   f"{rx['step_time_s']:.4f} s = {rx['step_time_s'] / ry['step_time_s']:.2f}x speed-up; "
                   f"MFU {pct(ry['mfu'])} vs {pct(rx['mfu'])}; peak mem {ry['peak_mem_gib']:.1f} vs "
                   f"{rx['peak_mem_gib']:.1f} GiB; wall {y['wall_s']:.0f} vs {x['wall_s']:.0f} s")

    def speed(label, field, a, b, same):
        for x, y in pairs(runs, field, a, b, same):
            compare(label, x, y)

    # A step NAME-masked is step NAME with cfg_drop_attention masked (device_check.steps).
    by_name = {x["name"]: x for x in runs}
    for name, x in by_name.items():
        if name.endswith("-masked") and (y := by_name.get(name.removesuffix("-masked"))):
            compare("dropped conditioning unmasked (split) vs masked", x, y)

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
    mem = [(x["name"], x["memory_estimate_gib"].get("tensors", x["memory_estimate_gib"]["total"]),
            allocated_peak(x["record"])) for x in runs
           if (x.get("memory_estimate_gib") or {}).get("total") and allocated_peak(x["record"])]
    if mem:
        ratios = [e / p for _, e, p in mem]
        out.append(f"- memory estimate (tensors: without context, workspaces and fragmentation) / measured "
                   f"allocated peak: median {statistics.median(ratios):.2f}, "
                   f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(mem)} runs")
    for x in runs:  # a published row's slice: its MFU under the row's own convention beside the published
        card = x["record"].get("card") or {}
        pub = card.get("published") or {}
        if card.get("row_mfu") is not None and pub.get("mfu"):
            out.append(f"- published row {x['name']} ({card.get('label')}): MFU {pct(card['row_mfu'])} under the row's "
                       f"convention vs {pct(pub['mfu'])} published ({card['row_mfu'] / pub['mfu']:.0%} of it); "
                       f"tokens/s per GPU {card.get('tokens_per_s_per_gpu') or 0:.0f} vs "
                       f"{pub.get('tokens_per_s_per_gpu') or 0:.0f}; step {x['record']['step_time_s']:.3f} s")
    for t in (ln for ln in lines if ln["kind"] == "trace"):
        out.append(f"- profiler trace of {t['name']}: {t.get('note', '')}")
    return out


def window_lines(runs: list[dict]) -> list[str]:
    """Per run: what its measured window ran (the attention paths and their FLOP shares, the attention
    kernels of each warm-up variant) and whether anything compiled in it."""
    out = []
    for x in runs:
        r = x["record"]
        shares = r.get("attention_flop_shares") or {}
        paths = "; ".join(f"{part} " + ", ".join(f"{path} {n}" + (f" ({shares[part][path]:.0%})"
                                                                  if path in shares.get(part, {}) else "")
                                                 for path, n in counts.items())
                          for part, counts in (r.get("attention_paths") or {}).items())
        kernels = "; ".join(f"{variant}: {', '.join(list(names)[:3]) or 'none seen'}"
                            for variant, names in (r.get("attention_kernels") or {}).items())
        out.append(f"- {x['name']}: micro-batches per attention path (share of attention FLOPs): {paths or '-'}; "
                   f"compiles in window {r.get('compiles_in_window')}, windows measured again "
                   f"{len(r.get('window_restarts') or [])}" + (f"; attention kernels: {kernels}" if kernels else ""))
    return out


def probe_lines(probe: dict) -> list[str]:
    """The kernel probe's results (tools/device/kernel_probe.py), a line each; a failed one says why."""
    res, out = probe.get("results", {}), []
    where = f"{probe.get('scale')} mb {probe.get('micro_batch')} {probe.get('dtype')}, cuDNN {probe.get('cudnn')}"
    for name, r in res.items():
        if "error" in r:
            out.append(f"- probe {name} ({where}): failed: {r['error']}")
        elif name == "sdpa_choice":
            out.append(f"- SDPA's choice, predicted by torch._fused_sdp_choice ({where}): DiT no mask {r['dit']}, "
                       f"dense mask {r['dit_dense_mask']}, speaker {r['speaker_encoder']}")
        elif name == "attention":
            paths = ", ".join(f"{k} {v['tflops']:.4g} TFLOP/s" if "tflops" in v else f"{k} cannot run"
                              for k, v in r.items() if isinstance(v, dict))
            out.append(f"- DiT attention forward + backward ({where}): {paths}")
        elif name == "dit_block":
            for path, row in r.items():
                if isinstance(row, dict):
                    out.append(f"- one DiT block forward + backward, attention {path} ({where}): eager "
                               f"{row['eager_ms']} ms, compiled {row['compiled_ms']} ms ({row['speedup']}x; compile "
                               f"{row['compile_s']} s)")
        elif name == "memory_bound":
            out.append(f"- memory-bound kernels at the DiT's activation shape ({where}): "
                       + ", ".join(f"{k} {v['gb_per_s']} GB/s" + (f" (one call {v['call_gb_per_s']} GB/s)"
                                                                     if "call_gb_per_s" in v else "")
                                   for k, v in r.items() if isinstance(v, dict)))
        elif name == "adamw":
            out.append(f"- AdamW step + clipping as the runs take it over {r['params']:,} parameters "
                       f"({'fused, clip through grad_scale' if r['fused'] else 'foreach'}, {r['bytes_per_param']} B "
                       f"per parameter): {r['ms']} ms, {r['gb_per_s']} GB/s")
    return out


def summary_text(lines: list[dict], env: str = "", report_table: str | None = None, wall_s: float | None = None) -> str:
    head = [ln for ln in env.splitlines() if ln.startswith(("date:", "command:", "host:", "git:", "knobs:",
                                                            "echobench commit", "name,", "NVIDIA", "python "))]
    head += [ln for ln in env.splitlines() if re.match(r"^(torch|megatron-core|torchao|transformers|triton) ", ln)]
    parts = [f"# echobench device check{': ' + head[0].removeprefix('date: ') if head else ''}", "", "```",
             *head, *([f"wall time so far: {wall_s:.0f} s"] if wall_s is not None else []), "```", "",
             "## Outcome", "", *counts_line(lines), "", "## Steps", "", *steps_table(lines), "",
             "## Comparisons", "", *(comparisons(lines) or ["- none yet: too few successful runs"])]
    if report_table is not None:
        parts += ["", "## echobench report --table md", "", report_table]
    return "\n".join(parts) + "\n"


def write_summary(records: Path, dest: Path, env: Path | None = None, report_table: Path | None = None,
                  wall_s: float | None = None) -> None:
    """summary.md from the records so far, replaced atomically (a kill leaves the last whole one)."""
    env_text = env.read_text() if env is not None and env.exists() else ""
    table_text = report_table.read_text() if report_table is not None and report_table.exists() else None
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(summary_text(read_lines(records), env_text, table_text, wall_s))
    tmp.replace(dest)


def table(args) -> None:
    print(summary_text(read_lines(Path(args.records))), end="")


def unpack(args) -> None:
    """Each run line back into a run directory: result.json, breakdown.json where the run was
    profiled (`echobench explain DIR/NAME`), and plan.json with the estimate's total (where
    `echobench report` reads memory_estimate_gib beside a record)."""
    root = Path(args.dir)
    n = 0
    for ln in read_lines(Path(args.records)):
        if ln["kind"] != "run" or not ln.get("record"):
            continue
        run_dir = root / ln["name"]
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "result.json").write_text(json.dumps(ln["record"], indent=2) + "\n")
        if ln.get("breakdown"):
            (run_dir / "breakdown.json").write_text(json.dumps(ln["breakdown"], indent=2) + "\n")
        est = ln.get("memory_estimate_gib") or {}
        if est.get("total") is not None:
            plan = {"memory_estimate_gib": est["total"], "memory_estimate_parts_gib": est, "command": ln["command"]}
            (run_dir / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
        n += 1
    print(f"{n} run directories under {root}")


def verify_problems(lines: list[dict], expect_skip: bool = False) -> list[str]:
    """What makes a pass unsound: carried wheels that did not install, tests that did not collect or
    failed, a report that failed, no summary of a step; with expect_skip (a rehearsal with a scaled
    deadline), no step skipped for time."""
    by_name = {ln["name"]: ln for ln in lines}
    problems = []
    wheels = by_name.get("wheels")
    if wheels is None or wheels.get("outcome") != "passed":
        problems.append(f"carried wheels: {(wheels or {}).get('note', 'no wheels step')}")
    tests = [ln for ln in lines if ln["kind"] == "pytest"]
    for t in tests:
        if t.get("outcome") == "failed":
            problems.append(f"{t['name']}: exit {t.get('rc')}, {t.get('counts') or 'no counts'} ({t.get('log')})")
    for ln in lines:
        record = ln.get("record") or {}
        if ln["kind"] == "run" and (record.get("compiles_in_window") or record.get("window_restarts")):
            problems.append(f"{ln['name']}: torch compiled inside a measured window ({record.get('compiles_in_window')} "
                            f"in the last, {len(record.get('window_restarts') or [])} window(s) measured again): "
                            "warm-up missed a variant")
    report = by_name.get("report")
    if report is None or report.get("outcome") != "passed":
        problems.append(f"report: {(report or {}).get('note') or 'did not run or failed'}")
    if expect_skip and not any(ln["kind"] == "skipped" and str(ln.get("note", "")).startswith("time:") for ln in lines):
        problems.append("no step was skipped for time: the deadline was not exercised")
    return problems


def verify(args) -> int:
    problems = verify_problems(read_lines(Path(args.records)), args.expect_skip)
    for p in problems:
        print(f"device check: {p}", file=sys.stderr)
    if not problems:
        print("device check: sound (wheels installed, tests collected, report written"
              + (", deadline exercised)" if args.expect_skip else ")"))
    return 1 if problems else 0


# ---- the profiler trace ----

def pack_trace(records: Path, outdir: Path, scale: str = "3B") -> str:
    """Gzips the chrome trace of the best run of `scale` (by MFU) that has one, replacing an earlier
    pick; over the return limit it keeps the GPU-side events only (kernels, copies, step
    annotations) and says so."""
    lines = read_lines(records)
    runs = [x for x in runs_ok(lines) if x["record"].get("profile_traces")
            and all(t and Path(t).exists() for t in x["record"]["profile_traces"][:1])]
    chosen = [x for x in runs if x["record"]["scale"] == scale] or runs
    if not chosen:
        return "no profiled run succeeded: no trace"
    best = max(chosen, key=lambda x: x["record"]["mfu"])
    src = Path(best["record"]["profile_traces"][0])
    dst = Path(outdir) / f"trace-{best['name']}.json.gz"
    for old in Path(outdir).glob("trace-*.json.gz"):
        old.unlink()
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
    kept = [ln for ln in lines if ln["kind"] != "trace"]
    kept.append({"kind": "trace", "name": best["name"], "status": "ok", "outcome": "passed", "file": dst.name,
                 "source": str(src), "note": note})
    tmp = Path(records).with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(ln, default=str) + "\n" for ln in kept))
    tmp.replace(records)
    return note


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("table")
    s.add_argument("records")
    u = sub.add_parser("unpack")
    u.add_argument("records")
    u.add_argument("dir")
    v = sub.add_parser("verify")
    v.add_argument("records")
    v.add_argument("--expect-skip", action="store_true", help="a step must have been skipped for time")
    args = p.parse_args(argv)
    return {"table": table, "unpack": unpack, "verify": verify}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
