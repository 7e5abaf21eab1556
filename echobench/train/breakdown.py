"""Where one training step's time goes, and the MFU waterfall built from it.

A `--trace` run (`trace: true` in a matrix) traces a few steps after the measured ones with
torch.profiler. Right after, each rank turns the profiler's own events (`prof.events()`: ops with
their nesting, device kernels with their streams, all timestamped) into a breakdown of one
step on its busiest timeline:

- GPU runs: the device's kernels, memory copies and memsets on all its streams, plus the host's
  data-wait ranges (the device idles while the host waits for the loader).
- CPU runs: the main thread's op tree (a classified op claims its whole subtree; the catch-all
  "other compute" op keeps only the time its children leave over), plus the collectives that
  run on gloo's worker threads.

Parts are computed by a sweep over all span boundaries in the profiled window: each elementary
interval goes to the highest-priority category active in it (PRIORITY), and time with nothing
active is idle. So the parts add up to the window exactly, and overlapping communication counts
as exposed only where no compute, optimizer or memory copy ran beside it.

Kernel names are classified by their documented patterns (cuBLAS `nvjet` / `sm90_xmma_gemm`,
CUTLASS `...gemm...`, flash / cuDNN `sdpa` / mem-efficient `fmha` attention, `nccl` collectives,
`Memcpy` / `Memset`); a kernel launched inside `Optimizer.step` counts as optimizer whatever its
name (a compiled optimizer's Triton kernels say nothing of it).
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from rich.table import Table
from rich.text import Text

from echobench.records.atomic import write_json_atomic
from echobench.records.console import attention_text, esc, padding_text
from echobench.records.results import RECORD_FILE, Record, find_record_files, peak_notes
from echobench.records.run_figures import peak_fraction

CATEGORIES = ("gemm", "attention", "optimizer", "other_compute", "memcpy", "communication", "data_wait", "idle")
# Highest first: an interval where several are active goes to the first; idle is what is left.
PRIORITY = CATEGORIES[:-1]
COMPUTE = ("gemm", "attention", "optimizer", "other_compute", "memcpy")
LABELS = {
    "gemm": "matmul (GEMM)",
    "attention": "attention",
    "optimizer": "optimizer",
    "other_compute": "other compute (norms, element-wise, RoPE, softmax)",
    "memcpy": "memory copies",
    "communication": "communication (exposed)",
    "data_wait": "data wait",
    "idle": "idle (launch overhead, host syncs)",
}
RULE = ("each instant of the profiled window goes to the first category active in it, in the order "
        + " > ".join(PRIORITY) + "; instants with none are idle")
DATA_WAIT = "echobench.data_wait"  # the record_function around the loader's next() (bench.run_loop)
BREAKDOWN_FILE = "breakdown.json"
BREAKDOWN_SCHEMA = 1
TOP_NAMES = 5

# ---- names ----

_GEMM_OPS = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
    "aten::mv", "aten::addmv", "aten::dot", "aten::vdot", "aten::einsum", "aten::tensordot", "aten::_scaled_mm",
    "aten::_int_mm", "aten::_addmm_activation", "aten::convolution", "aten::_convolution", "aten::conv1d",
    "aten::conv2d", "aten::conv3d", "aten::mkldnn_convolution",
}
_ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_", "aten::_flash_attention_",
                  "aten::_efficient_attention_", "aten::_cudnn_attention", "flash_attn")
_COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous", "aten::_copy_from",
             "aten::_copy_from_and_resize", "fsdp::all_gather_copy_in", "fsdp::split_with_sizes_copy",
             "fsdp::chunk_cat", "torch.distributed.ddp.reducer::copy_bucket_to_grad"}
_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:", "record_param_comms")
_OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#", "aten::_foreach_", "aten::_fused_adam",
                       "aten::_fused_sgd")
# A compiled graph's call on CPU: inductor's fused C++ kernels run in it without ops of their own
# (its wrappers, "Torch-Compiled Region" and "CompiledFunction", are framework overhead: containers).
_COMPILED_GRAPH = "## Call CompiledFxGraph"

_ATTENTION_KERNEL = re.compile(r"flash|fmha|sdpa|attn|attention")
_GEMM_KERNEL = re.compile(r"gemm|nvjet|gemv|splitkreduce|matmul|^triton_tem_")
_OPTIMIZER_KERNEL = re.compile(r"multi_tensor_apply|adam")


def classify_op(name: str) -> str | None:
    """A host op or record_function name -> its category; None for a container (autograd nodes,
    module and FSDP ranges) whose children say what ran. Every other aten op is other compute."""
    if name == DATA_WAIT:
        return "data_wait"
    if name.startswith(_OPTIMIZER_PREFIXES):
        return "optimizer"
    if name.startswith(_COMM_PREFIXES):
        return "communication"
    if name in _COPY_OPS or name.startswith("FSDP::all_gather_copy_out"):
        return "memcpy"
    if name in _GEMM_OPS:
        return "gemm"
    if name.startswith(_ATTENTION_OPS):
        return "attention"
    if name.startswith(("aten::", "prims::", _COMPILED_GRAPH)):
        return "other_compute"
    return None


def classify_kernel(name: str) -> str:
    """A device activity name (kernel, Memcpy, Memset) -> its category."""
    n = name.lower()
    if n.startswith(("memcpy", "memset")):
        return "memcpy"
    if "nccl" in n:
        return "communication"
    # Inductor's pointwise / reduction kernels are named after the ops they fuse ("addmm" in an
    # epilogue, "attention" in a mask): never a GEMM. Its templates (triton_tem_) are.
    if n.startswith("triton_") and not n.startswith("triton_tem_"):
        return "other_compute"
    if _ATTENTION_KERNEL.search(n):
        return "attention"
    if _GEMM_KERNEL.search(n):
        return "gemm"
    if _OPTIMIZER_KERNEL.search(n):
        return "optimizer"
    return "other_compute"


def short_name(name: str, width: int = 80) -> str:
    """A kernel or op name without `void`, template and argument lists: what a table can show."""
    out, depth = [], 0
    for ch in name.removeprefix("void ").replace("(anonymous namespace)::", ""):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(ch)
    return ("".join(out).strip() or name)[:width]


# ---- spans from the profiler's events ----

def _is_step(event) -> bool:
    return event.name.startswith("ProfilerStep")


def _is_device(event) -> bool:
    return str(event.device_type) not in ("DeviceType.CPU", "cpu")


def _span(event) -> tuple[float, float]:
    return event.time_range.start, event.time_range.end


def cpu_spans(steps) -> list[tuple[float, float, str, str]]:
    """(start, end, category, name) of the main thread's ops under the ProfilerStep ranges. A
    classified op claims its whole subtree. An other-compute op keeps the time its children leave
    over, and its children are classified in turn. A container's own gaps go to its nearest
    other-compute ancestor, or stay idle without one."""
    spans = []
    stack = [(child, None) for step in steps for child in step.cpu_children]
    while stack:
        event, inherited = stack.pop()
        category = classify_op(event.name)
        if category not in (None, "other_compute"):
            spans.append((*_span(event), category, event.name))
            continue
        owner = ("other_compute", event.name) if category == "other_compute" else inherited
        children = sorted(event.cpu_children, key=lambda c: c.time_range.start)
        if owner is not None:
            t = event.time_range.start
            for child in children:
                if child.time_range.start > t:
                    spans.append((t, child.time_range.start, *owner))
                t = max(t, child.time_range.end)
            if event.time_range.end > t:
                spans.append((t, event.time_range.end, *owner))
        stack.extend((child, owner) for child in children)
    return spans


def _optimizer_ops(events) -> set:
    """Correlation ids of host ops that ran inside Optimizer.step (their kernels are optimizer)."""
    ids = set()
    for event in events:
        if _is_device(event) or event.is_async:
            continue
        parent = event
        while parent is not None:
            if parent.name.startswith("Optimizer.step#"):
                ids.add(event.id)
                break
            parent = parent.cpu_parent
    return ids


def device_spans(events) -> list[tuple[float, float, str, str]]:
    """(start, end, category, name) of every kernel, memcpy and memset on the device's streams."""
    events = list(events)
    optimizer_ops = _optimizer_ops(events)
    spans = []
    for event in events:
        if not _is_device(event) or event.is_user_annotation:
            continue  # gpu_user_annotation: a record_function's range drawn on the GPU, not work
        category = classify_kernel(event.name)
        # torch >= 2.13 links a kernel to its host op; torch 2.11 (the H200 image's) keeps only the
        # kernel's own correlation id, which its launch (cudaLaunchKernel, a host event under the op) has too.
        link = getattr(event, "linked_correlation_id", None)
        if category in ("other_compute", "gemm") and (event.id if link is None else link) in optimizer_ops:
            category = "optimizer"
        spans.append((*_span(event), category, event.name))
    return spans


