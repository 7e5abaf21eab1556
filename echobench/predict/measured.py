"""A prediction held against a measured record: against -> Comparison (step time, MFU, and the
predicted parts of the step against the record's profiled breakdown), summary over many. A card
run (a record with a `card` section) is priced by predict_card at the layout it ran
(cards.run.measured_layout), an Echo run by predict."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from echobench.records.config import RunConfig, as_ran
from echobench.hardware.profile import HardwareProfile
from echobench.predict.cards.model import CardPrediction, predict_card
from echobench.predict.cards.run import measured_attention_kernel, measured_card, measured_layout
from echobench.predict.errors import PredictError
from echobench.predict.frameworks import framework
from echobench.predict.model import Prediction, predict
from echobench.predict.pricing import SDPA_SETTINGS, is_cpu_name, priced, sdpa_kernel
from echobench.predict.profiles import choose_profile, other_device_lines, profiles_for_records
from echobench.predict.work import host_ops, run_work
from echobench.records.results import Record, record_settings
from echobench.records.states import RunState

# The breakdown's categories (echobench.train.breakdown) each predicted part is held against.
BREAKDOWN_PARTS = {"gemm": ("gemm",), "attention": ("attention",), "optimizer": ("optimizer",),
                   "communication": ("communication",),
                   "other": ("other_compute", "memcpy", "data_wait", "idle")}


def predicted_shares(p: Prediction) -> dict[str, float]:
    """The predicted step in the breakdown's categories, as shares of the step. On a CPU the host's
    time per op lands in the op's own category (a profiled op's span holds its dispatch): GEMM and
    attention get two ops per call (the op and its transpose or view), the optimizer its phase's
    ops, the rest goes to other; on a GPU host time beyond the device's is idle (other)."""
    cfg = priced(p.cfg, p.profile_device)
    mm, att = run_work(cfg)
    calls = {"gemm": 2 * sum(w.count for w in mm), "attention": 2 * sum(a.calls for a in att)}
    per_op = p.host_s / p.host_ops if p.host_ops and is_cpu_name(p.profile_device) else 0.0
    ops = host_ops(cfg)
    host = {"gemm": calls["gemm"] * per_op, "attention": calls["attention"] * per_op,
            "optimizer": ops["optimizer"] * per_op}
    host["other"] = p.parts["host"] - sum(host.values())
    # waiting on the slowest rank (the straggler part) is idle in a breakdown: other
    seconds = {"gemm": p.parts["gemm"] + host["gemm"], "attention": p.parts["attention"] + host["attention"],
               "optimizer": p.parts["optimizer"] + host["optimizer"], "communication": p.parts["communication"],
               "other": p.parts["elementwise"] + p.parts["straggler"] + host["other"]}
    return {k: v / p.step_time_s for k, v in seconds.items()}


def measured_shares(breakdown: dict | None) -> dict[str, float] | None:
    """A record's profiled breakdown (its `breakdown` summary) in BREAKDOWN_PARTS' categories."""
    fractions = (breakdown or {}).get("fractions")
    if not fractions:
        return None
    return {k: sum(fractions.get(c, 0.0) for c in cats) for k, cats in BREAKDOWN_PARTS.items()}


@dataclass
class Comparison:
    """A prediction held against a measured record: error = (predicted - measured) / measured."""

    prediction: Prediction | CardPrediction
    measured_step_time_s: float
    measured_mfu: float | None
    error: float
    mfu_error: float | None
    parts: dict[str, dict[str, float]] | None  # category -> predicted and measured share of the step
    path: str | None = None

    def as_dict(self) -> dict:
        return {**self.prediction.as_dict(), "measured_step_time_s": self.measured_step_time_s,
                "measured_mfu": self.measured_mfu, "error": self.error, "mfu_error": self.mfu_error,
                "parts_vs_breakdown": self.parts, "path": self.path}


def recorded_sdpa(cfg: RunConfig, record) -> str | None:
    """The kernel of an Echo GPU run's unmasked SDPA calls where the run left the choice to torch
    (sdpa_backend auto): the backend its record says torch chose for the DiT's unmasked attention
    (sdpa_backends_predicted["dit"]; torch's priority differs between versions: 2.11 puts cuDNN first
    on an H200), as the profiles name it; None where the settings say (pricing.attention_kernel).
    Only those calls: the settings stay as the run had them, so that the calls torch did not choose
    are priced as they ran: a masked call's kernel, and split's flash calls where the settings ran
    split (the record's attention_paths counts those micro-batches under the DiT's "split")."""
    chosen = SDPA_SETTINGS.get((record.sdpa_backends_predicted or {}).get("dit"))
    if cfg.sdpa_backend != "auto" or chosen is None or record.env.device_type != "cuda":
        return None
    return sdpa_kernel(chosen)


