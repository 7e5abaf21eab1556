"""`echobench validate published FILE`: the model held against published training runs
(validation/published-runs.yaml: one row per run, validation/SOURCES.md says where each figure is
from). Each row's `model` is a model card, its `run` and `hardware` a layout on a shipped profile;
predict_card prices it. The published step time is global_batch x seq / (tokens/s per GPU x GPUs),
tokens/s per GPU being published, or derived from the published TFLOP/s per GPU under the row's own
FLOP convention (CONVENTIONS), or the published iteration time itself (step_s); error = predicted /
published - 1. A row the model cannot price (a profile that is not there, a layout it refuses) is
refused with why and left out of the mean and max.

The schema is strict (load_rows): a key the schema does not know is refused in one line naming the
key and the row, never dropped. Every `assumed` entry names a field (run.*, model.*,
hardware.clock: the sustained clock ratio, hardware.network: a factor on the inter-node bandwidth)
and its plausible `values`, the row's own among them: the row is priced at each, and the range of
those predictions (each field's lowest and highest ratio to the row's, multiplied) is its interval.
A row that names no framework is priced at the generic default (frameworks.GENERIC), its interval
widened to the range of its step over the named frameworks' defaults (frameworks.SPANNED).
Each row's interval is that range widened by the model's leave-one-source-out residuals
(intervals.py), so that a row with nothing assumed still has one.

The rows are priced at the committed fit (validation/fit.json) unless a fit is given (crossval.py
refits on a file's own rows: in-sample); each row says whether it is among the fit's rows. A row's
memory per GPU (cards.memory) is checked against its device's: one that exceeds it is priced but
flagged, and where the row publishes its memory (published.memory_gib) the estimate's error is given.

A scaling series (scaling_series) is a source's rows at several GPU counts at constant per-GPU work:
how the error moves from the fewest GPUs to the most says whether what grows with the cluster is
priced (SERIES_AIM: within 5 points either way)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from echobench.hardware.devicerates import run_fit
from echobench.hardware.devicememory import device_capacity_gib
from echobench.hardware.profile import HardwareProfile, ProfileError, SustainedClock, find_profile, load_profile
from echobench.predict.cards.card import Layout, ModelCard, card_params, model_card, run_layout
from echobench.predict.cards.memory import card_memory_gib
from echobench.predict.cards.model import predict_card
from echobench.predict.errors import PredictError
from echobench.predict.intervals import interval
from echobench.predict.pricing import Rates
from echobench.records.run_figures import mfu_of, peak_fraction
from echobench.records.yamltext import read_yaml

# The keys a row's sections may have (model and run: card.model_card and card.run_layout check theirs).
SECTIONS = {"id": None, "source": {"name", "repo", "commit", "path", "line", "table", "text", "config", "figure"},
            "hardware": {"profile", "gpus", "gpus_per_node"}, "model": None, "run": None,
            "published": {"mfu", "hfu", "tflops_per_gpu", "tokens_per_s_per_gpu", "tokens_per_s", "aggregate_pflops",
                          "convention", "step_s", "memory_gib"},
            "derived": {"flops_per_token", "tokens_per_s_per_gpu", "how"}, "assumed": None}
REQUIRED = {"source": ("name", "repo", "commit"), "hardware": ("profile", "gpus", "gpus_per_node"),
            "published": ("convention",)}
ASSUMED_HARDWARE = ("hardware.clock", "hardware.network")
SERIES_AIM = 0.05  # a scaling series' error may move by this much from its fewest GPUs to its most


def _llm_foundry(card: ModelCard, layout: Layout) -> float:
    """llm-foundry's collect_results.py: 6 n_params + 12 L d s per token (n_params: every parameter)."""
    n = card.params if card.params is not None else card_params(card, layout.seq)
    return 6 * n + 12 * card.layers * card.hidden * layout.seq


def _megatron(card: ModelCard, layout: Layout) -> float:
    """Megatron-LM's num_floating_point_operations (MHA, ffn 4h): 72 L h^2 + 12 L h s + 6 h V per token."""
    L, h = card.layers, card.hidden
    return 72 * L * h * h + 12 * L * h * layout.seq + 6 * h * card.vocab


