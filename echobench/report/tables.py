"""The publication table: one row per configuration, sorted the way papers sort it.

A configuration's figures are the median over its successful repeats, with MFU's min-max and
the number of repeats beside them. Notes under the table say when an MFU is not against a
datasheet bf16 peak (a calibrated GEMM rate, an fp32 run, an fp8 run); an fp8 row also gets
its MFU against the fp8 peak, in its own column.

`--reference FILE.csv` puts published figures beside the measured ones. Its columns:

    scale,framework,parallelism,nodes        the key (all four required)
    mfu                                      published MFU as a fraction (0.42, not 42)
    tflops_per_gpu                           published TFLOP/s per GPU
    samples_per_s                            published samples/s (whole job)
    source                                   optional: where the figure comes from

Any of the three figures may be left empty or left out. `--reference ROWS.yaml`, a published-runs
file (validation/published-runs.yaml's format), gives the same columns from its rows
(read_reference_rows): each keyed by its id as the scale (a card run's record names its row so),
its layout in echobench's framework and parallelism, its published node count. Differences are measured minus published:
MFU in percentage points, TFLOP/s and samples/s in percent of the published value. A published
row with no measured run appears with empty measured columns.
"""

from __future__ import annotations

import difflib
import io
from pathlib import Path

import pandas as pd

from echobench.records.config import check_value, choices
from echobench.records.layout import is_layout
from echobench.report.data import over_configurations, scale_order, successful, varying_keys

KEYS = ["scale", "framework", "parallelism", "nodes"]
REFERENCE_FIGURES = ["mfu", "tflops_per_gpu", "samples_per_s"]
# (frame column, header)
COLUMNS = [
    ("scale", "scale"), ("framework", "framework"), ("parallelism", "parallelism"), ("nodes", "nodes"),
    ("world_size", "GPUs"), ("global_batch", "global batch"), ("step_time_s", "step time (s)"),
    ("samples_per_s", "samples/s"), ("tflops_per_gpu", "TFLOP/s per GPU"), ("mfu", "MFU (%)"),
    ("mfu_min", "MFU min (%)"), ("mfu_max", "MFU max (%)"), ("repeats", "repeats"), ("peak_mem_gib", "memory (GiB)"),
]
FP8_COLUMN = ("mfu_fp8_peak", "MFU vs fp8 peak (%)")  # only when a row ran in fp8
NOTES_COLUMN = "notes"  # a column in csv; numbered notes under md and latex
REFERENCE_COLUMNS = [
    ("ref_mfu", "published MFU (%)"), ("diff_mfu_pp", "MFU diff (pp)"),
    ("ref_tflops_per_gpu", "published TFLOP/s per GPU"), ("diff_tflops_pct", "TFLOP/s diff (%)"),
    ("ref_samples_per_s", "published samples/s"), ("diff_samples_pct", "samples/s diff (%)"),
    ("ref_source", "source"),
]
PERCENT_COLUMNS = {"mfu", "mfu_min", "mfu_max", "mfu_fp8_peak", "ref_mfu"}  # fractions shown as percent


class ReferenceError(ValueError):
    pass


def read_reference(path: Path) -> pd.DataFrame:
    """Reads and checks a reference CSV (see the module docstring for its columns), or a published-runs
    YAML file (read_reference_rows)."""
    if Path(path).suffix in (".yaml", ".yml"):
        return read_reference_rows(Path(path))
    try:
        ref = pd.read_csv(path, dtype={"scale": str, "framework": str, "parallelism": str})
    except (OSError, ValueError) as exc:
        raise ReferenceError(f"{path}: cannot read the reference CSV ({exc})") from exc
    ref.columns = [c.strip() for c in ref.columns]
    missing = [k for k in KEYS if k not in ref.columns]
    if missing:
        raise ReferenceError(f"{path}: missing key column(s) {', '.join(missing)}; "
                             f"expected {','.join(KEYS)} plus any of {','.join(REFERENCE_FIGURES)}")
    figures = [c for c in REFERENCE_FIGURES if c in ref.columns]
    if not figures:
        raise ReferenceError(f"{path}: no published figure column; add one of {', '.join(REFERENCE_FIGURES)}")
    try:
        ref["nodes"] = ref["nodes"].astype(int)
        for c in figures:
            ref[c] = pd.to_numeric(ref[c], errors="raise")
    except (ValueError, TypeError) as exc:
        raise ReferenceError(f"{path}: nodes and figures must be numbers ({exc})") from exc
    if "mfu" in ref.columns and (ref["mfu"] > 1).any():
        raise ReferenceError(f"{path}: mfu must be a fraction (0.42 for 42%); found {ref['mfu'].max()}")
    dup = ref[ref.duplicated(KEYS, keep=False)]
    if len(dup):
        raise ReferenceError(f"{path}: more than one row for {dup.iloc[0][KEYS].to_dict()}")
    for c in REFERENCE_FIGURES + ["source"]:
        if c not in ref.columns:
            ref[c] = None
    for k in ("scale", "framework", "parallelism"):
        ref[k] = ref[k].str.strip()
    for i, row in ref.iterrows():
        for k in ("scale", "framework", "parallelism"):
            if problem := slip(k, row[k]):
                raise ReferenceError(f"{path}: line {i + 2}: {problem}")
    return ref[KEYS + REFERENCE_FIGURES + ["source"]].rename(
        columns={c: f"ref_{c}" for c in REFERENCE_FIGURES + ["source"]})


