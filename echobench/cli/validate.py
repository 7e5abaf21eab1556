"""`echobench validate`: the performance model (echobench.predict) held against what ran, measured
runs (their records) or published ones (a validation file), each priced as `echobench predict`
prices a matrix's runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from echobench.cli.common import console, err_console, fail, load_profiles_or_fail, validate_app
from echobench.cli.plan import PROFILE_HELP
from echobench.records.console import esc
from echobench.records.states import RunState


@validate_app.command("measured")
def measured_command(
    paths: list[Path] = typer.Argument(..., metavar="DIR", help="Measured runs: sweep or run directories, or "
                                       "result.json files, each predicted at the node count it ran on."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help=PROFILE_HELP
                               + "Default: the profile their sweep measured (hardware.calibrate_comm), else the "
                               "profile of the records' device, else this machine's calibrated one."),
    as_json: bool = typer.Option(False, "--json", help="A list with one object per run, with the fit it was "
                                 "priced at."),
):
    """The model held against measured runs: each record predicted and held against what it measured,
    step time, MFU and, for --trace runs, the parts of the step."""
    from echobench import predict
    from echobench.predict.crossval import fit_line, fit_used
    from echobench.records.results import load_records

    wide = Console(width=None if sys.stdout.isatty() else 170)  # a row per run: the id and ten figures
    profiles = load_profiles_or_fail(profile)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such file or directory: {', '.join(missing)}")
    records, problems = load_records(paths)
    for problem in problems:
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    if not any(r.status == RunState.OK and r.step_time_s for r in records):
        fail(f"no successful runs under {', '.join(map(str, paths))} to predict")
    held = predict.against_records(records, profiles)
    for kind, line in held.lines:
        err_console.print(f"[yellow]{kind}:[/] {esc(line)}", highlight=False, soft_wrap=True)
    comparisons, profiles = held.comparisons, held.profiles
    used = fit_used()
    if as_json:
        print(json.dumps([{**c.as_dict(), "fit": used} for c in comparisons], indent=2, default=str))
        return
    wide.print(predict.comparison_table(comparisons, f"predicted vs measured: {len(comparisons)} runs"))
    s = predict.summary(comparisons)
    if s["runs"]:
        console.print(f"step time: mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%} over "
                      f"{s['runs']} runs (error = (predicted - measured) / measured)"
                      + (f"; MFU: mean |error| {s['mean_abs_mfu_error']:.1%}, max {s['max_abs_mfu_error']:.1%}"
                         if s["mean_abs_mfu_error"] is not None else ""))
    for line in predict.profile_lines(profiles):
        console.print(esc(line), highlight=False)
    console.print(esc(fit_line(used) + " (a run on one GPU, a CPU or a measured profile takes none)"),
                  highlight=False, soft_wrap=True)


@validate_app.command("published")
def published_command(
    path: Path = typer.Argument(..., metavar="FILE", help="Published training runs, e.g. "
                                "validation/published-runs.yaml."),
    refit: bool = typer.Option(False, "--refit", help="Price FILE's rows at the in-step clock refitted on FILE's "
                               "own rows (an in-sample error, labelled so) instead of the committed fit "
                               "(validation/fit.json)."),
    write_fit: bool = typer.Option(False, "--write-fit", help="Write the in-step clocks fitted on every row and the "
                                   "residual quantiles to validation/fit.json (the committed fit)."),
    as_json: bool = typer.Option(False, "--json", help="The rows, summary, cross-validation and the fit they "
                                 "were priced at."),
):
    """The model held against published training runs: each row (which names its shipped profile)
    predicted at the committed fit vs its published step time, leave-one-source-out and in-sample
    |error| per source and overall, and the scaling series. Exit 0 when it ran, 1 on bad input."""
    from echobench.predict.crossval import crossval, fit_line, fit_used, refit as refit_on, write_fit as write
    from echobench import predict
    from echobench.predict.validate import as_json as to_json, scaling_series

    try:
        rows = predict.load_rows(path)
        cv = crossval(rows)
        fit = refit_on(cv, path) if refit else None
        results = predict.validate(rows, terms=fit)
    except predict.PredictError as exc:
        fail(str(exc), 1)
    if write_fit:
        console.print(f"wrote {esc(write(cv, path))}", highlight=False)
    used = fit_used(fit, path)  # after --write-fit: the fit the next run prices at
    series = scaling_series(rows, results, cv["loso_errors"])
    if as_json:
        print(json.dumps(to_json(results, cv, used, series), indent=2, default=str))
        return
    at = "IN-SAMPLE, at the fit refitted on its rows" if refit else "at the committed fit"
    wide = Console(width=None if sys.stdout.isatty() else 250)  # a row per run: thirteen columns
    wide.print(predict.validation_table(results, f"{path}: {len(results)} published runs, PREDICTED ({at}) vs published",
                                   cv["loso_errors"], in_sample=refit))
    for r in results:
        if r.refused is not None:
            console.print(f"refused: {esc(r.id)}: {esc(r.refused)}", highlight=False, soft_wrap=True)
    for note in sorted({n for r in results for n in r.notes}):
        console.print(f"note: {esc(note)}", highlight=False, soft_wrap=True)
    wide.print(predict.crossval_table(cv))
    summary = predict.validation_summary(results)
    console.print(esc(fit_line(used)), highlight=False, soft_wrap=True)
    if summary["priced"]:
        held = summary["held_out"]
        console.print(f"{'in-sample' if refit else 'at the committed fit'}: mean |error| {summary['mean_abs_error']:.1%}, "
                      f"max {summary['max_abs_error']:.1%} over {summary['priced']} rows"
                      + ("" if refit else f"; {summary['in_fit_set']} of them in its fit set (in-sample), "
                         + (f"{held['rows']} held out: mean |error| {held['mean_abs_error']:.1%}, max "
                            f"{held['max_abs_error']:.1%}" if held["rows"] else "none held out")),
                      highlight=False, soft_wrap=True)
    if cv["sources"] == 1:  # no other source to fit the clock on: each row would be priced at no clock at all
        console.print(f"leave-one-source-out: not meaningful for {esc(path)}, whose rows are all of one source (no "
                      "other source to refit the clock on); the held-out figure is the committed fit's above",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"leave-one-source-out (the clock refitted on the other sources of {esc(path)}): mean |error| "
                      + (f"{cv['loso']['mean_abs_error']:.1%}, max {cv['loso']['max_abs_error']:.1%} over "
                         f"{cv['loso']['rows']} rows of {cv['sources']} sources" if cv["loso"]["rows"] else "- (no row priced)"),
                      highlight=False, soft_wrap=True)
    committed = predict.committed_fit()
    if set(committed.fitted_on) == set(cv["in_sample_errors"]) and committed.clock != cv["fit"]:
        console.print(f"the committed fit is stale for these rows (refitted: {esc(cv['fit'])}): rerun with --write-fit",
                      highlight=False, soft_wrap=True)
    console.print(f"assumed values: {summary['ranged']} rows have a range, {summary['inside_range']} hold their "
                  f"published step inside it; {summary['inside_interval']} of {summary['priced']} inside their interval "
                  "(the range widened by the leave-one-source-out residuals)", highlight=False)
    if summary["over_memory"]:
        console.print(f"over the device's memory (estimated, priced anyway): {esc(', '.join(summary['over_memory']))}",
                      highlight=False, soft_wrap=True)
    for line in series_lines(series):
        console.print(esc(line), highlight=False, soft_wrap=True)


def series_lines(series) -> list[str]:
    """The scaling series (validate.scaling_series) a line each, and how many are within the aim."""
    from echobench.predict.validate import SERIES_AIM

    if not series:
        return ["scaling series: none (no source has rows at several GPU counts at constant per-GPU work)"]
    lines = [f"scaling series (constant per-GPU work; the error's change from the fewest GPUs to the most, aim within "
             f"+-{SERIES_AIM * 100:.0f} points): {sum(s.within_aim for s in series)} of {len(series)} within"]
    for s in series:
        held = "" if s.loso_change is None else f"; held out {s.loso_change * 100:+.1f}"
        lines.append(f"  {s.ids[0]} .. {s.ids[-1]} ({s.source}, {' / '.join(map(str, s.gpus))} GPUs): "
                     + " -> ".join(f"{e:+.1%}" for e in s.errors) + f": {s.change * 100:+.1f} points{held}")
    return lines