def _narayanan(card: ModelCard, layout: Layout) -> float:
    """Narayanan et al. 2021, eq. 3 (recomputation counted): 96 B s l h^2 (1 + s / 6h + V / 16 l h) per
    sequence = 96 L h^2 + 16 L h s + 6 h V per token."""
    L, h = card.layers, card.hidden
    return 96 * L * h * h + 16 * L * h * layout.seq + 6 * h * card.vocab


# A row's `published.convention` starts with its formula; its peak is the number after "peak".
CONVENTIONS = {"6N + 12 L d s": _llm_foundry, "72 L h^2 + 12 L h s + 6 h V": _megatron,
               "96 L h^2 + 16 L h s + 6 h V": _narayanan}


@dataclass
class ValidationRow:
    """One published row held against its prediction (refused: why it was not priced)."""

    id: str
    source: str
    gpus: int
    layout: str
    device: str = ""
    published_step_s: float | None = None
    published_from: str = ""  # tokens/s, TFLOP/s under the row's convention, or step_s
    predicted_step_s: float | None = None
    low_s: float | None = None  # the row priced over its assumed values: fastest
    high_s: float | None = None  # slowest
    error: float | None = None  # predicted / published - 1
    published_mfu: float | None = None
    predicted_mfu: float | None = None  # under the row's convention and peak
    predicted_mfu_echobench: float | None = None
    parts: dict[str, float] = field(default_factory=dict)
    refused: str | None = None
    notes: list[str] = field(default_factory=list)
    interval_low_s: float | None = None  # the assumed range widened by the cross-validated residuals
    interval_high_s: float | None = None
    in_fit_set: bool | None = None  # among the rows of the fit it was priced at: its error is in-sample
    memory_gib: float | None = None  # one GPU's memory, estimated (cards.memory)
    device_memory_gib: float | None = None  # the device's (device_capacity_gib; None: unknown)
    published_memory_gib: float | None = None
    memory_error: float | None = None  # estimated / published memory - 1

    @property
    def inside(self) -> bool | None:
        """Whether the published step lies within the assumed values' range."""
        if self.low_s is None or self.published_step_s is None:
            return None
        return self.low_s <= self.published_step_s <= self.high_s

    @property
    def inside_interval(self) -> bool | None:
        """Whether the published step lies within the row's interval."""
        if self.interval_low_s is None or self.published_step_s is None:
            return None
        return self.interval_low_s <= self.published_step_s <= self.interval_high_s

    @property
    def over_memory(self) -> bool | None:
        """Whether the row's estimated memory exceeds its device's (None: either unknown)."""
        if self.memory_gib is None or self.device_memory_gib is None:
            return None
        return self.memory_gib > self.device_memory_gib


def load_rows(path: Path | str) -> list[dict]:
    """The rows of a published-runs YAML file; PredictError (one line) for a missing or unreadable
    file, bad YAML, a file that is not a list of rows, a row lacking a key predict reads, or a key the
    schema does not know (check_row)."""
    path = Path(path)
    data = read_yaml(path, "published runs file", PredictError,
                     missing="give the published runs file, e.g. validation/published-runs.yaml")
    if not isinstance(data, list) or not data:
        raise PredictError(f"{path}: expected a non-empty list of rows (each with id, hardware, model, run, published)")
    seen = set()
    for i, row in enumerate(data):
        if not isinstance(row, Mapping) or not isinstance(row.get("id"), str):
            raise PredictError(f"{path}: row {i + 1} is not a mapping with a string `id`: give each row an id")
        if row["id"] in seen:
            raise PredictError(f"{path}: row id {row['id']!r} appears twice: give each row its own id")
        seen.add(row["id"])
        check_row(row, f"{path}: row {row['id']}")
    return data


