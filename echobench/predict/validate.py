"""`echobench predict --validate FILE`: the model held against published training runs
(validation/published-runs.yaml: one row per run, validation/SOURCES.md says where each figure is
from). Each row's `model` is a model card, its `run` and `hardware` a layout on a shipped profile;
predict_card prices it. The published step time is global_batch x seq / (tokens/s per GPU x GPUs),
tokens/s per GPU being published or derived from the published TFLOP/s per GPU under the row's own
FLOP convention (CONVENTIONS); error = predicted / published - 1. Rows the model cannot price (pipeline
parallelism, a profile that is not there) are refused with why and left out of the mean and max."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


from echobench.hwprofile import HardwareProfile, ProfileError, find_profile, load_profile
from echobench.predict.card import Layout, ModelCard, card_params, model_card, run_layout
from echobench.predict.card_model import predict_card
from echobench.predict.errors import PredictError
from echobench.yamltext import read_yaml

# The keys a row must have to be priced (a row lacking one is bad input, named with its row).
REQUIRED = {"hardware": ("profile", "gpus", "gpus_per_node"),
            "model": ("layers", "hidden", "ffn", "activation", "heads", "kv_heads", "vocab", "tied_embeddings",
                      "positions", "bias"),
            "run": ("seq", "micro_batch", "grad_accum", "global_batch", "layout", "tp"),
            "published": ("tflops_per_gpu", "convention")}
AIM = {"mean_abs_error": 0.10, "max_abs_error": 0.20, "rows": 16}  # issue 34's aim, reported, not enforced


def _llm_foundry(card: ModelCard, layout: Layout) -> float:
    """llm-foundry's collect_results.py: 6 n_params + 12 L d s per token (n_params: every parameter)."""
    n = card.params if card.params is not None else card_params(card, layout.seq)
    return 6 * n + 12 * card.layers * card.hidden * layout.seq


def _megatron(card: ModelCard, layout: Layout) -> float:
    """Megatron-LM's num_floating_point_operations (MHA, ffn 4h): 72 L h^2 + 12 L h s + 6 h V per token."""
    L, h = card.layers, card.hidden
    return 72 * L * h * h + 12 * L * h * layout.seq + 6 * h * card.vocab


# A row's `published.convention` starts with its formula; its peak is the number after "peak".
CONVENTIONS = {"6N + 12 L d s": _llm_foundry, "72 L h^2 + 12 L h s + 6 h V": _megatron}


@dataclass
class ValidationRow:
    """One published row held against its prediction (refused: why it was not priced)."""

    id: str
    source: str
    gpus: int
    layout: str
    published_step_s: float | None = None
    published_from: str = ""  # tokens/s, or TFLOP/s under the row's convention
    predicted_step_s: float | None = None
    error: float | None = None  # predicted / published - 1
    published_mfu: float | None = None
    predicted_mfu: float | None = None  # under the row's convention and peak
    predicted_mfu_echobench: float | None = None
    parts: dict[str, float] = field(default_factory=dict)
    refused: str | None = None
    notes: list[str] = field(default_factory=list)


def load_rows(path: Path | str) -> list[dict]:
    """The rows of a published-runs YAML file; PredictError (one line) for a missing or unreadable
    file, bad YAML, a file that is not a list of rows, or a row lacking a key predict reads."""
    path = Path(path)
    data = read_yaml(path, "published runs file", PredictError,
                     missing="give the published runs file, e.g. validation/published-runs.yaml")
    if not isinstance(data, list) or not data:
        raise PredictError(f"{path}: expected a non-empty list of rows (each with id, hardware, model, run, published)")
    for i, row in enumerate(data):
        if not isinstance(row, Mapping) or not isinstance(row.get("id"), str):
            raise PredictError(f"{path}: row {i + 1} is not a mapping with a string `id`: give each row an id")
        for section, keys in REQUIRED.items():
            if not isinstance(row.get(section), Mapping):
                raise PredictError(f"{path}: row {row['id']} lacks the mapping {section!r}: add it")
            for key in keys:
                if key not in row[section]:
                    raise PredictError(f"{path}: row {row['id']} lacks {section}.{key}: add it")
    return data


