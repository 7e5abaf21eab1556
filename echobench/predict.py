"""`echobench predict`: a performance model of one training step, from a run's settings and a
hardware profile (echobench.hwprofile), and its residual against measured records.

Per rank and step (README, "Predicting a run"):

    device  = forward + backward + optimizer + exposed communication
    forward = sum over the step's GEMMs of 2 m n k / gemm_tflops(m, n, k)        (flops.py's matmuls,
              + attention FLOPs / attention_tflops(seq_q, seq_k)                at the run's rows,
              + element-wise bytes / memory_gbps                                TP-split per rank)
    backward: the same for the input- and weight-gradient GEMMs (and AC's recompute)
    optimizer = AdamW + gradient-clipping bytes of this rank's parameters / memory_gbps
    host    = dispatched ATen ops of the step x the host's cost per op (the profile's host point)
    step    = device + host on a CPU (the host runs the kernels itself), max(device, host) on a GPU
              (the host queues kernels ahead of the device)

Communication: each collective of commvolume.step_bytes priced with hwprofile.collective_seconds,
then placed: DDP's bucketed gradient all-reduce overlaps backward but its last bucket; FSDP2's
all-gathers are prefetched (the first exposed), its reduce-scatters overlap backward (the last
exposed), HSDP's replica all-reduce likewise; the frame-count all-reduce overlaps forward; TP's
collectives and the gradient-norm all-reduce are on the critical path. Exposed = the unhideable
part + max(0, the rest - the compute of the phase it overlaps).

Element-wise bytes (eager): 6.0 x forward and 9.5 x backward the bytes of what autograd saves per
sample (memory.activation_elements_per_sample, x micro-batch x the compute dtype's size): the ratio
of the bytes read + written by every non-matmul ATen op of a real tiny step to that estimate,
counted (5.4 .. 7.2 forward, 9.4 .. 14 backward over micro-batches 1-4 and lengths 50-400; a test
holds it). Compiled blocks (inductor fuses each element-wise chain into one kernel): 2 x / 3 x,
assumed. AdamW: 56 bytes per parameter (foreach, CPU: counted) or 28 (fused, GPU: p, g, m, v read,
p, m, v written), at the profile's measured AdamW rate (memory op "adamw") where it has one, else
at its add bandwidth; clipping 8 (counted) at the add bandwidth.

Host ops per step: HOST_OPS, counted on real tiny steps of each layout (per DiT, speaker and text
encoder layer, plus a fixed part; a test holds the single-process rows against a count).

The MFU convention is the record's: model FLOPs / (step time x world x peak), the peak the run's
(the matrix's peak_tflops, else the datasheet entry of the profile's device, else the profile's
best GEMM rate). The interval: the model at the calibration's best and worst figures (each GEMM,
attention and memory point's min / max, the host step's min / max; each collective fit +- its
rel_rms). Plain functions over RunConfig; no torch import (commvolume's imports it where the
collectives are derived).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

from echobench.config import RunConfig, run_id
from echobench.flops import hardware_flops, model_flops, param_counts, speaker_patches
from echobench.hwprofile import HardwareProfile, attention_tflops, bus_factor, gemm_point, link_fit
from echobench.memory import activation_elements_per_sample, estimate_memory, state_shards

BOUNDS = ("mid", "low", "high")  # the point figures; the calibration's best; its worst
# Element-wise bytes per byte of saved activations (module docstring): counted eager; assumed compiled.
ELEMENTWISE = {"eager": (6.0, 9.5), "compiled": (2.0, 3.0)}
ADAMW_BYTES = {"foreach": 56, "fused": 28}  # per parameter (float32 p, g, m, v and temporaries)
CLIP_BYTES = 8  # per parameter: the norm reads each gradient, the scale reads and writes it (counted)
# ATen ops dispatched per step (views included), counted on real tiny steps on the CPU (one gloo
# process per rank; scripts/count_host_ops.py): phase -> (fixed, per DiT layer, per speaker layer,
# per text-encoder layer). torchtitan single / ddp / fsdp2 (fsdp2 stands for hsdp) and megatron tp2
# (stands for any TP).
HOST_OPS = {
    "single": {"forward": (131, 139, 87, 100), "backward": (124, 266, 155, 0), "optimizer": (56, 26, 16, 0)},
    "ddp": {"forward": (160, 152, 95, 100), "backward": (159, 292, 171, 0), "optimizer": (56, 26, 16, 0)},
    "fsdp2": {"forward": (164, 169, 109, 100), "backward": (137, 321, 200, 0), "optimizer": (57, 26, 16, 0)},
    "tp": {"forward": (135, 148, 87, 100), "backward": (130, 272, 157, 0), "optimizer": (62, 32, 16, 0)},
}
# Activation checkpointing adds, per DiT / speaker layer, these backward ops (single, counted):
# full re-runs the block's forward; selective, eager, every second block's (half of full's per
# layer; compiled, COMPILED_BLOCK_OPS stand); the forward changes by views only.
AC_BACKWARD_OPS = {"none": (0, 0), "full": (263, 152), "selective": (132, 76)}
# A compiled block dispatches its matmuls, attention and about as many fused kernels (assumed):
# forward / backward ops per DiT and per speaker layer.
COMPILED_BLOCK_OPS = {"forward": (30, 16), "backward": (58, 30)}


class PredictError(ValueError):
    """A run or a profile the model cannot price: one line naming what is missing and the fix."""


# ---- the work of one step on one rank ----

@dataclass(frozen=True)
class Matmul:
    """`count` GEMMs x (m, k) @ W^T (k, n) of one part in one phase on one rank."""

    part: str  # a flops.PARTS name
    phase: str  # forward, backward, recompute
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class AttentionWork:
    """Attention scores and values of one part in one phase on one rank: `flops` as flops.py counts
    them (forward 4 seq_q seq_k width per sample and layer, backward 2x), at seq_q x seq_k."""

    part: str
    phase: str
    seq_q: int
    seq_k: int
    flops: int
    calls: int


def _linear(out: list, part: str, rows: int, n: int, k: int, count: int = 1, input_grad: bool = True,
            backward: bool = True, recompute: bool = False) -> None:
    """One nn.Linear's GEMMs in commbench's layout: forward (rows, n, k); backward the weight gradient
    (n, k, rows) and, where its input has a gradient, the input gradient (rows, k, n); recompute: the
    forward again in backward (activation checkpointing)."""
    out.append(Matmul(part, "forward", rows, n, k, count))
    if backward:
        out.append(Matmul(part, "backward", n, k, rows, count))
        if input_grad:
            out.append(Matmul(part, "backward", rows, k, n, count))
    if recompute:
        out.append(Matmul(part, "recompute", rows, n, k, count))


@lru_cache(maxsize=4096)
def step_work(model_cfg, framework: str, tp: int, micro_batch: int, audio_frames: int, text_tokens: int,
              speaker_frames: int, ac: str) -> tuple[tuple[Matmul, ...], tuple[AttentionWork, ...]]:
    """The GEMMs and attentions of one step of one rank: flops.model_flops' matmuls at rows =
    micro_batch x tokens (its conventions: backward 2x, 1x for a first layer, the frozen encoder
    forward only), AC full's recompute (flops.recompute_flops' blocks), with q/k/v/gate, text and
    speaker k/v and the MLP's gate/up each one GEMM (both backends), and megatron's layout: those
    column-parallel (n / tp), the attention and MLP outputs row-parallel (k / tp), heads split;
    everything else replicated."""
    m, b, la, lt = model_cfg, micro_batch, audio_frames, text_tokens
    d, ds, p = m.width, m.speaker_width, speaker_patches(m, speaker_frames)
    keys, full = la + lt + p, ac == "full"
    mm: list[Matmul] = []
    att: list[AttentionWork] = []
    latent, text, spk = b * la, b * lt, b * p
    L = m.layers
    # Both backends fuse the same projections (megatron's column-parallel ones split n by tp).
    _linear(mm, "dit_attention", latent, 4 * d // tp, d, L, recompute=full)  # q, k, v, gate
    _linear(mm, "dit_attention", latent, d, d // tp, L, recompute=full)  # out (row-parallel)
    _linear(mm, "dit_attention", text, 2 * d // tp, d, L, recompute=full)  # text k, v
    _linear(mm, "dit_attention", spk, 2 * d // tp, ds, L, recompute=full)  # speaker k, v
    _linear(mm, "dit_mlp", latent, 2 * m.mlp // tp, d, L, recompute=full)  # gate + up
    _linear(mm, "dit_mlp", latent, d, m.mlp // tp, L, recompute=full)  # down (row-parallel)
    fwd = 4 * b * la * keys * d * L // tp
    att.append(AttentionWork("dit_attention", "forward", la, keys, fwd, L))
    att.append(AttentionWork("dit_attention", "backward", la, keys, 2 * fwd, L))
    if full:
        att.append(AttentionWork("dit_attention", "recompute", la, keys, fwd, L))
    _linear(mm, "dit_conditioning", b, m.adaln_rank, d, L, recompute=full)  # adaln down
    _linear(mm, "dit_conditioning", b, 6 * d, m.adaln_rank, L, recompute=full)  # adaln up
    _linear(mm, "dit_conditioning", b, m.adaln_rank, d)  # final adaln
    _linear(mm, "dit_conditioning", b, 2 * d, m.adaln_rank)
    _linear(mm, "dit_conditioning", b, d, m.timestep_dim, input_grad=False)  # timestep MLP
    _linear(mm, "dit_conditioning", b, d, d)
    _linear(mm, "dit_io", latent, d, m.latent_dim, input_grad=False)
    _linear(mm, "dit_io", latent, m.latent_dim, d)
    # Speaker encoder: full AC re-runs all of a block but its MLP down projection (flops.recompute_flops).
    S = m.speaker_layers
    _linear(mm, "speaker_encoder", spk, ds, m.latent_dim * m.speaker_patch, input_grad=False)
    _linear(mm, "speaker_encoder", spk, 3 * ds, ds, S, recompute=full)  # q, k, v
    _linear(mm, "speaker_encoder", spk, ds, ds, S, recompute=full)  # out
    _linear(mm, "speaker_encoder", spk, 2 * m.speaker_mlp, ds, S, recompute=full)  # gate + up
    _linear(mm, "speaker_encoder", spk, ds, m.speaker_mlp, S)
    fwd = 4 * b * p * p * ds * S
    att.append(AttentionWork("speaker_encoder", "forward", p, p, fwd, S))
    att.append(AttentionWork("speaker_encoder", "backward", p, p, 2 * fwd, S))
    if full:
        att.append(AttentionWork("speaker_encoder", "recompute", p, p, fwd, S))
    enc, trains = m.text_encoder, not m.frozen_encoder
    _linear(mm, "text_projection", text, d, enc.hidden, input_grad=trains)
    q_dim, kv_dim, E = enc.heads * enc.head_dim, enc.kv_heads * enc.head_dim, enc.layers
    for n, k, count in ((q_dim, enc.hidden, E), (kv_dim, enc.hidden, 2 * E), (enc.hidden, q_dim, E),
                        (enc.mlp, enc.hidden, (2 if enc.gated_mlp else 1) * E), (enc.hidden, enc.mlp, E)):
        _linear(mm, "text_encoder", text, n, k, count, backward=trains)
    fwd = 4 * b * lt * lt * q_dim * E
    att.append(AttentionWork("text_encoder", "forward", lt, lt, fwd, E))
    if trains:
        att.append(AttentionWork("text_encoder", "backward", lt, lt, 2 * fwd, E))
    return tuple(mm), tuple(att)


def _work(cfg: RunConfig):
    return step_work(cfg.model_config(), cfg.framework, cfg.tp, cfg.micro_batch, cfg.audio_frames, cfg.text_tokens,
                     cfg.speaker_frames, cfg.ac)


def host_ops(cfg: RunConfig) -> dict[str, int]:
    """ATen ops one rank dispatches per step, by phase (HOST_OPS; AC and compile as noted there)."""
    m = cfg.model_config()
    kind = "tp" if cfg.framework == "megatron" else {"hsdp": "fsdp2"}.get(cfg.parallelism, cfg.parallelism)
    table = HOST_OPS["single" if kind == "tp" and cfg.tp == 1 and cfg.dp == 1 else kind]
    out = {}
    for phase, (fixed, dit, speaker, encoder) in table.items():
        if cfg.compile is True and phase in COMPILED_BLOCK_OPS:  # priced(): compile auto resolved
            dit, speaker = COMPILED_BLOCK_OPS[phase]
        elif phase == "backward":
            dit, speaker = dit + AC_BACKWARD_OPS[cfg.ac][0], speaker + AC_BACKWARD_OPS[cfg.ac][1]
        if phase == "backward" and not m.frozen_encoder:
            encoder = 2 * table["forward"][3]  # a trained encoder's backward: assumed twice its forward
        out[phase] = fixed + dit * m.layers + speaker * m.speaker_layers + encoder * m.text_encoder.layers
    if kind == "tp" and cfg.dp > 1:  # torch DDP over the data-parallel group adds ddp's backward ops
        extra = [a - b for a, b in zip(HOST_OPS["ddp"]["backward"], HOST_OPS["single"]["backward"])]
        out["backward"] += extra[0] + extra[1] * m.layers + extra[2] * m.speaker_layers
    return out


# ---- rates from the profile ----

@dataclass
class Rates:
    """A profile's figures at one bound (mid: the points; low: the calibration's best figures, the
    fast end of the interval; high: its worst), looked up once per shape."""

    profile: HardwareProfile
    bound: str = "mid"
    _gemm: dict = field(default_factory=dict)
    _attention: dict = field(default_factory=dict)
    _factor: float | None = None  # in_situ_factor's, once computed (1.0 while it is being fitted)

    @property
    def compute_factor(self) -> float:
        if self._factor is None:
            self._factor = 1.0
            self._factor = in_situ_factor(self)
        return self._factor

    def gemm_tflops(self, m: int, n: int, k: int) -> float:
        key = (m, n, k)
        if key not in self._gemm:
            try:
                point = gemm_point(self.profile, m, n, k)
            except KeyError as exc:
                raise PredictError(f"{exc.args[0]}: measure them with `echobench calibrate --comm` or add `gemm` "
                                   "entries") from None
            self._gemm[key] = _bounded(point.tflops, point.tflops_max, point.tflops_min, self.bound)
        return self._gemm[key]

    def attention_tflops(self, seq_q: int, seq_k: int, head_dim: int) -> float:
        key = (seq_q, seq_k, head_dim)
        if key not in self._attention:
            if self.profile.attention:
                mid = attention_tflops(self.profile, seq_q, seq_k, head_dim)
                spread = [(p.tflops_max or p.tflops) / p.tflops for p in self.profile.attention]
                low = [(p.tflops_min or p.tflops) / p.tflops for p in self.profile.attention]
                self._attention[key] = _bounded(mid, mid * max(spread), mid * min(low), self.bound)
            else:  # no attention points: the rate of its score GEMM (seq_q x seq_k x head_dim)
                self._attention[key] = self.gemm_tflops(seq_q, seq_k, head_dim)
        return self._attention[key]

    def memory_gbps(self, op: str = "add") -> float:
        """The bandwidth of `op` (add: element-wise work; adamw: the optimizer's step), at the largest
        tensors measured; a profile without that op: its add (else its datasheet) figure."""
        if not self.profile.memory:
            raise PredictError(f"profile {self.profile.name!r} has no memory bandwidth: measure one with "
                               f"`echobench calibrate --comm` or add a `memory` entry")
        same = ([p for p in self.profile.memory if p.op == op] or [p for p in self.profile.memory if p.op == "add"]
                or self.profile.memory)
        point = max(same, key=lambda p: p.nbytes or 0)
        return _bounded(point.gbps, point.gbps_max, point.gbps_min, self.bound)

    def collective_seconds(self, op: str, nbytes: float, group_size: int, link: str) -> float:
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        try:
            fit = link_fit(self.profile, op, link)
        except KeyError as exc:
            have = ", ".join(self.profile.links) or "none"
            fix = ("calibrate across nodes: `echobench calibrate --comm` under torchrun on 2 or more nodes "
                   "(README, Hardware profiles), or give a profile of profiles/ that has an inter link"
                   if link == "inter" else "calibrate on this node: `echobench calibrate --comm --nproc N`")
            raise PredictError(f"{exc.args[0]}; link classes it has: {have}: {fix}") from None
        seconds = fit.alpha_s + bus_factor(op, group_size) * nbytes / (fit.bus_gbps * 1e9)
        rms = fit.rel_rms or 0.0
        return seconds * {"mid": 1.0, "low": max(0.0, 1 - rms), "high": 1 + rms}[self.bound]


def _bounded(mid: float, best: float | None, worst: float | None, bound: str) -> float:
    if bound == "low":
        return best if best else mid
    if bound == "high":
        return worst if worst else mid
    return mid


def is_cpu(profile: HardwareProfile) -> bool:
    """Whether the profile's device is a CPU (hardware.device_name names one `CPU ...`): its host runs
    the kernels itself, so host time adds to the device's instead of hiding behind it."""
    return profile.device.upper().startswith("CPU")


def compute_bytes(cfg: RunConfig, profile: HardwareProfile) -> int:
    """Bytes per element of the compute dtype: precision auto is the profile's dtype."""
    if cfg.precision == "auto":
        return 4 if profile.dtype == "float32" else 2
    return 4 if cfg.precision == "fp32" else 2


def rank_params(cfg: RunConfig) -> float:
    """Trainable parameters one rank holds and updates: TP splits the DiT's attention and MLP
    matrices, FSDP2 / HSDP shard everything (as memory.estimate_memory)."""
    counts = param_counts(cfg.model_config())
    params = float(counts.trainable)
    if cfg.tp > 1:
        split = counts.parts["dit_attention"] + counts.parts["dit_mlp"]
        params += split / cfg.tp - split
    return params / state_shards(cfg)


# ---- the prediction ----

@dataclass(frozen=True)
class Collective:
    """One kind of collective of the step, priced: where it can hide (forward, backward or nowhere)
    and how much of it cannot (`floor_s`: a first all-gather, a last bucket or reduce-scatter)."""

    what: str
    op: str
    group: str
    group_size: int
    link: str
    calls: int
    nbytes: int
    bus_bytes: float
    alpha_s: float  # the fit's latency per call
    bus_gbps: float  # the fit's bus bandwidth
    seconds: float
    overlaps: str  # forward, backward, none
    floor_s: float


@dataclass
class Prediction:
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
        from dataclasses import asdict

        out = {k: v for k, v in self.__dict__.items() if k not in ("cfg", "collectives")}
        out["collectives"] = [asdict(c) for c in self.collectives]
        out["settings"] = {k: getattr(self.cfg, k) for k in ("scale", "framework", "parallelism", "nodes",
                                                             "gpus_per_node", "micro_batch", "audio_frames",
                                                             "text_tokens", "speaker_frames", "precision", "ac",
                                                             "compile")}
        return out


def run_peak(cfg: RunConfig, profile: HardwareProfile) -> tuple[float, str]:
    """The MFU denominator as the run would take it (hardware.resolve_peak's order): the run's
    peak_tflops (a flag, or the matrix's hardware.peak_tflops), else the datasheet entry of the
    profile's device, else the profile's best GEMM rate (calibrated)."""
    from echobench.peaks import table_peak

    if cfg.peak_tflops is not None:
        return cfg.peak_tflops, "flag"
    if hit := table_peak(profile.device):
        return hit
    if profile.gemm:
        return max(p.tflops for p in profile.gemm), f"calibrated:{profile.dtype} GEMM (profile {profile.name})"
    raise PredictError(f"no peak for {run_id(cfg)}: set peak_tflops (hardware.peak_tflops in the matrix) or give "
                       f"a profile with GEMM points")


def _device_seconds(cfg: RunConfig, rates: Rates, eb: int) -> dict[str, float]:
    """The device's seconds of one step by phase and kind (no communication): GEMMs and attention at
    the profile's rates, element-wise and optimizer bytes at its memory bandwidth."""
    mm, att = _work(cfg)
    factor = rates.compute_factor
    out = dict.fromkeys(("gemm_forward", "gemm_backward", "attention_forward", "attention_backward"), 0.0)
    for w in mm:
        out[f"gemm_{'forward' if w.phase == 'forward' else 'backward'}"] += w.flops / (rates.gemm_tflops(w.m, w.n, w.k) * 1e12)
    m = cfg.model_config()
    for a in att:
        head_dim = m.speaker_width // m.speaker_heads if a.part == "speaker_encoder" else m.head_dim
        out[f"attention_{'forward' if a.phase == 'forward' else 'backward'}"] += \
            a.flops / (rates.attention_tflops(a.seq_q, a.seq_k, head_dim) * 1e12)
    gbps = rates.memory_gbps() * 1e9
    saved = activation_elements_per_sample(cfg)[0] * cfg.micro_batch * eb
    if cfg.tp > 1:
        saved *= 0.25 + 0.75 / cfg.tp  # as memory.estimate_memory: norms and residuals stay whole
    fwd, bwd = ELEMENTWISE["compiled" if cfg.compile else "eager"]
    out["elementwise_forward"] = fwd * saved / gbps
    out["elementwise_backward"] = (bwd + (fwd if cfg.ac != "none" else 0)) * saved / gbps  # AC re-runs them
    out = {key: seconds * factor for key, seconds in out.items()}
    adamw = ADAMW_BYTES["foreach" if is_cpu(rates.profile) else "fused"]
    out["optimizer"] = rank_params(cfg) * (adamw / (rates.memory_gbps("adamw") * 1e9) + CLIP_BYTES / gbps)
    return out


def _rows(point) -> int:
    return point.micro_batch * point.audio_frames


def host_point(cfg: RunConfig, profile: HardwareProfile):
    """The profile's host point for the run's layout (its shortest step, where the host is most of
    it): megatron TP of any width, FSDP2 (for HSDP too), DDP, else single; None when the profile
    has none."""
    kind = ("megatron", None) if cfg.framework == "megatron" and cfg.tp > 1 else \
        ("torchtitan", {"hsdp": "fsdp2"}.get(cfg.parallelism, cfg.parallelism))
    points = sorted(profile.host_steps, key=_rows)
    for p in points:
        if p.framework == kind[0] and (kind[1] is None or p.parallelism == kind[1]):
            return p
    return next((p for p in points if p.parallelism == "single"), None)


FACTOR_BOUNDS = (1 / 3, 3.0)  # an in-situ factor outside these says the points are not what it assumes


def _point_run(point, profile: HardwareProfile) -> RunConfig:
    """The RunConfig of a host point's steps."""
    nodes = max(1, point.processes // (profile.gpus_per_node or point.processes))
    return RunConfig(scale=point.scale, micro_batch=point.micro_batch, audio_frames=point.audio_frames,
                     text_tokens=point.text_tokens, speaker_frames=point.speaker_frames, framework=point.framework,
                     parallelism=point.parallelism, nodes=nodes, gpus_per_node=point.processes // nodes)


def in_situ_factor(rates: Rates) -> float:
    """How much longer a CPU's kernels take inside a training step than timed alone (operands the
    step left elsewhere in the cache, its allocations), from the profile's two single-process host
    steps (calibrate --comm: the shortest one, mostly host, and a reference step, mostly compute):
    each is step = factor x compute + optimizer + cost per op x ops, two equations for the factor
    and the cost per op. Scales the GEMMs, attention and element-wise work (the optimizer is
    measured as training meets it). 1 on a GPU (its host and device overlap: not fitted), or without
    both points, or where the points give a factor outside FACTOR_BOUNDS."""
    if not is_cpu(rates.profile):
        return 1.0
    single = sorted((p for p in rates.profile.host_steps if p.parallelism == "single"), key=_rows)
    if len(single) < 2 or _rows(single[0]) == _rows(single[-1]):
        return 1.0
    sides = []
    for point in (single[0], single[-1]):
        run = _point_run(point, rates.profile)
        dev = _device_seconds(run, rates, compute_bytes(run, rates.profile))
        compute = sum(v for k, v in dev.items() if k != "optimizer")
        step = _bounded(point.step_s, point.step_s_min, point.step_s_max, rates.bound)
        sides.append((compute, step - dev["optimizer"], point.ops))
    (d1, s1, o1), (d2, s2, o2) = sides
    det = d2 * o1 - d1 * o2
    factor = (s2 * o1 - s1 * o2) / det if det > 0 else 1.0
    return factor if FACTOR_BOUNDS[0] <= factor <= FACTOR_BOUNDS[1] else 1.0


def _host_per_op(cfg: RunConfig, rates: Rates) -> float:
    """The host's seconds per dispatched op in the run's layout: its host point's step less what the
    model puts on the device for that step (its compute and exposed communication), over its ops. On
    a GPU the tiny step's device work hides behind its host: the step over its ops. 0 without a
    host point: the host is then assumed never to hold the device up."""
    point = host_point(cfg, rates.profile)
    if point is None:
        return 0.0
    step = _bounded(point.step_s, point.step_s_min, point.step_s_max, rates.bound)
    if not is_cpu(rates.profile):
        return step / point.ops
    return max(0.0, step - _device_step(_point_run(point, rates.profile), rates)) / point.ops


def _bucket_caps(cfg: RunConfig) -> tuple[int, int]:
    from echobench.commvolume import TORCHTITAN_DDP_BUCKET_BYTES, megatron_ddp_bucket_bytes

    return megatron_ddp_bucket_bytes(cfg) if cfg.framework == "megatron" else TORCHTITAN_DDP_BUCKET_BYTES


def _last_bucket(total: int, calls: int, first_cap: int, cap: int) -> int:
    """The bytes of DDP's last bucket: what is left after the first and the full ones
    (commvolume.ddp_buckets fills them in the order the gradients become ready)."""
    if calls <= 1:
        return total
    left = total - first_cap - (calls - 2) * cap
    return left if 0 < left <= cap else cap


@lru_cache(maxsize=4096)
def _traffic(cfg_key: tuple, device: str):
    from echobench.commvolume import step_bytes

    return tuple(step_bytes(RunConfig(**dict(cfg_key)), device))


def collectives(cfg: RunConfig, rates: Rates) -> list[Collective]:
    """commvolume.step_bytes of the run (groups of one rank left out), priced and placed (module
    docstring)."""
    key = tuple(sorted((k, v) for k, v in cfg.to_dict().items() if k not in ("repeat", "seed", "steps", "warmup_steps")))
    out = []
    for t in _traffic(key, "cpu" if is_cpu(rates.profile) else "cuda"):
        if t.group_size <= 1 or t.nbytes <= 0:
            continue
        one = rates.collective_seconds(t.op, t.nbytes / t.calls, t.group_size, t.link)
        if t.group == "tp" or (t.op == "all_reduce" and t.group == "dp_shard"):
            parts = [(t.calls, "none", t.calls * one)]  # TP activations, the gradient norm: on the critical path
        elif t.dtype == "int64":
            parts = [(t.calls, "forward", 0.0)]  # the frame count: started before the forward, waited after it
        elif t.op == "all_gather" and "once" in t.what:
            parts = [(t.calls, "forward", t.calls * one)]  # the root's: gathered before anything can run
        elif t.op == "all_gather":  # each block's, prefetched: in forward (the root's goes first) and in backward
            parts = [(t.calls // 2, "forward", 0.0), (t.calls - t.calls // 2, "backward", one)]
        elif t.op == "all_reduce" and t.group == "dp":  # DDP's buckets: the last one waits for the backward's end
            last = _last_bucket(t.nbytes, t.calls, *_bucket_caps(cfg))
            parts = [(t.calls, "backward", rates.collective_seconds(t.op, last, t.group_size, t.link))]
        else:  # FSDP2's reduce-scatters, HSDP's replica all-reduce: the last unit's waits
            parts = [(t.calls, "backward", one)]
        fit = rates.profile.links[t.link][t.op]
        for calls, overlaps, floor in parts:
            nbytes = t.nbytes * calls // t.calls
            out.append(Collective(t.what, t.op, t.group, t.group_size, t.link, calls, nbytes,
                                  bus_factor(t.op, t.group_size) * nbytes, fit.alpha_s, fit.bus_gbps, calls * one,
                                  overlaps, min(floor, calls * one)))
    return out


def exposed(comm: Sequence[Collective], windows: dict[str, float]) -> dict[str, float]:
    """Exposed seconds per overlap class: the critical-path collectives whole; per phase, the
    unhideable floors plus whatever of the rest the phase's compute (windows[phase]) cannot cover."""
    out = {"none": sum(c.seconds for c in comm if c.overlaps == "none")}
    for phase in ("forward", "backward"):
        mine = [c for c in comm if c.overlaps == phase]
        floors = sum(c.floor_s for c in mine)
        out[phase] = floors + max(0.0, sum(c.seconds for c in mine) - floors - windows[phase])
    return out


def _device(cfg: RunConfig, rates: Rates) -> dict:
    """One step's device side at one bound: seconds by kind, the phases, communication and its
    exposed part."""
    dev = _device_seconds(cfg, rates, compute_bytes(cfg, rates.profile))
    fwd = dev["gemm_forward"] + dev["attention_forward"] + dev["elementwise_forward"]
    bwd = dev["gemm_backward"] + dev["attention_backward"] + dev["elementwise_backward"]
    comm = collectives(cfg, rates)
    # On a CPU the collectives hide behind nothing: gloo's threads need the cores the ranks compute
    # on (profiled DDP, FSDP2 and TP=2 steps on 2 cores overlap under 2% of their communication).
    hidden = exposed(comm, {"forward": 0.0, "backward": 0.0} if is_cpu(rates.profile) else {"forward": fwd, "backward": bwd})
    exposed_s = sum(hidden.values())
    return {"dev": dev, "forward": fwd, "backward": bwd, "comm": comm, "exposed": hidden, "exposed_s": exposed_s,
            "device": fwd + bwd + dev["optimizer"] + exposed_s}


def _device_step(cfg: RunConfig, rates: Rates) -> float:
    return _device(cfg, rates)["device"]


def _evaluate(cfg: RunConfig, rates: Rates) -> dict:
    """One step's figures at one bound: the device side, the host, the step."""
    out = _device(cfg, rates)
    ops = host_ops(cfg)
    host = sum(ops.values()) * _host_per_op(cfg, rates)
    step = out["device"] + host if is_cpu(rates.profile) else max(out["device"], host)
    return {**out, "ops": ops, "host": host, "step": step}


def device_type(profile_device: str) -> str:
    return "cpu" if is_cpu_name(profile_device) else "cuda"


def priced(cfg: RunConfig, profile_device: str) -> RunConfig:
    """The run as it would run on the profile's device, its auto settings resolved (compile), as
    predict prices it: sequence parallelism as the same layout without it (its all-gathers and
    reduce-scatters move the bytes of the all-reduces they replace; the prediction's notes say so)."""
    device = device_type(profile_device)
    return replace(cfg, compile=cfg.compiled_on(device), sequence_parallel=False)


def predict(cfg: RunConfig, profile: HardwareProfile, peak: tuple[float, str] | None = None,
            model_flops_per_sample: float | None = None) -> Prediction:
    """The predicted step of `cfg` on `profile`'s machine (module docstring). `peak` overrides the
    run's (run_peak); `model_flops_per_sample` the FLOP model's at the run's full lengths (a record's
    measured figure, over its real lengths)."""
    given = cfg
    sequence_parallel = cfg.sequence_parallel_on(device_type(profile.device))
    cfg = priced(cfg, profile.device)
    if cfg.grad_accum > 1:
        raise PredictError(f"{run_id(given)}: gradient accumulation is not modelled: predict it with grad_accum: 1")
    mid, low, high = (_evaluate(cfg, Rates(profile, b)) for b in BOUNDS)
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
             "optimizer": dev["optimizer"], "communication": mid["exposed_s"],
             "host": mid["host"] if is_cpu(profile) else max(0.0, mid["host"] - mid["device"])}
    notes = _notes(cfg, profile)
    if sequence_parallel:
        notes.append("sequence parallelism priced as the same TP layout without it (its all-gathers and "
                     "reduce-scatters move the bytes of the all-reduces they replace; the norms' split not modelled)")
    mem = estimate_memory(cfg)
    capacity = _capacity(profile)
    world = cfg.world_size
    return Prediction(
        run_id=run_id(given), cfg=given, profile=profile.name, profile_device=profile.device, step_time_s=step,
        step_time_low_s=min(low["step"], step), step_time_high_s=max(high["step"], step), parts=parts,
        forward_s=mid["forward"], backward_s=mid["backward"], optimizer_s=dev["optimizer"], device_s=mid["device"],
        host_s=mid["host"], host_ops=ops, communication_s=sum(c.seconds for c in mid["comm"]),
        exposed_communication_s=mid["exposed_s"], collectives=mid["comm"], link_bytes=link_bytes(mid["comm"]),
        hide_gbps=hide_gbps(mid["comm"], {"forward": mid["forward"], "backward": mid["backward"]}),
        samples_per_s=cfg.global_batch / step, model_flops_per_sample=int(mflops), hardware_flops_per_sample=int(hflops),
        mfu=mflops * cfg.global_batch / (step * world * peak_tflops * 1e12),
        hfu=hflops * cfg.global_batch / (step * world * peak_tflops * 1e12),
        peak_tflops=peak_tflops, peak_source=peak_source, memory_gib=mem.total_gib,
        fits=None if capacity is None else mem.total_gib <= capacity, notes=notes)


def _capacity(profile: HardwareProfile) -> float | None:
    from echobench.memory import device_memory_gib

    try:
        return device_memory_gib(device=profile.device)
    except ValueError:  # a CPU, or a device the memory table lacks
        return None


def link_bytes(comm: Sequence[Collective]) -> dict[str, dict[str, float]]:
    """Per link class: the message bytes (nccl-tests' sizes) and bus bytes one rank's collectives move per step."""
    out: dict[str, dict[str, float]] = {}
    for c in comm:
        row = out.setdefault(c.link, {"bytes": 0.0, "bus_bytes": 0.0})
        row["bytes"] += c.nbytes
        row["bus_bytes"] += c.bus_bytes
    return out


def hide_gbps(comm: Sequence[Collective], windows: dict[str, float]) -> dict[str, float | None]:
    """Per link class, the bus bandwidth (GB/s) at which its overlappable collectives take no longer
    than the compute they overlap: the largest over the phases of bus bytes / (the phase's compute -
    their latencies). None: nothing on that link can overlap (TP, the gradient norm); inf: the
    latencies alone exceed the compute."""
    out: dict[str, float | None] = {}
    for link in dict.fromkeys(c.link for c in comm):
        need = None
        for phase, window in windows.items():
            mine = [c for c in comm if c.link == link and c.overlaps == phase and c.bus_bytes > 0]
            if not mine:
                continue
            left = window - sum(c.calls * c.alpha_s for c in mine)
            rate = math.inf if left <= 0 else sum(c.bus_bytes for c in mine) / left / 1e9
            need = rate if need is None else max(need, rate)
        out[link] = need
    return out


def _notes(cfg: RunConfig, profile: HardwareProfile) -> list[str]:
    """What the prediction assumes for this run beyond the module's rules."""
    notes = []
    if not profile.measured:
        notes.append(f"profile {profile.name} is not measured (datasheets and published figures)")
    if host_point(cfg, profile) is None:
        notes.append("no host point in the profile: host overhead not modelled")
    if not profile.attention:
        notes.append("no attention points in the profile: attention at its score GEMM's rate")
    if cfg.precision == "fp8":
        notes.append("fp8: GEMMs at the profile's rate (float8 GEMMs are not modelled apart)")
    if cfg.data != "synthetic":
        notes.append("data from shards: no data wait modelled, lengths taken as the maxima"
                     + (" (batching bucket: every step at the largest bucket's shape)"
                        if getattr(cfg, "batching", "pad") == "bucket" else ""))
    if is_cpu(profile) and profile.gpus_per_node and cfg.gpus_per_node != profile.gpus_per_node:
        notes.append(f"CPU rates measured with {profile.gpus_per_node} process(es) per node, the run has "
                     f"{cfg.gpus_per_node}: its threads per process differ")
    return notes


# ---- which profile, which runs ----

def profile_processes(profile: HardwareProfile) -> int:
    """How many processes a profile was measured on: its largest collective group (1 without links)."""
    return max((pt.group_size for ops in profile.links.values() for fit in ops.values() for pt in fit.points),
               default=1 if not profile.links else 0)


def choose_profile(cfg: RunConfig, profiles: Sequence[HardwareProfile]) -> HardwareProfile:
    """Of several profiles, the one measured most like the run: with the link classes its
    collectives need (inter across nodes), the same processes per node and in all (on a CPU they
    decide the threads and cores each process has), then the GEMM point nearest the run's biggest
    GEMM (the DiT's q projection at its rows), then the first given."""
    from echobench.hwprofile import _log_distance

    rows, width = cfg.micro_batch * cfg.audio_frames, cfg.model_config().width
    needs = ({"inter"} if cfg.nodes > 1 else set()) | ({"intra"} if cfg.gpus_per_node > 1 else set())

    def key(item):
        i, p = item
        lacks = len(needs - set(p.links))
        per_node = p.gpus_per_node is not None and p.gpus_per_node != cfg.gpus_per_node
        world = profile_processes(p) not in (0, cfg.world_size)  # 0: published fits without points
        near = min((_log_distance((g.m, g.n, g.k), (rows, width, width)) for g in p.gemm), default=math.inf)
        return (lacks, per_node, world, round(near, 6), i)

    return min(enumerate(profiles), key=key)[1]


def at_nodes(cfgs: Sequence[RunConfig], nodes: Sequence[int]) -> list[RunConfig]:
    """Each distinct configuration of `cfgs` (node count aside) at each of `nodes`, where its layout
    can run there (matrix.layout_problem on SLURM: single stays on one node, HSDP needs two)."""
    from echobench.matrix import layout_problem

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


# ---- against measured records ----

# The breakdown's categories (echobench.breakdown) each predicted part is held against.
BREAKDOWN_PARTS = {"gemm": ("gemm",), "attention": ("attention",), "optimizer": ("optimizer",),
                   "communication": ("communication",),
                   "other": ("other_compute", "memcpy", "data_wait", "idle")}


def predicted_shares(p: Prediction) -> dict[str, float]:
    """The predicted step in the breakdown's categories, as shares of the step. On a CPU the host's
    time per op lands in the op's own category (a profiled op's span holds its dispatch): GEMM and
    attention get two ops per call (the op and its transpose or view), the optimizer its phase's
    ops, the rest goes to other; on a GPU host time beyond the device's is idle (other)."""
    cfg = priced(p.cfg, p.profile_device)
    mm, att = _work(cfg)
    calls = {"gemm": 2 * sum(w.count for w in mm), "attention": 2 * sum(a.calls for a in att)}
    per_op = p.host_s / p.host_ops if p.host_ops and is_cpu_name(p.profile_device) else 0.0
    ops = host_ops(cfg)
    host = {"gemm": calls["gemm"] * per_op, "attention": calls["attention"] * per_op,
            "optimizer": ops["optimizer"] * per_op}
    host["other"] = p.parts["host"] - sum(host.values())
    seconds = {"gemm": p.parts["gemm"] + host["gemm"], "attention": p.parts["attention"] + host["attention"],
               "optimizer": p.parts["optimizer"] + host["optimizer"], "communication": p.parts["communication"],
               "other": p.parts["elementwise"] + host["other"]}
    return {k: v / p.step_time_s for k, v in seconds.items()}


def is_cpu_name(device: str) -> bool:
    return device.upper().startswith("CPU")


def measured_shares(breakdown: dict | None) -> dict[str, float] | None:
    """A record's profiled breakdown (its `breakdown` summary) in BREAKDOWN_PARTS' categories."""
    fractions = (breakdown or {}).get("fractions")
    if not fractions:
        return None
    return {k: sum(fractions.get(c, 0.0) for c in cats) for k, cats in BREAKDOWN_PARTS.items()}


@dataclass
class Comparison:
    """A prediction held against a measured record: error = (predicted - measured) / measured."""

    prediction: Prediction
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


def against(record, profiles: Sequence[HardwareProfile]) -> Comparison:
    """The prediction of a measured run (an ok Record with a median step time), on the profile
    choose_profile picks, with the record's own peak and model FLOPs per sample (its real lengths),
    so that the MFUs compare under one convention."""
    from echobench.results import record_settings

    if record.status != "ok" or not record.step_time_s:
        raise PredictError(f"{record.run_id}: status {record.status}, no measured step time to compare")
    cfg = RunConfig.from_dict({**record_settings(record), "repeat": 0})
    profile = choose_profile(cfg, profiles)
    peak = (record.peak_tflops, record.peak_source or "record") if record.peak_tflops else None
    p = predict(cfg, profile, peak=peak, model_flops_per_sample=record.model_flops_per_sample)
    p.run_id = record.run_id
    measured, predicted = measured_shares(record.breakdown), predicted_shares(p)
    parts = None if measured is None else {k: {"predicted": predicted[k], "measured": measured[k]} for k in measured}
    mfu_error = (p.mfu - record.mfu) / record.mfu if record.mfu else None
    return Comparison(p, record.step_time_s, record.mfu, (p.step_time_s - record.step_time_s) / record.step_time_s,
                      mfu_error, parts, str(record.path) if record.path else None)


def summary(comparisons: Sequence[Comparison]) -> dict:
    """Mean and max absolute relative step-time error over the comparisons (and MFU's)."""
    errors = [abs(c.error) for c in comparisons]
    mfu = [abs(c.mfu_error) for c in comparisons if c.mfu_error is not None]
    return {"runs": len(errors), "mean_abs_error": sum(errors) / len(errors) if errors else None,
            "max_abs_error": max(errors, default=None),
            "mean_abs_mfu_error": sum(mfu) / len(mfu) if mfu else None, "max_abs_mfu_error": max(mfu, default=None)}


# ---- profiles by name or device ----

def load_profiles(names: Sequence[str]) -> list[HardwareProfile]:
    """Profiles from shipped names or files (hwprofile.find_profile); PredictError on a bad one."""
    from echobench.hwprofile import ProfileError, find_profile, load_profile

    try:
        return [load_profile(find_profile(n)) for n in names]
    except ProfileError as exc:
        raise PredictError(str(exc)) from None


def profile_for_device(device: str | None, near: str | None = None) -> HardwareProfile | None:
    """The profile to use for a device name without --profile: the one the sweep that `near` (a
    record's file) lies in measured for that device (hardware.calibrate_comm: SWEEP/profile.yaml,
    named after its file); else the shipped profile of the same datasheet row (peaks.PEAK_TFLOPS
    names: a whole word of both names); else, for this machine's own device, the profile `calibrate
    --comm` left in echobench's cache; None without any. PredictError when the sweep's cannot be read."""
    from echobench.hwprofile import ProfileError, calibrated_profile_path, load_profile, shipped_profiles
    from echobench.peaks import PEAK_PATTERNS
    from echobench.executors import measured_profile

    if not device:
        return None
    if near is not None and (path := measured_profile(near)) is not None:
        try:
            profile = load_profile(path)
        except ProfileError as exc:
            raise PredictError(str(exc)) from None
        if profile.device == device:  # another device (a sweep over mixed nodes): the lookups below
            return profile.model_copy(update={"name": f"{profile.name} ({path})"})
    row = next((pattern for pattern, _, _ in PEAK_PATTERNS if pattern.search(device)), None)
    for path in shipped_profiles().values():
        profile = load_profile(path)
        if row is not None and row.search(profile.device):
            return profile
    for dtype in ("float32", "bfloat16"):
        path = calibrated_profile_path(device, dtype)
        if path.is_file():
            return load_profile(path)
    return None


def machine_device(cfgs: Sequence[RunConfig]) -> str:
    """This machine's device name, for runs whose matrix names no hardware.device: its GPU where
    the runs may use one (device cuda or auto), else its CPU; profile_for_device then finds the
    profile `calibrate --comm` measured here."""
    import torch

    from echobench.hardware import device_name

    gpu = torch.cuda.is_available() and any(c.device != "cpu" for c in cfgs)
    return device_name(torch.device("cuda" if gpu else "cpu"))


def other_device_lines(records, profiles: Sequence[HardwareProfile]) -> list[str]:
    """For `predict --against ... --profile P`: one line per device the records ran on that none of
    the profiles given is of (their errors then say how two machines differ, not how good the
    model is)."""
    have = {p.device for p in profiles}
    counts: dict[str, int] = {}
    for r in records:
        device = r.env.device_name
        if device and device not in have:
            counts[device] = counts.get(device, 0) + 1
    return [f"{n} run(s) measured on {device!r}, predicted from a profile of another device "
            f"({', '.join(sorted(have))}): give that device's profile to judge the model"
            for device, n in counts.items()]


def no_profile_message(what: str) -> str:
    from echobench.hwprofile import shipped_profiles

    return (f"no hardware profile for {what}: pass --profile NAME|FILE (shipped: {', '.join(shipped_profiles())}), "
            f"or measure this machine's with `echobench calibrate --comm`")


# ---- tables ----

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _gbps(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.3g}")


def prediction_table(items: Sequence[Prediction | PredictError], cfgs: Sequence[RunConfig], title: str):
    """`echobench predict MATRIX`: one row per run (PREDICTED), ranked per scale and node count."""
    from rich.table import Table

    from echobench.console import esc

    good = [p for p in items if isinstance(p, Prediction)]
    rank = ranks(good)
    table = Table(title=esc(title), caption="n x g: nodes x GPUs per node; mb/gb: micro / global batch; comm, host: "
                  "exposed communication and host overhead, shares of the step; rank: by MFU within scale and nodes; "
                  "hide: bus GB/s per link that hides the overlappable collectives")
    table.add_column("run id", no_wrap=True)
    for col in ("n x g", "mb/gb", "step s", "range s", "samples/s", "MFU", "comm", "host", "GiB", "rank", "hide GB/s"):
        table.add_column(col, justify="right", no_wrap=True)
    order = sorted(zip(items, cfgs), key=lambda pc: (pc[1].scale, pc[1].nodes, rank.get(run_id(pc[1]), 99)))
    for p, cfg in order:
        shape = f"{cfg.nodes} x {cfg.gpus_per_node}"
        if isinstance(p, PredictError):
            table.add_row(esc(run_id(cfg)), shape, "", "", "[red]not predicted[/]", *[""] * 7)  # why: under the table
            continue
        hide = " ".join(f"{k} {_gbps(v)}" for k, v in p.hide_gbps.items() if v is not None) or "-"
        fits = {True: "", False: " [red]NO[/]", None: ""}[p.fits]
        table.add_row(esc(p.run_id), shape, f"{cfg.micro_batch} / {cfg.global_batch}",
                      f"{p.step_time_s:.4g}", f"{p.step_time_low_s:.3g}-{p.step_time_high_s:.3g}",
                      f"{p.samples_per_s:.4g}", _pct(p.mfu),
                      _pct(p.exposed_communication_s / p.step_time_s), _pct(p.parts["host"] / p.step_time_s),
                      f"{p.memory_gib:.1f}{fits}", str(rank[p.run_id]), hide)
    return table


def comparison_table(comparisons: Sequence[Comparison], title: str):
    """`echobench predict --against`: predicted vs measured per run, parts vs the breakdown."""
    from rich.table import Table

    from echobench.console import esc

    table = Table(title=esc(title), caption="error = (predicted - measured) / measured step time; parts: predicted / "
                  "measured share of the step (profiled runs), gemm attention optimizer communication other")
    table.add_column("run id", no_wrap=True)
    for col in ("measured s", "predicted s", "range s", "error", "MFU meas", "MFU pred", "parts"):
        table.add_column(col, justify="right", no_wrap=True)
    for c in sorted(comparisons, key=lambda c: (c.prediction.cfg.scale, c.prediction.cfg.framework,
                                                c.prediction.cfg.parallelism, c.prediction.run_id)):
        p = c.prediction
        parts = "-" if c.parts is None else " ".join(
            f"{v['predicted']:.0%}/{v['measured']:.0%}" for v in c.parts.values())
        table.add_row(esc(p.run_id), f"{c.measured_step_time_s:.4g}", f"{p.step_time_s:.4g}",
                      f"{p.step_time_low_s:.3g}-{p.step_time_high_s:.3g}", f"{c.error:+.1%}",
                      _pct(c.measured_mfu), _pct(p.mfu), parts)
    return table


def profile_lines(profiles: Sequence[HardwareProfile]) -> list[str]:
    """One line per profile used: what it is and where its numbers come from."""
    lines = []
    for p in profiles:
        kind = "measured" if p.measured else "NOT MEASURED: datasheets and published figures"
        factor = Rates(p).compute_factor
        lines.append(f"profile {p.name}: {p.device}, {p.dtype}, {kind}, {p.date}"
                     + (f", {p.gpus_per_node} per node" if p.gpus_per_node else "")
                     + (f", in-situ factor {factor:.3g}" if factor != 1.0 else ""))
    return lines