def check_row(row: Mapping, where: str) -> None:
    """The row's sections and keys (SECTIONS, REQUIRED), its model and run as cards/card.py reads them,
    and its assumed entries (check_assumed); PredictError naming the first problem."""
    for key in row:
        if key not in SECTIONS:
            raise PredictError(f"{where}: unknown key {key!r}: give only {', '.join(SECTIONS)}")
    for section in ("source", "hardware", "model", "run", "published"):
        if not isinstance(row.get(section), Mapping):
            raise PredictError(f"{where} lacks the mapping {section!r}: add it")
    for section, keys in SECTIONS.items():
        if keys is None or section not in row:
            continue
        for key in row[section]:
            if key not in keys:
                raise PredictError(f"{where}: unknown key {section}.{key}: remove it or give one of {', '.join(sorted(keys))}")
        for key in REQUIRED.get(section, ()):
            if key not in row[section]:
                raise PredictError(f"{where} lacks {section}.{key}: add it")
    model_card(row["model"], f"{where}: model")
    run_layout(row["run"], row["hardware"], f"{where}: run", f"{where}: hardware")
    pub = row["published"]
    if not any(pub.get(k) for k in ("tokens_per_s_per_gpu", "tflops_per_gpu", "step_s")):
        raise PredictError(f"{where}: published gives none of tokens_per_s_per_gpu, tflops_per_gpu, step_s: give one")
    check_assumed(row, where)


def check_assumed(row: Mapping, where: str) -> None:
    """Each `assumed` entry: a mapping of field (run.*, model.*, or ASSUMED_HARDWARE), a non-empty
    list of values with the row's own among them, and why; the row at each value must be a layout."""
    entries = row.get("assumed", [])
    if not isinstance(entries, list):
        raise PredictError(f"{where}: assumed must be a list of {{field, values, why}}")
    for e in entries:
        if not isinstance(e, Mapping) or set(e) != {"field", "values", "why"}:
            raise PredictError(f"{where}: assumed entry {e!r}: give exactly field, values and why")
        f, values = e["field"], e["values"]
        if not isinstance(values, list) or not values:
            raise PredictError(f"{where}: assumed {f}: values must be a non-empty list")
        if f in ASSUMED_HARDWARE:
            if not all(isinstance(v, (int, float)) and 0.1 <= v <= 2 for v in values):
                raise PredictError(f"{where}: assumed {f}: values must be factors between 0.1 and 2")
            continue
        section, _, key = f.partition(".")
        if section not in ("run", "model") or not key:
            raise PredictError(f"{where}: assumed field {f!r}: give run.KEY, model.KEY or one of {', '.join(ASSUMED_HARDWARE)}")
        own = row[section].get(key)
        if own not in values:
            raise PredictError(f"{where}: assumed {f}: the row's own value {own!r} is not among the values {values}: add it")


def row_convention(row: Mapping) -> tuple:
    """(FLOPs per token function or None, peak TFLOP/s or None) of the row's published convention."""
    text = str(row["published"]["convention"])
    formula = next((f for prefix, f in CONVENTIONS.items() if text.startswith(prefix)), None)
    peak = re.search(r"peak\s+([0-9.]+)", text)
    if formula is None and not (row["published"].get("tokens_per_s_per_gpu") or row["published"].get("step_s")):
        known = "; ".join(CONVENTIONS)
        raise PredictError(f"row {row['id']}: unknown published.convention {text!r}: start it with one of: {known}, "
                           "and name the peak ('peak 989'), or publish tokens_per_s_per_gpu or step_s")
    return formula, float(peak.group(1)) if peak else None


def published_step(row: Mapping, card: ModelCard, layout: Layout) -> tuple[float, str]:
    """The published step time (seconds) and what it is derived from."""
    pub = row["published"]
    tokens = layout.global_batch * layout.seq
    if pub.get("step_s"):
        return float(pub["step_s"]), "step_s"
    if pub.get("tokens_per_s_per_gpu"):
        return tokens / (pub["tokens_per_s_per_gpu"] * layout.gpus), "tokens/s"
    formula, _ = row_convention(row)
    per_gpu = pub["tflops_per_gpu"] * 1e12 / formula(card, layout)
    return tokens / (per_gpu * layout.gpus), "TFLOP/s / row's FLOPs per token"


