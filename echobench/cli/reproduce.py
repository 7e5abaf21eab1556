"""`echobench reproduce`: published rows measured: their card runs written as a matrix at the
published layout (or scaled down), swept (echobench.sweep.loop, as `echobench sweep`), then held
against the published figures and the predictions (echobench.sweep.reproduce)."""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from echobench.cli.common import app, console, err_console, fail, load_profiles_or_fail, writable_dir
from echobench.cli.sweep import ask_on_a_terminal
from echobench.records.console import esc
from echobench.records.results import RECORD_FILE
from echobench.sweep.matrix import ExecutorName, MatrixError


@app.command(short_help="Published rows measured: their card runs at the published layout (or scaled down), swept, "
                        "then measured vs published vs predicted.")
def reproduce(
    rows_file: Path = typer.Argument(..., metavar="ROWS_FILE", help="A published-runs file "
                                     "(validation/published-runs.yaml's format)."),
    rows: str = typer.Option(..., "--rows", metavar="ID[,ID...]", help="The rows to measure, by id."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/reproduce-STEM): the "
                                       "matrix it writes (reproduce.yaml) and the runs."),
    executor: str = typer.Option("local", "--executor", help="local or slurm."),
    scale_down: Optional[int] = typer.Option(None, "--scale-down", metavar="N", help="Run each row on N nodes "
                                             "instead of its published GPU count, at its micro-batch and "
                                             "accumulation (the global batch shrinks; each change is said)."),
    site: Optional[Path] = typer.Option(None, "--site", metavar="FILE", help="A site file (or a matrix file, over its "
                                        "own site) whose slurm, local and hardware sections (partition, account, setup, "
                                        "fabric, GPUs per node, peak) the written matrix takes; its GPUs per node are "
                                        "the runs' (else each row's)."),
    steps: int = typer.Option(30, "--steps", min=1, help="Measured steps of each run."),
    warmup_steps: int = typer.Option(10, "--warmup-steps", min=0, help="Warm-up steps of each run."),
    device: str = typer.Option("auto", "--device", help="auto, cuda or cpu."),
    peak_tflops: Optional[float] = typer.Option(None, "--peak-tflops", min=0.001, help="Dense bf16 peak TFLOP/s per "
                                                "device for MFU (the matrix's hardware.peak_tflops; else the datasheet "
                                                "table or a calibration, as a sweep does)."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help="Hardware profile for the predicted "
                                      "figures (default: that of the runs' device, as `validate measured` finds it)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Write the matrix and print the plan; measure nothing."),
):
    """Measure published rows through the same harness as Echo: their model cards as card runs at
    the published layout mapped to echobench's settings (what it cannot run is refused, one line
    per row), or on --scale-down N nodes; swept as `echobench sweep` sweeps (SLURM: preflight
    first); then per row measured vs published vs predicted: step time, tokens/s per GPU, MFU under
    the row's convention, the differences, and whether the published MFU lies beyond the run's own
    spread (its step-time p10-p90). Exit 0 when every run is ok, 1 when some failed, 2 for bad input."""
    from echobench.predict.tables import reference_table
    from echobench.records.results import Record
    from echobench.sweep.loop import SweepOptions, choose_runs, run_sweep
    from echobench.sweep.matrix import expand, load_matrix
    from echobench.sweep.reproduce import (matrix_name, matrix_text, plan_rows, reference_rows, settings_text,
                                           site_per_node, site_sections)
    from echobench.sweep.state import run_dir

    if executor not in typing.get_args(ExecutorName):
        fail(f"--executor {executor!r} is not valid: allowed {', '.join(typing.get_args(ExecutorName))}")
    if device not in ("auto", "cuda", "cpu"):
        fail(f"--device {device!r} is not valid: allowed auto, cuda, cpu")
    profiles = load_profiles_or_fail(profile)
    sections = site_sections(site) if site is not None else {}
    plans = plan_rows(rows_file, [r.strip() for r in rows.split(",") if r.strip()],
                      site_per_node(sections, executor), scale_down, executor)
    for p in plans:
        if p.refused:
            err_console.print(f"[yellow]refused:[/] row {esc(p.id)} ({esc(p.published)}): {esc(p.refused)}",
                              highlight=False, soft_wrap=True)
    if not any(p.settings for p in plans):
        fail(f"no row of {rows_file} given can run here (why: above, a line each)")
    name = matrix_name(rows_file)
    out = writable_dir(out or Path("runs") / name)
    if peak_tflops is not None:
        sections = {**sections, "hardware": {**sections.get("hardware", {}), "peak_tflops": peak_tflops}}
    command = " ".join(["echobench reproduce", *sys.argv[2:]]) if sys.argv[1:2] == ["reproduce"] else "echobench reproduce"
    matrix_path = out / "reproduce.yaml"
    matrix_path.write_text(matrix_text(plans, name, executor, {"steps": steps, "warmup_steps": warmup_steps,
                                                               "device": device}, sections, command))
    try:
        matrix = load_matrix(matrix_path)
        the_plan = expand(matrix, executor)
    except MatrixError as exc:
        fail(f"{exc}" + (" (the --site file's sections are written into it)" if site is not None else ""))
    runs = {r.cfg.card: r.id for r in the_plan.runs}
    for p in plans:
        if p.settings is None:
            continue
        console.print(f"row {esc(p.id)}: published {esc(p.published)} on {p.row['hardware']['gpus']} GPU(s) -> "
                      f"{esc(settings_text(p.settings))}: run {esc(runs.get(p.settings['card'], '(skipped)'))}",
                      highlight=False, soft_wrap=True)
        for line in [f"changed: {c}" for c in p.changes] + [f"note: {n}" for n in p.notes]:
            console.print(f"  {esc(line)}", highlight=False, soft_wrap=True)
    console.print(f"wrote {esc(matrix_path)}", highlight=False)
    if dry_run:
        console.print(f"dry run: nothing measured; `echobench sweep {esc(matrix_path)} --out {esc(out)}` runs it",
                      highlight=False, soft_wrap=True)
        return
    try:
        chosen, skipped = choose_runs(the_plan, [], False, console)
        opts = SweepOptions(executor=executor, out=out, ask=ask_on_a_terminal())
        code = run_sweep(matrix, chosen, opts, console, skipped)
    except (MatrixError, ValueError) as exc:
        fail(str(exc))
    records = {}
    for rid in runs.values():
        path = run_dir(out.resolve(), rid) / RECORD_FILE
        try:
            records[rid] = Record.load(path)
        except (OSError, ValueError):
            continue  # said per row below
    ref_rows, lines = reference_rows(plans, runs, records, profiles)
    wide = Console(width=None if sys.stdout.isatty() else 200)
    wide.print(reference_table(ref_rows, f"{rows_file}: {len(ref_rows)} rows, MEASURED vs published vs predicted"))
    for r in ref_rows:
        console.print(esc(r.sentence()), highlight=False, soft_wrap=True)
    for line in lines:
        console.print(esc(line), highlight=False, soft_wrap=True)
    raise typer.Exit(code)
