"""The predicted step of a model card (predict_card -> CardPrediction): card_work priced by
pricing.work_seconds and card_traffic placed by communication.place and exposed, the same functions
Echo's prediction goes through; only the list of work differs. The framework the row names gives
the defaults it leaves out (frameworks.py).

    micro   = (forward + backward) / micro-batches + exposed(a micro-batch's collectives)
    compute = micro x micro-batches x (1 + the pipeline bubble (p - 1) / (v m))   (pipeline.py)
    sync    = compute + the once-a-step collectives exposed against the last micro-batch (under
              Megatron's interleaved schedule the gradient reduction per model chunk, against the
              backward of the chunks after it: pipeline.interleaved_grad_exposed)
              + pipeline point-to-point exposed + optimizer
    device  = sync x (1 + the straggler share of the layout's GPUs)   (hwprofile.straggler_share; 0
              where the profile has no jitter)
    host    = the host's ops (cards.work.HOST_OPS_*, counted) x the profile's cost per op (0 where none)
    step    = max(device, host)   (a GPU's host queues kernels ahead of the device)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from echobench.hardware.devicerates import run_fit
from echobench.hardware.profile import HardwareProfile, straggler_share
from echobench.predict.cards.card import Layout, ModelCard
from echobench.predict.cards.memory import card_memory_gib
from echobench.predict.cards.traffic import card_traffic, p2p_seconds, place_card
from echobench.predict.cards.work import card_work, model_flops_per_token
from echobench.predict.communication import Collective, exposed
from echobench.predict.errors import PredictError
from echobench.predict.frameworks import SPANNED, layout_framework, resolved
from echobench.predict.intervals import interval
from echobench.predict.pipeline import bubble_fraction, interleaved_grad_exposed, pipeline_seconds
from echobench.predict.pricing import Rates, attention_notes, in_step_note, is_cpu, profile_peak, work_seconds
from echobench.records.run_figures import mfu_of


@dataclass
class CardPrediction:
    """One card's predicted step on one profile: time, parts (seconds), MFU and HFU, and what it assumes."""

    step_time_s: float
    step_time_low_s: float  # the cross-validated interval (intervals.interval)
    step_time_high_s: float
    device_s: float
    host_s: float
    parts: dict[str, float]  # gemm, attention, elementwise, gaps, optimizer, communication (exposed), bubble, host
    communication_s: float  # every collective's time, hidden or not
    tokens_per_step: int
    model_flops_per_token: float  # echobench's convention (every attention score, no recompute)
    mfu: float  # echobench's: model FLOPs / (step x gpus x peak)
    hfu: float  # hardware FLOPs (re-runs counted) / (step x gpus x peak)
    peak_tflops: float
    peak_source: str
    mfu_row: float | None = None  # under the row's own FLOP convention and peak, where given
    memory_gib: float | None = None  # one GPU's memory (cards.memory.card_memory_gib)
    framework_span_s: tuple[float, float] | None = None  # naming no framework: its step's range over SPANNED's (unnamed_span)
    collectives: list[Collective] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # a measured card run's prediction (measured.against): its run id, settings and profile
    run_id: str = ""
    cfg: object = None
    profile: str = ""
    profile_device: str = ""

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("collectives", "cfg")}


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
                                         "(cards.work.HOST_OPS_*)")
    return 0.0, f"profile {profile.name} has no host cost per op: host overhead not modelled (0)"


def peak_of(profile: HardwareProfile) -> tuple[float, str]:
    """echobench's MFU denominator for a card: pricing.profile_peak (the datasheet peak of the
    profile's device, else its best GEMM rate)."""
    if hit := profile_peak(profile):
        return hit
    raise PredictError(f"no peak for profile {profile.name!r}: its device is not in the datasheet table and it has "
                       "no GEMM points: add `gemm` entries")