def published_figures(row: Mapping, card: ModelCard, layout: Layout) -> dict:
    """What a row publishes, as the figures a measured card run has: the step time (published_step),
    tokens/s per GPU (published, else from that step) and the MFU under the row's own convention
    (its `mfu`, else its TFLOP/s per GPU over the convention's peak, else its tokens/s per GPU x the
    convention's FLOPs per token over that peak; None without a peak), each with what it is from; the
    GPUs, global batch and tokens one GPU takes a step (a measured step compares with the published
    one only at the same)."""
    pub = row["published"]
    formula, peak = row_convention(row)
    step, step_from = published_step(row, card, layout)
    tokens = layout.global_batch * layout.seq
    per_gpu = float(pub.get("tokens_per_s_per_gpu") or tokens / (step * layout.gpus))
    mfu, mfu_from = None, None
    if pub.get("mfu"):
        mfu, mfu_from = float(pub["mfu"]), "mfu"
    elif peak and pub.get("tflops_per_gpu"):
        mfu, mfu_from = peak_fraction(pub["tflops_per_gpu"], peak), "tflops_per_gpu / the convention's peak"
    elif peak and formula:
        mfu, mfu_from = (mfu_of(formula(card, layout) * per_gpu, 1, 1, peak),
                         "tokens/s per GPU x FLOPs per token / peak")
    return {"step_s": step, "step_from": step_from, "tokens_per_s_per_gpu": per_gpu, "mfu": mfu, "mfu_from": mfu_from,
            "peak_tflops": peak, "gpus": layout.gpus, "global_batch": layout.global_batch,
            "tokens_per_gpu_step": tokens / layout.gpus}


def layout_text(layout: Layout) -> str:
    """A layout in a few words: megatron tpN ppN(xvp) cpN dpN sp zero1, fsdp sharding, ac, fp8."""
    if layout.layout == "megatron":
        text = (f"tp{layout.tp}" + (f" pp{layout.pp}" + (f"x{layout.vp}" if layout.vp > 1 else "") if layout.pp > 1 else "")
                + (f" cp{layout.cp}" if layout.cp > 1 else "") + f" dp{layout.data_parallel}" + (" sp" if layout.sp else "")
                + (" zero1" if layout.distributed_optimizer else ""))
    else:
        text = layout.layout + (f" {layout.sharding}" if layout.fsdp else "") + \
            (f" tp{layout.tp}" if layout.tp > 1 else "") + (f" pp{layout.pp}" if layout.pp > 1 else "")
    return text + (f" ac {layout.ac}" if layout.ac != "none" else "") + (" fp8" if layout.precision == "fp8" else "") + \
        (" compiled" if layout.compile else "")


def _profile(name: str, profiles: dict[str, HardwareProfile]) -> HardwareProfile:
    if name not in profiles:
        try:
            profiles[name] = load_profile(find_profile(name))
        except ProfileError as exc:
            raise PredictError(str(exc)) from None
    return profiles[name]


def with_hardware(profile: HardwareProfile, field_name: str, value: float) -> HardwareProfile:
    """The profile with an assumed hardware value: hardware.clock its sustained clock ratio,
    hardware.network its inter-node bandwidths x value."""
    if field_name == "hardware.clock":
        return profile.model_copy(update={"clock": SustainedClock(ratio=value, source=f"assumed: clock {value:g} (the row's range)")})
    links = {k: {op: f.model_copy(update={"bus_gbps": f.bus_gbps * (value if k == "inter" else 1)})
                 for op, f in ops.items()} for k, ops in profile.links.items()}
    kinds = {k: {op: [f.model_copy(update={"bus_gbps": f.bus_gbps * (value if k == "inter" else 1)}) for f in fits]
                 for op, fits in ops.items()} for k, ops in profile.link_kinds.items()}
    return profile.model_copy(update={"links": links, "link_kinds": kinds})