def breakdown_from_events(events, rank: int = 0) -> dict:
    """One rank's breakdown from torch.profiler's events (`prof.events()`), per step in seconds.

    The window is the profiled steps (ProfilerStep ranges; on GPU extended to the end of the
    last device activity, which trails the host). Returns the seconds per step of each category
    (they sum to step_time_s), communication in total / exposed / overlapped, and the names that
    took most time in each category.
    """
    events = list(events)
    steps = sorted((e for e in events if _is_step(e) and not _is_device(e)), key=lambda e: e.time_range.start)
    if not steps:
        raise ValueError("no ProfilerStep ranges among the profiler's events: was prof.step() called each step?")
    main_thread = steps[0].thread
    on_device = any(_is_device(e) for e in events)
    if on_device:
        spans = device_spans(events)
        timeline = "GPU streams"
    else:
        spans = cpu_spans(steps)
        timeline = "main thread"
    for event in events:
        if _is_device(event):
            continue
        if on_device:
            # The host's loader ranges: the device idles meanwhile, once its queue has drained.
            # (Host-side collective ops only launch the NCCL kernels, which are the communication.)
            if event.name == DATA_WAIT and event.thread == main_thread:
                spans.append((*_span(event), "data_wait", event.name))
        elif (event.thread != main_thread or event.is_async) and classify_op(event.name) == "communication":
            # gloo runs collectives on its worker threads while the main thread waits on them.
            spans.append((*_span(event), "communication", event.name))
    start = steps[0].time_range.start
    end = max([steps[-1].time_range.end] + [s[1] for s in spans if on_device])
    seconds, by_name, comm_total = sweep(spans, start, end)
    n = len(steps)
    per_step = {c: seconds[c] / n / 1e6 for c in CATEGORIES}
    comm_total_s = comm_total / n / 1e6
    top = {}
    for category, names in by_name.items():
        ranked = sorted(names.items(), key=lambda kv: -kv[1])[:TOP_NAMES]
        top[category] = [[name, us / n / 1e6] for name, us in ranked if us > 0]
    return {
        "rank": rank,
        "timeline": timeline,
        "steps": n,
        "step_time_s": (end - start) / n / 1e6,
        "seconds": per_step,
        "communication": {"total_s": comm_total_s, "exposed_s": per_step["communication"],
                          "overlapped_s": comm_total_s - per_step["communication"]},
        "top": top,
    }


