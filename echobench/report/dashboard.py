"""The HTML dashboard: one self-contained file (plotly.js inlined once, no CDN) from stored records.

The page answers first: the best MFU per scale and node count, MFU by configuration and node count
(failed runs shown by their status, never as 0), the reference workloads (card runs of published
rows held against them: reference_section) and the configurations' bars at each node count;
then the notes and the provenance (folded), the figures, the failures and the table of runs (its
key columns shown, the rest behind a box, a CSV link). Values that cannot be, or should not be
without a second look (echobench.report.checks), are flagged with their reason wherever shown.

The per-configuration views (MFU, throughput, scaling, best MFU) show the median over a
configuration's repeats, MFU with its min-max; the step-time and memory views and the table of
runs show every run. Notes flag what a bare MFU would hide: a calibrated denominator, fp32 / fp8
runs against a bf16 peak (fp8 rows also show MFU against the fp8 peak), allocator retries.

Every figure is drawn per scale, in its own element tagged with `data-scale`, so the page's scale
filter only shows and hides elements. Strings from records reach the page through jinja2's
autoescaping, or, inside figures, HTML-escaped (plotly renders a subset of HTML in its labels).
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from datetime import datetime, timezone
from importlib import resources
from urllib.parse import quote

import jinja2
import pandas as pd
from plotly.offline import get_plotlyjs

from echobench.report.checks import Flag, run_flags
from echobench.report.data import (CPU_MEMORY_CAVEAT, MEMORY_ESTIMATE_ERROR, ReportInput, flagged, scale_order,
                                   varying_keys)
from echobench.report.figures import Figures, numeric
from echobench.report.plotting import figure_html, panel
from echobench.report.reference_section import reference_section
from echobench.report.tables import fmt_number
from echobench.report.time_breakdown import time_section
from echobench.report.tune_section import tune_section
from echobench.records.states import RunState

FLOP_CONVENTION = (
    "Model FLOPs of one training sample: every matmul of the trainable parts (DiT, speaker encoder, "
    "text projection) forward and backward, plus the forward of the frozen text encoder (forward and "
    "backward when a run trains the encoder), at 2 FLOPs "
    "per multiply-add; attention scores and values counted in full (bidirectional); element-wise work "
    "not counted; recompute not counted (that is HFU). Counted on the real (unpadded) lengths; what the "
    "padded shapes cost on top (padded FLOPs: the runs table, the waterfall's padding step) is hardware "
    "work, never model FLOPs. "
    "Throughput is over the whole measured window: samples/s = measured samples / total measured time "
    "(each step at its slowest rank); MFU = model FLOPs of the measured samples / (total measured time x GPUs x peak). "
    "A configuration's figure is the median over its runs at that node count (repeats, and runs of other "
    "sweeps that differ only in how long or how often they measured: steps, warm-up, seed)."
)
# The gist of FLOP_CONVENTION, shown where the full text is folded away.
FLOP_CONVENTION_SHORT = (
    "MFU = model FLOPs of the measured samples / (measured time x GPUs x peak); model FLOPs are the matmuls of "
    "the trained parts forward and backward (2 per multiply-add) on the unpadded lengths, recompute not counted.")
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "driver", "transformers", "megatron_core", "transformer_engine",
                "torchao", "container", "git_commit")
def _unique(values) -> list[str]:
    return sorted({str(v) for v in values if v is not None and str(v) != "" and not pd.isna(v)})


def header_facts(data: ReportInput) -> dict:
    records = data.records
    envs = [r.env for r in records]
    times = _unique(e.time for e in envs)
    devices = Counter(e.device_name or "unknown" for e in envs)
    peaks = Counter((r.peak_tflops, r.peak_precision or "", r.peak_source, r.env.device_name)
                    for r in records if r.peak_tflops is not None)
    ceilings = _unique(f"{r.ceiling_tflops:.4g}" for r in records if r.ceiling_tflops)
    versions = {k: ", ".join(_unique(getattr(e, k) for e in envs)) or "-" for k in VERSION_KEYS}
    # Where the runs ran and over which fabric settings (the records' scheduler and NCCL / FI_ variables).
    versions["cluster"] = ", ".join(_unique("/".join(filter(None, ((e.scheduler or {}).get("cluster"),
                                                                   (e.scheduler or {}).get("partition"))))
                                            for e in envs)) or "-"
    versions["fabric env"] = "; ".join(_unique(" ".join(f"{k}={v}" for k, v in (e.comm_env or {}).items())
                                               for e in envs)) or "-"
    versions["NCCL transport"] = ", ".join(_unique(e.nccl_transport for e in envs)) or "-"
    matrices = _unique(data.frame["matrix"])
    statuses = Counter(r.status for r in records)
    return {
        "sources": [str(p) for p in data.paths],
        "matrices": matrices,
        "first_time": times[0] if times else None,
        "last_time": times[-1] if times else None,
        "devices": [f"{name} ({n} run{'s' if n != 1 else ''})" for name, n in devices.most_common()],
        "peaks": [f"{fmt_number(p)} TFLOP/s {prec} ({src}) on {dev} ({n} run{'s' if n != 1 else ''})"
                  for (p, prec, src, dev), n in peaks.most_common()],
        "ceilings": ceilings,
        "versions": versions,
        "n_runs": len(records),
        "statuses": ", ".join(f"{n} {s}" for s, n in statuses.most_common()),
        "n_skipped": len(data.skipped),
    }


def page_notes(data: ReportInput) -> list[str]:
    """Notes shown above the figures: what makes some MFU figures not comparable with others, and
    memory estimates off by more than their stated error."""
    ok = data.ok
    notes = memory_notes(ok)
    calibrated = ok[ok["peak_source"].fillna("").str.startswith("calibrated")]
    if len(calibrated):
        notes.append(f"{len(calibrated)} of {len(ok)} successful run(s) report MFU against a calibrated GEMM rate "
                     "(this device's measured matmul throughput), not a datasheet peak: their MFU reads higher than "
                     "datasheet-based figures. See the notes column of the table of runs.")
    mismatched = ok[(ok["precision"] != "fp8") & ok["peak_precision"].notna() & (ok["precision"] != ok["peak_precision"])]
    if len(mismatched):
        notes.append(f"{len(mismatched)} run(s) computed in another precision than their peak's "
                     f"({', '.join(sorted(set(mismatched['precision'] + ' against ' + mismatched['peak_precision'])))}).")
    fp8 = ok[ok["precision"] == "fp8"]
    if len(fp8):
        notes.append(f"{len(fp8)} fp8 run(s), marked fp8 in the table of runs: MFU is against the bf16 peak; the "
                     "column 'MFU fp8 peak' gives it against the dense fp8 peak.")
    peaks = ok.assign(_p=numeric(ok["peak_tflops"])).groupby("configuration")["_p"].nunique()
    if (peaks > 1).any():  # e.g. two local sweeps, each against its own calibration
        notes.append(f"{int((peaks > 1).sum())} configuration(s) pool runs measured against different peaks: their "
                     "median MFU mixes denominators (samples/s and step times do not). See the peak column of the "
                     "table of runs.")
    if data.predicted_by:
        below = ok[ok["below_prediction"].map(flagged)]
        errors = numeric(ok["prediction_error"]).dropna()
        notes.append(f"Predicted (echobench predict, profile {', '.join(data.predicted_by)}): open circles in the MFU "
                     f"figure, the predicted step and the residual (predicted - measured) / measured in the table of runs"
                     + (f"; mean |residual| {errors.abs().mean():.1%} over {len(errors)} runs" if len(errors) else "")
                     + f". {len(below)} run(s) more than {data.margin:.0%} below their predicted throughput"
                     + (": " + ", ".join(below["run_id"].astype(str)) if len(below) else "") + ".")
    echo = [r for r in data.records if r.status == "ok" and r.config and not r.config.get("card")]
    synthetic = [r for r in echo if r.config.get("data") == "synthetic"
                 and r.config.get("synthetic_lengths", "full") == "full"]
    if synthetic:
        notes.append(f"{len(synthetic)} run(s) trained on synthetic data: every sample at the maximum lengths, "
                     "nothing padded, so their MFU is an upper bound of what the same settings measure on a user's "
                     "variable-length data (padded tokens computed, attention over a key mask). Data of realistic "
                     "lengths (synthetic_lengths drawn, echobench data synth, or a user's shards) measures that: "
                     "their records give the padding share (padded FLOPs, padded tokens) and the attention path mix.")
    if padded := [r for r in echo if r not in synthetic and r.padded_flops_frac is not None]:
        shares = sorted(r.padded_flops_frac for r in padded)
        dit = [(r.attention_paths or {}).get("dit", {}) for r in padded]
        masked = sum(n for paths in dit for path, n in paths.items() if path not in ("none", "split"))
        notes.append(f"{len(padded)} run(s) trained on data of variable lengths (synthetic_lengths drawn or shards): "
                     f"{shares[0]:.1%}" + (f" to {shares[-1]:.1%}" if len(shares) > 1 else "")
                     + " of their matmul FLOPs went to padding, and the DiT attended over a key mask in "
                     f"{masked} of {sum(sum(paths.values()) for paths in dit)} measured micro-batches (the padding "
                     "figures and attention columns of the table of runs).")
    retries = ok[numeric(ok["num_alloc_retries"]).fillna(0) > 0]
    if len(retries):
        notes.append(f"{len(retries)} run(s) had CUDA allocator retries (flushes of the cache to satisfy an "
                     "allocation), which slow the steps they hit: " + ", ".join(retries["run_id"].astype(str)) + ".")
    return notes


def memory_notes(ok: pd.DataFrame) -> list[str]:
    """One note when runs' memory estimates are off their measured peaks by more than the stated
    error: how many, the furthest, and (CPU runs among them without a measured baseline) why those
    cannot agree."""
    error = numeric(ok["memory_estimate_error"])
    off = ok[error.abs() > MEMORY_ESTIMATE_ERROR]
    if off.empty:
        return []
    worst = off.loc[numeric(off["memory_estimate_error"]).abs().idxmax()]
    cpu = (numeric(off["device_memory_gib"]).isna() & numeric(off["memory_baseline_gib"]).isna()).sum()
    return [f"The plan's memory estimate is off the measured peak by more than its stated "
            f"+-{MEMORY_ESTIMATE_ERROR:.0%} for {len(off)} of {int(error.notna().sum())} run(s) (furthest: "
            f"{worst['run_id']}, {fmt_number(worst['memory_estimate_held_gib'])} GiB estimated against "
            f"{fmt_number(worst['memory_vs_estimate_gib'])} GiB measured, {float(worst['memory_estimate_error']):+.0%})"
            + (f"; {cpu} of them on a CPU, where {CPU_MEMORY_CAVEAT}" if cpu else "") + "."]


def best_rows(configs: pd.DataFrame, scales: list[str], reference: pd.DataFrame | None = None,
              failed: pd.DataFrame | None = None, flags: dict | None = None, crowns: dict | None = None) -> list[dict]:
    """Per scale and node count, the configuration of the highest median MFU over its runs (`configs`:
    ReportInput.configurations); with a reference, the published MFU of that layout (else the best
    published at that scale and node count, its layout named) and the difference in points. A scale
    and node count where every run failed (`failed`: the frame's failed rows) is a row saying so;
    `flags` (configs index -> checks.Flag) marks the best's suspicious values; `crowns`
    (ReportInput.crowns) says where the highest is tied with others (`tie`: those, with why)."""
    failed = failed if failed is not None else configs.iloc[0:0]
    rows = []
    for scale in scales:
        group = configs[configs["scale"] == scale]
        lost = failed[failed["scale"] == scale]
        counts = set(numeric(group["nodes"]).dropna()) | set(numeric(lost["nodes"]).dropna())
        for nodes in sorted(counts):
            at = group[numeric(group["nodes"]) == nodes]
            if at.empty:
                down = lost[numeric(lost["nodes"]) == nodes]
                statuses = Counter(down["status"].astype(str))
                rows.append({"scale": scale, "nodes": int(nodes), "failed_only": True,
                             "failed": f"no successful run: {len(down)} failed ("
                                       + ", ".join(f"{n} {s}" for s, n in statuses.most_common()) + ")"})
                continue
            index = numeric(at["mfu"]).idxmax()
            best = at.loc[index]
            row = {"scale": scale, "nodes": int(nodes), "gpus": best["world_size"], "failed_only": False,
                   "mfu": fmt_number(best["mfu"], percent=True),
                   "mfu_range": f"{fmt_number(best['mfu_min'], percent=True)}-{fmt_number(best['mfu_max'], percent=True)}",
                   "repeats": int(best["repeats"]),
                   "predicted": fmt_number(best.get("predicted_mfu"), percent=True),
                   "tflops": fmt_number(best["tflops_per_gpu"]),
                   "samples": fmt_number(best["samples_per_s"]), "config": best["config"],
                   "run_id": best["run_id"], "notes": "; ".join(best["notes"]), "n": len(at),
                   "flags": [f.reason for f in (flags or {}).get(index, [])],
                   "tie": crown.tied_with if (crown := (crowns or {}).get(index)) and crown.mark == "tie" else []}
            if reference is not None:
                row.update(published_beside(reference, best))
            rows.append(row)
    return rows


def setting_cell(value) -> str:
    """A setting in the MFU table's columns: on / off, default for None."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "default" if value is None else str(value)


def mfu_table(data: ReportInput, scales: list[str], flags: dict) -> dict:
    """MFU by configuration (rows: scale, framework, parallelism and the settings that differ between
    the page's configurations) and node count (columns): each cell the median MFU over the runs of that
    configuration and node count, starred where it is the best at its scale and node count; a cell
    whose runs all failed shows their status (not 0), one with some failed says how many; blank: not
    run. `flags`: configs index -> checks.Flag."""
    frame, configs = data.frame, data.configurations
    keys = varying_keys(list(frame["settings"]), ignore=("scale", "nodes", "framework", "parallelism"))
    counts = sorted({int(n) for n in numeric(frame["nodes"]).dropna()})
    crowns = data.crowns
    rank = {s: i for i, s in enumerate(scales)}
    rows = []
    for layout, runs in frame.groupby("layout", sort=False):
        first = runs.iloc[0]
        mine = configs[configs["layout"] == layout]
        cells = []
        for nodes in counts:
            at = mine[numeric(mine["nodes"]) == nodes]
            down = runs[(numeric(runs["nodes"]) == nodes) & (runs["status"] != RunState.OK)]
            lost = Counter(down["status"].astype(str))
            lost_text = ", ".join(f"{n} {s}" for s, n in lost.most_common())
            if at.empty:
                cells.append({"text": " / ".join(lost) if lost else "", "failed": bool(lost),
                              "title": "; ".join(str(e)[:200] for e in down["error"].fillna("").head(3))})
                continue
            index, c = at.index[0], at.iloc[0]
            reasons = [f.reason for f in flags.get(index, []) if f.column in ("mfu", "efficiency")]
            crown = crowns.get(index)
            cells.append({"text": fmt_number(c["mfu"], percent=True), "winner": bool(crown and crown.mark == "best"),
                          "tie": "; ".join(crown.tied_with) if crown and crown.mark == "tie" else "",
                          "predicted": fmt_number(c.get("predicted_mfu"), percent=True)
                          if data.predicted_by and pd.notna(c.get("predicted_mfu")) else "",
                          "title": f"median of {int(c['repeats'])} run(s), min-max "
                                   f"{fmt_number(c['mfu_min'], percent=True)}-{fmt_number(c['mfu_max'], percent=True)}%; "
                                   f"{fmt_number(c['samples_per_s'])} samples/s; {c['world_size']} GPUs",
                          "also_failed": f"+{lost_text}" if lost else "", "flags": reasons})
        values = [setting_cell(first["settings"].get(k)) for k in keys]
        order = (rank.get(first["scale"], len(rank)), str(first["framework"]), str(first["parallelism"]), values)
        rows.append((order, {"scale": first["scale"], "framework": first["framework"],
                             "parallelism": first["parallelism"], "settings": values, "cells": cells}))
    return {"settings": [k.replace("_", " ") for k in keys],
            "nodes": [f"{n} node{'s' if n != 1 else ''}" for n in counts],
            "rows": [row for _, row in sorted(rows, key=lambda item: item[0])]}


def published_beside(reference: pd.DataFrame, best: pd.Series) -> dict:
    """The published MFU to show beside a measured best: the same layout's, else the best published
    at that scale and node count (named); the difference measured minus published, in points."""
    ref = reference[(reference["scale"] == best["scale"]) & (reference["nodes"] == int(best["nodes"]))
                    & reference["ref_mfu"].notna()]
    same = ref[(ref["framework"] == best["framework"]) & (ref["parallelism"] == best["parallelism"])]
    if len(ref) == 0:
        return {"published": "-", "diff": "-", "published_source": ""}
    pub = same.iloc[0] if len(same) else ref.loc[ref["ref_mfu"].idxmax()]
    text = fmt_number(pub["ref_mfu"], percent=True)
    if not len(same):
        text += f" ({pub['framework']} {pub['parallelism']})"
    source = pub["ref_source"] if isinstance(pub["ref_source"], str) else ""
    return {"published": text, "diff": f"{(float(best['mfu']) - pub['ref_mfu']) * 100:+.1f}", "published_source": source}


def unplotted_published(reference: pd.DataFrame | None, configs: pd.DataFrame) -> list[str]:
    """Published MFU figures that no MFU figure could place: no measured run of their layout at their
    scale (an MFU figure marks every published node count of a layout it draws)."""
    if reference is None:
        return []
    drawn = set(zip(configs["scale"], configs["framework"], configs["parallelism"]))
    return [f"{r.scale} {r.framework} {r.parallelism} on {r.nodes} node(s): {fmt_number(r.ref_mfu, percent=True)}%"
            + (f" ({r.ref_source})" if isinstance(r.ref_source, str) and r.ref_source else "")
            for r in reference[reference["ref_mfu"].notna()].itertuples()
            if (r.scale, r.framework, r.parallelism) not in drawn]


# The table of runs: (frame column, header, kind) where kind picks the formatting. The key columns
# show; the rest are hidden until the page's "all columns" box is ticked.
KEY_RUN_COLUMNS = [
    ("run_id", "run", "text"), ("scale", "scale", "text"), ("framework", "framework", "text"),
    ("parallelism", "parallelism", "text"), ("nodes", "nodes", "int"), ("world_size", "GPUs", "int"),
    ("mfu", "MFU (%)", "pct"), ("samples_per_s", "samples/s", "num"), ("step_time_s", "step time (s)", "num"),
    ("status", "status", "text"),
]
FLAGS_COLUMN = ("flags", "flags", "flags")  # after the key columns: the numbers of the run's flagged values
EXTRA_RUN_COLUMNS = [
    ("micro_batch", "micro-batch", "int"), ("global_batch", "global batch", "int"),
    ("repeat", "repeat", "int"), ("steps", "steps", "int"), ("warmup_steps", "warm-up", "int"),
    ("step_time_p10_s", "p10 (s)", "num"),
    ("step_time_p90_s", "p90 (s)", "num"), ("step_time_mean_vs_median", "mean vs median (%)", "pct"),
    ("samples_per_s_per_gpu", "samples/s/GPU", "num"), ("audio_seconds_per_s_per_gpu", "audio s/s/GPU", "num"),
    ("tflops_per_gpu", "TFLOP/s/GPU", "num"), ("hfu", "HFU (%)", "pct"),
    ("mfu_fp8_peak", "MFU fp8 peak (%)", "pct"), ("peak_label", "peak", "text"),
    ("peak_mem_gib", "memory (GiB)", "num"), ("peak_mem_allocated_gib", "allocated (GiB)", "num"),
    ("memory_estimate_gib", "estimate (GiB)", "num"), ("memory_estimate_error", "estimate vs peak (%)", "pct"),
    ("num_alloc_retries", "alloc retries", "int"),
    ("lengths", "lengths a/t/s", "text"), ("padded_flops_frac", "padded FLOPs (%)", "pct"),
    ("padded_tokens", "padded tokens a/t/s (%)", "text"), ("precision", "precision", "text"),
    ("compile", "compile", "text"),
    ("ac", "ac", "text"), ("device_name", "device", "text"), ("hostname", "host", "text"), ("time", "time", "text"),
    ("notes", "notes", "text"), ("error", "error", "text"),
]
RUN_COLUMNS = KEY_RUN_COLUMNS + EXTRA_RUN_COLUMNS

# With predictions (a profile: --profile, or the one matching the records' device): the predicted
# step and the residual, shown beside the measured step time.
PREDICTED_RUN_COLUMNS = [("predicted_step_time_s", "predicted step (s)", "num"),
                         ("prediction_error", "vs prediction (%)", "pct")]


def run_columns(data: ReportInput) -> list[tuple[str, str, str, bool]]:
    """(frame column, header, kind, shown by default) of the table of runs."""
    key = KEY_RUN_COLUMNS + (PREDICTED_RUN_COLUMNS if data.predicted_by else []) + [FLAGS_COLUMN]
    return [(*c, True) for c in key] + [(*c, False) for c in EXTRA_RUN_COLUMNS]


def runs_frame(frame: pd.DataFrame, scales: list[str]) -> pd.DataFrame:
    """The frame with the table of runs' derived text columns, in the table's order."""
    rank = {s: i for i, s in enumerate(scales)}
    frame = frame.assign(_s=frame["scale"].map(lambda s: rank.get(s, len(rank))),
                         lengths=[f"{a}/{t}/{s}" for a, t, s in
                                  zip(frame["audio_frames"], frame["text_tokens"], frame["speaker_frames"])],
                         padded_tokens=[padded_tokens_text(shares) for shares in
                                        zip(frame["padded_frac_latent"], frame["padded_frac_text"],
                                            frame["padded_frac_speaker"])],
                         peak_label=[None if pd.isna(p) else f"{fmt_number(p)} {pp or ''} {_peak_kind(src)}".replace("  ", " ")
                                     for p, pp, src in zip(frame["peak_tflops"], frame["peak_precision"], frame["peak_source"])],
                         notes=frame["notes"].map(lambda n: "; ".join(n) if isinstance(n, tuple) else None))
    return frame.sort_values(["_s", "framework", "parallelism", "nodes", "run_id"])


def _missing(value) -> bool:
    return value is None or (not isinstance(value, str) and pd.isna(value))


def flag_notes(frame: pd.DataFrame, flags: dict[object, list[Flag]], scales: list[str]) -> dict[object, list[int]]:
    """Frame index -> the numbers of its flags in the list under the table of runs (in table order)."""
    numbers, n = {}, 0
    for index in runs_frame(frame, scales).index:
        for _ in flags.get(index, []):
            n += 1
            numbers.setdefault(index, []).append(n)
    return numbers


def run_rows(frame: pd.DataFrame, scales: list[str], columns=None, flags: dict | None = None) -> list[dict]:
    """The table of runs' rows: each cell's text and sort key, a flagged cell's reasons (`flags`:
    frame index -> checks.Flag; the flags column lists their numbers)."""
    columns = columns or [(*c, True) for c in RUN_COLUMNS]
    flags = flags or {}
    numbers = flag_notes(frame, flags, scales)
    rows = []
    for index, r in runs_frame(frame, scales).iterrows():
        mine = flags.get(index, [])
        cells = []
        for column, _, kind, _ in columns:
            reasons = [f.reason for f in mine if f.column == column]
            value = None if kind == "flags" else r[column]
            if kind == "flags":
                cells.append({"text": "", "sort": str(len(mine)) if mine else "",
                              "marks": list(zip(numbers.get(index, []), (f.reason for f in mine)))})
            elif _missing(value):
                cells.append({"text": "", "sort": ""})
            elif kind == "num":
                cells.append({"text": fmt_number(value), "sort": repr(float(value))})
            elif kind == "pct":
                cells.append({"text": fmt_number(value, percent=True), "sort": repr(float(value))})
            elif kind == "int":
                cells.append({"text": str(int(value)), "sort": str(int(value))})
            else:
                cells.append({"text": str(value), "sort": str(value)})
            cells[-1]["reasons"] = reasons
        retries = numeric(pd.Series([r["num_alloc_retries"]])).fillna(0).iloc[0]
        rows.append({"scale": r["scale"], "status": r["status"], "path": r["path"] or "", "cells": cells,
                     "fp8": r["precision"] == "fp8", "retries": bool(retries > 0), "below": flagged(r["below_prediction"]),
                     "calibrated": _peak_kind(r["peak_source"]) == "calibrated"})
    return rows


def flag_list(frame: pd.DataFrame, flags: dict[object, list[Flag]], scales: list[str]) -> list[dict]:
    """The numbered list under the table of runs: each flagged value's run and reason."""
    out, ordered = [], runs_frame(frame, scales)
    for index, numbers in flag_notes(frame, flags, scales).items():
        for n, f in zip(numbers, flags[index]):
            out.append({"n": n, "run_id": ordered.at[index, "run_id"], "reason": f.reason})
    return out


# The CSV of the table of runs: its columns, raw (MFU as a fraction, full precision), the peak as
# its three fields instead of the page's label, and the flags' reasons.
CSV_PEAK = ["peak_tflops", "peak_precision", "peak_source"]


def runs_csv(data: ReportInput) -> str:
    """The table of runs as CSV text, every run in the table's order (its flags: checks.run_flags)."""
    flags = run_flags(data.ok, data.configurations)
    kinds = {c: kind for c, _, kind, _ in run_columns(data) if kind != "flags"}
    columns = [x for c in kinds for x in (CSV_PEAK if c == "peak_label" else [c])] + ["flags"]

    def cell(value, kind) -> str:
        if _missing(value):
            return ""
        if kind == "int":
            return str(int(value))
        return repr(float(value)) if isinstance(value, float) else str(value)

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(columns)
    for index, r in runs_frame(data.frame, scale_order(data.frame)).iterrows():
        writer.writerow(["; ".join(f.reason for f in flags.get(index, [])) if c == "flags" else cell(r[c], kinds.get(c))
                         for c in columns])
    return buf.getvalue()


def padded_tokens_text(shares) -> str | None:
    """The padded share of the latent, text and speaker tokens as `a/t/s` percentages; None (an empty
    cell) for a record written before padding was counted."""
    if any(v is None or pd.isna(v) for v in shares):
        return None
    return "/".join(fmt_number(v, percent=True) for v in shares)


def _peak_kind(source) -> str:
    """datasheet / flag / calibrated, from a record's peak_source."""
    source = "" if source is None or (not isinstance(source, str) and pd.isna(source)) else str(source)
    return source.split(":", 1)[0] if source else ""


def build_sections(data: ReportInput, figs: Figures) -> list[dict]:
    """The figure sections, each a list of per-scale panels (a figure or a 'no data' line)."""
    # (id, title, caption, figure, drawn from: one row per configuration or one per run)
    specs = [
        ("mfu", "MFU vs GPUs",
         "One line per configuration across node counts; each point is the median over the runs of that "
         "configuration and node count (repeats, and sweeps of other lengths), bars from min to max; configurations "
         "are drawn a little apart along the GPU axis (as in the throughput and scaling figures), the hover names "
         "the GPU count. Open diamonds: published MFU, where --reference gives one; open circles on a dotted line: "
         "predicted MFU, where --profile gives a hardware profile.", figs.mfu_vs_gpus, figs.configs),
        ("throughput", "Per-GPU throughput",
         "samples/s and seconds of audio per second, per GPU, over the whole measured window (median over runs); "
         "dotted: ideal (linear) scaling from the configuration's smallest GPU count.",
         figs.throughput, figs.configs),
        ("scaling", "Scaling efficiency",
         "Per-GPU samples/s relative to the configuration's smallest GPU count (100%, dotted: linear scaling); "
         "configurations run at one GPU count only are left out.",
         figs.scaling_efficiency, figs.configs),
        ("steptime", "Step-time spread",
         "Every run: median step time of the slowest rank, bars from p10 to p90; x marks the mean, which the "
         "window throughput pays (far right of the median: stalls).", figs.step_time, figs.ok),
        ("memory", "Peak memory per GPU",
         "Measured peak (max over ranks; GPU: reserved by the allocator, its cache included) against the device "
         "memory (where the record has it: GPU runs) and, where the plan gave one, its estimate (x; it states "
         "+-30%), to compare with the allocated peak (GPU runs: the diamond, against the estimate's tensors; else "
         "the bar: on a CPU its tensors plus the process's resident baseline its run measured once the model was "
         "built, else its total); hover for the estimate's error. A CPU record without that baseline is not "
         "comparable at small scales: the bar is the process's resident set, the estimate counts a GPU's CUDA context.",
         figs.memory, figs.ok),
    ]
    sections = []
    for key, title, caption, make, rows in specs:
        panels = []
        for i, scale in enumerate(figs.scales):
            group = rows[rows["scale"] == scale]
            if len(group) == 0:
                panels.append(panel(scale, empty=f"{scale}: no successful runs"))
                continue
            fig = make(scale, group)
            panels.append(panel(scale, empty=fig) if isinstance(fig, str)
                          else panel(scale, html=figure_html(fig, f"fig-{key}-{i}")))
        sections.append({"id": key, "title": title, "caption": caption, "panels": panels})
    flop_panels = []
    for i, scale in enumerate(figs.scales):
        fig, note = figs.flop_breakdown(scale)
        if fig is None:
            flop_panels.append(panel(scale, empty=f"{scale}: no FLOP breakdown in the records"))
        else:
            flop_panels.append(panel(scale, html=figure_html(fig, f"fig-flops-{i}"), note=note))
    sections.append({"id": "flops", "title": "FLOP breakdown per scale",
                     "caption": "Model FLOPs of one sample by part (the MFU numerator), forward and backward.",
                     "panels": flop_panels})
    sections.append(time_section(data, figs.scales))
    if data.ok.empty:
        for s in sections:
            s["panels"] = [p for p in s["panels"] if p["html"]] if s["id"] == "flops" else []
    return sections


def failed_rows(data: ReportInput) -> list[dict]:
    rows = []
    for _, r in data.failed.iterrows():
        rows.append({"run_id": r["run_id"], "status": r["status"], "error": r["error"] or "", "scale": r["scale"],
                     "config": r["config"], "nodes": r["nodes"], "host": r["hostname"] or "", "path": r["path"] or ""})
    return rows


LAYOUTS_CAPTION = ("At each node count, one bar per configuration: its median MFU over its runs there, bars min-max; "
                   "\u2605 and a black outline: the best (as in the tables above); \u2248: tied for best (its steps "
                   "not significantly faster than the others marked so: hover for why). A configuration whose runs at a "
                   "node count all failed stands there as an empty bar labelled with the status. "
                   "\u26a0: a flagged value (hover: why).")


def layouts_section(data: ReportInput, figs: Figures) -> dict:
    """The bar chart of the configurations at each node count, one panel per scale."""
    panels = []
    failed = data.failed[numeric(data.failed["nodes"]).notna()]
    for i, scale in enumerate(figs.scales):
        group = figs.configs[figs.configs["scale"] == scale]
        if group.empty:
            panels.append(panel(scale, empty=f"{scale}: no successful runs"))
            continue
        fig = figs.layouts(scale, group, failed[failed["scale"] == scale])
        panels.append(panel(scale, html=figure_html(fig, f"fig-layouts-{i}")))
    return {"id": "layouts", "title": "Configurations at each node count", "caption": LAYOUTS_CAPTION,
            "panels": panels if not data.ok.empty else [], "empty": "No successful runs."}


def config_flag_lines(configs: pd.DataFrame, flags: dict) -> list[str]:
    """One line per flagged value of a configuration (its medians): where, and why."""
    return [f"{c['scale']} {c['config']}, {c['nodes']} node(s): {f.reason}"
            for index, c in configs.iterrows() for f in flags.get(index, [])]


def flags_note(run_flags: dict, config_flags: dict) -> list[str]:
    """The notes box's line on the flagged values, where there are any."""
    runs, medians = sum(map(len, run_flags.values())), sum(map(len, config_flags.values()))
    if not (runs or medians):
        return []
    return [f"\u26a0 {runs} value(s) of the runs and {medians} of the configurations' medians flagged as impossible or "
            "suspicious (MFU above 100% or not positive, superlinear scaling, a step time not positive, memory above "
            "the device's): marked where they are shown, the reasons under the MFU table and the table of runs."]


def render_dashboard(data: ReportInput, reference: pd.DataFrame | None = None, reference_path: str | None = None) -> str:
    """The page; `reference` (tables.read_reference) marks published MFU beside the measured."""
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(resources.files("echobench.report").joinpath("dashboard.html.j2").read_text())
    if not data.records:
        message = "No result records found under " + ", ".join(str(p) for p in data.paths) + "."
    elif data.ok.empty:
        message = f"No successful runs: all {len(data.records)} record(s) failed (see Failed and skipped runs)."
    else:
        message = ""
    figs = Figures(data, reference)
    scales = figs.scales
    sections = build_sections(data, figs)
    links = next((s["links"] for s in sections if s["id"] == "time"), {})  # best-MFU row -> its waterfall
    best = [{**b, "waterfall": links.get(b.get("run_id"))}
            for b in best_rows(figs.configs, scales, reference, data.failed, figs.config_flags, data.crowns)]
    columns = run_columns(data)
    return template.render(
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        facts=header_facts(data), flop_convention=FLOP_CONVENTION, flop_convention_short=FLOP_CONVENTION_SHORT,
        message=message, scales=scales, problems=data.problems,
        notes=page_notes(data) + flags_note(figs.run_flags, figs.config_flags), best=best,
        predicted=bool(data.predicted_by), profile_line=data.profile_line,
        matrix=mfu_table(data, scales, figs.config_flags),
        config_flags=config_flag_lines(figs.configs, figs.config_flags),
        references=reference_section(data, reference),
        layouts=layouts_section(data, figs), sections=sections,
        reference=reference_path if reference is not None else None,
        unplotted=unplotted_published(reference, figs.configs),
        tune=tune_section(data.tunes), failed=failed_rows(data), skipped=data.skipped, skipped_files=data.skipped_files,
        run_headers=columns, runs=run_rows(data.frame, scales, columns, figs.run_flags),
        run_flags=flag_list(data.frame, figs.run_flags, scales),
        runs_csv=quote(runs_csv(data), safe=""),
        margin=f"{(data.margin or 0) * 100:g}",
        plotlyjs=get_plotlyjs(),
    )
