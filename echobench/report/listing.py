"""`echobench results`: every result record under some directories, one row each, filtered and sorted.

Unlike the report (newest record per run id), nothing is merged: two sweeps that ran the same run
id are two rows. A record that cannot be read is a row of its own (status `unreadable`, its path
and why), so a listing never drops a file quietly.
"""

from __future__ import annotations

import csv
import io
import typing
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from echobench.records.config import FIELDS, configuration, unknown_key
from echobench.records.console import esc, fmt, state_markup
from echobench.records.results import (Record, Status, find_record_files, gpu_hours_per_million_samples,
                                       record_settings)
from echobench.report.data import scale_size, varying_keys
from echobench.sweep.matrix import MatrixError, parse_only

UNREADABLE = "unreadable"
# (row key, table header): the table's columns, in order; CSV and JSON have these keys plus ERROR_KEYS.
COLUMNS = [
    ("sweep_dir", "sweep dir"), ("run_id", "run id"), ("scale", "scale"), ("framework", "framework"),
    ("parallelism", "parallelism"), ("nodes", "nodes"), ("gpus", "GPUs"), ("status", "status"), ("mfu", "MFU"),
    ("samples_per_s", "samples/s"), ("gpu_h_per_1m_samples", "GPU-h / 1M samples"), ("step_time_s", "step time (s)"),
    ("peak_mem_gib", "peak memory (GiB)"),
    ("date", "date"),
]
ERROR_KEYS = ["error", "path"]  # long text: in CSV and JSON, under the table on the terminal
KEYS = [k for k, _ in COLUMNS] + ERROR_KEYS
DEFAULT_SORT = ["scale", "nodes", "-mfu"]
STATUS_KEY = "status"  # --only status=...: the record's, not a run setting


class ListingError(ValueError):
    """Bad input (a filter, a sort key): one line naming it and the fix."""


@dataclass
class Listing:
    rows: list[dict] = field(default_factory=list)
    unreadable: list[dict] = field(default_factory=list)  # rows of records that could not be read


def sweep_dir(record_file: Path) -> Path:
    """The directory that holds a record's run directory: a sweep's (SWEEP/RUN_ID/result.json), a
    `run --repeats` OUT (OUT/repeat-K/result.json), or the parent of a lone run directory."""
    return record_file.parent.parent


def shown_dir(path: Path, roots: list[Path]) -> str:
    """`path` as the user named it: relative to the parent of the argument it was found under, so
    `results runs` shows runs/smoke, `results runs/smoke` and `results runs/smoke/RUN` show smoke."""
    for root in roots:
        base = root.resolve().parent if root.is_dir() else root.resolve().parent.parent
        try:
            shown = path.resolve().relative_to(base)
        except ValueError:
            continue
        return str(shown) if shown.parts else path.resolve().name  # a run directory given alone: its sweep's name
    return str(path)


def record_row(record: Record, shown_sweep: str) -> dict:
    return {"sweep_dir": shown_sweep, "run_id": record.run_id, "scale": record.scale, "framework": record.framework,
            "parallelism": record.parallelism, "nodes": record.nodes, "gpus": record.world_size,
            "status": record.status, "mfu": record.mfu, "samples_per_s": record.samples_per_s,
            "gpu_h_per_1m_samples": gpu_hours_per_million_samples(record.world_size, record.samples_per_s),
            "step_time_s": record.step_time_s, "peak_mem_gib": record.peak_mem_gib, "date": record.env.time,
            "error": record.error or None, "path": str(record.path), "_settings": record_settings(record)}


def list_records(paths: list[Path]) -> Listing:
    """Every record file under paths (a sweep's earlier attempts left out, as everywhere), each read
    once however many of the paths hold it."""
    listing, seen = Listing(), set()
    for path in find_record_files(paths):
        if (key := path.resolve()) in seen:
            continue
        seen.add(key)
        where = sweep_dir(path)
        try:
            record = Record.load(path)
        except ValueError as exc:
            listing.unreadable.append({**{k: None for k in KEYS}, "sweep_dir": shown_dir(where, paths),
                                       "status": UNREADABLE, "error": str(exc), "path": str(path)})
            continue
        listing.rows.append(record_row(record, shown_dir(where, paths)))
    return listing


# ---- --only ----

def parse_filters(items: list[str]) -> dict[str, list]:
    """--only KEY=VALUE as `sweep` and `plan` take it (a run setting, checked as there; the same key
    twice: either value), and status=STATUS, the record's."""
    statuses = typing.get_args(Status)
    wanted: dict[str, list] = {}
    settings = []
    for item in items:
        key, sep, value = item.partition("=")
        if key != STATUS_KEY:
            settings.append(item)
        elif value not in statuses:
            raise ListingError(f"--only {item!r}: status is one of {', '.join(statuses)}")
        else:
            wanted.setdefault(STATUS_KEY, []).append(value)
    try:
        wanted.update(parse_only(settings))
    except MatrixError as exc:
        raise ListingError(f"{exc} (or status=STATUS, the record's)") from None
    return wanted


def matches(row: dict, wanted: dict[str, list]) -> bool:
    """Whether a record's row has, for each key, one of the wanted values: its status, else the
    setting as the run was launched with it (the record's `config`)."""
    for key, values in wanted.items():
        have = row["status"] if key == STATUS_KEY else row["_settings"].get(key, row.get(key))
        if have not in values:
            return False
    return True