def row_convention(row: Mapping) -> tuple:
    """(FLOPs per token function, peak TFLOP/s) of the row's published convention."""
    text = str(row["published"]["convention"])
    formula = next((f for prefix, f in CONVENTIONS.items() if text.startswith(prefix)), None)
    peak = re.search(r"peak\s+([0-9.]+)", text)
    if formula is None or peak is None:
        known = "; ".join(CONVENTIONS)
        raise PredictError(f"row {row['id']}: unknown published.convention {text!r}: start it with one of: {known}, "
                           "and name the peak ('peak 989')")
    return formula, float(peak.group(1))


def published_step(row: Mapping, card: ModelCard, layout: Layout) -> tuple[float, str]:
    """The published step time (seconds) and what it is derived from."""
    pub = row["published"]
    tokens = layout.global_batch * layout.seq
    if pub.get("tokens_per_s_per_gpu"):
        return tokens / (pub["tokens_per_s_per_gpu"] * layout.gpus), "tokens/s"
    formula, _ = row_convention(row)
    per_gpu = pub["tflops_per_gpu"] * 1e12 / formula(card, layout)
    return tokens / (per_gpu * layout.gpus), "TFLOP/s / row's FLOPs per token"


def _layout_text(layout: Layout) -> str:
    if layout.layout == "megatron":
        return (f"tp{layout.tp} dp{layout.dp}" + (" sp" if layout.sp else "")
                + (" zero1" if layout.distributed_optimizer else "") + (f" ac {layout.ac}" if layout.ac != "none" else ""))
    text = layout.layout + (f" {layout.sharding}" if layout.layout in ("fsdp", "hsdp") else "")
    return text + (f" ac {layout.ac}" if layout.ac != "none" else "")


def validate_row(row: Mapping, profiles: dict[str, HardwareProfile]) -> ValidationRow:
    """One row predicted (or refused, with why); `profiles` caches the loaded profiles by name."""
    rid, hw = row["id"], row["hardware"]
    source = str((row.get("source") or {}).get("repo", ""))
    out = ValidationRow(rid, source, hw.get("gpus") if isinstance(hw.get("gpus"), int) else 0, str(row["run"].get("layout")))
    try:
        card = model_card(row["model"], f"row {rid}: model")
        layout = run_layout(row["run"], hw, f"row {rid}: run", f"row {rid}: hardware")
        out.layout = _layout_text(layout)
        name = str(hw["profile"])
        if name not in profiles:
            try:
                profiles[name] = load_profile(find_profile(name))
            except ProfileError as exc:
                raise PredictError(str(exc)) from None
        formula, peak = row_convention(row)
        out.published_step_s, out.published_from = published_step(row, card, layout)
        p = predict_card(card, layout, profiles[name], row_flops_per_token=formula(card, layout), row_peak_tflops=peak)
    except PredictError as exc:
        out.refused = str(exc)
        return out
    out.predicted_step_s, out.parts, out.notes = p.step_time_s, p.parts, p.notes
    out.error = p.step_time_s / out.published_step_s - 1
    out.published_mfu = row["published"].get("mfu")
    out.predicted_mfu, out.predicted_mfu_echobench = p.mfu_row, p.mfu
    return out


def validate(rows: Sequence[Mapping]) -> list[ValidationRow]:
    """Every row predicted or refused, in the file's order."""
    profiles: dict[str, HardwareProfile] = {}
    return [validate_row(row, profiles) for row in rows]


def validation_summary(results: Sequence[ValidationRow]) -> dict:
    """Mean and max |error| over the rows priced, the rows refused, and the aim (not enforced)."""
    errors = [abs(r.error) for r in results if r.error is not None]
    mean = sum(errors) / len(errors) if errors else None
    worst = max(errors) if errors else None
    met = (mean is not None and mean <= AIM["mean_abs_error"] and worst <= AIM["max_abs_error"]
           and len(errors) >= AIM["rows"])
    return {"rows": len(results), "priced": len(errors), "refused": len(results) - len(errors),
            "mean_abs_error": mean, "max_abs_error": worst,
            "worst_row": max((r for r in results if r.error is not None), key=lambda r: abs(r.error)).id if errors else None,
            "aim": AIM, "aim_met": met}


def as_json(results: Sequence[ValidationRow]) -> dict:
    """--json: the rows and the summary."""
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}
             for r in results]
    return {"rows": clean, "summary": validation_summary(results)}