def sweep(spans, start: float, end: float):
    """Assigns each instant of [start, end] to the highest-priority active span (the innermost,
    i.e. latest started, within a category). Returns (time per category, time per category and
    short name, time with any communication active)."""
    rank = {c: i for i, c in enumerate(PRIORITY)}
    bounds = []
    for i, (s, e, category, _) in enumerate(spans):
        s, e = max(s, start), min(e, end)
        if e > s:
            bounds.append((s, 1, i))
            bounds.append((e, 0, i))  # ends sort before starts at the same instant
    bounds.sort()
    active = [dict() for _ in PRIORITY]
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    by_name: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    names: dict[int, str] = {}
    comm_total, t = 0.0, start
    comm = rank["communication"]

    def attribute(a: float, b: float) -> None:
        nonlocal comm_total
        if b <= a:
            return
        for level, spans_here in enumerate(active):
            if spans_here:
                owner = next(reversed(spans_here))
                category = PRIORITY[level]
                seconds[category] += b - a
                name = names.get(owner) or names.setdefault(owner, short_name(spans[owner][3]))
                by_name[category][name] += b - a
                break
        else:
            seconds["idle"] += b - a
        if active[comm]:
            comm_total += b - a

    for time_, is_start, i in bounds:
        attribute(t, time_)
        t = max(t, time_)
        level = rank[spans[i][2]]
        if is_start:
            active[level][i] = True
        else:
            active[level].pop(i, None)
    attribute(t, end)
    return seconds, by_name, comm_total


