"""The dashboard's "Tune" section (echobench tune): per scale and node count, every ranked candidate's
predicted samples/s beside the measured samples/s of those the tune ran, and a table of the measured.

Drawn only from the tune.json files echobench.report.data.load_tunes found and checked. Their text
is data: the page's template escapes it, and figure text goes through plotting.esc (plotly renders
a subset of HTML in hover text and legends).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from echobench.report.data import TUNE_SETTINGS, TuneDoc
from echobench.report.figures import PALETTE
from echobench.report.plotting import esc, figure_html, layout, panel
from echobench.report.tables import fmt_number

PREDICTED_COLOR, INTERVAL_COLOR = "#9e9e9e", "#d0d0d0"
CAPTION = ("Per scale and node count, what echobench tune ranked and what it measured. x: a candidate's rank by the "
           "performance model's predicted samples/s (1 = predicted best); y: samples/s, log axis. Grey: every ranked "
           "candidate's prediction, bars over its interval (the calibration's worst to best figures); coloured, by "
           "layout family: the measured samples/s of the candidates that ran ok; star: the measured winner. The "
           "table lists every measured candidate (a failed one with its error); residual = measured / predicted - 1.")


def _setting(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "-" if value is None else str(value)


def settings_text(c: dict) -> str:
    return ", ".join(f"{short} {_setting(c['settings'][key])}" for key, short in TUNE_SETTINGS)


def _hover(c: dict, winner) -> str:
    lines = [f"<b>{esc(c['run_id'])}</b>" + (" (measured winner)" if c["run_id"] == winner else ""),
             f"rank {c['rank']}, family {esc(c['family'])} ({esc(c['layout'])})", esc(settings_text(c)),
             f"predicted {c['predicted']:.4g} samples/s [{c['low']:.4g}, {c['high']:.4g}]"]
    if c["measured_ok"]:
        lines.append(f"measured {c['samples_per_s']:.4g} samples/s" +
                     ("" if c["residual"] is None else f" ({c['residual']:+.1%} vs predicted)"))
    elif c["measured"]:
        lines.append(f"measured: {esc(c['status'])}")
    return "<br>".join(lines)


def log_ticks(values) -> dict:
    """y ticks at 1, 2 and 5 times the powers of ten the values span, labelled in full (plotly labels
    its own minor log ticks with a bare digit: '3' for 300); plotly's own where these are too few."""
    values = [v for v in values if v > 0]
    if not values:
        return {}
    lo, hi = min(values), max(values)
    ticks = [m * 10 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5) if lo <= m * 10 ** k <= hi]
    return {"tickvals": ticks, "ticktext": [fmt_number(t) for t in ticks]} if len(ticks) >= 2 else {}


def tune_figure(problem: dict) -> go.Figure:
    """Grey: every ranked candidate's prediction with its interval; then per family, the measured
    samples/s of its candidates that ran ok; the winner as a star of its family's colour, in a trace
    of its own (drawn over its family's marker, it would hide it)."""
    cands, winner = problem["candidates"], problem["winner"]
    colors = {f: PALETTE[i % len(PALETTE)] for i, f in enumerate(sorted({c["family"] for c in cands}))}
    fig = go.Figure(go.Scatter(
        x=[c["rank"] for c in cands], y=[c["predicted"] for c in cands], mode="markers",
        name=f"predicted (all {len(cands)})", marker={"color": PREDICTED_COLOR, "size": 6},
        error_y={"type": "data", "array": [c["high"] - c["predicted"] for c in cands],
                 "arrayminus": [c["predicted"] - c["low"] for c in cands], "color": INTERVAL_COLOR, "thickness": 1,
                 "width": 0},
        text=[_hover(c, winner) for c in cands], hovertemplate="%{text}<extra></extra>"))
    measured = [c for c in cands if c["measured_ok"]]
    for family in sorted({c["family"] for c in measured}):
        points = [c for c in measured if c["family"] == family and c["run_id"] != winner]
        if points:
            fig.add_trace(go.Scatter(x=[c["rank"] for c in points], y=[c["samples_per_s"] for c in points],
                                     mode="markers", name=f"measured: {esc(family)}", legendgroup=esc(family),
                                     marker={"color": colors[family], "size": 10, "line": {"color": "#fff", "width": 1}},
                                     text=[_hover(c, winner) for c in points], hovertemplate="%{text}<extra></extra>"))
    best = next((c for c in measured if c["run_id"] == winner), None)
    if best is not None:
        fig.add_trace(go.Scatter(x=[best["rank"]], y=[best["samples_per_s"]], mode="markers",
                                 name=f"measured winner: {esc(best['family'])}", legendgroup=esc(best["family"]),
                                 marker={"color": colors[best["family"]], "size": 18, "symbol": "star",
                                         "line": {"color": "#222", "width": 1}},
                                 text=[_hover(best, winner)], hovertemplate="%{text}<extra></extra>"))
    return layout(fig, f"{problem['key']}: predicted (all candidates) vs measured samples/s", height=380,
                  xaxis={"title": "rank by predicted samples/s", "rangemode": "tozero"},
                  yaxis={"title": "samples/s (log axis)", "type": "log",
                         **log_ticks([c["low"] for c in cands] + [c["high"] for c in cands]
                                     + [c["samples_per_s"] for c in measured])})