def slip(key: str, value) -> str | None:
    """Why `value` of a reference row's key is refused, as a matrix refuses it (check_value's words),
    when it is a slip of a valid run setting ('3b' for 3B, 'fsdp' for fsdp2, 'Megatron' for megatron):
    such a row would stand unmatched. None for a valid value, or one near none (another model's
    name, GPT-1.7B: a published-only row)."""
    try:
        check_value(key, value)
        return None
    except ValueError as exc:
        problem = str(exc)
    text = str(value).lower()
    allowed = [c for c in choices(key) if key != "parallelism" or is_layout(c)]  # tpN: its widths, as text's
    if key == "parallelism" and is_layout(text):
        allowed.append(text)
    near = [c for c in allowed if c.lower() == text] or [
        c for c in allowed if difflib.SequenceMatcher(None, text, c.lower()).ratio() >= NEAR]
    return f"{problem} (did you mean {near[0]!r}?)" if near else None


NEAR = 0.75  # how alike (difflib's ratio, ignoring case) a reference key is to a valid value to count as a slip of it


def unmatched_rows(reference: pd.DataFrame, frame: pd.DataFrame, path: Path) -> list[str]:
    """One line per reference row of echobench's own scales and layouts that no measured
    configuration pairs with (it stands published-only), naming the row and the nearest measured
    configuration (the most keys in common). Rows of other models' names are published-only by design."""
    measured = over_configurations(successful(frame))[KEYS].drop_duplicates() if not frame.empty else pd.DataFrame()
    have = [tuple(str(v) for v in row) for row in measured.itertuples(index=False)]
    lines = []
    for i, row in reference.iterrows():
        key = tuple(str(row[k]) for k in KEYS)
        if key in have or any(not valid(k, row[k]) for k in ("scale", "framework", "parallelism")):
            continue
        nearest = max(have, key=lambda h: sum(a == b for a, b in zip(h, key)), default=None)
        lines.append(f"{path}: line {i + 2} ({', '.join(key[:3])}, {key[3]} node(s)): no measured run has these keys, "
                     f"so its figures stand alone; " + (f"nearest measured: {', '.join(nearest[:3])}, {nearest[3]} "
                                                        f"node(s)" if nearest else "no run measured"))
    return lines


def valid(key: str, value) -> bool:
    try:
        check_value(key, value)
        return True
    except ValueError:
        return False


def read_reference_rows(path: Path) -> pd.DataFrame:
    """A published-runs file as the reference frame: per row its id (the scale of its card runs),
    framework and parallelism as echobench names its layout (sweep.reproduce.echobench_layout), its
    published nodes, MFU (under the row's own FLOP convention, which the source says), TFLOP/s per GPU
    and samples/s; and `ref_published`, its figures as a card run's record keeps them (the dashboard's
    Reference workloads takes them for a record that lacks its own)."""
    from echobench.predict.cards.card import model_card, run_layout
    from echobench.predict.errors import PredictError
    from echobench.predict.validate import load_rows, published_figures
    from echobench.sweep.reproduce import echobench_layout

    out = []
    try:
        for row in load_rows(path):
            card, layout = model_card(row["model"]), run_layout(row["run"], row["hardware"])
            figures = published_figures(row, card, layout)
            framework, parallelism = echobench_layout(layout)
            src = row["source"]
            out.append({"scale": row["id"], "framework": framework, "parallelism": parallelism, "nodes": layout.nodes,
                        "ref_mfu": figures["mfu"], "ref_tflops_per_gpu": row["published"].get("tflops_per_gpu"),
                        "ref_samples_per_s": figures["tokens_per_s_per_gpu"] * layout.gpus / layout.seq,
                        "ref_source": f"{src.get('name')} {src.get('repo')}@{str(src.get('commit'))[:8]}; MFU under its "
                                      f"convention: {row['published']['convention']}",
                        "ref_published": figures})
    except PredictError as exc:
        raise ReferenceError(str(exc)) from None
    return pd.DataFrame(out, columns=KEYS + [f"ref_{c}" for c in REFERENCE_FIGURES] + ["ref_source", "ref_published"])


