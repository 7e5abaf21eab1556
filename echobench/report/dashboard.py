"""The HTML dashboard: one self-contained file (plotly.js inlined once, no CDN) from stored records.

The per-configuration views (MFU, throughput, scaling, best MFU) show the median over a
configuration's repeats, MFU with its min-max; the step-time and memory views and the table of
runs show every run. Notes flag what a bare MFU would hide: a calibrated denominator, fp32 / fp8
runs against a bf16 peak (fp8 rows also show MFU against the fp8 peak), allocator retries.

Every figure is drawn per scale, in its own element tagged with `data-scale`, so the page's scale
filter only shows and hides elements. Strings from records reach the page through jinja2's
autoescaping, or, inside figures, HTML-escaped (plotly renders a subset of HTML in its labels).
"""

from __future__ import annotations

import math
from collections import Counter
from datetime import datetime, timezone
from importlib import resources

import jinja2
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from echobench.report.data import ReportInput, flagged, scale_order
from echobench.report.plotting import esc, figure_html, layout, panel
from echobench.report.tables import fmt_number
from echobench.report.time_breakdown import time_section

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
VERSION_KEYS = ("python", "torch", "cuda", "nccl", "driver", "transformers", "megatron_core", "transformer_engine",
                "torchao", "container", "git_commit")
FLOP_PARTS_ORDER = ("dit_attention", "dit_mlp", "dit_conditioning", "dit_io", "speaker_encoder",
                    "text_projection", "text_encoder")


def _num(series) -> pd.Series:
    return pd.to_numeric(series, errors="coerce")