# ---- over ranks: the record's summary and breakdown.json ----

def busiest(ranks: list[dict]) -> dict:
    """The rank whose device computed longest per step (the one the others wait for)."""
    return max(ranks, key=lambda b: (sum(b["seconds"][c] for c in COMPUTE), -b["rank"]))


def rank_breakdown(prof, rank: int) -> dict:
    """This rank's breakdown from a finished torch.profiler; a failure to compute it is reported in
    it (the run's measurements stand without it)."""
    try:
        return breakdown_from_events(prof.events(), rank)
    except Exception as exc:  # noqa: BLE001 - never lose a measured run to its breakdown
        return {"rank": rank, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}


def summary(ranks: list[dict]) -> dict:
    """What result.json keeps: the busiest rank's parts as fractions of its step (or the error)."""
    ok = [b for b in ranks if b and "error" not in b]
    if not ok:
        errors = [f"rank {b['rank']}: {b['error']}" for b in ranks if b and "error" in b]
        return {"error": "; ".join(errors) or "no rank computed a breakdown"}
    b = busiest(ok)
    total = sum(b["seconds"].values()) or 1.0
    return {
        "file": BREAKDOWN_FILE,
        "rank": b["rank"],
        "timeline": b["timeline"],
        "profiled_steps": b["steps"],
        "step_time_s": b["step_time_s"],
        "fractions": {c: b["seconds"][c] / total for c in CATEGORIES},
        "communication_total_frac": b["communication"]["total_s"] / total,
        "communication_overlapped_frac": b["communication"]["overlapped_s"] / total,
    }


def write_breakdown(out_dir: Path, record: Record, ranks: list[dict]) -> Path:
    path = Path(out_dir) / BREAKDOWN_FILE
    write_json_atomic(path, {
        "schema_version": BREAKDOWN_SCHEMA, "run_id": record.run_id, "rule": RULE,
        "profiled_steps": record.profiled_steps,
        "busiest_rank": record.breakdown["rank"],  # summary() chose it
        "labels": LABELS, "ranks": ranks,
    })
    return path


def read_breakdown(run_dir: Path) -> dict:
    path = Path(run_dir) / BREAKDOWN_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: unreadable breakdown ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema_version") != BREAKDOWN_SCHEMA or not data.get("ranks"):
        raise ValueError(f"{path}: not a breakdown this echobench reads (schema_version {BREAKDOWN_SCHEMA})")
    return data


def read_profiled_run(run_dir: Path) -> tuple[Record, dict]:
    """A profiled run's record and breakdown; else ValueError, one line saying what is missing and what to do."""
    if run_dir.name == RECORD_FILE and run_dir.is_file():  # the record itself: its run's directory
        run_dir = run_dir.parent
    if not run_dir.exists():
        raise ValueError(f"{run_dir}: no such file or directory: give a run's directory (RUN_DIR/{RECORD_FILE})")
    if not (run_dir / RECORD_FILE).is_file():
        inner = find_record_files([run_dir]) if run_dir.is_dir() else []  # current records, not attempts/
        raise ValueError(f"{run_dir}: no {RECORD_FILE}" + (f"; give one run's directory, e.g. {inner[0].parent}"
                                                          if inner else ": not a run directory"))
    record = Record.load(run_dir / RECORD_FILE)
    run_id = record.run_id
    if record.status != "ok":
        raise ValueError(f"{run_id}: status {record.status}, nothing to explain "
                         f"({record.error or 'no error text'})")
    if "error" in (record.breakdown or {}):
        raise ValueError(f"{run_id}: the profiler breakdown failed during the run: {record.breakdown['error']}")
    if not (run_dir / BREAKDOWN_FILE).exists():
        raise ValueError(f"{run_dir}: no breakdown.json: the run was not profiled; rerun it with --trace "
                         "(in a matrix: trace: true)")
    return record, read_breakdown(run_dir)