def sort_rows(table: pd.DataFrame, scales: list[str], extra: list[str] = ()) -> pd.DataFrame:
    """Scale by size, then framework, parallelism, nodes, GPUs, global batch (then extra keys)."""
    rank = {s: i for i, s in enumerate(scales)}
    order = table.assign(_scale=table["scale"].map(lambda s: rank.get(s, len(rank))))
    by = ["_scale", "scale", "framework", "parallelism", "nodes", "world_size", "global_batch", *extra]
    return order.sort_values(by, kind="stable", na_position="last").drop(columns="_scale").reset_index(drop=True)


def distinguishing_keys(ok: pd.DataFrame) -> list[str]:
    """Settings that tell apart rows the standard columns cannot (e.g. two lengths at one layout)."""
    standard = [c for c, _ in COLUMNS[:6]]
    dups = ok[ok.duplicated(standard, keep=False)]
    keys = []
    for _, group in dups.groupby(standard, dropna=False):
        keys += [k for k in varying_keys(list(group["settings"])) if k not in standard and k not in keys]
    return keys


def publication_table(frame: pd.DataFrame, reference: pd.DataFrame | None = None) -> pd.DataFrame:
    """Raw numbers (fractions for MFU), one row per configuration of the successful runs (the
    median over its repeats), plus reference columns and the notes on its peak.

    When two configurations share the standard columns, the settings that differ between them
    are added after `parallelism` (e.g. micro_batch, audio_frames), so no two rows look the same.
    """
    ok = over_configurations(successful(frame))
    extra = distinguishing_keys(ok)
    figures = [c for c, _ in COLUMNS[3:]]
    if (ok["precision"] == "fp8").any():
        figures.insert(figures.index("mfu_max") + 1, FP8_COLUMN[0])
    columns = [c for c, _ in COLUMNS[:3]] + extra + figures + [NOTES_COLUMN]
    ok = ok.assign(**{k: [s.get(k) for s in ok["settings"]] for k in extra if k not in ok.columns})
    table = ok[columns].copy()
    table["repeats"] = table["repeats"].astype("Int64")
    for c in ("nodes", "world_size", "global_batch"):
        table[c] = pd.to_numeric(table[c], errors="coerce").astype("Int64")
    scales = scale_order(frame)
    if reference is not None:
        reference = reference.copy()
        reference["nodes"] = reference["nodes"].astype("Int64")
        table = table.merge(reference, on=KEYS, how="outer")
        table["diff_mfu_pp"] = (table["mfu"] - table["ref_mfu"]) * 100
        table["diff_tflops_pct"] = (table["tflops_per_gpu"] / table["ref_tflops_per_gpu"] - 1) * 100
        table["diff_samples_pct"] = (table["samples_per_s"] / table["ref_samples_per_s"] - 1) * 100
        scales = scales + [s for s in reference["scale"].drop_duplicates() if s not in scales]
        table = table[columns[:-1] + [c for c, _ in REFERENCE_COLUMNS] + [NOTES_COLUMN]]
    return sort_rows(table, scales, extra)


def fmt_number(value, percent: bool = False) -> str:
    """Three significant figures without exponents: 989, 41.2, 3.07, 0.0365."""
    if value is None or pd.isna(value):
        return "-"
    if isinstance(value, str):
        return value
    v = float(value) * (100 if percent else 1)
    if float(v).is_integer() and abs(v) >= 1 and not percent:
        return str(int(v))
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}" if a >= 1e-4 else f"{v:.2e}"


