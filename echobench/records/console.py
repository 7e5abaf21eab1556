"""What echobench prints through rich: text from outside, run states, log lines, sweep progress,
and the tables `run` prints.

Text from outside (records, logs, matrices, exceptions, paths): rich reads "[...]" in a printed
string as markup: a gloo error holding "[/__w/.../pair.cc:537]" is a closing tag with no opening
one (a MarkupError), "[bold]" would vanish into a style. Every such string goes through `esc`
before it reaches a rich format string or a table cell.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from echobench.records.results import RECORD_FILE, configuration_key, over_repeats, peak_notes
from echobench.records.states import ACTIVE, RunState

STATE_COLORS = {RunState.OK: "green", RunState.RUNNING: "cyan", RunState.PENDING: "yellow", RunState.WAITING: "yellow",
                RunState.QUEUED: "", RunState.NOT_STARTED: ""}  # else: red


def esc(value: object) -> str:
    """`value` as text that rich prints verbatim."""
    return escape(str(value))


def state_markup(state: str) -> str:
    """A run's state (a record status, pending, running, ...) in its color."""
    color = STATE_COLORS.get(state, "red")
    return f"[{color}]{esc(state)}[/]" if color else esc(state)


def state_counts(states) -> str:
    """"2 ok, 1 running": how many runs are in each state."""
    return ", ".join(f"{v} {k}" for k, v in sorted(Counter(states).items()))


def log(console, text: str) -> None:
    """One timestamped line; `text` is rich markup: pass outside strings through esc()."""
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}", highlight=False)


PROGRESS_MARK = "[echobench] "  # what a run's progress lines start with (echobench.train.progress.say)


def last_progress_line(run_dir, tail_bytes: int = 16384) -> str | None:
    """The newest progress line in a run's newest log (its logs/ folder), without the mark (and any
    srun label before it); None where there is none yet. Reads the log's tail only: logs grow long."""
    logs = [p for p in (run_dir / "logs").glob("*") if p.is_file()] if (run_dir / "logs").is_dir() else []
    if not logs:
        return None
    newest = max(logs, key=lambda p: p.stat().st_mtime)
    with open(newest, "rb") as f:
        f.seek(max(f.seek(0, 2) - tail_bytes, 0))
        lines = f.read().decode("utf-8", "replace").splitlines()
    found = [line.split(PROGRESS_MARK, 1)[1] for line in lines if PROGRESS_MARK in line]
    return found[-1].strip() if found else None


def outcome_text(run_dir) -> str | None:
    """A finished run's headline from its record: MFU and samples/s ("" where the record has none)."""
    from echobench.records.results import Record  # lazy: console is imported where records are not read

    try:
        record = Record.load(run_dir / RECORD_FILE)
    except (OSError, ValueError):
        return None
    if record.status != RunState.OK or record.mfu is None:
        return None
    return f"MFU {record.mfu:.1%}, {record.samples_per_s:.3g} samples/s"


@dataclass
class SweepProgress:
    """A sweep's live view on a terminal: a bar of the runs finished, then a table of every run with
    its state and what it last said (a running run: its newest progress line, step, MFU, memory; a
    finished one: its MFU). Elsewhere (a log file, CI) the sweep's log lines say it all."""

    console: object
    live: object = None
    started: float = 0.0
    finished: dict = field(default_factory=dict)  # run dir -> its outcome_text, read once

    def table(self, rows: list[tuple]):
        """rows: (run id, state, detail[, run directory]); a directory adds what the run last said."""
        states = [row[1] for row in rows]
        done = sum(1 for s in states if s not in (RunState.QUEUED, *ACTIVE, RunState.WAITING, RunState.NOT_STARTED))
        elapsed = time.strftime("%H:%M:%S", time.gmtime(time.monotonic() - self.started)) if self.started else None
        table = Table(title=f"sweep: {done}/{len(rows)} finished ({state_counts(states)})"
                            + (f", {elapsed} elapsed" if elapsed else ""))
        for col in ("run", "state", "detail"):
            table.add_column(col, overflow="fold")
        for rid, state, detail, *where in rows:
            said = None
            if where and where[0] is not None:
                if state == RunState.RUNNING:
                    said = last_progress_line(where[0])
                elif state == RunState.OK:
                    said = self.finished.setdefault(where[0], outcome_text(where[0]))
            table.add_row(esc(rid), state_markup(state), esc((said or detail or "")[:100]))
        return Group(ProgressBar(total=max(len(rows), 1), completed=done, width=60), table)

    def __enter__(self):
        self.started = time.monotonic()
        if getattr(self.console, "is_terminal", False):
            self.live = Live(console=self.console, refresh_per_second=2, transient=False).__enter__()
        return self

    def update(self, rows):
        if self.live is not None:
            self.live.update(self.table(rows))

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)


def fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def record_report(record) -> list:
    """A successful run's record as `echobench run` prints it: one table, then the peak's notes."""
    table = Table(title=esc(record.run_id), show_header=False)
    rows = [
        ("device", record.env.device_name),
        ("step time (median, p10-p90)", f"{record.step_time_s:.4f} s ({record.step_time_p10_s:.4f}-{record.step_time_p90_s:.4f})"),
        ("step time (mean)", f"{record.step_time_mean_s:.4f} s ({record.step_time_mean_vs_median:+.1%} vs median)"),
        ("measured window", f"{record.measured_steps} steps, {record.measured_time_s:.3f} s, "
                            f"{record.measured_samples} samples"),
        ("samples/s (window)", fmt(record.samples_per_s, ".2f")),
        *([("card", f"{record.card['label']} ({record.card['source']}), seq {record.card['seq']}"),
           ("tokens/s per device (window)", fmt(record.card.get("tokens_per_s_per_gpu"), ".4g"))] if record.card else
          [("audio seconds/s (window)", fmt(record.audio_seconds_per_s, ".1f"))]),
        ("model TFLOP/sample", fmt(record.model_flops_per_sample / 1e12, ".4g")),
        ("TFLOP/s per device", fmt(record.tflops_per_gpu, ".4g")),
        ("peak TFLOP/s", f"{record.peak_tflops:.4g} {record.peak_precision} ({record.peak_source})"),
        # a float8 run's MFU is against the bf16 peak: labelled as float8's, never read as a bf16 run's
        ("MFU (window)" if record.precision != "fp8" else "MFU (window, float8 run, vs the bf16 peak)",
         f"{record.mfu:.2%}"),
        *([("MFU vs fp8 peak", "-" if record.mfu_fp8_peak is None else f"{record.mfu_fp8_peak:.2%}")]
          if record.precision == "fp8" else []),
        *([("MFU (row's convention)", f"{record.card['row_mfu']:.2%} ({record.card['row_convention'].split(',')[0]})")]
          if record.card and record.card.get("row_mfu") is not None else []),
        ("HFU (window)", f"{record.hfu:.2%}"),
        ("MFU vs GEMM ceiling", "-" if record.mfu_vs_ceiling is None else f"{record.mfu_vs_ceiling:.2%}"),
        ("peak memory", f"{record.peak_mem_gib:.2f} GiB"),
        ("allocator retries / OOMs", "-" if record.num_alloc_retries is None
         else f"{record.num_alloc_retries} / {record.num_ooms}"),
        ("data wait", f"{record.data_wait_frac:.1%}"),
        *([("weights", f"{record.backend['master_weights']}"
                       + (f", gradients summed in {record.backend['grad_accum_dtype']}"
                          if record.backend.get("grad_accum_dtype") else "")
                       + f": {record.backend.get('master_weights_recipe', '')}")]
          if (record.backend or {}).get("master_weights") else []),
        ("compile", compile_text(record)),
        ("attention", attention_text(record)),
        *([("padding", padding_text(record))] if record.padded_flops_frac is not None else []),
    ]
    for k, v in rows:
        table.add_row(k, esc(v))
    return [table, *(Text(f"note: {note}") for note in peak_notes(record))]


def compile_text(record) -> str:
    """What compile produced, as the run's table says it: eager, or the graphs and graph breaks."""
    if not record.compile:
        return record.compile_note or "eager"
    return f"{record.compile_graphs} graphs, {record.compile_graph_breaks} graph breaks"


def attention_text(record) -> str:
    """Per attention, the paths its measured micro-batches took and their share of the attention FLOPs;
    the DiT's unmasked SDPA kernel, as a profiled pass saw it on a GPU, else torch's predicted choice (a
    card run: its decoder's)."""
    shares = record.attention_flop_shares or {}
    paths = "; ".join(f"{part} " + ", ".join(f"{path} {n}" + (f" ({shares[part][path]:.0%} of FLOPs)"
                                                             if path in shares.get(part, {}) else "")
                                            for path, n in counts.items())
                      for part, counts in (record.attention_paths or {}).items())
    predicted = record.sdpa_backends_predicted or {}
    if not paths:  # a card run: its decoder's one attention path
        return f"decoder SDPA, predicted: {predicted['decoder']}" if "decoder" in predicted else "-"
    return paths + (f" (DiT SDPA, predicted: {predicted['dit']})" if "dit" in predicted else "")


def padding_text(record) -> str:
    """The record's padding figures in one line (padding_figures): its share of the matmul FLOPs
    executed and the padded share of each stream's tokens."""
    streams = ", ".join(f"{s} {share:.1%}" if share is not None else f"{s} unknown"
                        for s, share in (("latent", record.padded_frac_latent), ("text", record.padded_frac_text),
                                         ("speaker", record.padded_frac_speaker)))
    text = f"{record.padded_flops_frac:.1%} of the matmul FLOPs executed; padded tokens: {streams}"
    if record.bucket_steps:  # batching=bucket: which shapes the measured steps ran at
        text += "; audio buckets (frames: steps) " + ", ".join(f"{f}: {n}" for f, n in record.bucket_steps.items())
    return text


def repeats_report(records: list, out) -> list:
    """`run --repeats N`: one row per repeat, the median over the ok ones, where the records went."""
    table = Table(title=esc(f"{len(records)} repeats of {configuration_key(records[0])}"))
    for col in ("repeat", "run id", "status", "samples/s", "MFU", "step time median s", "mean vs median"):
        table.add_column(col, justify="left" if col in ("run id", "status") else "right")
    for k, r in enumerate(records):
        ok = r.status == RunState.OK
        table.add_row(str(k), esc(r.run_id), esc(r.status), fmt(r.samples_per_s, ".4g") if ok else "-",
                      f"{r.mfu:.2%}" if ok else "-", fmt(r.step_time_s, ".4f") if ok else "-",
                      f"{r.step_time_mean_vs_median:+.1%}" if ok else "-")
    out_parts = [table]
    ok = [r for r in records if r.status == RunState.OK]
    if ok:
        sps, mfu = over_repeats(r.samples_per_s for r in ok), over_repeats(r.mfu for r in ok)
        out_parts.append(Text(f"median over {len(ok)} ok repeat(s): samples/s {sps['median']:.4g} "
                              f"({sps['min']:.4g}-{sps['max']:.4g}), MFU {mfu['median']:.2%} "
                              f"({mfu['min']:.2%}-{mfu['max']:.2%})"))
    paths = ", ".join(str(out / f"repeat-{k}" / RECORD_FILE) for k in range(len(records)))
    return out_parts + [Text(f"wrote {paths}")]
