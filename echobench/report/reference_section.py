"""The dashboard's Reference workloads: the card runs among the records (a `card` section: a
published row, or a model card file, trained through the same harness) beside the Echo runs, each
held against its published row and its prediction (echobench.predict.reference): measured MFU
under the row's convention with the run's spread, published, predicted, the difference, and one
sentence ("the reference reaches 0.44 of its published 0.46 ..."; where the records hold Echo runs too, next
to Echo's best MFU on the same device: ReferenceRow.beside). The published figures are the
record's own (its card section keeps them), else those of `report --reference ROWS.yaml`."""

from __future__ import annotations

import pandas as pd

from echobench.predict.cards.card import Layout
from echobench.predict.reference import best_echo, pct, reference_row
from echobench.predict.validate import layout_text
from echobench.report.data import ReportInput
from echobench.records.states import RunState

CAPTION = ("Card runs (echobench run --card, echobench reproduce): a published row's model trained through the same "
           "harness, on the same nodes, as the Echo runs. MFU under the row's own FLOP convention (each against its "
           "hardware's peak: the run's, the row's); [the run's spread: its MFU at its step-time p90 .. p10]; "
           "difference = measured - published, in percentage points, beyond or within that spread; predicted: echobench "
           "predict at the layout the run ran. Near its published MFU, the cluster and the stack are fine and an Echo "
           "gap is the model's; far below it, the cluster is the first suspect.")


def _published_layout(card: dict) -> str:
    """The layout the row publishes (the record's card.published_layout) in a few words."""
    try:
        layout = Layout(**card.get("published_layout") or {})
    except (TypeError, ValueError):
        return "-"
    return f"{layout_text(layout)} on {layout.gpus} GPUs"


def _value(frame: pd.DataFrame, run_id: str, column: str) -> float | None:
    if column not in frame.columns or run_id not in frame.index:
        return None
    value = frame.at[run_id, column]
    return None if value is None or pd.isna(value) else float(value)


def reference_section(data: ReportInput, reference: pd.DataFrame | None = None) -> dict | None:
    """The section's rows (None without a card run among the records)."""
    cards = [r for r in data.records if r.card]
    if not cards:
        return None
    frame = data.frame.drop_duplicates("run_id").set_index("run_id")
    given = {}  # row id -> published figures, from --reference ROWS.yaml
    if reference is not None and "ref_published" in reference.columns:
        given = {r.scale: r.ref_published for r in reference.itertuples() if isinstance(r.ref_published, dict)}
    rows = []
    beside = any(not r.card for r in data.records)  # Echo runs too: each reference next to Echo's MFU on its device
    for record in sorted(cards, key=lambda r: (r.card.get("label") or r.scale, r.run_id)):
        ref = reference_row(record, given.get(record.scale), _value(frame, record.run_id, "predicted_step_time_s"),
                            _value(frame, record.run_id, "predicted_row_mfu"))
        spread = f" [{pct(ref.mfu_spread[0])}-{pct(ref.mfu_spread[1])}]" if ref.mfu_spread else ""
        diff = "-" if ref.mfu_diff is None else f"{ref.mfu_diff * 100:+.1f}" + (f" {ref.verdict}" if ref.verdict else "")
        tokens = f"{ref.tokens_per_s_per_gpu:.4g}" if ref.tokens_per_s_per_gpu is not None else "-"
        published_tokens = ref.pub("tokens_per_s_per_gpu")
        rows.append({"card": ref.label, "source": ref.source, "run_id": ref.run_id, "ok": ref.status == RunState.OK,
                     "layout": ref.ran, "published_layout": _published_layout(record.card),
                     "gpus": f"{ref.gpus}" + (f" of {ref.published_gpus}" if ref.published_gpus else ""),
                     "measured": pct(ref.mfu) + spread if ref.status == RunState.OK else ref.status,
                     "published": pct(ref.pub("mfu")), "predicted": pct(ref.predicted_mfu), "diff": diff,
                     "tokens": tokens + " / " + (f"{published_tokens:.4g}" if published_tokens is not None else "-"),
                     "convention": ref.convention or "echobench's (a card file: no published row)",
                     "sentence": ref.beside(best_echo(data.records, record.env.device_name)) if beside
                     else ref.sentence()})
    return {"caption": CAPTION, "rows": rows}