def formatted(table: pd.DataFrame) -> pd.DataFrame:
    """Text cells; the notes column becomes numbered marks ([1], [2]) that notes_text() explains, and
    is left out when no row has a note."""
    headers = dict(COLUMNS + REFERENCE_COLUMNS + [FP8_COLUMN])
    out = pd.DataFrame(index=table.index)
    marks = note_numbers(table)
    for c in table.columns:
        if c == NOTES_COLUMN:
            out[NOTES_COLUMN] = table[c].map(lambda v: " ".join(f"[{marks[n]}]" for n in split_notes(v)))
        elif c == "repeats":
            out[headers[c]] = table[c].map(lambda v: "-" if pd.isna(v) else str(int(v)))
        elif c not in headers:  # a setting that tells two rows apart (none on a reference-only row)
            out[c.replace("_", " ")] = table[c].map(lambda v: "-" if v is None or (isinstance(v, float) and pd.isna(v))
                                                     else str(v))
        elif c in ("scale", "framework", "parallelism", "ref_source"):
            out[headers[c]] = table[c].map(lambda v: "-" if v is None or pd.isna(v) else str(v))
        elif c in ("nodes", "world_size", "global_batch"):
            out[headers[c]] = table[c].map(lambda v: "-" if pd.isna(v) else str(int(v)))
        elif c.startswith("diff_"):
            out[headers[c]] = table[c].map(lambda v: "-" if pd.isna(v) else f"{v:+.1f}")
        else:
            out[headers[c]] = table[c].map(lambda v, p=c in PERCENT_COLUMNS: fmt_number(v, p))
    return out if out[NOTES_COLUMN].str.len().any() else out.drop(columns=NOTES_COLUMN)


def split_notes(value) -> list[str]:
    """The notes of a row (a tuple in the frame; absent on reference-only rows)."""
    return list(value) if isinstance(value, (tuple, list)) else []


def note_numbers(table: pd.DataFrame) -> dict[str, int]:
    """Each distinct note of the table's rows -> its number, in order of first appearance."""
    numbers: dict[str, int] = {}
    for value in table.get(NOTES_COLUMN, []):
        for note in split_notes(value):
            numbers.setdefault(note, len(numbers) + 1)
    return numbers


def notes_text(table: pd.DataFrame) -> list[str]:
    return [f"[{n}] {note}." for note, n in note_numbers(table).items()]


def to_markdown(table: pd.DataFrame) -> str:
    text = formatted(table)
    cols = list(text.columns)
    numeric = [c not in ("scale", "framework", "parallelism", "source", NOTES_COLUMN) for c in cols]

    def cell(v):
        return str(v).replace("|", "\\|")

    lines = ["| " + " | ".join(cols) + " |",
             "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in text.itertuples(index=False)]
    notes = notes_text(table)
    return "\n".join(lines) + "\n" + ("\n" + "\n".join(f"_{cell(n)}_" for n in notes) + "\n" if notes else "")


def to_csv(table: pd.DataFrame) -> str:
    """Raw numbers, machine-readable: MFU as a fraction, full precision; notes as text."""
    buf = io.StringIO()
    table = table.assign(**{NOTES_COLUMN: table[NOTES_COLUMN].map(lambda v: "; ".join(split_notes(v)))})
    table.to_csv(buf, index=False, float_format="%.6g")
    return buf.getvalue()


def to_latex(table: pd.DataFrame) -> str:
    text = formatted(table)
    align = "".join("l" if c in ("scale", "framework", "parallelism", "source", NOTES_COLUMN) else "r"
                    for c in text.columns)
    body = text.to_latex(index=False, escape=True, column_format=align)
    notes = notes_text(table)
    if notes:  # text after the tabular: visible under the table
        body += "\\par\\smallskip\n" + "\\par\n".join(f"\\noindent\\textit{{{latex_escape(n)}}}" for n in notes) + "\n"
    return body


LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                 "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}


def latex_escape(text: str) -> str:
    return "".join(LATEX_SPECIAL.get(ch, ch) for ch in text)


RENDERERS = {"md": to_markdown, "csv": to_csv, "latex": to_latex}


def render_table(frame: pd.DataFrame, fmt: str, reference: pd.DataFrame | None = None) -> str:
    """The publication table as md / csv / latex; with no successful run, a table saying so."""
    table = publication_table(frame, reference)
    if len(table) == 0:
        n = len(frame)
        note = "no result records" if n == 0 else f"no successful runs ({n} record(s), none ok)"
        if fmt == "csv":
            return ",".join(table.columns) + "\n"
        if fmt == "latex":
            return f"% {note}\n" + to_latex(table)
        return f"_{note}_\n\n" + to_markdown(table)
    return RENDERERS[fmt](table)