def with_labels(group: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by configuration and nodes, each with a short label unique within the group."""
    rows = group.assign(_n=_num(group["nodes"])).sort_values(["config", "_n", "run_id"])
    labels, seen = [], Counter()
    for config, nodes in zip(rows["config"], rows["nodes"]):
        label = f"{config} | {nodes}n"
        seen[label] += 1
        labels.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return rows.assign(label=labels)


# A configuration's line: the colour of its framework + parallelism, and within those a dash and a
# marker of its own. "dot" is left to the ideal-scaling references.
PALETTE = qualitative.D3 + qualitative.Dark2
DASHES = ("solid", "dash", "dashdot", "longdash", "longdashdot")
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "triangle-down", "star", "hexagon", "pentagon")


def line_styles(frame: pd.DataFrame) -> dict[str, dict]:
    """Configuration label -> {color, dash, symbol}: one colour per framework + parallelism on the
    whole page, so a layout looks the same in every figure."""
    pairs = frame[["framework", "parallelism", "config"]].astype(str).drop_duplicates()
    styles = {}
    for i, ((_, _), labels) in enumerate(pairs.groupby(["framework", "parallelism"], sort=True)):
        for k, label in enumerate(sorted(labels["config"])):
            styles[label] = {"color": PALETTE[i % len(PALETTE)], "dash": DASHES[k % len(DASHES)],
                             "symbol": SYMBOLS[k % len(SYMBOLS)]}
    return styles


# Why: configurations with equal figures at one GPU count would draw one marker exactly over another.
DODGE_STEP, DODGE_SPREAD, GPU_AXIS_PAD = 0.08, 0.3, 0.5  # octaves: between neighbours, at most in all, axis margin


def dodge(index: int, count: int, gpus) -> float:
    """The factor on the GPU counts of configuration `index` of `count` (as sorted for the figure):
    offsets DODGE_STEP octaves apart, centred on the true count; all within DODGE_SPREAD octaves and
    half the smallest gap between the GPU counts drawn, so a point stays nearest its own count."""
    logs = sorted({math.log2(g) for g in gpus if g > 0})
    gap = min((b - a for a, b in zip(logs, logs[1:])), default=1.0)
    step = min(DODGE_STEP, min(DODGE_SPREAD, gap / 2) / max(count - 1, 1))
    return 2 ** ((index - (count - 1) / 2) * step)


def gpu_axis(group: pd.DataFrame) -> dict:
    """x = GPUs on a log2 axis: ticks at the powers of two the data spans, and at the data. The range
    is set (GPU_AXIS_PAD octaves beyond the data; plotly takes log10 units): autoranged, one GPU count
    would span only the dodge between configurations and blow it up to the plot's width."""
    gpus = sorted(set(_num(group["world_size"]).dropna().astype(int)))
    lo, hi = (gpus[0], gpus[-1]) if gpus else (1, 1)
    ticks = sorted(set(gpus) | {2 ** k for k in range(max(lo, 1).bit_length() - 1, hi.bit_length()) if lo <= 2 ** k <= hi})
    pad = GPU_AXIS_PAD * math.log10(2)
    return {"type": "log", "tickvals": ticks, "ticktext": [str(t) for t in ticks], "title": "GPUs (log2 axis)",
            "range": [math.log10(max(lo, 1)) - pad, math.log10(max(hi, 1)) + pad]}


class Figures:
    """Builds the per-scale figures; keeps one style per configuration across the page."""

    def __init__(self, data: ReportInput, reference: pd.DataFrame | None = None):
        self.data = data
        self.ok = data.ok.copy()
        self.configs = data.configurations
        self.scales = scale_order(data.frame)
        self.styles = line_styles(data.frame)
        self.reference = reference

    def _line(self, config: str) -> dict:
        style = self.styles[config]
        return {"line": {"color": style["color"], "dash": style["dash"]}, "marker": {"symbol": style["symbol"], "size": 8}}

    def _per_config(self, group: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
        """(label, rows sorted by GPUs) for each configuration across node counts, by label (legends
        read alike in every figure); group holds one row per configuration and node count. Rows
        carry _g, the GPU count, and _x, where it is drawn: _g dodged by the label's place (dodge)."""
        lines = sorted(((rows["config"].iloc[0], rows.assign(_g=_num(rows["world_size"])).sort_values("_g"))
                        for _, rows in group.groupby("layout", sort=False)), key=lambda item: item[0])
        gpus = _num(group["world_size"]).dropna()
        return [(config, rows.assign(_x=rows["_g"] * dodge(i, len(lines), gpus)))
                for i, (config, rows) in enumerate(lines)]

    def _hover(self, rows: pd.DataFrame) -> list[str]:
        """Per point: GPUs as nodes x per node, global batch, and each pooled run with its steps."""
        texts = []
        for r in rows.itertuples():
            runs = list(zip(r.run_ids, r.run_steps))
            shown = "<br>".join(f"{esc(rid)} ({steps} steps)" for rid, steps in runs[:4])
            more = f"<br>... and {len(runs) - 4} more" if len(runs) > 4 else ""
            pooled = f"median of {len(runs)} runs:" if len(runs) > 1 else "run:"
            texts.append(f"<b>{esc(r.config)}</b><br>{r.world_size} GPUs = {r.nodes} node(s) x {r.gpus_per_node}, "
                         f"global batch {r.global_batch}<br>{pooled}<br>{shown}{more}")
        return texts

    def mfu_vs_gpus(self, scale: str, group: pd.DataFrame) -> go.Figure:
        fig = go.Figure()
        for config, rows in self._per_config(group):
            mfu, lo, hi = (_num(rows[c]) * 100 for c in ("mfu", "mfu_min", "mfu_max"))
            fig.add_trace(go.Scatter(x=rows["_x"], y=mfu, name=esc(config), mode="lines+markers",
                                     error_y={"type": "data", "array": (hi - mfu).clip(lower=0),
                                              "arrayminus": (mfu - lo).clip(lower=0), "visible": bool((hi > lo).any()),
                                              "color": self.styles[config]["color"]},
                                     text=self._hover(rows), customdata=list(zip(lo, hi)),
                                     hovertemplate="%{text}<br>MFU %{y:.3g}% (min %{customdata[0]:.3g}, "
                                                   "max %{customdata[1]:.3g})<extra></extra>", **self._line(config)))
        published = self._published(scale, group)
        if published is not None:
            fig.add_trace(published)
        for trace in self._predicted(group):
            fig.add_trace(trace)
        return layout(fig, f"{scale}: MFU vs GPUs (median over runs, bars min-max)", xaxis=gpu_axis(group),
                       yaxis={"title": "MFU (%)", "rangemode": "tozero"})

    def _predicted(self, group: pd.DataFrame) -> list[go.Scatter]:
        """Per configuration, its predicted MFU (report --profile: the median over its runs' predictions)
        as open circles on a dotted line in its colour, at its dodged x; one legend entry for all."""
        if not self.data.predicted_by or _num(group["predicted_mfu"]).isna().all():
            return []
        traces = []
        for config, rows in self._per_config(group):
            predicted, measured = _num(rows["predicted_mfu"]) * 100, _num(rows["mfu"]) * 100
            if predicted.isna().all():
                continue
            texts = [f"<b>predicted</b> ({esc(', '.join(self.data.predicted_by))}): {esc(config)}, {g:.0f} GPUs"
                     f"<br>MFU {p:.3g}% predicted, {m:.3g}% measured" for g, p, m in zip(rows["_g"], predicted, measured)]
            traces.append(go.Scatter(x=rows["_x"], y=predicted, mode="lines+markers", legendgroup="predicted",
                                     name=f"predicted: {esc(config)}", showlegend=not traces, text=texts,
                                     marker={"symbol": "circle-open", "size": 12, "color": self.styles[config]["color"],
                                             "line": {"width": 2}},
                                     line={"color": self.styles[config]["color"], "dash": "dot", "width": 1},
                                     hovertemplate="%{text}<extra></extra>"))
        if traces:
            traces[0].name = "predicted (--profile)"
        return traces

    def _published(self, scale: str, group: pd.DataFrame) -> go.Scatter | None:
        """The reference CSV's MFU at this scale, as open markers in the colour of the measured
        configuration of that framework, parallelism and node count, with the difference in points."""
        if self.reference is None:
            return None
        ref = self.reference[(self.reference["scale"] == scale) & self.reference["ref_mfu"].notna()]
        xs, ys, colors, texts, placed = [], [], [], [], set()
        for config, rows in self._per_config(group):
            first = rows.iloc[0]
            mine = ref[(ref["framework"] == first["framework"]) & (ref["parallelism"] == first["parallelism"])]
            for p in mine.itertuples():
                at = rows[_num(rows["nodes"]) == p.nodes]
                gpus = p.nodes * int(first["gpus_per_node"])
                if (p.Index, gpus) in placed:  # another configuration of the layout: one marker is enough
                    continue
                placed.add((p.Index, gpus))
                shift = first["_x"] / first["_g"]  # at this configuration's dodged x
                measured = f"measured {_num(at['mfu']).iloc[0] * 100:.3g}%, {(_num(at['mfu']).iloc[0] - p.ref_mfu) * 100:+.1f} pp" \
                    if len(at) else "no measured run at this node count"
                source = f" ({esc(p.ref_source)})" if isinstance(p.ref_source, str) and p.ref_source else ""
                xs.append(gpus * shift)
                ys.append(p.ref_mfu * 100)
                colors.append(self.styles[config]["color"])
                texts.append(f"<b>published</b>{source}: {esc(p.framework)} {esc(p.parallelism)}, {p.nodes} node(s)"
                             f"<br>MFU {p.ref_mfu * 100:.3g}%; {esc(config)}: {measured}")
        if not xs:
            return None
        return go.Scatter(x=xs, y=ys, mode="markers", name="published (--reference)", text=texts,
                          marker={"symbol": "diamond-open", "size": 13, "color": colors, "line": {"width": 2}},
                          hovertemplate="%{text}<extra></extra>")

    def throughput(self, scale: str, group: pd.DataFrame) -> go.Figure:
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                            subplot_titles=("samples/s per GPU", "audio seconds/s per GPU"))
        for config, rows in self._per_config(group):
            for row, column in ((1, "samples_per_s_per_gpu"), (2, "audio_seconds_per_s_per_gpu")):
                y = _num(rows[column])
                fig.add_trace(go.Scatter(x=rows["_x"], y=y, name=esc(config), legendgroup=esc(config),
                                         showlegend=row == 1, mode="lines+markers", text=self._hover(rows),
                                         hovertemplate="%{text}<br>%{y:.4g} per GPU<extra></extra>",
                                         **self._line(config)), row=row, col=1)
                if len(rows) > 1:  # ideal: the smallest GPU count's per-GPU rate at every GPU count
                    fig.add_trace(self._ideal(config, rows, y.iloc[0], "%{y:.4g} per GPU"), row=row, col=1)
        fig.update_xaxes(**gpu_axis(group))
        fig.update_xaxes(title=None, row=1, col=1)
        fig.update_yaxes(rangemode="tozero")
        fig.update_annotations(font_size=12)  # the subplot titles
        return layout(fig, f"{scale}: per-GPU throughput (dotted: ideal scaling)", height=520, top=70)

    def _ideal(self, config: str, rows: pd.DataFrame, y: float, what: str) -> go.Scatter:
        base = int(_num(rows["world_size"]).iloc[0])
        return go.Scatter(x=rows["_x"], y=[y] * len(rows), mode="lines", legendgroup=esc(config),
                          showlegend=False, name=f"{esc(config)}: ideal", opacity=0.6,
                          line={"color": self.styles[config]["color"], "dash": "dot", "width": 1.5},
                          hovertemplate=f"{esc(config)}<br>ideal (linear) scaling from {base} GPUs: {what}<extra></extra>")

    def scaling_efficiency(self, scale: str, group: pd.DataFrame) -> go.Figure | str:
        """The figure, or why there is none: a configuration at one GPU count is 100% by definition."""
        fig = go.Figure()
        for config, rows in self._per_config(group):
            if len(rows) < 2:  # one GPU count: 100% by definition (a dot hiding the others' first)
                continue
            per_gpu = _num(rows["samples_per_s_per_gpu"])
            efficiency = per_gpu / per_gpu.iloc[0] * 100
            base = int(_num(rows["world_size"]).iloc[0])
            fig.add_trace(go.Scatter(x=rows["_x"], y=efficiency, name=esc(config), mode="lines+markers",
                                     text=self._hover(rows), hovertemplate=f"%{{text}}<br>%{{y:.1f}}% of the per-GPU "
                                     f"rate at {base} GPUs<extra></extra>", **self._line(config)))
        if not fig.data:
            return f"{scale}: every configuration ran at one GPU count: no scaling to show"
        gpus = _num(group["world_size"]).dropna()
        fig.add_trace(go.Scatter(x=[gpus.min(), gpus.max()], y=[100, 100], mode="lines", name="ideal (linear) scaling",
                                 line={"color": "#666", "dash": "dot", "width": 1.5},
                                 hovertemplate="ideal: 100%<extra></extra>"))
        return layout(fig, f"{scale}: scaling efficiency vs each configuration's smallest GPU count",
                       xaxis=gpu_axis(group), yaxis={"title": "efficiency (%)", "rangemode": "tozero"})

    def _run_height(self, n: int) -> int:
        return 110 + 30 * n

    def step_time(self, scale: str, group: pd.DataFrame) -> go.Figure:
        rows = with_labels(group)
        med, p10, p90 = _num(rows["step_time_s"]), _num(rows["step_time_p10_s"]), _num(rows["step_time_p90_s"])
        labels = [esc(x) for x in rows["label"]]
        fig = go.Figure(go.Scatter(
            x=med, y=labels, mode="markers", name="median",
            marker={"color": [self.styles[c]["color"] for c in rows["config"]], "size": 9},
            error_x={"type": "data", "array": (p90 - med).clip(lower=0), "arrayminus": (med - p10).clip(lower=0)},
            text=[f"{esc(r)} ({n} steps)" for r, n in zip(rows["run_id"], rows["steps"])],
            customdata=list(zip(p10, p90)),
            hovertemplate="%{text}<br>median %{x:.4g} s (p10 %{customdata[0]:.4g}, p90 %{customdata[1]:.4g})"
                          "<extra></extra>"))
        mean = _num(rows["step_time_mean_s"])
        if mean.notna().any():  # the mean is what the window throughput pays; far above the median: stalls
            fig.add_trace(go.Scatter(x=mean, y=labels, mode="markers", name="mean",
                                     marker={"symbol": "x", "size": 9, "color": "#222"},
                                     customdata=_num(rows["step_time_mean_vs_median"]) * 100,
                                     hovertemplate="mean %{x:.4g} s (%{customdata:+.1f}% vs median)<extra></extra>"))
        return layout(fig, f"{scale}: step time, median with p10-p90, x = mean", height=self._run_height(len(rows)),
                       xaxis={"title": "step time (s)", "rangemode": "tozero"},
                       yaxis={"automargin": True, "autorange": "reversed"}, showlegend=False)

    def memory(self, scale: str, group: pd.DataFrame) -> go.Figure:
        rows = with_labels(group)
        labels = [esc(x) for x in rows["label"]]
        # The bar: peak_mem_gib (GPU: reserved, the allocator's cache included), against the device's
        # memory; the plan's estimate is set beside the allocated peak where there is one (a diamond).
        fig = go.Figure(go.Bar(x=_num(rows["peak_mem_gib"]), y=labels, orientation="h", name="measured peak",
                               marker={"color": [self.styles[c]["color"] for c in rows["config"]]},
                               hovertext=[esc(r) for r in rows["run_id"]],
                               hovertemplate="%{hovertext}<br>measured %{x:.3g} GiB<extra></extra>"))
        allocated = _num(rows["peak_mem_allocated_gib"])
        if allocated.notna().any():
            fig.add_trace(go.Scatter(x=allocated, y=labels, mode="markers", name="allocated peak",
                                     marker={"symbol": "diamond-open", "size": 10, "color": "#222"},
                                     hovertemplate="allocated %{x:.3g} GiB (bar: reserved)<extra></extra>"))
        estimate = _num(rows["memory_estimate_gib"])
        if estimate.notna().any():
            fig.add_trace(go.Scatter(x=estimate, y=labels, mode="markers", name="plan estimate",
                                     marker={"symbol": "x", "size": 11, "color": "#222"},
                                     customdata=_num(rows["memory_vs_estimate_gib"]),
                                     hovertemplate="estimate %{x:.3g} GiB vs measured %{customdata:.3g} GiB"
                                                   "<extra></extra>"))
        device = _num(rows["device_memory_gib"])
        if device.notna().any():
            fig.add_trace(go.Scatter(x=device, y=labels, mode="markers", name="device memory",
                                     marker={"symbol": "line-ns-open", "size": 22, "color": "#d62728",
                                             "line": {"width": 3, "color": "#d62728"}},
                                     hovertemplate="device %{x:.3g} GiB<extra></extra>"))
        # the legend above the bars: long run labels already take the width beside them
        return layout(fig, f"{scale}: peak memory per GPU", height=self._run_height(len(rows)) + 30, top=80,
                       xaxis={"title": "GiB", "rangemode": "tozero"},
                       yaxis={"automargin": True, "autorange": "reversed"},
                       legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 1.02, "yanchor": "bottom"})

    def flop_breakdown(self, scale: str) -> tuple[go.Figure | None, str]:
        """Forward / backward FLOPs per part for the commonest lengths of this scale."""
        settings = Counter()
        breakdowns = {}
        for r in self.data.records:
            bd = ((r.flops_breakdown or {}).get("breakdown") or {})
            if r.scale != scale or not bd.get("parts"):
                continue
            key = (r.audio_frames, r.text_tokens, r.speaker_frames)
            settings[key] += 1
            breakdowns[key] = bd
        if not settings:
            return None, ""
        key = settings.most_common(1)[0][0]
        parts = breakdowns[key]["parts"]
        names = [p for p in FLOP_PARTS_ORDER if p in parts] + [p for p in parts if p not in FLOP_PARTS_ORDER]
        fig = go.Figure()
        for phase, color in (("forward", "#4c78a8"), ("backward", "#f58518")):
            fig.add_trace(go.Bar(x=[esc(n) for n in names], y=[parts[n].get(phase, 0) for n in names],
                                 name=phase, marker={"color": color},
                                 hovertemplate="%{x} " + phase + ": %{y:.4s}FLOP<extra></extra>"))
        total = breakdowns[key].get("total") or sum(p.get("total", 0) for p in parts.values())
        fig.update_layout(barmode="stack")
        title = f"{scale}: {flops_text(total)} per sample"
        others = [f"audio {k[0]} / text {k[1]} / speaker {k[2]}: {flops_text(breakdowns[k].get('total') or 0)}"
                  for k in settings if k != key]
        note = f"Lengths: audio {key[0]}, text {key[1]}, speaker {key[2]} frames."
        if others:
            note += " Other lengths at this scale: " + "; ".join(others) + "."
        return layout(fig, title, yaxis={"title": "FLOPs per sample", "tickformat": "~s"}), note


