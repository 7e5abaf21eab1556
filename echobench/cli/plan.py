"""`echobench plan` and `echobench predict`: a matrix's runs before any runs (echobench.sweep.plan), and
the performance model's predictions (echobench.predict)."""

from __future__ import annotations

import json
import sys
import time as clock
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from echobench.cli.common import (
    MAX_RUNS_HELP,
    ONLY_HELP,
    SITE_HELP,
    app,
    console,
    err_console,
    fail,
    load_plan,
    load_profiles_or_fail,
    writable_dir,
)
from echobench.records.console import esc
from echobench.records.states import RunState


@app.command()
def plan(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME): paths in --script."),
    script: Optional[str] = typer.Option(None, "--script", metavar="RUN_ID", help="Print this run's exact job script."),
    write_scripts: Optional[Path] = typer.Option(None, "--write-scripts", metavar="DIR",
                                                 help="Write every run's job script to DIR/RUN_ID.sh (slurm: and the "
                                                 "preflight job's to DIR/preflight.sh), submit nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=ONLY_HELP),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help="Hardware profile for the "
                                      "predicted step time and MFU (echobench predict); default: the shipped "
                                      "profile of hardware.device, if any."),
    site: Optional[Path] = typer.Option(None, "--site", metavar="FILE", help=SITE_HELP),
):
    """Runs of a matrix, skipped ones with the reason, per-GPU memory estimates, GPU-hours,
    predicted step time and MFU; then where each cluster setting came from (the site file, the
    matrix, a default)."""
    from echobench.sweep.plan import default_out, plan_report, plan_summary, render_job_script
    from echobench.sweep.loop import run_dir

    if write_scripts is not None and script is not None:
        fail("--write-scripts writes every run's script, --script prints one: give one of them")
    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs, only, site)
    if write_scripts is not None:  # for review on a cluster before spending GPU-hours
        dest = writable_dir(write_scripts, f"--write-scripts {write_scripts}")
        sweep_dir = (out or default_out(matrix)).resolve()
        try:
            # Logs beside the scripts: SLURM does not start a job whose --output directory is missing.
            (logs := dest / "logs").mkdir(exist_ok=True)
            for run in the_plan.runs:
                path = dest / f"{run.id}.sh"
                log = logs.resolve() / f"{run.id}-%j.out" if executor == "slurm" else None
                path.write_text(render_job_script(run, run_dir(sweep_dir, run.id), matrix, executor, log))
                path.chmod(0o755)
            if executor == "slurm" and the_plan.runs:  # the job a sweep submits first: to read, or sbatch by hand
                from echobench.sweep.executors import PREFLIGHT_SCRIPT
                from echobench.sweep.preflight import preflight_script

                (path := dest / PREFLIGHT_SCRIPT).write_text(
                    preflight_script(matrix, the_plan.runs, sweep_dir, logs.resolve() / "preflight-%j.out"))
                path.chmod(0o755)
        except OSError as exc:
            fail(f"--write-scripts {write_scripts}: cannot write {exc.filename} ({exc.strerror or exc}): "
                 "choose another directory")
        except ValueError as exc:
            fail(str(exc))
        preflight = " and the preflight job's, preflight.sh," if executor == "slurm" and the_plan.runs else ""
        console.print(f"{len(the_plan.runs)} job scripts{preflight} in {esc(dest)} (paths as for `echobench sweep "
                      f"--out {esc(sweep_dir)}`; each writes its run.yaml there, its log goes to {esc(dest / 'logs')}); "
                      f"nothing submitted", highlight=False)
        return
    if script is not None:
        run = the_plan.by_id(script)
        if run is None:
            fail(f"no run {script!r} in {matrix_path}: `echobench plan {matrix_path}` lists the run ids")
        try:
            sweep_dir = (out or default_out(matrix)).resolve()
            print(render_job_script(run, run_dir(sweep_dir, run.id), matrix, executor), end="")
        except ValueError as exc:
            fail(str(exc))
        return
    from echobench.predict import profile_for_device

    profiles = load_profiles_or_fail(profile) or list(filter(None, [profile_for_device(
        matrix.spec.hardware.device, fabric=matrix.spec.slurm.fabric)]))
    if as_json:
        print(json.dumps(plan_summary(the_plan, executor, profiles), indent=2, default=str))
        return
    wide = Console(width=None if sys.stdout.isatty() else 170)  # a row per run: the id and nine figures
    for part in plan_report(the_plan, executor, profiles):
        wide.print(part)


