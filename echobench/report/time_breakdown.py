"""The dashboard's "Where the time goes": stacked parts of the step per configuration, and the MFU
waterfall of a selected run (drawn in the page from the data here, one run at a time).

Reads only the records' `breakdown` summary (written by `--trace` runs; echobench.train.breakdown).
"""

from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go

from echobench.train.breakdown import CATEGORIES, LABELS, waterfall
from echobench.report.data import ReportInput
from echobench.report.plotting import PLOT_CONFIG, esc, figure_html, layout, panel
from echobench.records.results import Record
from echobench.records.states import RunState

COLORS = {"gemm": "#1f77b4", "attention": "#17becf", "optimizer": "#9467bd", "other_compute": "#ff7f0e",
          "memcpy": "#8c564b", "communication": "#d62728", "data_wait": "#bcbd22", "idle": "#c7c7c7"}
LEGEND = {"gemm": "GEMM", "attention": "attention", "optimizer": "optimizer", "other_compute": "other compute",
          "memcpy": "memory copies", "communication": "exposed comm", "data_wait": "data wait", "idle": "idle"}
CAPTION = ("One step's time on the busiest device (GPU streams; on CPU runs the main thread), from the profiler "
           "trace of a few steps after the measured ones (runs with trace: true or --trace). Bars: the parts as "
           "a share of the step, mean over a configuration's profiled repeats. The waterfall goes from the peak "
           "to the run's MFU in percentage points (docs/explanation/time.md); its padding step is the matmul "
           "time spent on padded tokens (docs/explanation/mfu.md); pick a run, or follow a "
           "'waterfall' link in the best-MFU table.")
EMPTY = "No profiled runs: set trace: true in the matrix (or run --trace) to see where the step's time goes."


def profiled_rows(data: ReportInput) -> pd.DataFrame:
    """One row per successful record with a breakdown: its labels and the parts' fractions."""
    rows = []
    frame = data.frame
    for i, r in enumerate(data.records):
        fractions = (r.breakdown or {}).get("fractions")
        if r.status != RunState.OK or not fractions or r.mfu is None:
            continue
        row = frame.iloc[i]
        rows.append({"run_id": r.run_id, "scale": r.scale, "config": row["config"],
                     "configuration": row["configuration"], "nodes": row["nodes"], "repeat": r.repeat,
                     "step_time_s": r.breakdown.get("step_time_s"), **{c: fractions.get(c, 0.0) for c in CATEGORIES}})
    return pd.DataFrame(rows, columns=["run_id", "scale", "config", "configuration", "nodes", "repeat", "step_time_s",
                                       *CATEGORIES])


def stacked_parts(scale: str, rows: pd.DataFrame) -> go.Figure:
    """Horizontal bars, one per configuration of this scale: the parts of its step, stacked to 100%."""
    means = (rows.groupby("configuration", sort=False)
             .agg(config=("config", "first"), nodes=("nodes", "first"), n=("run_id", "size"),
                  step_time_s=("step_time_s", "mean"), **{c: (c, "mean") for c in CATEGORIES}))
    means = means.assign(_n=pd.to_numeric(means["nodes"], errors="coerce")).sort_values(["config", "_n"])
    labels = [esc(f"{c} | {n}n") for c, n in zip(means["config"], means["nodes"])]
    fig = go.Figure()
    for c in CATEGORIES:
        ms = means[c] * means["step_time_s"] * 1e3
        fig.add_trace(go.Bar(x=means[c] * 100, y=labels, orientation="h", name=LEGEND[c],
                             marker={"color": COLORS[c]}, customdata=list(zip(ms, means["n"])),
                             hovertemplate="%{y}<br>" + esc(LABELS[c]) + ": %{x:.1f}% of the step "
                                           "(%{customdata[0]:.3g} ms), %{customdata[1]} profiled run(s)<extra></extra>"))
    return layout(fig, f"{scale}: where one step's time goes (share of the step)", height=200 + 34 * len(means), bottom=40,
                  legend={"orientation": "h", "y": -0.12, "yanchor": "top", "traceorder": "normal"},
                  barmode="stack", xaxis={"range": [0, 100], "ticksuffix": "%"},
                  yaxis={"automargin": True, "autorange": "reversed"})


def waterfall_figure(record: Record) -> go.Figure | None:
    steps = waterfall(record)
    if steps is None:
        return None
    # A step of unknown size (padding in an older record) is drawn flat, its text "unknown": not a 0 of padding.
    fig = go.Figure(go.Waterfall(
        x=[s["short"] for s in steps], y=[0.0 if s["pp"] is None else s["pp"] for s in steps],
        measure=[s["kind"] for s in steps],
        text=["unknown" if s["pp"] is None else f"{s['pp']:.2f}" if s["kind"] != "relative" else f"{s['pp']:+.2f}"
              for s in steps],
        textposition="outside", hovertext=[s["label"] for s in steps],
        hovertemplate="%{hovertext}: %{text} points<extra></extra>",
        decreasing={"marker": {"color": "#d62728"}}, increasing={"marker": {"color": "#2ca02c"}},
        totals={"marker": {"color": "#1f77b4"}}, connector={"line": {"color": "#999", "width": 1}}))
    return layout(fig, f"{record.run_id}: MFU waterfall (points of the peak)", height=420, bottom=80,
                  yaxis={"title": "% of peak", "rangemode": "tozero"}, showlegend=False)


def script_json(obj) -> str:
    """JSON for a <script type="application/json"> block: no '<', '>' or '&' that could end it."""
    return json.dumps(obj, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def time_section(data: ReportInput, scales: list[str]) -> dict:
    """The section for the page: per-scale panels of stacked parts, the waterfall runs to choose
    from (best MFU first), their figures as JSON for the page to draw, and run id -> the run whose
    waterfall a best-MFU row links to (a profiled repeat of the same configuration)."""
    rows = profiled_rows(data)
    section = {"id": "time", "title": "Where the time goes", "caption": CAPTION, "panels": [], "empty": EMPTY,
               "waterfall": None, "links": {}}
    if rows.empty:
        return section
    for i, scale in enumerate(scales):
        group = rows[rows["scale"] == scale]
        section["panels"].append(panel(scale, empty=f"{scale}: no profiled runs") if group.empty
                                 else panel(scale, html=figure_html(stacked_parts(scale, group), f"fig-time-{i}")))
    by_id = {r.run_id: r for r in data.records}
    figures, template, options = {}, None, []
    order = sorted(rows.itertuples(), key=lambda r: -by_id[r.run_id].mfu)
    for r in order:
        fig = waterfall_figure(by_id[r.run_id])
        spec = json.loads(fig.to_json())
        template = spec["layout"].pop("template", template)  # sent once, not per run
        figures[r.run_id] = spec
        options.append({"id": r.run_id, "label": f"{r.run_id} ({by_id[r.run_id].mfu:.2%} MFU)"})
    section["waterfall"] = {"options": options,
                            "payload": script_json({"template": template, "config": PLOT_CONFIG, "runs": figures})}
    first_profiled = {}
    for r in sorted(rows.itertuples(), key=lambda r: (r.repeat, r.run_id)):
        first_profiled.setdefault(r.configuration, r.run_id)
    frame = data.frame
    section["links"] = {run_id: first_profiled[key] for run_id, key in zip(frame["run_id"], frame["configuration"])
                        if key in first_profiled}
    return section