def flops_text(flops: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:.4g} {unit}"
    return f"{flops:.4g} FLOP"


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
    """Notes shown above the figures: what makes some MFU figures not comparable with others."""
    ok = data.ok
    notes = []
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
    peaks = ok.assign(_p=_num(ok["peak_tflops"])).groupby("configuration")["_p"].nunique()
    if (peaks > 1).any():  # e.g. two local sweeps, each against its own calibration
        notes.append(f"{int((peaks > 1).sum())} configuration(s) pool runs measured against different peaks: their "
                     "median MFU mixes denominators (samples/s and step times do not). See the peak column of the "
                     "table of runs.")
    if data.predicted_by:
        below = ok[ok["below_prediction"].map(flagged)]
        errors = _num(ok["prediction_error"]).dropna()
        notes.append(f"Predicted (echobench predict, profile {', '.join(data.predicted_by)}): open circles in the MFU "
                     f"figure, the predicted step and the residual (predicted - measured) / measured in the table of runs"
                     + (f"; mean |residual| {errors.abs().mean():.1%} over {len(errors)} runs" if len(errors) else "")
                     + f". {len(below)} run(s) more than {data.margin:.0%} below their predicted throughput"
                     + (": " + ", ".join(below["run_id"].astype(str)) if len(below) else "") + ".")
    retries = ok[_num(ok["num_alloc_retries"]).fillna(0) > 0]
    if len(retries):
        notes.append(f"{len(retries)} run(s) had CUDA allocator retries (flushes of the cache to satisfy an "
                     "allocation), which slow the steps they hit: " + ", ".join(retries["run_id"].astype(str)) + ".")
    return notes


