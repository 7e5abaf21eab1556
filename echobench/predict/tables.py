"""Rich tables of predictions: one row per run of a matrix (prediction_table), predicted
against measured runs (comparison_table) and against published runs (validation_table); measured
card runs beside their published rows and predictions (reference_table)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.table import Table

from echobench.records.config import RunConfig, run_id
from echobench.records.console import esc
from echobench.predict.measured import Comparison
from echobench.predict.errors import PredictError
from echobench.predict.model import Prediction, ranks
from echobench.predict.reference import ReferenceRow, pct, relative
from echobench.predict.validate import ValidationRow


def _pct(x: float | None) -> str:
    """A share as a percentage, `-` for none."""
    return "-" if x is None else f"{x:.1%}"


def _gbps(x: float | None) -> str:
    """A bandwidth in GB/s to 3 figures, `-` for none."""
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.3g}")


def prediction_table(items: Sequence[Prediction | PredictError], cfgs: Sequence[RunConfig], title: str) -> Table:
    """`echobench predict MATRIX`: one row per run (PREDICTED), ranked per scale and node count."""
    good = [p for p in items if isinstance(p, Prediction)]
    rank = ranks(good)
    table = Table(title=esc(title), caption="n x g: nodes x GPUs per node; mb/gb: micro / global batch; comm, host: "
                  "exposed communication and host overhead, shares of the step; rank: by MFU within scale and nodes; "
                  "hide: bus GB/s per link that hides the overlappable collectives")
    table.add_column("run id", no_wrap=True)
    for col in ("n x g", "mb/gb", "step s", "range s", "samples/s", "MFU", "comm", "host", "GiB", "rank", "hide GB/s"):
        table.add_column(col, justify="right", no_wrap=True)
    order = sorted(zip(items, cfgs), key=lambda pc: (pc[1].scale, pc[1].nodes, rank.get(run_id(pc[1]), 99)))
    for p, cfg in order:
        shape = f"{cfg.nodes} x {cfg.gpus_per_node}"
        if isinstance(p, PredictError):
            table.add_row(esc(run_id(cfg)), shape, "", "", "[red]not predicted[/]", *[""] * 7)  # why: under the table
            continue
        hide = " ".join(f"{k} {_gbps(v)}" for k, v in p.hide_gbps.items() if v is not None) or "-"
        fits = {True: "", False: " [red]NO[/]", None: ""}[p.fits]
        table.add_row(esc(p.run_id), shape, f"{cfg.micro_batch} / {cfg.global_batch}",
                      f"{p.step_time_s:.4g}", f"{p.step_time_low_s:.3g}-{p.step_time_high_s:.3g}",
                      f"{p.samples_per_s:.4g}", _pct(p.mfu),
                      _pct(p.exposed_communication_s / p.step_time_s), _pct(p.parts["host"] / p.step_time_s),
                      f"{p.memory_gib:.1f}{fits}", str(rank[p.run_id]), hide)
    return table


def comparison_table(comparisons: Sequence[Comparison], title: str) -> Table:
    """`echobench validate measured`: predicted vs measured per run, parts vs the breakdown."""
    table = Table(title=esc(title), caption="error = (predicted - measured) / measured step time; parts: predicted / "
                  "measured share of the step (profiled runs), gemm attention optimizer communication other")
    table.add_column("run id", no_wrap=True)
    for col in ("measured s", "predicted s", "range s", "error", "MFU meas", "MFU pred", "parts"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in sorted(comparisons, key=lambda c: (c.prediction.cfg.scale, c.prediction.cfg.framework,
                                                c.prediction.cfg.parallelism, c.prediction.run_id)):
        p = c.prediction
        parts = "-" if c.parts is None else " ".join(
            f"{v['predicted']:.0%}/{v['measured']:.0%}" for v in c.parts.values())
        table.add_row(esc(p.run_id), f"{c.measured_step_time_s:.4g}", f"{p.step_time_s:.4g}",
                      f"{p.step_time_low_s:.3g}-{p.step_time_high_s:.3g}", f"{c.error:+.1%}",
                      _pct(c.measured_mfu), _pct(p.mfu), parts)
    return table


def validation_table(results: Sequence[ValidationRow], title: str, loso: dict[str, float] | None = None,
                     in_sample: bool = False) -> Table:
    """`echobench validate published`: predicted vs published step time per published row, the
    assumed values' range, the row's interval against the published step, the error at the fit the
    rows were priced at (the committed one; in_sample: refitted on these rows) and left out of the
    fit (LOSO). A row among the fit's rows is marked (fit), one over its device's memory (GiB!)."""
    at = ("IN-SAMPLE: the in-step clock refitted on these rows" if in_sample else
          "at the committed fit (validation/fit.json); (fit): the row is in its fit set, its error in-sample")
    table = Table(title=esc(title), caption=f"error = predicted / published - 1, {at}; LOSO: the clock fitted without the "
                  "row's source; published step = global batch x seq / (tokens/s per GPU x GPUs), from TFLOP/s under the "
                  "row's own FLOP convention where only that is published (*); range: the row priced over its assumed "
                  "values (predicted: their middle); interval: the range widened by the leave-one-source-out residuals, "
                  "as errors; GiB: estimated memory per GPU (! over the device's); refused rows: why below, not counted")
    table.add_column("row", no_wrap=True)
    for col in ("source", "GPUs", "device", "layout", "published s", "predicted s", "range s", "error", "interval",
                "LOSO", "MFU pub", "MFU pred", "GiB"):
        table.add_column(col, justify="left" if col in ("source", "device") else "right", no_wrap=col != "layout")
    for r in results:
        if r.refused is not None:
            table.add_row(esc(r.id), esc(r.source), str(r.gpus), "", esc(r.layout), "", "", "", "[yellow]refused[/]",
                          *[""] * 5)
            continue
        derived = "*" if r.published_from.startswith("TFLOP") else ""
        rng = "-" if r.low_s is None or r.low_s == r.high_s else f"{r.low_s:.3g}-{r.high_s:.3g}"
        held = (loso or {}).get(r.id)
        band = "-" if r.interval_low_s is None else \
            f"{r.interval_low_s / r.published_step_s - 1:+.1%} .. {r.interval_high_s / r.published_step_s - 1:+.1%}"
        memory = "-" if r.memory_gib is None else f"{r.memory_gib:.1f}" + ("[red]![/]" if r.over_memory else "")
        table.add_row(esc(r.id), esc(r.source), str(r.gpus), esc(r.device.removeprefix("NVIDIA ")), esc(r.layout),
                      f"{r.published_step_s:.4g}{derived}", f"{r.predicted_step_s:.4g}", rng,
                      f"{r.error:+.1%}" + (" (fit)" if r.in_fit_set and not in_sample else ""), band,
                      "-" if held is None else f"{held:+.1%}", _pct(r.published_mfu), _pct(r.predicted_mfu), memory)
    return table


def crossval_table(cv: dict) -> Table:
    """The leave-one-source-out cross-validation (crossval.crossval): per source and overall."""
    table = Table(title="leave-one-source-out cross-validation (the in-step clock fitted without the source, the "
                  "source predicted)", caption="|error| mean / max; clock: the in-step clock per GPU family fitted on "
                  "the other sources; needed: the clock at which each row's step is its published one, min / "
                  "median / max over the rows")
    for col in ("source", "rows", "clock fitted without it", "clock needed", "LOSO mean", "LOSO max", "in-sample mean",
                "in-sample max"):
        table.add_column(col, justify="left" if col.startswith(("source", "clock")) else "right")

    def needed(by_family: dict) -> str:
        return " ".join(f"{k} {lo:.2f}/{mid:.2f}/{hi:.2f}" for k, (lo, mid, hi) in by_family.items()) or "-"


    def cells(e: dict) -> list[str]:
        return [_pct(e["mean_abs_error"]), _pct(e["max_abs_error"])]

    for s, v in cv["per_source"].items():
        clock = " ".join(f"{k} {c:.3g}" for k, c in v["clock_fitted_without_it"].items())
        table.add_row(esc(s), str(v["rows"]), clock, needed(v["clock_needed"]), *cells(v["loso"])[:1],
                      cells(v["loso"])[1], *cells(v["in_sample"]))
    table.add_row("all", str(cv["rows"]), " ".join(f"{k} {c:.3g}" for k, c in cv["fit"].items()) + " (every row)",
                  needed(cv["clock_needed"]), *cells(cv["loso"]), *cells(cv["in_sample"]))
    return table


def _num(x: float | None, spec: str = ".4g") -> str:
    return "-" if x is None else format(x, spec)


def _diff(x: float | None, points: bool = False) -> str:
    """A relative difference (+12.3%), or one in percentage points (+1.2 pp)."""
    return "-" if x is None else f"{x * 100:+.1f} pp" if points else f"{x:+.1%}"


def reference_table(rows: Sequence[ReferenceRow], title: str) -> Table:
    """`echobench reproduce`: per row, its step time, tokens/s per GPU and MFU under the row's
    convention, measured (with the run's p10-p90 spread), published and predicted, and the
    differences; `beyond` where the published figure lies outside the run's spread."""
    table = Table(title=esc(title), caption=esc(
        "measured: median step, window throughput and MFU, [the run's spread: at its step-time p10 .. p90]; vs "
        "published: measured / published - 1 (MFU: measured - published, percentage points), `beyond` / `within` "
        "the run's spread; vs predicted: predicted / measured - 1 (MFU: predicted - measured)"))
    table.add_column("row", no_wrap=True)
    table.add_column("figure", no_wrap=True)
    for col in ("measured", "published", "predicted", "vs published", "vs predicted"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        if r.status != "ok":
            table.add_row(esc(r.label), "-", esc(f"not measured: {r.status}"), _num(r.pub("step_s")), "-", "-", "-")
            continue
        spread = f" [{r.p10_s:.4g}-{r.p90_s:.4g}]" if r.p10_s is not None and r.p90_s is not None else ""
        published_step = _num(r.pub("step_s")) if r.same_step else "(other batch)"
        tokens = f" [{r.tokens_spread[0]:.4g}-{r.tokens_spread[1]:.4g}]" if r.tokens_spread else ""
        mfu = f" [{pct(r.mfu_spread[0])}-{pct(r.mfu_spread[1])}]" if r.mfu_spread else ""
        verdict = f" {r.verdict}" if r.verdict else ""
        mfu_pred = r.predicted_mfu - r.mfu if r.predicted_mfu is not None and r.mfu is not None else None
        table.add_row(esc(r.label), "step time (s)", _num(r.step_s) + spread, published_step, _num(r.predicted_step_s),
                      _diff(r.step_diff), _diff(relative(r.predicted_step_s, r.step_s)))
        table.add_row("", "tokens/s per GPU", _num(r.tokens_per_s_per_gpu) + tokens, _num(r.pub("tokens_per_s_per_gpu")),
                      _num(r.predicted_tokens_per_s_per_gpu),
                      _diff(r.tokens_diff) + ("" if r.pub("mfu") is not None and r.mfu is not None else verdict),
                      _diff(relative(r.predicted_tokens_per_s_per_gpu, r.tokens_per_s_per_gpu)))
        table.add_row("", "MFU (row's convention)", pct(r.mfu) + mfu, pct(r.pub("mfu")), pct(r.predicted_mfu),
                      _diff(r.mfu_diff, points=True) + (verdict if r.pub("mfu") is not None and r.mfu is not None else ""),
                      _diff(mfu_pred, points=True), end_section=True)
    return table
