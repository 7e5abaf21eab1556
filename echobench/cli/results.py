"""`echobench results`: every stored record under some directories as one table (echobench.report.listing)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from echobench.cli.common import ONLY_HELP, app, err_console, fail, writable_file
from echobench.records.console import esc
from echobench.records.states import RunState
from echobench.records.results import find_record_files


@app.command(short_help="Every record under some directories as one table (or --csv, --json), filtered with --only, sorted with --sort.")
def results(
    paths: list[Path] = typer.Argument(..., metavar="DIR", help="Sweep, tune or run directories (searched "
                                       "recursively) or result.json files."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help=ONLY_HELP + " Also status=ok, "
                                   "error, oom, ...: the record's."),
    sort: list[str] = typer.Option([], "--sort", metavar="COLUMN", help="Sort by this column (repeatable, in "
                                   "order; a leading '-' sorts descending: --sort=-mfu). Default: scale (by "
                                   "size), nodes, MFU descending."),
    csv_out: Optional[str] = typer.Option(None, "--csv", metavar="FILE|-", help="Write the rows as CSV to FILE "
                                          "('-': standard output) instead of the table; MFU as a fraction."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON instead of the table."),
    columns: list[str] = typer.Option([], "--columns", metavar="A,B", help="The columns to show, in order "
                                      "(repeatable): the table's (run_id, mfu, ...) and any run setting (ac, "
                                      "compile, micro_batch, ...). Default: the table's, with the settings that "
                                      "tell apart rows of one scale, layout and size after parallelism."),
):
    """Every run record under the directories, one row each (no merging: two sweeps of one run id are
    two rows): scale, layout, the settings that tell apart otherwise equal rows, GPUs, status, MFU,
    samples/s, step time, peak memory, date (--columns chooses). A record that cannot be read is
    listed as unreadable with its path, whatever the filters."""
    from echobench.report import listing

    if csv_out is not None and as_json:
        fail("--csv and --json: give one of them")
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such file or directory: {', '.join(missing)}")
    for p in paths:
        if not find_record_files([p]):
            fail(f"{p}: no result records (result.json) in it or below it: give a sweep or run directory")
    found = listing.list_records(paths)
    rows = listing.select_and_sort(found, only, sort)
    shown = listing.parse_columns(columns, rows)
    if csv_out is not None or as_json:  # the rows hold them too; the table lists them under it
        for row in found.unreadable:
            err_console.print(f"[yellow]unreadable record:[/] {esc(row['error'])}", highlight=False, soft_wrap=True)
    if csv_out == "-":
        sys.stdout.write(listing.to_csv(rows, shown))
    elif csv_out is not None:
        path = writable_file(Path(csv_out), "--csv")
        try:
            path.write_text(listing.to_csv(rows, shown), encoding="utf-8")
        except OSError as exc:
            fail(f"--csv {path}: cannot write it ({exc.strerror or exc})")
        err_console.print(f"wrote {esc(path)} ({len(rows)} rows)", highlight=False)
    elif as_json:
        print(json.dumps([listing.public(r, shown) for r in rows], indent=2, default=str))
    else:
        # Off a terminal (a pipe, a log) the table takes the width it needs: no cell folded or cut.
        out = Console(width=None if sys.stdout.isatty() else 100_000)
        read, ok = len(rows) - len(found.unreadable), sum(r["status"] == RunState.OK for r in rows)
        title = (f"{read} records, {ok} ok" + (f", {len(found.unreadable)} unreadable" if found.unreadable else "")
                 + (f" ({len(found.rows) - read} left out by --only)" if only else ""))
        out.print(listing.results_table(rows, title, shown), highlight=False)
        for row in found.unreadable:
            out.print(f"[red]unreadable:[/] {esc(row['error'])}", highlight=False, soft_wrap=True)
