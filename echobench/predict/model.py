"""The prediction of one step (predict -> Prediction) and of many runs (predict_runs, ranks,
at_nodes, parse_nodes): the device side (compute from pricing.py, collectives from
communication.py), the host at the profile's cost per op, the interval over the three bounds, MFU,
memory and the notes on what the prediction assumes (echobench.predict's docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from echobench.records.config import RunConfig, run_id
from echobench.model.flops import hardware_flops, model_flops
from echobench.hardware.devicerates import InStepFit, run_fit
from echobench.hardware.profile import HardwareProfile, straggler_share
from echobench.backends import layout_problem
from echobench.hardware.devicememory import device_memory_gib
from echobench.predict.memory import estimate_memory
from echobench.predict.intervals import interval
from echobench.predict.communication import (Collective, accumulated, collectives, exposed_accumulated, hide_gbps,
                                             link_bytes)
from echobench.predict.errors import PredictError
from echobench.predict.pricing import (
    BOUNDS,
    Rates,
    attention_kernel,
    dit_attention_mix,
    attention_notes,
    bounded,
    compute_bytes,
    device_seconds,
    device_type,
    elementwise_note,
    host_point,
    in_step_note,
    is_cpu,
    point_run,
    priced,
    run_peak,
    split_share,
)
from echobench.predict.profiles import choose_profile
from echobench.predict.work import host_ops, run_work
from echobench.records.run_figures import mfu_of


@dataclass
class Prediction:
    """One run's predicted step on one profile: its time and interval, the parts and phases, the
    collectives, MFU and HFU, memory, and what the prediction assumes (`notes`)."""

    run_id: str
    cfg: RunConfig
    profile: str
    profile_device: str
    step_time_s: float
    step_time_low_s: float
    step_time_high_s: float
    parts: dict[str, float]  # seconds: gemm, attention, elementwise, optimizer, host, communication (exposed)
    forward_s: float
    backward_s: float
    optimizer_s: float
    device_s: float
    host_s: float
    host_ops: int
    communication_s: float  # every collective's time, hidden or not
    exposed_communication_s: float
    collectives: list[Collective]
    link_bytes: dict[str, dict[str, float]]  # link -> message bytes and bus bytes one rank moves per step
    hide_gbps: dict[str, float | None]  # link -> the bus bandwidth that hides its overlappable traffic
    samples_per_s: float
    model_flops_per_sample: int
    hardware_flops_per_sample: int
    mfu: float
    hfu: float
    peak_tflops: float
    peak_source: str
    memory_gib: float
    fits: bool | None
    notes: list[str]

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("cfg", "collectives")}
        out["collectives"] = [asdict(c) for c in self.collectives]
        out["settings"] = {k: getattr(self.cfg, k) for k in ("scale", "framework", "parallelism", "nodes",
                                                             "gpus_per_node", "micro_batch", "audio_frames",
                                                             "text_tokens", "speaker_frames", "precision", "ac",
                                                             "compile")}
        return out


def host_per_op(cfg: RunConfig, rates: Rates) -> float:
    """The host's seconds per dispatched op in the run's layout: its host point's step less what the
    model puts on the device for that step (its compute and exposed communication), over its ops. On
    a GPU the tiny step's device work hides behind its host: the step over its ops. Without a host
    point: the profile's host_op cost (assumed, its source says so), else 0 (the host is then
    assumed never to hold the device up)."""
    point = host_point(cfg, rates.profile)
    if point is None:
        return rates.profile.host_op.seconds if rates.profile.host_op else 0.0
    step = bounded(point.step_s, point.step_s_min, point.step_s_max, rates.bound)
    if not is_cpu(rates.profile):
        return step / point.ops
    return max(0.0, step - _device_step(point_run(point, rates.profile), rates)) / point.ops


def _device(cfg: RunConfig, rates: Rates) -> dict:
    """One step's device side at one bound: seconds by kind, the phases, communication and its
    exposed part. grad_accum micro-batches: each one's compute and collectives that many times, the
    gradients' reductions and the optimizer once (communication.exposed_accumulated)."""
    n, one = cfg.grad_accum, replace(cfg, grad_accum=1)
    dev = device_seconds(one, rates, compute_bytes(one, rates.profile))
    fwd = dev["gemm_forward"] + dev["attention_forward"] + dev["elementwise_forward"]
    bwd = dev["gemm_backward"] + dev["attention_backward"] + dev["elementwise_backward"]
    comm = collectives(one, rates)
    # On a CPU the collectives hide behind nothing: gloo's threads need the cores the ranks compute
    # on (profiled DDP, FSDP2 and TP=2 steps on 2 cores overlap under 2% of their communication).
    windows = {"forward": 0.0, "backward": 0.0} if is_cpu(rates.profile) else {"forward": fwd, "backward": bwd}
    hidden = exposed_accumulated(comm, windows, n)
    exposed_s = sum(hidden.values())
    synchronous = n * (fwd + bwd) + dev["optimizer"] + exposed_s
    straggler = synchronous * straggler_share(rates.profile, cfg.world_size)  # the slowest rank's lead
    return {"dev": {k: v if k == "optimizer" else n * v for k, v in dev.items()}, "forward": n * fwd,
            "backward": n * bwd, "comm": accumulated(comm, n), "exposed": hidden, "exposed_s": exposed_s,
            "straggler": straggler, "device": synchronous + straggler}


