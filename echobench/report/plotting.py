"""What every dashboard figure shares: escaped labels, the layout, the plot options, a panel."""

from __future__ import annotations

import html

import plotly.graph_objects as go

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "displayModeBar": "hover"}


def esc(value) -> str:
    """Text for plotly labels: escaped, so a record's `<b>` or `<a>` shows as typed."""
    return html.escape("" if value is None else str(value))


def layout(fig: go.Figure, title: str, height: int = 340, top: int = 50, bottom: int = 50,
           legend: dict | None = None, **kw) -> go.Figure:
    fig.update_layout(title={"text": esc(title), "font": {"size": 14}}, height=height, template="plotly_white",
                      margin={"l": 60, "r": 20, "t": top, "b": bottom}, legend={"font": {"size": 10}, **(legend or {})},
                      **kw)
    return fig


def figure_html(fig: go.Figure, div_id: str) -> str:
    """The figure as a div for the page (plotly.js is inlined once, by the page)."""
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=PLOT_CONFIG)


def panel(scale: str, html: str = "", empty: str = "", note: str = "") -> dict:
    """One scale's cell of a section: a figure's html, or the line saying why there is none."""
    return {"scale": scale, "html": html, "empty": empty, "note": note}