# ---- the MFU waterfall ----

def waterfall(record: Record) -> list[dict] | None:
    """From 100% of the peak down to the run's MFU, in percentage points of the peak.

    C = ceiling / peak (1 without a calibration). If every instant of the step ran matmuls at the
    calibrated ceiling, MFU would be C; each other part of the step costs C x its fraction. Padding
    is a part of the matmul time: with p = padded_flops_frac, (padded - hardware FLOPs) / padded
    FLOPs over the measured window, the share of the matmul FLOPs executed that went to padded
    tokens, the matmuls spent p of their time (GEMM + attention fraction) on padding (padded rows run
    in the same kernels as real ones: their time goes with their FLOPs), which costs
    C x (GEMM + attention fraction) x p. What is left between C x (GEMM + attention fraction) x
    (1 - p) and the achieved MFU is the matmuls' own shortfall from the ceiling, with whatever the
    profiled steps differ from the measured ones. A record without padded FLOPs (written before they
    were counted) gets a padding step of unknown size (pp None), its padding left in the shortfall.
    Returns None without a breakdown or an MFU.
    """
    f = (record.breakdown or {}).get("fractions")
    mfu, peak = record.mfu, record.peak_tflops
    if not f or mfu is None or not peak:
        return None
    ceiling = record.ceiling_tflops
    c = peak_fraction(ceiling, peak) if ceiling else 1.0
    source = record.peak_source or ""
    peak_label = ("peak (calibrated GEMM rate)" if source.startswith("calibrated")
                  else "given peak (flag / matrix)" if source == "flag" else "datasheet peak")
    steps = [{"label": peak_label, "short": "peak", "kind": "absolute", "pp": 100.0}]

    def lose(label: str, short: str, pp: float) -> None:
        steps.append({"label": label, "short": short, "kind": "relative", "pp": 0.0 - pp})

    lose("calibrated GEMM ceiling" if ceiling else "calibrated GEMM ceiling (none: taken as the peak)",
         "GEMM ceiling", 100 * (1 - c))
    lose("non-GEMM compute (other compute, optimizer)", "non-GEMM compute",
         100 * c * (f["other_compute"] + f["optimizer"]))
    lose("memory copies", "memory copies", 100 * c * f["memcpy"])
    lose("exposed communication", "exposed comm", 100 * c * f["communication"])
    lose("idle and launch overhead", "idle / launch", 100 * c * f["idle"])
    lose("data wait", "data wait", 100 * c * f["data_wait"])
    matmul, p = 100 * c * (f["gemm"] + f["attention"]), record.padded_flops_frac
    if p is None:
        steps.append({"label": "padding (unknown: the record has no padded FLOPs; it stays in the matmul shortfall)",
                      "short": "padding", "kind": "relative", "pp": None})
        lose("matmuls below the ceiling, padding (unknown), other/unexplained", "matmul shortfall / other",
             matmul - 100 * mfu)
    else:
        lose("padding (matmul time on padded tokens)", "padding", matmul * p)
        lose("matmuls below the ceiling, other/unexplained", "matmul shortfall / other", matmul * (1 - p) - 100 * mfu)
    steps.append({"label": "achieved MFU", "short": "achieved MFU", "kind": "total", "pp": 100 * mfu})
    return steps