def _priced(row: Mapping, profile: HardwareProfile, terms=None) -> float:
    """The row's predicted step (the terms crossval fitted, None: the committed ones)."""
    card = model_card(row["model"])
    layout = run_layout(row["run"], row["hardware"])
    return predict_card(card, layout, profile, rates=Rates(profile, "mid", terms=run_fit(layout.gpus, terms))).step_time_s


def variants(row: Mapping) -> list[tuple[str, dict]]:
    """Per assumed field, the row at each of its other values: (field, row) pairs; a micro-batch
    change carries grad_accum with it (global_batch / (micro_batch x dp)); values no layout has
    (a grad_accum that is not whole) are left out."""
    out = []
    for e in row.get("assumed", []):
        f = e["field"]
        if f in ASSUMED_HARDWARE:
            out += [(f, {**row, "hardware": {**row["hardware"], "_" + f: v}}) for v in e["values"]]
            continue
        section, _, key = f.partition(".")
        for v in e["values"]:
            if v == row[section].get(key):
                continue
            changed = {**row[section], key: v}
            if section == "run" and key == "micro_batch":
                lay = run_layout(row["run"], row["hardware"])
                accum, left = divmod(lay.global_batch, v * lay.data_parallel)
                if left or not accum:
                    continue
                changed["grad_accum"] = accum
            out.append((f, {**row, section: changed}))
    return out


def predict_row(row: Mapping, profiles: dict[str, HardwareProfile], terms=None) -> float:
    """The row's predicted step on its profile, hardware assumptions applied (variants' `_hardware.*`)."""
    hw = row["hardware"]
    prof = _profile(str(hw["profile"]), profiles)
    for f in ASSUMED_HARDWARE:
        if "_" + f in hw:
            prof = with_hardware(prof, f, hw["_" + f])
    clean = {**row, "hardware": {k: v for k, v in hw.items() if not k.startswith("_")}}
    return _priced(clean, prof, terms)


def assumed_range(row: Mapping, own: float, profiles: dict[str, HardwareProfile], terms=None) -> tuple[float, float]:
    """The row priced over its assumed values: its own prediction x the product over fields of each
    field's lowest (highest) ratio to it, 1 included."""
    ratios: dict[str, list[float]] = {}
    for f, v in variants(row):
        try:
            ratios.setdefault(f, []).append(predict_row(v, profiles, terms) / own)
        except PredictError:
            continue
    low = math.prod(min(1.0, *r) for r in ratios.values())
    high = math.prod(max(1.0, *r) for r in ratios.values())
    return own * low, own * high


def central_step(row: Mapping, profiles: dict[str, HardwareProfile], terms=None) -> tuple[float, float, float]:
    """(central, low, high): the row priced over its assumed values (assumed_range) and the middle of
    that range, sqrt(low x high): where a source leaves a value unstated, the model predicts the
    middle of its plausible range, not one end of it (a row with no assumed field: its own)."""
    own = predict_row(row, profiles, terms)
    low, high = assumed_range(row, own, profiles, terms)
    return math.sqrt(low * high), low, high