# ---- --sort ----

def parse_sort(items: list[str]) -> list[tuple[str, bool]]:
    """--sort COLUMN (repeatable, in order; a leading '-' sorts it descending) -> [(key, descending)]."""
    keys = []
    for item in items:
        key, descending = item.removeprefix("-"), item.startswith("-")
        if key not in KEYS:
            raise ListingError(f"--sort {item!r}: not a column; one of {', '.join(k for k, _ in COLUMNS)} "
                               "(a leading '-' sorts descending, e.g. --sort=-mfu)")
        keys.append((key, descending))
    return keys


def sort_rows(rows: list[dict], keys: list[tuple[str, bool]]) -> list[dict]:
    """Stable sorts from the last key to the first; empty cells last whichever the direction; scales
    by size (800M before 3B), not as text."""
    def value(row, key):
        v = row.get(key)
        return scale_size(v) if key == "scale" and v is not None else v

    rows = list(rows)
    for key, descending in reversed(keys):
        present = [r for r in rows if value(r, key) is not None]
        missing = [r for r in rows if value(r, key) is None]
        try:
            present.sort(key=lambda r: value(r, key), reverse=descending)
        except TypeError:  # mixed types (a hand-edited record): compare as text
            present.sort(key=lambda r: str(value(r, key)), reverse=descending)
        rows = present + missing
    return rows


# ---- --columns ----

STANDARD = ("scale", "framework", "parallelism", "nodes", "gpus")  # what tells runs apart without a setting


def telling_settings(rows: list[dict]) -> list[str]:
    """The run settings that differ between rows the standard columns cannot tell apart (the same
    scale, layout, nodes and GPUs; ac, compile, micro_batch, ...): shown beside them by default."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "_settings" in row:
            groups.setdefault(tuple(str(row.get(k)) for k in STANDARD), []).append(row)
    keys: list[str] = []
    for group in groups.values():
        if len(group) > 1:
            settings = [configuration(r["_settings"], with_nodes=False) for r in group]
            keys += [k for k in varying_keys(settings, ignore=STANDARD) if k not in keys]
    return keys


def parse_columns(items: list[str], rows: list[dict]) -> list[str]:
    """--columns A,B (repeatable) -> the columns to show: the table's (COLUMNS) and run settings; none
    given: COLUMNS with telling_settings after `parallelism`."""
    names = [name.strip() for item in items for name in item.split(",") if name.strip()]
    if not names:
        shown = [k for k, _ in COLUMNS]
        at = shown.index("parallelism") + 1
        return shown[:at] + telling_settings(rows) + shown[at:]
    allowed = [k for k, _ in COLUMNS] + [k for k in FIELDS if k not in STANDARD]
    if bad := [n for n in names if n not in allowed]:
        raise ListingError(f"--columns: {unknown_key(bad, allowed, 'column')}")
    return list(dict.fromkeys(names))


def value_of(row: dict, key: str):
    """A column's value in a row: its own, else the run setting's."""
    return row[key] if key in row else row.get("_settings", {}).get(key)


def select_and_sort(listing: Listing, only: list[str], sort: list[str]) -> list[dict]:
    """The rows --only keeps, sorted by --sort (default DEFAULT_SORT), then the unreadable records,
    which no filter can judge and which are never left out."""
    wanted = parse_filters(only)
    keys = parse_sort(sort or DEFAULT_SORT)
    kept = [r for r in listing.rows if matches(r, wanted)]
    return sort_rows(kept, keys) + listing.unreadable


# ---- output ----

def public(row: dict, columns: list[str] | None = None) -> dict:
    """A row as CSV and JSON give it: the columns (default KEYS) and ERROR_KEYS, numbers as recorded
    (MFU a fraction)."""
    keys = list(dict.fromkeys((columns or [k for k, _ in COLUMNS]) + ERROR_KEYS))
    return {k: value_of(row, k) for k in keys}


def to_csv(rows: list[dict], columns: list[str] | None = None) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(public({}, columns)), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in public(row, columns).items()})
    return buf.getvalue()


def cell(key: str, value) -> str:
    """One cell of the terminal table, as rich markup (record text escaped)."""
    if value is None:
        return "-"
    if key == "status":
        return state_markup(value)
    if key == "mfu":
        return f"{value:.2%}"
    if key in ("samples_per_s", "peak_mem_gib", "gpu_h_per_1m_samples"):
        return fmt(value, ".4g")
    if key == "step_time_s":
        return fmt(value, ".4f")
    if key == "date":
        return esc(str(value)[:16].replace("T", " "))  # minutes are enough to tell runs apart
    return esc(str(value))


def results_table(rows: list[dict], title: str, columns: list[str] | None = None) -> Table:
    """The terminal table of these columns (default COLUMNS); a setting's header is its name."""
    columns = columns or [k for k, _ in COLUMNS]
    headers = dict(COLUMNS)
    table = Table(title=esc(title))
    for key in columns:
        numeric = key in ("nodes", "gpus", "mfu", "samples_per_s", "gpu_h_per_1m_samples", "step_time_s", "peak_mem_gib")
        table.add_column(esc(headers.get(key, key)), justify="right" if numeric else "left")
    for row in rows:
        table.add_row(*(cell(key, value_of(row, key)) for key in columns))
    return table