def best_rows(configs: pd.DataFrame, scales: list[str], reference: pd.DataFrame | None = None) -> list[dict]:
    """Per scale and node count, the configuration of the highest median MFU over its runs (`configs`:
    ReportInput.configurations); with a reference, the published MFU of that layout (else the best
    published at that scale and node count, its layout named) and the difference in points."""
    rows = []
    for scale in scales:
        group = configs[configs["scale"] == scale]
        for nodes in sorted(_num(group["nodes"]).dropna().unique()):
            at = group[_num(group["nodes"]) == nodes]
            best = at.loc[_num(at["mfu"]).idxmax()]
            row = {"scale": scale, "nodes": int(nodes), "gpus": best["world_size"],
                   "mfu": fmt_number(best["mfu"], percent=True),
                   "mfu_range": f"{fmt_number(best['mfu_min'], percent=True)}-{fmt_number(best['mfu_max'], percent=True)}",
                   "repeats": int(best["repeats"]),
                   "tflops": fmt_number(best["tflops_per_gpu"]),
                   "samples": fmt_number(best["samples_per_s"]), "config": best["config"],
                   "run_id": best["run_id"], "notes": "; ".join(best["notes"]), "n": len(at)}
            if reference is not None:
                row.update(published_beside(reference, best))
            rows.append(row)
    return rows


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


