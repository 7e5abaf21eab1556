"""`echobench report`, `compare` and `explain`: dashboards, tables and regression gates from stored
records (echobench.report), and where one run's step time went (echobench.train.breakdown)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from echobench.cli.common import ONLY_HELP, app, console, err_console, fail, load_profiles_or_fail, writable_dir
from echobench.sweep.matrix import parse_only
from echobench.records.console import esc
from echobench.records.results import RECORD_FILE


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="Sweep or run directories (or result.json files); merged, newest record per run id."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Dashboard HTML file (default report.html unless --table)."),
    table: Optional[str] = typer.Option(None, "--table", help="Print the publication table: md, csv or latex."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="CSV of published figures to put beside the measured ones, in the table and the dashboard (docs/guides/reports.md)."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help="Hardware profile(s): put each "
                                      "run's prediction (echobench predict) beside it in the dashboard. Default: the "
                                      "profile of the records' device (its sweep's, else a shipped one), where one matches."),
    margin: float = typer.Option(15.0, "--margin", help="Flag runs more than this percent below their predicted "
                                 "throughput."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=ONLY_HELP),
):
    """Dashboard (self-contained HTML) and publication tables, from stored result records only."""
    from echobench.report import load_report_input, read_reference, render_dashboard, render_table
    from echobench.report.tables import RENDERERS

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such file or directory: {', '.join(missing)}")
    if table is not None and table not in RENDERERS:
        fail(f"--table {table!r} is not valid: allowed {', '.join(RENDERERS)}")
    if out is None and table is None:
        out = Path("report.html")
    if out is not None:
        if out.is_dir():
            fail(f"-o {out} is a directory: give the HTML file's path (e.g. {out / 'report.html'})")
        writable_dir(out.parent, f"-o {out}")
    ref = None
    if reference is not None:
        ref = read_reference(reference)
    if not 0 <= margin < 100:
        fail(f"--margin {margin:g}: a percentage from 0 to below 100")
    profiles = load_profiles_or_fail(profile)
    wanted = parse_only(only)
    data = load_report_input(paths, wanted)
    if out is not None:  # predicted beside measured: on the profiles given, else on the records' device's
        from echobench.report.data import with_device_predictions, with_predictions

        if profiles:
            data = with_predictions(data, profiles, margin / 100)
            data.profile_line = (f"Predicted figures from hardware profile {', '.join(data.predicted_by)} "
                                 "(given with --profile).")
        else:
            data = with_device_predictions(data, margin / 100)
    problems = list(data.problems)
    if ref is not None:
        from echobench.report.tables import unmatched_rows

        problems += unmatched_rows(ref, data.frame, reference)
    for problem in problems:
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    if not data.records:
        err_console.print(f"no result records under {esc(', '.join(map(str, paths)))}", highlight=False)
    elif data.ok.empty:
        err_console.print(f"no successful runs: all {len(data.records)} record(s) failed", highlight=False)
    if table is not None:
        sys.stdout.write(render_table(data.frame, table, ref))
    if out is not None:
        from echobench.report.dashboard import runs_csv

        table_file = out.with_name(f"{out.stem}.runs.csv")  # beside the page, named after it: two pages, two files
        try:
            out.write_text(render_dashboard(data, ref, str(reference) if reference else None), encoding="utf-8")
            table_file.write_text(runs_csv(data), encoding="utf-8")
        except OSError as exc:
            fail(f"-o {out}: cannot write it or {table_file.name} beside it ({exc.strerror or exc})")
        if data.profile_line:
            err_console.print(esc(data.profile_line), highlight=False, soft_wrap=True)
        err_console.print(f"wrote {esc(out)} and {esc(table_file.name)} ({len(data.records)} runs, "
                          f"{len(data.skipped)} skipped)", highlight=False)


@app.command(short_help="Throughput / MFU change per configuration with a significance test; exits 1 on a regression.")
def compare(
    old: Path = typer.Argument(..., help="Baseline sweep or run directory."),
    new: Path = typer.Argument(..., help="Candidate sweep or run directory."),
    threshold: float = typer.Option(5.0, "--threshold", help="Percent loss of samples/s or MFU that fails the gate."),
    alpha: float = typer.Option(0.01, "--alpha", help="Significance level of the step-time test (one-sided Mann-Whitney U)."),
):
    """Pair configurations, print throughput / MFU changes; exit 1 when any lost more than the
    threshold and its step times say the slowdown is significant."""
    from echobench.report import compare_records
    from echobench.report.compare import comparison_report
    from echobench.records.results import load_records

    for p in (old, new):
        if not p.exists():
            fail(f"no such file or directory: {p}")
    if threshold < 0:
        fail("--threshold must be >= 0 (a percentage)")
    if not 0 < alpha < 1:
        fail(f"--alpha {alpha:g}: must be between 0 and 1 (e.g. 0.01)")
    (old_records, old_problems), (new_records, new_problems) = load_records([old]), load_records([new])
    for problem in old_problems + new_problems:
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    result = compare_records(old_records, new_records, threshold, alpha)
    if not result.changes:
        fail(f"no configurations in common between {old} ({len(old_records)} records) and {new} "
             f"({len(new_records)} records): compare pairs the same configuration before and after a change; to "
             f"set different layouts side by side: echobench report {old} {new}")

    table, *lines = comparison_report(result, f"{old} -> {new}")
    console.print(table)
    for line in lines:
        console.print(line, soft_wrap=True)
    if result.regressions:
        raise typer.Exit(1)


@app.command()
def explain(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="One run's directory (result.json, and breakdown.json "
                                   "from a --trace run); or a sweep directory with card runs: each reference beside "
                                   "Echo's MFU on the same device."),
    as_json: bool = typer.Option(False, "--json", help="Print the breakdown and the waterfall (a sweep: the "
                                 "references) as JSON."),
):
    """Where one step's time went (from the run's profiler breakdown) and the MFU waterfall. Given a
    sweep directory that holds card runs (echobench reproduce, a matrix with `card`) beside Echo runs:
    one sentence per reference, how it stands against its published MFU next to Echo's MFU on the
    same device, and so whether an Echo gap is the model's or the cluster's."""
    from echobench.train.breakdown import explain_report, read_profiled_run, waterfall

    if run_dir.is_dir() and not (run_dir / RECORD_FILE).is_file() and explain_references(run_dir, as_json):
        return
    try:
        record, bd = read_profiled_run(run_dir)
    except ValueError as exc:
        fail(str(exc))
    steps = waterfall(record)
    if as_json:
        # padding: the record's figures (null: a record written before padding was counted)
        padding = {k: getattr(record, k) for k in ("measured_padded_flops", "measured_hardware_flops",
                                                   "padded_flops_frac", "padded_frac_latent", "padded_frac_text",
                                                   "padded_frac_speaker")}
        print(json.dumps({"run_id": record.run_id, "summary": record.breakdown or {}, "breakdown": bd,
                          "padding": padding, "waterfall": steps}, indent=2))
        return
    for part in explain_report(record, bd, steps):
        console.print(part)


def explain_references(sweep_dir: Path, as_json: bool) -> bool:
    """`explain SWEEP`: each card run's sentence beside the best Echo run on its device
    (predict.reference: ReferenceRow.beside); False when the directory holds no card run."""
    from echobench.predict.reference import best_echo, reference_row
    from echobench.records.results import load_records

    records, problems = load_records([sweep_dir])
    cards = sorted((r for r in records if r.card), key=lambda r: (r.card.get("label") or r.scale, r.run_id))
    if not cards:
        return False
    for problem in problems:
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    lines = []
    for record in cards:
        ref, echo = reference_row(record), best_echo(records, record.env.device_name)
        lines.append({"reference": ref.run_id, "label": ref.label, "device": record.env.device_name, "mfu": ref.mfu,
                      "published_mfu": ref.pub("mfu"), "ratio": ref.ratio, "stands": ref.stands,
                      "echo": echo.run_id if echo else None, "echo_mfu": echo.mfu if echo else None,
                      "sentence": ref.beside(echo)})
    if as_json:
        print(json.dumps(lines, indent=2))
    for line in [] if as_json else lines:
        console.print(esc(line["sentence"]), highlight=False, soft_wrap=True)
    return True