def _rows(problem: dict) -> list[dict]:
    """The measured candidates, by rank: table cells as text."""
    rows = []
    for c in problem["candidates"]:
        if not c["measured"]:
            continue
        rows.append({"rank": c["rank"], "run_id": c["run_id"], "family": c["family"],
                     "settings": [_setting(c["settings"][key]) for key, _ in TUNE_SETTINGS],
                     "predicted": f"{fmt_number(c['predicted'])} [{fmt_number(c['low'])}, {fmt_number(c['high'])}]",
                     "measured": fmt_number(c["samples_per_s"]) if c["measured_ok"] else c["status"],
                     "error": "" if c["measured_ok"] else c["error"],
                     "residual": "-" if c["residual"] is None else f"{c['residual'] * 100:+.1f}%",
                     "round": "-" if c["round"] is None else str(c["round"]), "winner": c["run_id"] == problem["winner"]})
    return rows


def _tau(value) -> str:
    return "-" if value is None else f"{float(value):.2f}"


def _lines(problem: dict, header: dict) -> list[str]:
    """What the tune concluded for this problem, a line each (plain text: the template escapes it)."""
    by_id = {c["run_id"]: c for c in problem["candidates"]}
    win, tau = by_id.get(problem["winner"]), problem["tau"]
    pruned = problem["pruned_counts"]
    profile = f"Ranked on {header['shipped']}" + (
        f"; re-ranked on {header['final']}" + (f" ({header['fit_note']})" if header["fit_note"] else "")
        if header["fit_note"] or header["final"] != header["shipped"] else "") + "."
    return [
        f"Measured winner: {win['run_id']} (rank {win['rank']}, {fmt_number(win['samples_per_s'])} samples/s)."
        if win and win["measured_ok"] else "No measured winner: no measured candidate ran ok.",
        f"Predicted winner: {problem['predicted_winner']}"
        + (" (the measured winner)." if problem["predicted_winner"] == problem["winner"] else "."),
        *(["Within measurement noise of the winner (one-sided Mann-Whitney U on step times per sample, "
           "p >= 0.05): " + ", ".join(f"{rid} (p = {pv:.2f})" for rid, pv in problem["ties"]) + "."]
          if problem["ties"] else []),
        f"Stopped: {problem['stop'] or '- (not recorded)'}.",
        f"Kendall's tau of predicted vs measured samples/s over {tau['runs']} measured run(s): "
        f"{_tau(tau['shipped'])} on the shipped profile, {_tau(tau['final'])} on the final one.",
        profile,
        f"{len(problem['candidates'])} candidates ranked; pruned: "
        + (", ".join(f"{n} by {kind}" for kind, n in sorted(pruned.items(), key=lambda kv: -kv[1])) if pruned else "none")
        + ".",
    ]


def _header_text(h: dict) -> str:
    hours = "" if h["device_hours"] is None else f"; {h['device_hours']:.3g} device-hours measured"
    return (f"Tune {h['name']}: tune file {h['tune_file']}, {h['date']}; executor {h['executor']}{hours}"
            + ("; interrupted (the same echobench tune resumes it)" if h["interrupted"] else "") + ".")


def tune_section(tunes: list[TuneDoc]) -> dict | None:
    """The section for the page, None without tune files (the page is then as before)."""
    if not tunes:
        return None
    out = []
    for t, tune in enumerate(tunes):
        problems = []
        for i, p in enumerate(tune.problems):
            figure = (panel(p["scale"], html=figure_html(tune_figure(p), f"fig-tune-{t}-{i}")) if p["candidates"]
                      else panel(p["scale"], empty=f"{p['key']}: no ranked candidates"))
            problems.append({"scale": p["scale"], "figure": figure, "rows": _rows(p), "lines": _lines(p, tune.header)})
        out.append({"source": str(tune.path), "header": _header_text(tune.header), "problems": problems})
    return {"caption": CAPTION, "settings": [short for _, short in TUNE_SETTINGS], "tunes": out}