# Full table of runs: (frame column, header, kind) where kind picks the formatting.
RUN_COLUMNS = [
    ("run_id", "run", "text"), ("status", "status", "text"), ("scale", "scale", "text"),
    ("framework", "framework", "text"), ("parallelism", "parallelism", "text"), ("nodes", "nodes", "int"),
    ("world_size", "GPUs", "int"), ("micro_batch", "micro-batch", "int"), ("global_batch", "global batch", "int"),
    ("repeat", "repeat", "int"), ("steps", "steps", "int"), ("warmup_steps", "warm-up", "int"),
    ("step_time_s", "step time (s)", "num"), ("step_time_p10_s", "p10 (s)", "num"),
    ("step_time_p90_s", "p90 (s)", "num"), ("step_time_mean_vs_median", "mean vs median (%)", "pct"),
    ("samples_per_s", "samples/s", "num"),
    ("samples_per_s_per_gpu", "samples/s/GPU", "num"), ("audio_seconds_per_s_per_gpu", "audio s/s/GPU", "num"),
    ("tflops_per_gpu", "TFLOP/s/GPU", "num"), ("mfu", "MFU (%)", "pct"), ("hfu", "HFU (%)", "pct"),
    ("mfu_fp8_peak", "MFU fp8 peak (%)", "pct"), ("peak_label", "peak", "text"),
    ("peak_mem_gib", "memory (GiB)", "num"), ("peak_mem_allocated_gib", "allocated (GiB)", "num"),
    ("memory_estimate_gib", "estimate (GiB)", "num"),
    ("num_alloc_retries", "alloc retries", "int"),
    ("lengths", "lengths a/t/s", "text"), ("padded_flops_frac", "padded FLOPs (%)", "pct"),
    ("padded_tokens", "padded tokens a/t/s (%)", "text"), ("precision", "precision", "text"),
    ("compile", "compile", "text"),
    ("ac", "ac", "text"), ("device_name", "device", "text"), ("hostname", "host", "text"), ("time", "time", "text"),
    ("notes", "notes", "text"), ("error", "error", "text"),
]