def explain_report(record: Record, bd: dict, steps: list[dict] | None) -> list:
    """`echobench explain`: the busiest rank's parts of the step, every rank's summary, and the MFU
    waterfall, as rich renderables for the terminal (outside text wrapped in Text: printed verbatim)."""
    run_id = record.run_id
    rank = next(r for r in bd["ranks"] if r.get("rank") == bd["busiest_rank"])
    step_s = rank["step_time_s"]
    t = Table(title=esc(f"Where the time goes: {run_id} (rank {rank['rank']}, {rank['timeline']}, mean of "
                        f"{rank['steps']} profiled steps)"))
    for col in ("part", "ms / step", "% of step", "biggest items (ms / step)"):
        t.add_column(col, justify="right" if col in ("ms / step", "% of step") else "left",
                     overflow="fold" if col.startswith("biggest") else "ellipsis")
    for c in CATEGORIES:
        top = "; ".join(f"{name} {s * 1e3:.3g}" for name, s in rank["top"].get(c, [])[:3])
        t.add_row(Text(LABELS[c]), f"{rank['seconds'][c] * 1e3:.3f}", f"{rank['seconds'][c] / step_s:.1%}", Text(top))
    comm = rank["communication"]
    t.add_row(Text("communication overlapped with compute (not in the sum)", style="dim"),
              f"{comm['overlapped_s'] * 1e3:.3f}", f"{comm['overlapped_s'] / step_s:.1%}", "")
    padding = record.padded_flops_frac
    matmul_s = rank["seconds"]["gemm"] + rank["seconds"]["attention"]
    t.add_row(Text("padded tokens, within matmul and attention (not in the sum)", style="dim"),
              *((f"{matmul_s * padding * 1e3:.3f}", f"{matmul_s * padding / step_s:.1%}",
                 Text(padding_text(record))) if padding is not None
                else ("unknown", "unknown", Text("the record has no padded FLOPs"))))
    t.add_row(Text("profiled step", style="bold"), f"{step_s * 1e3:.3f}", "100%",
              Text(f"parts sum to {sum(rank['seconds'].values()) * 1e3:.3f} ms"))
    out = [t]
    if len(bd["ranks"]) > 1:
        per = Table(title="per rank (the busiest, whose device computed longest, is explained above)")
        for col in ("rank", "step ms", "compute %", "exposed comm %", "overlapped comm %", "idle %", "data wait %"):
            per.add_column(col, justify="right")
        for r in bd["ranks"]:
            if "error" in r:
                per.add_row(Text(str(r["rank"])), Text(r["error"]), "", "", "", "", "")
                continue
            s, step = r["seconds"], r["step_time_s"]
            per.add_row(Text(str(r["rank"])), f"{step * 1e3:.3f}", f"{sum(s[c] for c in COMPUTE) / step:.1%}",
                        f"{s['communication'] / step:.1%}", f"{r['communication']['overlapped_s'] / step:.1%}",
                        f"{s['idle'] / step:.1%}", f"{s['data_wait'] / step:.1%}")
        out.append(per)
    measured = record.step_time_mean_s or record.step_time_s
    out.append(Text(f"measured step (mean over the window, unprofiled): {measured * 1e3:.3f} ms; the profiled steps "
                    f"took {step_s / measured - 1:+.1%} (profiler overhead, noise, and their own attention paths). "
                    f"Rule: {RULE}."))
    out.append(Text(f"attention paths of the measured window (micro-batches, share of attention FLOPs): "
                    f"{attention_text(record)}"))
    if steps:
        w = Table(title=esc(f"MFU waterfall: {run_id} (percentage points of the {record.peak_tflops:.4g} "
                            f"TFLOP/s peak)"))
        for col in ("step", "points", "MFU after (%)"):
            w.add_column(col, justify="left" if col == "step" else "right")
        level = 0.0
        for s in steps:
            if s["pp"] is None:  # a size the record cannot give (padding in an older record)
                w.add_row(Text(s["label"]), "unknown", f"{level:.2f}")
                continue
            level = s["pp"] if s["kind"] != "relative" else level + s["pp"]
            w.add_row(Text(s["label"], style="bold" if s["kind"] != "relative" else ""),
                      f"{s['pp']:.2f}" if s["kind"] != "relative" else f"{s['pp']:+.2f}", f"{level:.2f}")
        out += [w, Text("Each loss after the ceiling is the ceiling's share x that part's fraction of the profiled "
                        "step; padding is the matmul (GEMM + attention) fraction x the padded share of the matmul "
                        "FLOPs executed; the last loss is what remains to the measured MFU (docs/explanation/mfu.md "
                        "and time.md).")]
    return out + [Text(f"note: {note}") for note in peak_notes(record)]
