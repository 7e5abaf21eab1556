"""A run's `card` setting read into what `echobench run` trains (model.config.CardWorkload): a card
file (card.load_card_file) or FILE#ROW, a row of a published-runs file (validate.load_rows), with
the row's own FLOP convention (validate.row_convention) so that the record can state the measured
MFU under it beside echobench's."""

from __future__ import annotations

from dataclasses import fields

from echobench.model.config import CardWorkload
from echobench.predict.card import Layout, load_card_file, model_card, run_layout
from echobench.predict.errors import PredictError
from echobench.predict.validate import load_rows, row_convention
from echobench.records.config import card_label


def published_layout(layout: Layout) -> dict:
    """The layout a card or row publishes, as the record keeps it: the fields it sets (defaults left out)."""
    return {f.name: getattr(layout, f.name) for f in fields(layout) if getattr(layout, f.name) != f.default}


def run_card(spec: str) -> CardWorkload:
    """The workload of setting card=SPEC; PredictError (one line) for a file, row or card that is not there
    or not valid."""
    path, _, row_id = spec.partition("#")
    if not row_id:
        card, layout, _ = load_card_file(path)
        return CardWorkload(card, layout.seq, card_label(spec), spec, published_layout(layout))
    rows = load_rows(path)
    row = next((r for r in rows if r["id"] == row_id), None)
    if row is None:
        raise PredictError(f"{path}: no row {row_id!r}: give one of {', '.join(r['id'] for r in rows)}")
    card = model_card(row["model"], f"{path}: row {row_id}: model")
    layout = run_layout(row["run"], row["hardware"], f"{path}: row {row_id}: run")
    formula, _ = row_convention(row)
    return CardWorkload(card, layout.seq, row_id, spec, published_layout(layout),
                        row_convention=str(row["published"]["convention"]),
                        row_flops_per_token=formula(card, layout) if formula else None)

