"""`echobench plan` and `echobench predict`: a matrix's runs before any runs (echobench.sweep.plan), and
the performance model's predictions of them (echobench.predict)."""

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


# --profile of predict and validate measured; each command says its own default after it
PROFILE_HELP = ("Hardware profile: a shipped name (profiles/) or a YAML file; repeatable: each run takes the one "
                "measured most like it (processes per node, GEMM shapes). ")


@app.command("predict", short_help="The performance model: predicted step time and MFU per run of a matrix.")
def predict_command(
    path: Path = typer.Argument(..., metavar="MATRIX", help="A matrix YAML file: its runs predicted."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help=PROFILE_HELP
                               + "Default: the shipped profile of the matrix's hardware.device, else this machine's "
                               "calibrated one."),
    nodes: Optional[str] = typer.Option(None, "--nodes", help="Every configuration at these node counts (1 .. "
                                        "1024, e.g. 1,4,16) instead of the matrix's."),
    as_json: bool = typer.Option(False, "--json", help="A list with one object per run."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=ONLY_HELP),
    notes: bool = typer.Option(False, "--notes", help="List the assumptions behind the predictions (else counted "
                               "in one line; --json carries them per run)."),
):
    """The performance model: each run's predicted step time, its parts, samples/s, MFU, HFU,
    bytes per link and the bandwidth that would hide its exposed communication (docs/explanation/predict.md).
    `echobench validate` holds the model against measured or published runs."""
    from echobench import predict

    started = clock.perf_counter()
    wide = Console(width=None if sys.stdout.isatty() else 170)  # a row per run: the id and ten figures
    profiles = load_profiles_or_fail(profile)
    matrix, the_plan, _ = load_plan(path, "slurm" if nodes is not None else None, None, only)
    cfgs = [r.cfg for r in the_plan.runs]
    if nodes is not None:
        cfgs = predict.at_nodes(cfgs, predict.parse_nodes(nodes))
    if not profiles:
        device = matrix.spec.hardware.device or predict.machine_device(cfgs)
        found = predict.profile_for_device(device, fabric=matrix.spec.slurm.fabric)
        if found is None:
            fail(predict.no_profile_message(f"matrix {path} (device {device!r}: its hardware.device, else this "
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
        fail(f"no run of {path} could be predicted (why: above)", 1)