def _device_step(cfg: RunConfig, rates: Rates) -> float:
    return _device(cfg, rates)["device"]


def _evaluate(cfg: RunConfig, rates: Rates) -> dict:
    """One step's figures at one bound: the device side, the host (each micro-batch's forward and
    backward ops, the optimizer's once), the step."""
    out = _device(cfg, rates)
    one = replace(cfg, grad_accum=1)
    ops = {k: v if k == "optimizer" else cfg.grad_accum * v for k, v in host_ops(one).items()}
    host = sum(ops.values()) * host_per_op(one, rates)
    step = out["device"] + host if is_cpu(rates.profile) else max(out["device"], host)
    return {**out, "ops": ops, "host": host, "step": step}


def predict(cfg: RunConfig, profile: HardwareProfile, peak: tuple[float, str] | None = None,
            model_flops_per_sample: float | None = None, terms=None, sdpa: str | None = None) -> Prediction:
    """The predicted step of `cfg` on `profile`'s machine (echobench.predict's docstring). `peak`
    overrides the run's (run_peak); `model_flops_per_sample` the FLOP model's at the run's full
    lengths (a record's measured figure, over its real lengths); `terms` the fitted in-step clock
    (devicerates.InStepFit; None: the committed one); `sdpa` the kernel of the unmasked SDPA calls
    (a record's: measured.recorded_sdpa; None: pricing.attention_kernel's)."""
    given = cfg
    sequence_parallel = cfg.sequence_parallel_on(device_type(profile.device))
    cfg = priced(cfg, profile.device)
    terms = run_fit(cfg.world_size, terms)  # the fitted in-step clock, none on one GPU
    mid, low, high = (_evaluate(cfg, Rates(profile, b, terms, sdpa=sdpa)) for b in BOUNDS)
    m = cfg.model_config()
    f = model_flops(m, cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames)
    mflops = model_flops_per_sample if model_flops_per_sample is not None else f.total
    hflops = hardware_flops(m, f, cfg.ac) * (mflops / f.total)
    peak_tflops, peak_source = peak or run_peak(cfg, profile)
    step, dev = mid["step"], mid["dev"]
    ops = sum(mid["ops"].values())
    parts = {"gemm": dev["gemm_forward"] + dev["gemm_backward"],
             "attention": dev["attention_forward"] + dev["attention_backward"],
             "elementwise": dev["elementwise_forward"] + dev["elementwise_backward"],
             "optimizer": dev["optimizer"], "communication": mid["exposed_s"], "straggler": mid["straggler"],
             "host": mid["host"] if is_cpu(profile) else max(0.0, mid["host"] - mid["device"])}
    notes = _notes(cfg, profile, terms, sdpa)
    if sequence_parallel:
        notes.append("sequence parallelism priced as the same TP layout without it (its all-gathers and "
                     "reduce-scatters move the bytes of the all-reduces they replace; the norms' split not modelled)")
    mem = estimate_memory(cfg)
    capacity = _capacity(profile)
    world = cfg.world_size
    near, far = interval(step)  # the cross-validated model error, beside the calibration's spread
    return Prediction(
        run_id=run_id(given), cfg=given, profile=profile.name, profile_device=profile.device, step_time_s=step,
        step_time_low_s=min(low["step"], near), step_time_high_s=max(high["step"], far), parts=parts,
        forward_s=mid["forward"], backward_s=mid["backward"], optimizer_s=dev["optimizer"], device_s=mid["device"],
        host_s=mid["host"], host_ops=ops, communication_s=sum(c.seconds for c in mid["comm"]),
        exposed_communication_s=mid["exposed_s"], collectives=mid["comm"], link_bytes=link_bytes(mid["comm"]),
        hide_gbps=hide_gbps(mid["comm"], {"forward": mid["forward"], "backward": mid["backward"]}),
        samples_per_s=cfg.global_batch / step, model_flops_per_sample=int(mflops), hardware_flops_per_sample=int(hflops),
        mfu=mfu_of(mflops * cfg.global_batch, step, world, peak_tflops),
        hfu=mfu_of(hflops * cfg.global_batch, step, world, peak_tflops),
        peak_tflops=peak_tflops, peak_source=peak_source, memory_gib=mem.total_gib,
        fits=None if capacity is None else mem.total_gib <= capacity, notes=notes)


def _capacity(profile: HardwareProfile) -> float | None:
    try:
        return device_memory_gib(device=profile.device)
    except ValueError:  # a CPU, or a device the memory table lacks
        return None