# With predictions (report --profile): after the step-time columns, the predicted step and the residual.
PREDICTED_RUN_COLUMNS = [("predicted_step_time_s", "predicted step (s)", "num"),
                         ("prediction_error", "vs prediction (%)", "pct")]


def run_columns(data: ReportInput) -> list[tuple[str, str, str]]:
    if not data.predicted_by:
        return RUN_COLUMNS
    at = [c[0] for c in RUN_COLUMNS].index("step_time_mean_vs_median") + 1
    return RUN_COLUMNS[:at] + PREDICTED_RUN_COLUMNS + RUN_COLUMNS[at:]


def run_rows(frame: pd.DataFrame, scales: list[str], columns: list[tuple[str, str, str]] = RUN_COLUMNS) -> list[dict]:
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
    rows = []
    for _, r in frame.sort_values(["_s", "framework", "parallelism", "nodes", "run_id"]).iterrows():
        cells = []
        for column, _, kind in columns:
            value = r[column]
            missing = value is None or (not isinstance(value, str) and pd.isna(value))
            if missing:
                cells.append({"text": "", "sort": ""})
            elif kind == "num":
                cells.append({"text": fmt_number(value), "sort": repr(float(value))})
            elif kind == "pct":
                cells.append({"text": fmt_number(value, percent=True), "sort": repr(float(value))})
            elif kind == "int":
                cells.append({"text": str(int(value)), "sort": str(int(value))})
            else:
                cells.append({"text": str(value), "sort": str(value)})
        retries = _num(pd.Series([r["num_alloc_retries"]])).fillna(0).iloc[0]
        rows.append({"scale": r["scale"], "status": r["status"], "path": r["path"] or "", "cells": cells,
                     "fp8": r["precision"] == "fp8", "retries": bool(retries > 0), "below": flagged(r["below_prediction"]),
                     "calibrated": _peak_kind(r["peak_source"]) == "calibrated"})
    return rows


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
         "memory (where the record has it: GPU runs) and, where the plan gave one, its estimate, to compare with "
         "the allocated peak (GPU runs: the diamond; else the bar).",
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
    best = [{**b, "waterfall": links.get(b["run_id"])} for b in best_rows(figs.configs, scales, reference)]
    return template.render(
        generated=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        facts=header_facts(data), flop_convention=FLOP_CONVENTION, message=message, scales=scales,
        problems=data.problems, notes=page_notes(data), best=best, sections=sections,
        reference=reference_path if reference is not None else None,
        unplotted=unplotted_published(reference, figs.configs),
        failed=failed_rows(data), skipped=data.skipped,
        run_headers=[(h, kind) for _, h, kind in run_columns(data)], runs=run_rows(data.frame, scales, run_columns(data)),
        margin=f"{(data.margin or 0) * 100:g}",
        plotlyjs=get_plotlyjs(),
    )
