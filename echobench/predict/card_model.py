"""The predicted step of a model card (predict_card -> CardPrediction): card_work priced by
pricing.work_seconds and card_traffic placed by communication.place and exposed, the same functions
Echo's prediction goes through; only the list of work differs.

    device = forward + backward + optimizer + exposed communication
    exposed = (grad_accum - 1) x exposed(a micro-batch's collectives, a micro-batch's compute)
              + exposed(the last micro-batch's and the once-a-step collectives, a micro-batch's compute)
    host   = the host's ops (card.HOST_OPS_*, counted) x the profile's cost per op (0 where it has none)
    step   = max(device, host)   (a GPU's host queues kernels ahead of the device)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echobench.hwprofile import HardwareProfile
from echobench.predict.card import Layout, ModelCard, card_work, model_flops_per_token
from echobench.predict.card_traffic import card_traffic, place_card
from echobench.predict.communication import Collective, exposed
from echobench.predict.errors import PredictError
from echobench.predict.pricing import Rates, in_step_note, is_cpu, profile_peak, work_seconds


@dataclass
class CardPrediction:
    """One card's predicted step on one profile: time, parts (seconds), MFU, and what it assumes."""

    step_time_s: float
    device_s: float
    host_s: float
    parts: dict[str, float]  # gemm, attention, elementwise, optimizer, communication (exposed), host (beyond device)
    communication_s: float  # every collective's time, hidden or not
    tokens_per_step: int
    model_flops_per_token: float  # echobench's convention (every attention score, no recompute)
    mfu: float  # echobench's: model FLOPs / (step x gpus x peak)
    peak_tflops: float
    peak_source: str
    mfu_row: float | None = None  # under the row's own FLOP convention and peak, where given
    collectives: list[Collective] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "collectives"}


def profile_host_per_op(profile: HardwareProfile) -> tuple[float, str | None]:
    """The host's seconds per dispatched op on this profile and a note on where it comes from: its
    shortest GPU host step over its ops (measured, as model.host_per_op takes it on a GPU), else the
    profile's assumed `host_op`, else 0."""
    steps = sorted(profile.host_steps, key=lambda p: p.micro_batch * p.audio_frames)
    if steps and not is_cpu(profile):
        return steps[0].step_s / steps[0].ops, None
    if profile.host_op is not None:
        return profile.host_op.seconds, (f"host at {profile.host_op.seconds * 1e6:.0f} us per op, assumed "
                                         f"({profile.host_op.source}); host ops counted on an eager CPU decoder "
                                         "(card.HOST_OPS_*)")
    return 0.0, f"profile {profile.name} has no host cost per op: host overhead not modelled (0)"


def peak_of(profile: HardwareProfile) -> tuple[float, str]:
    """echobench's MFU denominator for a card: pricing.profile_peak (the datasheet peak of the
    profile's device, else its best GEMM rate)."""
    if hit := profile_peak(profile):
        return hit
    raise PredictError(f"no peak for profile {profile.name!r}: its device is not in the datasheet table and it has "
                       "no GEMM points: add `gemm` entries")


def predict_card(card: ModelCard, layout: Layout, profile: HardwareProfile,
                 row_flops_per_token: float | None = None, row_peak_tflops: float | None = None) -> CardPrediction:
    """The predicted step of `card` trained as `layout` on `profile` (the module docstring), its
    attention priced as layout.attention_kernel (None: whichever the profile has);
    `row_flops_per_token` and `row_peak_tflops`: a published row's own MFU convention."""
    rates = Rates(profile, "mid")
    work = card_work(card, layout)
    dev = work_seconds(work.matmuls, work.attention, work.elementwise, work.params, rates, layout.attention_kernel)
    fwd = dev["gemm_forward"] + dev["attention_forward"] + dev["elementwise_forward"]
    bwd = dev["gemm_backward"] + dev["attention_backward"] + dev["elementwise_backward"]
    acc = layout.grad_accum
    traffic = card_traffic(card, layout)
    micro = place_card(traffic.per_micro, rates, layout, traffic.bucket_caps)
    once = place_card(traffic.per_step, rates, layout, traffic.bucket_caps)
    windows = {"forward": fwd / acc, "backward": bwd / acc}
    exposed_s = (acc - 1) * sum(exposed(micro, windows).values()) + sum(exposed(micro + once, windows).values())
    device = fwd + bwd + dev["optimizer"] + exposed_s
    per_op, host_note = profile_host_per_op(profile)
    host = work.host_ops * per_op
    step = max(device, host)
    tokens = layout.global_batch * layout.seq
    flops = model_flops_per_token(card, layout)
    peak, peak_source = peak_of(profile)
    notes = [n for n in (host_note,) if n]
    if not profile.measured:
        notes.append(f"profile {profile.name} is not measured (datasheets and published figures)")
    if note := in_step_note(profile):
        notes.append(note)
    if layout.attention_kernel is None:
        notes.append("attention kernel not stated: priced at whichever the profile has")
    if not profile.attention:
        notes.append("no attention points in the profile: attention at its score GEMM's rate")
    notes.append("element-wise bytes counted per op of a pre-norm decoder (card.ELEMENTWISE_READS_WRITES)")
    if layout.tp_comm_overlap and layout.tp > 1:
        notes.append("--tp-comm-overlap: TP collectives hidden behind their phase's compute but one call (assumed)")
    parts = {"gemm": dev["gemm_forward"] + dev["gemm_backward"],
             "attention": dev["attention_forward"] + dev["attention_backward"],
             "elementwise": dev["elementwise_forward"] + dev["elementwise_backward"],
             "optimizer": dev["optimizer"], "communication": exposed_s, "host": max(0.0, host - device)}
    mfu_row = None
    if row_flops_per_token is not None and row_peak_tflops:
        mfu_row = row_flops_per_token * tokens / (step * layout.gpus * row_peak_tflops * 1e12)
    return CardPrediction(
        step_time_s=step, device_s=device, host_s=host, parts=parts,
        communication_s=sum(c.seconds for c in micro) * acc + sum(c.seconds for c in once),
        tokens_per_step=tokens, model_flops_per_token=flops,
        mfu=flops * tokens / (step * layout.gpus * peak * 1e12), peak_tflops=peak, peak_source=peak_source,
        mfu_row=mfu_row, collectives=micro + once, notes=notes)