def _notes(cfg: RunConfig, profile: HardwareProfile, terms: InStepFit, sdpa: str | None = None) -> list[str]:
    """What the prediction assumes for this run beyond the rules of echobench.predict's docstring
    (`sdpa`: predict's)."""
    notes = []
    if not profile.measured:
        notes.append(f"profile {profile.name} is not measured (datasheets and published figures)")
    if note := in_step_note(profile, terms):
        notes.append(note)
    if note := elementwise_note(cfg, profile):
        notes.append(note)
    if host_point(cfg, profile) is None:
        notes.append(f"no host point in the profile: host at its host_op, {profile.host_op.seconds * 1e6:.3g} us per "
                     "op (its source says how it is assumed)" if profile.host_op else
                     "no host point in the profile: host overhead not modelled")
    kernel = None if is_cpu(profile) else attention_kernel(cfg, sdpa)
    if kernel and any(p.kernel for p in profile.attention):
        mix = dit_attention_mix(cfg, sdpa)
        dit = "" if list(mix) == [kernel] else "; the DiT's " + ", ".join(f"{share:.0%} {k}" for k, share in mix.items()) \
            + " (micro-batches in which a sample drops its conditioning attend over a key mask)"
        if share := split_share(cfg):
            dit = (f"; the DiT's {share:.0%} micro-batches in which a sample drops its conditioning as two unmasked "
                   "flash2 calls and their log-sum-exp merge (pricing.split_share)")
        how = "its record names for its unmasked calls (sdpa_backends_predicted)" if sdpa else \
            "the run takes (pricing.attention_kernel)"
        notes.append(f"attention priced as the {kernel} kernel {how}{dit}")
    notes += attention_notes(run_work(cfg)[1], Rates(profile, terms=terms), kernel)
    if profile.sm_count and profile.gemm:
        notes.append(f"GEMM shapes priced from the profile's best-shape rate by tile and wave quantization over "
                     f"{profile.sm_count} SMs and the fitted k-loop and launch costs where no measured shape is near "
                     "(devicerates.gemm_rate)")
    if cfg.precision == "fp8" and not is_cpu(profile):
        notes.append("fp8: the float8 linears' GEMMs (work.FP8_PARTS) at the device's float8 rate, their casts and "
                     "amax reductions as element-wise bytes (work.FP8_BYTES)")
    if cfg.data != "synthetic":
        notes.append("data from shards: no data wait modelled, lengths taken as the maxima"
                     + (" (batching bucket: every step at the largest bucket's shape)"
                        if getattr(cfg, "batching", "pad") == "bucket" else ""))
    if is_cpu(profile) and profile.gpus_per_node and cfg.gpus_per_node != profile.gpus_per_node:
        notes.append(f"CPU rates measured with {profile.gpus_per_node} process(es) per node, the run has "
                     f"{cfg.gpus_per_node}: its threads per process differ")
    return notes


# ---- many runs ----

def predict_runs(cfgs: Sequence[RunConfig], profiles: Sequence[HardwareProfile]) -> list[Prediction | PredictError]:
    """A prediction (or why there is none) per run, each on its choose_profile."""
    out: list[Prediction | PredictError] = []
    for cfg in cfgs:
        try:
            out.append(predict(cfg, choose_profile(cfg, profiles)))
        except PredictError as exc:
            out.append(exc)
    return out


def ranks(predictions: Sequence[Prediction]) -> dict[str, int]:
    """Run id -> rank of its layout by predicted MFU among the runs of its scale and node count (1 best)."""
    groups: dict[tuple, list[Prediction]] = {}
    for p in predictions:
        groups.setdefault((p.cfg.scale, p.cfg.nodes), []).append(p)
    return {p.run_id: i + 1 for group in groups.values()
            for i, p in enumerate(sorted(group, key=lambda p: -p.mfu))}


def at_nodes(cfgs: Sequence[RunConfig], nodes: Sequence[int]) -> list[RunConfig]:
    """Each distinct configuration of `cfgs` (node count aside) at each of `nodes`, where its layout
    can run there (backends.layout_problem on SLURM: single stays on one node, HSDP needs two)."""
    out, seen = [], set()
    for cfg in cfgs:
        for n in nodes:
            moved = replace(cfg, nodes=n)
            if (rid := run_id(moved)) in seen or layout_problem(moved, "slurm") is not None:
                continue
            seen.add(rid)
            out.append(moved)
    return out


def parse_nodes(text: str) -> list[int]:
    """--nodes 1,4,16 -> [1, 4, 16]; each between 1 and 1024."""
    try:
        nodes = [int(x) for x in text.split(",")]  # an empty entry (1,,4) is a typo, not nothing
    except ValueError:
        raise PredictError(f"--nodes {text!r}: give node counts separated by commas, e.g. 1,4,16") from None
    if not nodes or any(not 1 <= n <= 1024 for n in nodes):
        raise PredictError(f"--nodes {text!r}: each node count must be between 1 and 1024")
    return list(dict.fromkeys(nodes))