def against(record, profiles: Sequence[HardwareProfile]) -> Comparison:
    """The prediction of a measured run (an ok Record with a median step time), on the profile
    choose_profile picks, with the record's own peak and model FLOPs per sample (its real lengths),
    so that the MFUs compare under one convention."""
    if record.status != RunState.OK or not record.step_time_s:
        raise PredictError(f"{record.run_id}: status {record.status}, no measured step time to compare")
    cfg = RunConfig.from_dict({**as_ran(record_settings(record)), "repeat": 0})
    profile = choose_profile(cfg, profiles)
    peak = (record.peak_tflops, record.peak_source or "record") if record.peak_tflops else None
    if record.card is not None:
        p, parts = card_prediction(record, cfg, profile, peak), None  # a card's prediction has no per-category shares
    else:
        p = predict(cfg, profile, peak=peak, model_flops_per_sample=record.model_flops_per_sample,
                    sdpa=recorded_sdpa(cfg, record))
        p.run_id = record.run_id
        measured, predicted = measured_shares(record.breakdown), predicted_shares(p)
        parts = None if measured is None else {k: {"predicted": predicted[k], "measured": measured[k]} for k in measured}
    mfu_error = (p.mfu - record.mfu) / record.mfu if record.mfu else None
    return Comparison(p, record.step_time_s, record.mfu, (p.step_time_s - record.step_time_s) / record.step_time_s,
                      mfu_error, parts, str(record.path) if record.path else None)


def card_prediction(record, cfg: RunConfig, profile: HardwareProfile, peak: tuple[float, str] | None) -> CardPrediction:
    """A card run's prediction at the layout it ran, with the record's peak (so that both MFUs share
    their denominator) and, for a published row, the MFU under the row's convention at that peak."""
    card = record.card
    backend = (record.sdpa_backends_predicted or {}).get("decoder")
    kernel = measured_attention_kernel(record.sdpa_backends_predicted, record.env.device_type)
    layout = measured_layout(cfg, card["seq"], record.precision, bool(record.compile), attention_kernel=kernel)
    p = predict_card(measured_card(card), layout, profile, row_flops_per_token=card.get("row_flops_per_token"),
                     row_peak_tflops=record.peak_tflops, peak=peak)
    if kernel:
        p.notes.append(f"attention priced as the {kernel} kernel the record names (sdpa_backends_predicted: torch's "
                       f"{backend} at the run's shapes)")
    else:
        why = ("names a CPU's kernel" if backend and record.env.device_type != "cuda" else
               f"names {backend}, which no profile kernel stands for" if backend else "does not name one")
        default = framework(layout.framework).attention_kernel
        p.notes.append(f"attention priced as {layout.framework}'s default kernel {default}: the record {why} "
                       "(sdpa_backends_predicted)")
    p.run_id, p.cfg, p.profile, p.profile_device = record.run_id, cfg, profile.name, profile.device
    return p


def summary(comparisons: Sequence[Comparison]) -> dict:
    """Mean and max absolute relative step-time error over the comparisons (and MFU's)."""
    errors = [abs(c.error) for c in comparisons]
    mfu = [abs(c.mfu_error) for c in comparisons if c.mfu_error is not None]
    return {"runs": len(errors), "mean_abs_error": sum(errors) / len(errors) if errors else None,
            "max_abs_error": max(errors, default=None),
            "mean_abs_mfu_error": sum(mfu) / len(mfu) if mfu else None, "max_abs_mfu_error": max(mfu, default=None)}


@dataclass
class AgainstRecords:
    """`validate measured`: the comparisons, the profiles they took (each once), and what to tell the
    user in the order it arose: (kind, line), kind "not predicted" (a record without a profile, or one
    the model refused) or "warning" (a record on another device than the profile given)."""
    comparisons: list[Comparison]
    profiles: list[HardwareProfile]
    lines: list[tuple[str, str]]


def against_records(records: Sequence[Record], profiles: Sequence[HardwareProfile]) -> AgainstRecords:
    """Each successful record held against its prediction: on `profiles` if given, else on the profile
    of its device (its sweep's own first). No record to predict, or no profile for any, is a PredictError."""
    ok = [r for r in records if r.status == RunState.OK and r.step_time_s]
    if not ok:
        raise PredictError("no successful runs to predict")
    each, missing = ({r.run_id: list(profiles) for r in ok}, []) if profiles else profiles_for_records(ok)
    lines = [("not predicted", line) for line in missing]
    lines += [("warning", line) for line in other_device_lines(ok, profiles)]
    comparisons = []
    for record in (r for r in ok if r.run_id in each):
        try:
            comparisons.append(against(record, each[record.run_id]))
        except (PredictError, ValueError) as exc:
            lines.append(("not predicted", str(exc)))
    used = list({id(p): p for ps in each.values() for p in ps}.values())  # those given or found, each once
    return AgainstRecords(comparisons, used, lines)