def validate_row(row: Mapping, profiles: dict[str, HardwareProfile], terms=None, with_range: bool = True,
                 quantiles=None) -> ValidationRow:
    """One row predicted (or refused, with why); `profiles` caches the loaded profiles by name;
    `terms` the fit it is priced at (None: the committed one), `quantiles` its interval's residual
    quantiles (None: the committed ones)."""
    rid, hw = row["id"], row["hardware"]
    out = ValidationRow(rid, str(row["source"].get("name", "")), hw.get("gpus") if isinstance(hw.get("gpus"), int) else 0,
                        str(row["run"].get("layout")))
    out.in_fit_set = rid in run_fit(None, terms).fitted_on
    try:
        card = model_card(row["model"], f"row {rid}: model")
        layout = run_layout(row["run"], hw, f"row {rid}: run", f"row {rid}: hardware")
        out.layout = layout_text(layout)
        profile = _profile(str(hw["profile"]), profiles)
        out.device = profile.device
        formula, peak = row_convention(row)
        out.published_step_s, out.published_from = published_step(row, card, layout)
        p = predict_card(card, layout, profile, row_flops_per_token=formula(card, layout) if formula else None,
                         row_peak_tflops=peak, rates=Rates(profile, "mid", terms=run_fit(layout.gpus, terms)))
        step = p.step_time_s
        if with_range:
            out.low_s, out.high_s = assumed_range(row, step, profiles, terms)
            step = math.sqrt(out.low_s * out.high_s)
    except PredictError as exc:
        out.refused = str(exc)
        return out
    out.predicted_step_s, out.parts, out.notes = step, p.parts, p.notes
    out.error = step / out.published_step_s - 1
    out.published_mfu = row["published"].get("mfu")
    out.predicted_mfu = None if p.mfu_row is None else p.mfu_row * p.step_time_s / step
    out.predicted_mfu_echobench = p.mfu * p.step_time_s / step
    low, high = out.low_s or step, out.high_s or step
    if p.framework_span_s:  # no framework named: the generic default's range spans the named ones' (frameworks.py)
        low, high = low * p.framework_span_s[0] / p.step_time_s, high * p.framework_span_s[1] / p.step_time_s
    out.interval_low_s, out.interval_high_s = row_interval(low, high, quantiles)
    check_memory(out, card, layout, profile, row["published"].get("memory_gib"))
    return out


def row_interval(low: float, high: float, quantiles=None) -> tuple[float, float]:
    """A row's interval: its assumed range (low .. high; the prediction itself where nothing is
    assumed) widened by the cross-validated residuals (intervals.interval: `quantiles`, None: the
    committed ones) at each end, so that it is never of zero width."""
    return interval(low, quantiles)[0], interval(high, quantiles)[1]


def check_memory(out: ValidationRow, card: ModelCard, layout: Layout, profile: HardwareProfile,
                 published: float | None) -> None:
    """The row's estimated memory per GPU against its device's, and against the published figure
    where the row gives one: a row over its device is priced as published, flagged here."""
    out.memory_gib = card_memory_gib(card, layout)
    out.device_memory_gib = device_capacity_gib(profile.device)
    if published:
        out.published_memory_gib = float(published)
        out.memory_error = out.memory_gib / out.published_memory_gib - 1
    if out.over_memory:
        out.notes.append(f"memory: estimated {out.memory_gib:.1f} GiB per GPU exceeds the {out.device_memory_gib:.1f} "
                         f"GiB of {profile.device}: priced as published, flagged")


def validate(rows: Sequence[Mapping], terms=None, with_range: bool = True, quantiles=None,
             profiles: dict[str, HardwareProfile] | None = None) -> list[ValidationRow]:
    """Every row predicted or refused, in the file's order (validate_row); `profiles`: the profiles by
    name to price at where not the shipped ones (loaded as needed)."""
    profiles = {} if profiles is None else profiles
    return [validate_row(row, profiles, terms, with_range, quantiles) for row in rows]


def error_summary(errors: Sequence[float]) -> dict:
    """Mean and max |error| and the mean signed error of a list of errors."""
    if not errors:
        return {"rows": 0, "mean_abs_error": None, "max_abs_error": None, "mean_error": None}
    return {"rows": len(errors), "mean_abs_error": sum(map(abs, errors)) / len(errors),
            "max_abs_error": max(map(abs, errors)), "mean_error": sum(errors) / len(errors)}


def validation_summary(results: Sequence[ValidationRow]) -> dict:
    """The error at the fit the rows were priced at over the rows priced (per source and overall;
    `held_out`: those outside its fit set), the rows refused, how many published figures lie within
    their assumed range and within their interval, and the rows over their device's memory."""
    priced = [r for r in results if r.error is not None]
    worst = max(priced, key=lambda r: abs(r.error)).id if priced else None
    by_source = {s: error_summary([r.error for r in priced if r.source == s]) for s in dict.fromkeys(r.source for r in priced)}
    ranged = [r for r in priced if r.inside is not None and r.low_s < r.high_s]
    return {"rows": len(results), "priced": len(priced), "refused": len(results) - len(priced),
            **error_summary([r.error for r in priced]), "worst_row": worst, "by_source": by_source,
            "in_fit_set": sum(bool(r.in_fit_set) for r in priced),
            "held_out": error_summary([r.error for r in priced if not r.in_fit_set]),
            "ranged": len(ranged), "inside_range": sum(bool(r.inside) for r in ranged),
            "inside_interval": sum(bool(r.inside_interval) for r in priced),
            "over_memory": [r.id for r in priced if r.over_memory]}