PROFILE_HELP = ("Hardware profile: a shipped name (profiles/) or a YAML file; repeatable: each run takes the one "
                "measured most like it (processes per node, GEMM shapes). Default: the shipped profile of the "
                "matrix's hardware.device (with --against: the profile their sweep measured, hardware.calibrate_comm, else "
                "that of the records' device), else this machine's calibrated one.")



@app.command("predict", short_help="The performance model: predicted step time and MFU per run; --against measured runs, --validate published ones.")
def predict_command(
    paths: Optional[list[Path]] = typer.Argument(None, metavar="MATRIX", help="A matrix YAML file: its runs "
                                                 "predicted."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help=PROFILE_HELP),
    nodes: Optional[str] = typer.Option(None, "--nodes", help="Every configuration at these node counts (1 .. "
                                        "1024, e.g. 1,4,16) instead of the matrix's."),
    against: list[Path] = typer.Option([], "--against", metavar="DIR", help="Instead of a matrix: the measured "
                                       "runs under DIR (a sweep or run directory, or a result.json; repeat for "
                                       "more), each predicted and held against its record: step time, MFU and, for "
                                       "--trace runs, the parts of the step."),
    validate: Optional[Path] = typer.Option(None, "--validate", metavar="FILE", help="Hold the model against "
                                            "published training runs (e.g. validation/published-runs.yaml): "
                                            "predicted at the committed fit vs published step time per row, "
                                            "leave-one-source-out and in-sample |error| per source and overall."),
    refit: bool = typer.Option(False, "--refit", help="With --validate: price FILE's rows at the in-step clock "
                               "refitted on FILE's own rows (an in-sample error, labelled so) instead of the committed "
                               "fit (validation/fit.json)."),
    write_fit: bool = typer.Option(False, "--write-fit", help="With --validate: write the in-step clocks fitted on "
                                   "every row and the residual quantiles to validation/fit.json (the committed fit)."),
    as_json: bool = typer.Option(False, "--json", help="A list with one object per run (--validate: its rows, "
                                 "summary, cross-validation and the fit they were priced at)."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=f"MATRIX: {ONLY_HELP}"),
    notes: bool = typer.Option(False, "--notes", help="MATRIX: list the assumptions behind the predictions "
                               "(else counted in one line; --json carries them per run)."),
):
    """The performance model: each run's predicted step time, its parts, samples/s, MFU, HFU,
    bytes per link and the bandwidth that would hide its exposed communication (docs/explanation/predict.md); with --against, predicted vs measured; with --validate, predicted vs published."""
    from echobench import predict

    started = clock.perf_counter()
    paths = paths or []
    if validate is not None:
        if paths or against or nodes is not None or profile:
            fail("--validate FILE takes no MATRIX, --against, --nodes or --profile: each row names its shipped profile", 1)
        _validate(validate, as_json, write_fit, refit)
        return
    if write_fit or refit:
        fail(f"{'--write-fit' if write_fit else '--refit'} goes with --validate FILE", 1)
    if against and paths:
        fail(f"predict takes a MATRIX or --against DIR, not both ({paths[0]} beside --against {against[0]}): give "
             f"each directory its own --against (--against {against[0]} --against {paths[0]})")
    if not paths and not against:
        fail("predict needs a MATRIX (or --against DIR for measured runs, or --validate FILE)")
    wide = Console(width=None if sys.stdout.isatty() else 170)  # a row per run: the id and ten figures
    profiles = load_profiles_or_fail(profile)
    if against:
        from echobench.records.results import load_records

        if nodes is not None:
            fail("--nodes is for `predict MATRIX`: --against holds each record at the node count it ran on")
        paths = against
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            fail(f"--against: no such file or directory: {', '.join(missing)}")
        records, problems = load_records(paths)
        for problem in problems:
            err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
        if not any(r.status == RunState.OK and r.step_time_s for r in records):
            fail(f"no successful runs under {', '.join(map(str, paths))} to predict")
        held = predict.against_records(records, profiles)
        for kind, line in held.lines:
            err_console.print(f"[yellow]{kind}:[/] {esc(line)}", highlight=False, soft_wrap=True)
        comparisons, profiles = held.comparisons, held.profiles
        from echobench.predict.crossval import fit_line, fit_used

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
        return
    if len(paths) != 1:
        fail(f"predict takes one matrix ({len(paths)} paths given): for run directories, --against DIR each")
    matrix, the_plan, _ = load_plan(paths[0], "slurm" if nodes is not None else None, None, only)
    cfgs = [r.cfg for r in the_plan.runs]
    if nodes is not None:
        cfgs = predict.at_nodes(cfgs, predict.parse_nodes(nodes))
    if not profiles:
        device = matrix.spec.hardware.device or predict.machine_device(cfgs)
        found = predict.profile_for_device(device, fabric=matrix.spec.slurm.fabric)
        if found is None:
            fail(predict.no_profile_message(f"matrix {paths[0]} (device {device!r}: its hardware.device, else this "
                                       "machine's)"))
        profiles = [found]
    items = predict.predict_runs(cfgs, profiles)
    none_predicted = bool(cfgs) and not any(isinstance(p, predict.Prediction) for p in items)
    elapsed = clock.perf_counter() - started
    if as_json:
        rank = predict.ranks([p for p in items if isinstance(p, predict.Prediction)])
        print(json.dumps([{**p.as_dict(), "rank": rank[p.run_id]} if isinstance(p, predict.Prediction)
                          else {"run_id": predict.run_id(c), "error": str(p)} for p, c in zip(items, cfgs)],
                         indent=2, default=str))
        if none_predicted:
            raise typer.Exit(1)  # every object holds its error
        return
    wide.print(predict.prediction_table(items, cfgs, f"{matrix.name}: {len(cfgs)} runs, PREDICTED (not measured)"))
    for p, c in zip(items, cfgs):
        if isinstance(p, predict.PredictError):  # in full, one line each: a table cell cuts the fix off
            err_console.print(f"[red]not predicted:[/] {esc(predict.run_id(c))}: {esc(p)}", highlight=False, soft_wrap=True)
    for line in predict.profile_lines(profiles):
        console.print(esc(line), highlight=False)
    assumed = sorted({n for p in items if isinstance(p, predict.Prediction) for n in p.notes})
    if notes:
        for note in assumed:
            console.print(f"note: {esc(note)}", highlight=False)
    elif assumed:
        console.print(f"{len(assumed)} assumption(s) behind these predictions: --notes lists them", highlight=False)
    console.print(f"rank: by predicted MFU among the runs of a scale and node count; hide GB/s: the bus bandwidth "
                  f"per link at which the overlappable collectives take no longer than the compute they overlap; "
                  f"{len(cfgs)} runs in {elapsed:.2f} s", highlight=False)
    if none_predicted:
        fail(f"no run of {paths[0]} could be predicted (why: above)", 1)


def _validate(path: Path, as_json: bool, write_fit: bool = False, refit: bool = False) -> None:
    """`predict --validate FILE`: each row priced at the committed fit (validation/fit.json; --refit:
    at the fit on FILE's own rows, in-sample), the rows cross-validated leaving each source out
    (crossval), the table (or --json), the errors per source and overall; --write-fit commits the
    fit on every row. Exit 0 when it ran, 1 on bad input."""
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