def predict_card(card: ModelCard, layout: Layout, profile: HardwareProfile,
                 row_flops_per_token: float | None = None, row_peak_tflops: float | None = None,
                 rates: Rates | None = None, peak: tuple[float, str] | None = None) -> CardPrediction:
    """The predicted step of `card` trained as `layout` on `profile` (the module docstring);
    `row_flops_per_token` and `row_peak_tflops`: a published row's own MFU convention; `rates`: the
    profile's rates to price at (a bound, or fitted terms; default its mid figures); `peak`: the MFU
    denominator (TFLOP/s, its source) in place of the profile's (a measured run's own)."""
    rates = rates or Rates(profile, "mid", run_fit(layout.gpus))  # the fitted in-step clock, none on one GPU
    fw = layout_framework(layout)
    opts, notes = resolved(layout, fw)
    work = card_work(card, layout, fw)
    kf, kb = fw.kernels
    kernels = (work.kernels * kf / (kf + kb), work.kernels * kb / (kf + kb))
    dev = work_seconds(work.matmuls, work.attention, work.elementwise, work.params, rates, opts["attention_kernel"],
                       layout.compile, kernels)
    fwd = dev["gemm_forward"] + dev["attention_forward"] + dev["elementwise_forward"] + dev["gap_forward"]
    bwd = dev["gemm_backward"] + dev["attention_backward"] + dev["elementwise_backward"] + dev["gap_backward"]
    acc = layout.grad_accum
    traffic = card_traffic(card, layout, opts)
    micro = place_card(traffic.per_micro, rates, layout, traffic.bucket_caps, opts)
    once = place_card(traffic.per_step, rates, layout, traffic.bucket_caps, opts)
    windows = {"forward": fwd / acc, "backward": bwd / acc}
    per_micro = sum(exposed(micro, windows).values())
    grads = [c for c in once if c.group == "dp" and c.overlaps == "backward"] \
        if layout.layout == "megatron" and layout.pp > 1 and layout.vp > 1 and opts["overlap_grad_reduce"] else []
    # the once-a-step collectives against the last micro-batch; under the interleaved schedule the
    # gradient reduction per model chunk, against the backward of the chunks after it (pipeline.py)
    last = sum(exposed(micro + [c for c in once if c not in grads], windows).values()) - per_micro + \
        interleaved_grad_exposed(sum(c.seconds for c in grads), layout.pp, layout.vp, acc, windows["backward"])
    micro_s = (fwd + bwd) / acc + per_micro
    head = [m for m in work.matmuls if m.part == "lm_head"]
    head_s = sum(work_seconds(head, [], (0, 0), 0, rates).values()) / acc if layout.pp > 1 else 0.0
    # the slowest (last) stage holds the LM head; a stage's mean holds 1 / pp of it
    compute = pipeline_seconds(micro_s, layout.pp, layout.vp, acc, micro_s - head_s * (1 - 1 / layout.pp))
    p2p_all, p2p_one = p2p_seconds(card, layout, rates, fw.p2p_scatter_gather)
    p2p = 2 * p2p_one if opts["overlap_p2p_comm"] and layout.vp > 1 else p2p_all
    synchronous = compute + last + p2p + dev["optimizer"]
    straggler = synchronous * straggler_share(profile, layout.gpus)  # the slowest rank's lead (hwprofile)
    device = synchronous + straggler
    per_op, host_note = profile_host_per_op(profile)
    host = work.host_ops * per_op
    step = max(device, host)
    tokens = layout.global_batch * layout.seq
    flops = model_flops_per_token(card, layout, fw)
    done = sum(m.flops for m in work.matmuls) + sum(a.flops for a in work.attention)
    again = sum(m.flops for m in work.matmuls if m.phase == "recompute") + \
        sum(a.flops for a in work.attention if a.phase == "recompute")
    hardware = flops * done / (done - again)  # the re-runs on top of the model's FLOPs
    peak, peak_source = peak or peak_of(profile)
    notes += [n for n in (host_note,) if n]
    if not profile.measured:
        notes.append(f"profile {profile.name} is not measured (datasheets and published figures)")
    if note := in_step_note(profile, rates.terms):
        notes.append(note)
    notes += attention_notes(work.attention, rates, opts["attention_kernel"])
    notes.append(f"element-wise bytes counted on the eager {fw.eager_block} block (cards.work.ELEMENTWISE_EAGER)"
                 if fw.eager_block else "element-wise bytes: each op of a pre-norm decoder read and written once, as "
                 "fused kernels do (cards.work.ELEMENTWISE_READS_WRITES)")
    if opts["tp_comm_overlap"] and layout.tp > 1:
        notes.append("TP overlap: TP collectives hidden behind their phase's compute but one call (assumed)")
    if layout.pp > 1:
        ends = [w for w, on in (("an embedding-only first chunk", layout.embedding_chunk),
                                ("a head-only last chunk", layout.head_chunk)) if on]
        notes.append(f"pipeline: {layout.pp} stages x {layout.vp} chunks" + (f" ({' and '.join(ends)})" if ends else "") +
                     f", {acc} micro-batches: bubble "
                     f"{bubble_fraction(layout.pp, layout.vp, acc):.1%} of the slowest stage's compute")
    parts = {"gemm": dev["gemm_forward"] + dev["gemm_backward"],
             "attention": dev["attention_forward"] + dev["attention_backward"],
             "elementwise": dev["elementwise_forward"] + dev["elementwise_backward"],
             "gaps": dev["gap_forward"] + dev["gap_backward"], "optimizer": dev["optimizer"],
             "communication": per_micro * acc + last + p2p, "bubble": compute - (fwd + bwd + per_micro * acc),
             "straggler": straggler, "host": max(0.0, host - device)}
    mfu_row = None
    if row_flops_per_token is not None and row_peak_tflops:
        mfu_row = mfu_of(row_flops_per_token * tokens, step, layout.gpus, row_peak_tflops)
    low, high, span = *interval(step), None
    if layout.framework == "":
        span = unnamed_span(card, layout, profile, rates, step)
        low, high = interval(span[0])[0], interval(span[1])[1]
        notes.append(f"no framework named: priced at the generic default, its interval spanning {', '.join(SPANNED)}'s "
                     f"defaults ({span[0]:.4g} .. {span[1]:.4g} s, then the cross-validated residuals)")
    return CardPrediction(
        step_time_s=step, step_time_low_s=low, step_time_high_s=high, device_s=device, host_s=host, parts=parts,
        communication_s=sum(c.seconds for c in micro) * acc + sum(c.seconds for c in once) + p2p_all,
        tokens_per_step=tokens, model_flops_per_token=flops,
        mfu=mfu_of(flops * tokens, step, layout.gpus, peak), hfu=mfu_of(hardware * tokens, step, layout.gpus, peak),
        peak_tflops=peak, peak_source=peak_source, mfu_row=mfu_row, memory_gib=card_memory_gib(card, layout),
        framework_span_s=span, collectives=micro + once, notes=notes)


def unnamed_span(card: ModelCard, layout: Layout, profile: HardwareProfile, rates: Rates, step: float) -> tuple[float, float]:
    """A layout naming no framework: the lowest and highest of its step at the generic default
    (`step`) and at each SPANNED framework's defaults (frameworks.py)."""
    steps = [step] + [predict_card(card, replace(layout, framework=name), profile, rates=rates).step_time_s
                      for name in SPANNED]
    return min(steps), max(steps)