@dataclass
class ScalingSeries:
    """A source's rows at several GPU counts at constant per-GPU work, by GPU count: their errors at
    the fit they were priced at and held out (leave-one-source-out; None where not cross-validated)."""

    source: str
    ids: list[str]
    gpus: list[int]
    errors: list[float]
    loso_errors: list[float | None]

    @property
    def change(self) -> float:
        """The error at the most GPUs minus the error at the fewest (a fraction: 0.05 is 5 points)."""
        return self.errors[-1] - self.errors[0]

    @property
    def loso_change(self) -> float | None:
        first, last = self.loso_errors[0], self.loso_errors[-1]
        return None if first is None or last is None else last - first

    @property
    def within_aim(self) -> bool:
        return abs(self.change) <= SERIES_AIM


def per_gpu_work(row: Mapping) -> str:
    """What a row's GPUs each do, as a key: its source, model, run and hardware but the GPU count
    and the global batch, and the global batch per GPU (rows with the same key differ only in how
    many GPUs share the work: a scaling series)."""
    run = {k: v for k, v in row["run"].items() if k != "global_batch"}
    hw = {k: v for k, v in row["hardware"].items() if k != "gpus"}
    share = row["run"].get("global_batch", 0) / row["hardware"]["gpus"]
    return json.dumps([row["source"].get("name"), hw, row["model"], run, share], sort_keys=True, default=str)


def scaling_series(rows: Sequence[Mapping], results: Sequence[ValidationRow],
                   loso: Mapping[str, float] | None = None) -> list[ScalingSeries]:
    """The scaling series among the priced rows (per_gpu_work equal, at two or more GPU counts), in
    the file's order, each by GPU count; `loso`: the rows' leave-one-source-out errors by id."""
    priced = {r.id: r for r in results if r.error is not None}
    groups: dict[str, list[tuple[int, int, str]]] = {}
    for i, row in enumerate(rows):
        if row["id"] in priced:
            groups.setdefault(per_gpu_work(row), []).append((row["hardware"]["gpus"], i, row["id"]))
    out = []
    for members in groups.values():
        if len({g for g, _, _ in members}) < 2:
            continue
        members.sort()
        ids = [rid for _, _, rid in members]
        out.append(ScalingSeries(priced[ids[0]].source, ids, [g for g, _, _ in members],
                                 [priced[i].error for i in ids], [(loso or {}).get(i) for i in ids]))
    return out


def series_json(series: Sequence[ScalingSeries]) -> dict:
    """The scaling series for --json: each with its change (and held out), and how many are within SERIES_AIM."""
    return {"aim": SERIES_AIM, "within_aim": sum(s.within_aim for s in series), "count": len(series),
            "series": [{**asdict(s), "change": s.change, "loso_change": s.loso_change, "within_aim": s.within_aim}
                       for s in series]}


def as_json(results: Sequence[ValidationRow], crossval: dict | None = None, fit: dict | None = None,
            series: Sequence[ScalingSeries] = ()) -> dict:
    """--json: the rows (each with `over_memory`), the summary, the cross-validation, the fit the
    rows were priced at (crossval.fit_used) and the scaling series (series_json)."""
    clean = [{**{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()},
              "over_memory": r.over_memory} for r in results]
    return {"rows": clean, "summary": validation_summary(results), "crossval": crossval, "fit": fit,
            "scaling_series": series_json(series)}


def replace_run(row: Mapping, **run) -> dict:
    """The row with run settings replaced (scripts and tests)."""
    return {**row, "run": {**row["run"], **run}}

