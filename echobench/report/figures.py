"""The dashboard's figures (echobench.report.dashboard lays out the page): per scale, MFU,
throughput, scaling, step time, memory and the FLOPs by part, with their line styles and the
GPU-count axis; plotly figures from the report's frame (echobench.report.data)."""

from __future__ import annotations

import math
from collections import Counter

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from echobench.report.checks import config_flags, run_flags
from echobench.report.data import ReportInput, scale_order, setting_text, varying_keys
from echobench.report.plotting import esc, layout

FLOP_PARTS_ORDER = ("dit_attention", "dit_mlp", "dit_conditioning", "dit_io", "speaker_encoder",
                    "text_projection", "text_encoder")


def numeric(series) -> pd.Series:
    return pd.to_numeric(series, errors="coerce")


def with_labels(group: pd.DataFrame) -> pd.DataFrame:
    """Rows sorted by configuration and nodes, each with a short label unique within the group."""
    rows = group.assign(_n=numeric(group["nodes"])).sort_values(["config", "_n", "run_id"])
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
PATTERNS = ("", "/", "x", ".", "-")  # a bar's fill pattern: what the dash is to a line
FLAG_COLOR = "#d62728"
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "triangle-down", "star", "hexagon", "pentagon")


def line_styles(frame: pd.DataFrame) -> dict[str, dict]:
    """Configuration label -> {color, dash, symbol}: one colour per framework + parallelism on the
    whole page, so a layout looks the same in every figure."""
    pairs = frame[["framework", "parallelism", "config"]].astype(str).drop_duplicates()
    styles = {}
    for i, ((_, _), labels) in enumerate(pairs.groupby(["framework", "parallelism"], sort=True)):
        for k, label in enumerate(sorted(labels["config"])):
            styles[label] = {"color": PALETTE[i % len(PALETTE)], "dash": DASHES[k % len(DASHES)],
                             "symbol": SYMBOLS[k % len(SYMBOLS)], "pattern": PATTERNS[k % len(PATTERNS)]}
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
    gpus = sorted(set(numeric(group["world_size"]).dropna().astype(int)))
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
        self.config_flags = config_flags(self.configs)  # configs index -> flags (checks.value_flags)
        self.run_flags = run_flags(self.ok, self.configs)  # frame index -> flags

    def _flag_trace(self, points: list[tuple], flags: dict, columns: tuple[str, ...]) -> list[go.Scatter]:
        """A red ring round every drawn point whose value is flagged (checks.value_flags), its reasons
        in the hover; points: (row index, x, y) as drawn. [] when none is."""
        xs, ys, texts = [], [], []
        for index, x, y in points:
            reasons = [f.reason for f in flags.get(index, []) if f.column in columns]
            if reasons and not (pd.isna(x) or pd.isna(y)):
                xs.append(x)
                ys.append(y)
                texts.append("<b>flagged value</b><br>" + "<br>".join(esc(r) for r in reasons))
        if not xs:
            return []
        return [go.Scatter(x=xs, y=ys, mode="markers", name="\u26a0 flagged value (hover: why)", text=texts,
                           marker={"symbol": "circle-open", "size": 20, "color": FLAG_COLOR, "line": {"width": 2.5}},
                           hovertemplate="%{text}<extra></extra>")]

    def _line(self, config: str) -> dict:
        style = self.styles[config]
        return {"line": {"color": style["color"], "dash": style["dash"]}, "marker": {"symbol": style["symbol"], "size": 8}}

    def _per_config(self, group: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
        """(label, rows sorted by GPUs) for each configuration across node counts, by label (legends
        read alike in every figure); group holds one row per configuration and node count. Rows
        carry _g, the GPU count, and _x, where it is drawn: _g dodged by the label's place (dodge)."""
        lines = sorted(((rows["config"].iloc[0], rows.assign(_g=numeric(rows["world_size"])).sort_values("_g"))
                        for _, rows in group.groupby("layout", sort=False)), key=lambda item: item[0])
        gpus = numeric(group["world_size"]).dropna()
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
            mfu, lo, hi = (numeric(rows[c]) * 100 for c in ("mfu", "mfu_min", "mfu_max"))
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
        points = [(i, x, m * 100) for _, rows in self._per_config(group)
                  for i, x, m in zip(rows.index, rows["_x"], numeric(rows["mfu"]))]
        for trace in self._flag_trace(points, self.config_flags, ("mfu",)):
            fig.add_trace(trace)
        return layout(fig, f"{scale}: MFU vs GPUs (median over runs, bars min-max)", xaxis=gpu_axis(group),
                       yaxis={"title": "MFU (%)", "rangemode": "tozero"})

    def _predicted(self, group: pd.DataFrame) -> list[go.Scatter]:
        """Per configuration, its predicted MFU (report --profile: the median over its runs' predictions)
        as open circles on a dotted line in its colour, at its dodged x; one legend entry for all."""
        if not self.data.predicted_by or numeric(group["predicted_mfu"]).isna().all():
            return []
        traces = []
        for config, rows in self._per_config(group):
            predicted, measured = numeric(rows["predicted_mfu"]) * 100, numeric(rows["mfu"]) * 100
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
                at = rows[numeric(rows["nodes"]) == p.nodes]
                gpus = p.nodes * int(first["gpus_per_node"])
                if (p.Index, gpus) in placed:  # another configuration of the layout: one marker is enough
                    continue
                placed.add((p.Index, gpus))
                shift = first["_x"] / first["_g"]  # at this configuration's dodged x
                measured = f"measured {numeric(at['mfu']).iloc[0] * 100:.3g}%, {(numeric(at['mfu']).iloc[0] - p.ref_mfu) * 100:+.1f} pp" \
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

    @staticmethod
    def _failed_labels(group: pd.DataFrame, failed: pd.DataFrame) -> list[str]:
        """Labels for configurations that only failed: the page's, unless a configuration that ran
        has that label (labels name what differs between successful runs); then with the settings
        that differ from it added (e.g. `torchtitan ddp ac=full`)."""
        ran = dict(zip(group["config"], zip(group["layout"], group["settings"])))
        labels = []
        for label, key, settings in zip(failed["config"], failed["layout"], failed["settings"]):
            other = ran.get(label)
            if other is None or other[0] == key:
                labels.append(label)
                continue
            keys = varying_keys([other[1], settings])
            labels.append(" ".join([label, *(setting_text(k, settings.get(k)) for k in keys)]))
        return labels

    def layouts(self, scale: str, group: pd.DataFrame, failed: pd.DataFrame) -> go.Figure:
        """At each node count (x), one bar per configuration (`group`: one row per configuration and
        node count): its median MFU, bars min-max; the best at each node count outlined in black and
        starred. A configuration whose runs at a node count all failed (`failed`: the frame's failed
        rows of this scale) stands there as an empty bar labelled with the status: failed, not zero."""
        group = group.assign(_n=numeric(group["nodes"]).astype(int))
        measured = set(zip(group["layout"], group["_n"]))
        failed = failed.assign(_n=numeric(failed["nodes"]).astype(int))
        failed = failed[pd.Series([(lay, n) not in measured for lay, n in zip(failed["layout"], failed["_n"])],
                                   index=failed.index, dtype=bool)]
        failed = failed.assign(_label=failed["config"], config=self._failed_labels(group, failed))
        category = {n: f"{n} node{'s' if n != 1 else ''}" for n in sorted(set(group["_n"]) | set(failed["_n"]))}
        crowns = self.data.crowns
        lost_label = dict(zip(failed["config"], failed["_label"]))  # a failed one's label -> the page's label
        fig, top = go.Figure(), 1.0
        for config in sorted(set(group["config"]) | set(failed["config"])):
            bars = []  # (node count, MFU %, minus, plus, outline width, text, hover)
            for index, r in group[group["config"] == config].sort_values("_n").iterrows():
                mfu, low, high = (float(r[c]) * 100 for c in ("mfu", "mfu_min", "mfu_max"))
                reasons = [f.reason for f in self.config_flags.get(index, []) if f.column == "mfu"]
                mark = crowns[index].mark if index in crowns else ""
                winner = mark == "best"
                label = {"best": "\u2605 ", "tie": "\u2248 "}.get(mark, "") + (f"{mfu:.3g}%" if mark or reasons else "") \
                    + (" \u26a0" if reasons else "")
                runs = f"median of {r['repeats']} runs" if r["repeats"] > 1 else "1 run"
                said = (" (best at this node count)" if winner else " (tied for best at this node count: "
                        + esc("; ".join(crowns[index].tied_with)) + ")" if mark == "tie" else "")
                hover = (f"<b>{esc(config)}</b>{said}<br>{r['_n']} node(s), "
                         f"{r['world_size']} GPUs<br>MFU {mfu:.3g}% ({runs}, {low:.3g}-{high:.3g}%)<br>samples/s "
                         f"{float(r['samples_per_s']):.4g}" + "".join(f"<br>\u26a0 {esc(x)}" for x in reasons))
                bars.append((r["_n"], mfu, max(mfu - low, 0), max(high - mfu, 0), 3 if winner else 0, label, hover))
                top = max(top, high)
            for n, runs in failed[failed["config"] == config].groupby("_n"):
                statuses = ", ".join(sorted(set(runs["status"].astype(str))))
                error = str(runs["error"].iloc[0] or "")[:200]
                bars.append((n, 0, 0, 0, 0, f"failed: {statuses}", f"<b>{esc(config)}</b><br>{n} node(s): every run "
                             f"failed ({esc(statuses)})<br>{esc(error)}"))
            n, y, minus, plus, widths, texts, hovers = zip(*sorted(bars))
            style = self.styles.get(config) or self.styles[lost_label.get(config, config)]
            fig.add_trace(go.Bar(x=[category[k] for k in n], y=y, name=esc(config), text=texts, textposition="outside",
                                 cliponaxis=False, hovertext=hovers, hovertemplate="%{hovertext}<extra></extra>",
                                 error_y={"type": "data", "array": plus, "arrayminus": minus,
                                          "visible": any(plus) or any(minus), "color": "#444"},
                                 marker={"color": style["color"], "pattern": {"shape": style["pattern"]},
                                         "line": {"color": "#111", "width": widths}}))
        return layout(fig, f"{scale}: MFU of each configuration at each node count (\u2605 best)", height=380,
                      barmode="group", xaxis={"title": "nodes", "type": "category", "categoryorder": "array",
                                              "categoryarray": list(category.values())},
                      yaxis={"title": "MFU (%)", "range": [0, top * 1.2]})

    def throughput(self, scale: str, group: pd.DataFrame) -> go.Figure:
        fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                            subplot_titles=("samples/s per GPU", "audio seconds/s per GPU"))
        for config, rows in self._per_config(group):
            for row, column in ((1, "samples_per_s_per_gpu"), (2, "audio_seconds_per_s_per_gpu")):
                y = numeric(rows[column])
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
        base = int(numeric(rows["world_size"]).iloc[0])
        return go.Scatter(x=rows["_x"], y=[y] * len(rows), mode="lines", legendgroup=esc(config),
                          showlegend=False, name=f"{esc(config)}: ideal", opacity=0.6,
                          line={"color": self.styles[config]["color"], "dash": "dot", "width": 1.5},
                          hovertemplate=f"{esc(config)}<br>ideal (linear) scaling from {base} GPUs: {what}<extra></extra>")

    def scaling_efficiency(self, scale: str, group: pd.DataFrame) -> go.Figure | str:
        """The figure, or why there is none: a configuration at one GPU count is 100% by definition."""
        fig = go.Figure()
        flagged = []
        for config, rows in self._per_config(group):
            if len(rows) < 2:  # one GPU count: 100% by definition (a dot hiding the others' first)
                continue
            per_gpu = numeric(rows["samples_per_s_per_gpu"])
            efficiency = per_gpu / per_gpu.iloc[0] * 100
            flagged += list(zip(rows.index, rows["_x"], efficiency))
            base = int(numeric(rows["world_size"]).iloc[0])
            fig.add_trace(go.Scatter(x=rows["_x"], y=efficiency, name=esc(config), mode="lines+markers",
                                     text=self._hover(rows), hovertemplate=f"%{{text}}<br>%{{y:.1f}}% of the per-GPU "
                                     f"rate at {base} GPUs<extra></extra>", **self._line(config)))
        if not fig.data:
            return f"{scale}: every configuration ran at one GPU count: no scaling to show"
        gpus = numeric(group["world_size"]).dropna()
        fig.add_trace(go.Scatter(x=[gpus.min(), gpus.max()], y=[100, 100], mode="lines", name="ideal (linear) scaling",
                                 line={"color": "#666", "dash": "dot", "width": 1.5},
                                 hovertemplate="ideal: 100%<extra></extra>"))
        for trace in self._flag_trace(flagged, self.config_flags, ("efficiency",)):
            fig.add_trace(trace)
        return layout(fig, f"{scale}: scaling efficiency vs each configuration's smallest GPU count",
                       xaxis=gpu_axis(group), yaxis={"title": "efficiency (%)", "rangemode": "tozero"})

    def _run_height(self, n: int) -> int:
        return 110 + 30 * n

    def step_time(self, scale: str, group: pd.DataFrame) -> go.Figure:
        rows = with_labels(group)
        med, p10, p90 = numeric(rows["step_time_s"]), numeric(rows["step_time_p10_s"]), numeric(rows["step_time_p90_s"])
        labels = [esc(x) for x in rows["label"]]
        fig = go.Figure(go.Scatter(
            x=med, y=labels, mode="markers", name="median",
            marker={"color": [self.styles[c]["color"] for c in rows["config"]], "size": 9},
            error_x={"type": "data", "array": (p90 - med).clip(lower=0), "arrayminus": (med - p10).clip(lower=0)},
            text=[f"{esc(r)} ({n} steps)" for r, n in zip(rows["run_id"], rows["steps"])],
            customdata=list(zip(p10, p90)),
            hovertemplate="%{text}<br>median %{x:.4g} s (p10 %{customdata[0]:.4g}, p90 %{customdata[1]:.4g})"
                          "<extra></extra>"))
        mean = numeric(rows["step_time_mean_s"])
        if mean.notna().any():  # the mean is what the window throughput pays; far above the median: stalls
            fig.add_trace(go.Scatter(x=mean, y=labels, mode="markers", name="mean",
                                     marker={"symbol": "x", "size": 9, "color": "#222"},
                                     customdata=numeric(rows["step_time_mean_vs_median"]) * 100,
                                     hovertemplate="mean %{x:.4g} s (%{customdata:+.1f}% vs median)<extra></extra>"))
        for trace in self._flag_trace(list(zip(rows.index, med, labels)), self.run_flags, ("step_time_s",)):
            fig.add_trace(trace)
        return layout(fig, f"{scale}: step time, median with p10-p90, x = mean", height=self._run_height(len(rows)),
                       xaxis={"title": "step time (s)", "rangemode": "tozero"},
                       yaxis={"automargin": True, "autorange": "reversed"}, showlegend=False)

    def memory(self, scale: str, group: pd.DataFrame) -> go.Figure:
        rows = with_labels(group)
        labels = [esc(x) for x in rows["label"]]
        # The bar: peak_mem_gib (GPU: reserved, the allocator's cache included), against the device's
        # memory; the plan's estimate is set beside the allocated peak where there is one (a diamond).
        fig = go.Figure(go.Bar(x=numeric(rows["peak_mem_gib"]), y=labels, orientation="h", name="measured peak",
                               marker={"color": [self.styles[c]["color"] for c in rows["config"]]},
                               hovertext=[esc(r) for r in rows["run_id"]],
                               hovertemplate="%{hovertext}<br>measured %{x:.3g} GiB<extra></extra>"))
        allocated = numeric(rows["peak_mem_allocated_gib"])
        if allocated.notna().any():
            fig.add_trace(go.Scatter(x=allocated, y=labels, mode="markers", name="allocated peak",
                                     marker={"symbol": "diamond-open", "size": 10, "color": "#222"},
                                     hovertemplate="allocated %{x:.3g} GiB (bar: reserved)<extra></extra>"))
        estimate = numeric(rows["memory_estimate_held_gib"])
        if estimate.notna().any():
            # a CPU run without its measured resident baseline (an older record) was held against the plan's total
            cpu = numeric(rows["device_memory_gib"]).isna() & numeric(rows["memory_baseline_gib"]).isna()
            said = [f"estimate {e:.3g} GiB vs measured {m:.3g} GiB: {err:+.0%}" + (" (CPU: not comparable)" if c else "")
                    if pd.notna(e) and pd.notna(m) else ""
                    for e, m, err, c in zip(estimate, numeric(rows["memory_vs_estimate_gib"]),
                                            numeric(rows["memory_estimate_error"]), cpu)]
            fig.add_trace(go.Scatter(x=estimate, y=labels, mode="markers", name="plan estimate",
                                     marker={"symbol": "x", "size": 11, "color": "#222"},
                                     hovertext=said, hovertemplate="%{hovertext}<extra></extra>"))
        device = numeric(rows["device_memory_gib"])
        if device.notna().any():
            fig.add_trace(go.Scatter(x=device, y=labels, mode="markers", name="device memory",
                                     marker={"symbol": "line-ns-open", "size": 22, "color": "#d62728",
                                             "line": {"width": 3, "color": "#d62728"}},
                                     hovertemplate="device %{x:.3g} GiB<extra></extra>"))
        for trace in self._flag_trace(list(zip(rows.index, numeric(rows["peak_mem_gib"]), labels)), self.run_flags,
                                      ("peak_mem_gib",)):
            fig.add_trace(trace)
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

