"""`echobench sweep`, `preflight`, `cancel` and `status`: a matrix's runs through an executor
(echobench.sweep.loop, echobench.sweep.preflight) and the state of a sweep directory."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console

from echobench.cli.common import (MAX_RUNS_HELP, ONLY_HELP, SITE_HELP, app, console, err_console, fail, load_plan, print_error,
                                  writable_dir)
from echobench.records.console import esc, state_counts
from echobench.records.states import RunState
from echobench.sweep.matrix import parse_only


@app.command()
def sweep(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the jobs and collect (slurm: --no-wait returns after submitting)."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Also re-run runs whose record is a failure."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=ONLY_HELP),
    force: bool = typer.Option(False, "--force", help="Also run what the memory estimate says will not fit."),
    poll: Optional[float] = typer.Option(None, help="Seconds between state checks (default 1 local, 5 slurm; slurm "
                                                    "doubles it while nothing changes: up to 60 while every job is pending, 10 once "
                                                    "one runs)."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
    preflight: bool = typer.Option(True, "--preflight/--no-preflight", help="SLURM: one short job checks the runs' "
                                   "environment before any is submitted (default; skipped where this matrix passed "
                                   "it before)."),
    site: Optional[Path] = typer.Option(None, "--site", metavar="FILE", help=SITE_HELP),
):
    """Run every run of a matrix not yet done (resumable); shows progress, collects results.

    Exit 0 when every run is ok; 1 when some failed, the preflight failed or sbatch refused a job for
    good, or there is nothing to run; 75 when runs wait to be submitted (with --no-wait: slurm.max_submitted,
    a submit limit; the same command again submits them), 130 on Ctrl-C, 143 on SIGTERM; with --no-wait, 0 once every
    run is submitted, queued or ok. Ctrl-C with SLURM jobs queued asks whether to cancel them (on a
    terminal; elsewhere they keep running: `echobench cancel DIR`). Started with SIGINT ignored (a
    background job of a script, nohup), it keeps ignoring it: SIGTERM stops it."""
    from echobench.sweep.loop import SweepOptions, choose_runs, run_sweep, sigterm_stops_the_sweep
    from echobench.sweep.plan import default_out

    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs, site=site)
    runs, skipped = choose_runs(the_plan, only, force, console)
    if not runs:
        fail("no runs to do: every combination was skipped or filtered out (see `echobench plan`)", code=1)
    try:
        opts = SweepOptions(executor=executor, out=out or default_out(matrix), wait=wait,
                               retry_failed=retry_failed, poll_s=poll, ask=ask_on_a_terminal(), preflight=preflight)
        opts.out = writable_dir(opts.out)
        with sigterm_stops_the_sweep():
            code = run_sweep(matrix, runs, opts, console, skipped)
    except ValueError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command("preflight", short_help="One short job in the matrix's environment checks what its runs need.")
def preflight_command(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME): the job's script, "
                                       "log and preflight.json go there."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help="Only for runs with this setting."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the preflight job's script (local: its command) "
                                 "and submit nothing, write nothing."),
    site: Optional[Path] = typer.Option(None, "--site", metavar="FILE", help=SITE_HELP),
):
    """Check, in one short job in the matrix's exact environment, what its runs need: imports, GPUs,
    CPUs, numactl, the network interfaces, a tiny compile, an all-reduce across the nodes and the
    network NCCL chose for it. One line per check with the fix; exit 0 when every check passed, 1
    when one failed or sbatch refused the job, 75 when sbatch takes it later (a submit limit), 130 on
    Ctrl-C. A sweep of the same matrix into the same directory then does not check again."""
    from echobench.sweep.loop import DONE, FAILED, INTERRUPTED, choose_runs, refusal_code
    from echobench.sweep.executors import make_executor
    from echobench.sweep.plan import default_out
    from echobench.sweep.preflight import run_preflight

    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs, site=site)
    runs, _ = choose_runs(the_plan, only, True, Console(file=io.StringIO()))
    if not runs:
        fail("no runs to check: every combination was skipped or filtered out (see `echobench plan`)", code=1)
    made = make_executor(executor, matrix)
    if dry_run:
        show_preflight(matrix, runs, made, (out or default_out(matrix)).resolve())
        return
    sweep_dir = writable_dir(out or default_out(matrix)).resolve()
    try:
        made.check_dir(sweep_dir)
        result = run_preflight(matrix, runs, made, sweep_dir, console)
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C): the preflight job was cancelled", INTERRUPTED)
    except ValueError as exc:  # check_dir: a sweep directory the executor cannot use
        fail(str(exc))
    except Exception as exc:  # noqa: BLE001 - sbatch's refusal: one line
        fail(f"the preflight job was not submitted: {exc}", refusal_code(exc))
    raise typer.Exit(DONE if result.passed else FAILED)


def show_preflight(matrix, runs, executor, sweep_dir: Path) -> None:
    """`preflight --dry-run`: the script the preflight job would be (SLURM), or the command it would
    run here (local), on stdout; nothing written or submitted."""
    import shlex

    from echobench.sweep.preflight import local_command, preflight_script, preflight_spec

    try:
        executor.check_dir(sweep_dir)
        if executor.name == "slurm":
            sys.stdout.write(preflight_script(matrix, runs, sweep_dir))
        else:
            print(shlex.join(local_command(preflight_spec(matrix, runs, executor.name))))
    except ValueError as exc:
        fail(str(exc))


def ask_on_a_terminal() -> Callable[[str], bool] | None:
    """A yes/no question (default no) where stdin is a terminal; None elsewhere (nobody to answer)."""
    if not sys.stdin.isatty():
        return None
    return lambda question: typer.confirm(question, default=False)


@app.command()
def cancel(
    sweep_dir: Path = typer.Argument(..., metavar="DIR", help="A sweep directory."),
):
    """End a sweep's jobs: scancel of every job not yet over, then their records (cancelled, as the
    sweep writes them). Runs already over keep theirs; cancelling twice is harmless."""
    from echobench.records.paths import SWEEP_FILE
    from echobench.sweep.status import cancel_sweep

    if not sweep_dir.is_dir():
        fail(f"{sweep_dir}: no such directory: give the sweep's directory (`echobench sweep --out DIR`)")
    if not (sweep_dir / SWEEP_FILE).is_file():
        fail(f"{sweep_dir}: no {SWEEP_FILE} here: not a sweep directory")
    writable_dir(sweep_dir, f"cancel in {sweep_dir}")
    raise typer.Exit(cancel_sweep(sweep_dir, console))


@app.command()
def status(
    runs_dir: Path = typer.Argument(..., metavar="DIR", help="A sweep directory (or any directory of result.json)."),
    wait: bool = typer.Option(False, "--wait", help="Keep refreshing until no job is pending or running."),
    poll: float = typer.Option(5.0, help="Seconds between refreshes with --wait."),
    export: bool = typer.Option(False, "--export", help="Also write DIR/results.csv and results.parquet."),
    as_json: bool = typer.Option(False, "--json", help="The rows as JSON (errors in full) instead of the table."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=ONLY_HELP + " Runs never started "
                                   "have no stored settings: left out."),
):
    """One row per run: state (refreshed from the scheduler), step time, MFU; then each failure's error.

    Exit 0 when no run has failed (every one ok, or pending, running, waiting or not started yet;
    with --wait: every one ok); 1 when any has: its record says error, oom, timeout, node_fail,
    cancelled or preempted, or it cannot be read (corrupt), or there is no run; with --wait, 75 when
    runs are left never submitted (the same `echobench sweep` submits them); 2 for bad input."""
    from echobench.sweep.status import export_status, status as read_status

    if not runs_dir.is_dir():
        fail(f"{runs_dir} is not a directory")
    rows, problems = read_status(runs_dir, wait, poll, parse_only(only))
    paths = []
    if export:
        writable_dir(runs_dir, f"--export into {runs_dir}")
        paths, unreadable = export_status(runs_dir, rows)
        problems += unreadable
    for p in problems:
        err_console.print(f"[yellow]skipped a corrupt record:[/] {esc(p)}", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        show_status(runs_dir, rows, paths)
    raise typer.Exit(status_code(runs_dir, rows, problems, wait))


def status_code(runs_dir: Path, rows: list[dict], problems: list[str], waited: bool) -> int:
    """`status`'s exit code (echobench.sweep.loop's codes), what is not DONE said on stderr."""
    from echobench.sweep.loop import DONE, FAILED, NOT_ALL_SUBMITTED
    from echobench.sweep.status import failed_runs

    if failed_runs(rows) or problems:
        return FAILED
    if not rows:
        print_error(f"{runs_dir}: no runs here (neither a sweep directory nor one of result.json)")
        return FAILED
    if waited and (left := [r for r in rows if r["state"] != RunState.OK]):
        states = state_counts(r["state"] for r in left)
        err_console.print(f"[yellow]{len(left)} of {len(rows)} runs never submitted[/] ({esc(states)}): the same "
                          f"`echobench sweep` submits them", highlight=False, soft_wrap=True)
        return NOT_ALL_SUBMITTED
    return DONE


def show_status(runs_dir: Path, rows: list[dict], paths: list[Path]) -> None:
    """`status`'s table, each error on a line under it, the counts and the exported files."""
    from echobench.sweep.status import status_table

    console.print(status_table(f"{runs_dir}: {len(rows)} runs", rows))
    # Errors under the table, one line each (in a table column they fold into a few characters per
    # line): cut at a terminal's width, whole in a log or pipe. In full: --json, or RUN/result.json.
    if errors := [r for r in rows if r.get("error")]:
        crop = console.is_terminal
        for r in errors:
            console.print(f"{esc(r['run_id'])}: {esc(' '.join(r['error'].split()))}", highlight=False,
                          no_wrap=crop, overflow="ellipsis" if crop else None, soft_wrap=not crop)
        if crop:
            console.print("[dim]errors in full: echobench status DIR --json[/]", highlight=False)
    console.print(esc(state_counts(r["state"] for r in rows) or "no runs"))
    if paths:
        console.print(f"results: {esc(', '.join(map(str, paths)))}", highlight=False)
