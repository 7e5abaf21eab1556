"""How a step's work (work.py) is priced on a hardware profile: the profile's rates at one bound
(Rates: GEMM, attention, memory and collective figures), the device's seconds by phase and kind
(device_seconds), a CPU's in-situ factor, the host point that gives the host's cost per op, the
peak that MFU is taken against (run_peak), and the run as the profile's device would run it (priced)."""

from __future__ import annotations

import math

from dataclasses import dataclass, field, replace

from echobench.records.config import RunConfig, run_id
from echobench.hardware.devicerates import (
    InStepFit,
    attention_points,
    gpu_family,
    in_step_clock,
    gemm_rate,
    interpolate_attention,
    kernel_gap,
    sustained_clock,
)
from echobench.hardware.profile import CollectiveCost, HardwareProfile, collective_cost
from echobench.model.config import masked_share
from echobench.records.peaks import table_peak
from echobench.predict.elementwise import echo_elementwise
from echobench.predict.errors import PredictError
from echobench.predict.work import ADAMW_BYTES, CLIP_BYTES, float8_work, rank_params, run_work

BOUNDS = ("mid", "low", "high")  # the point figures; the calibration's best; its worst


@dataclass
class Rates:
    """A profile's figures at one bound (mid: the points; low: the calibration's best figures, the
    fast end of the interval; high: its worst), looked up once per shape."""

    profile: HardwareProfile
    bound: str = "mid"
    terms: InStepFit | None = None  # the fitted in-step clock to price with (None: the committed fit)
    # the kernel of an Echo run's unmasked SDPA calls where its record names torch's choice
    # (measured.recorded_sdpa); None: attention_kernel's, from the settings
    sdpa: str | None = None
    _gemm: dict = field(default_factory=dict)
    _attention: dict = field(default_factory=dict)
    _factor: float | None = None  # in_situ_factor's, once computed (1.0 while it is being fitted)

    @property
    def compute_factor(self) -> float:
        if self._factor is None:
            self._factor = 1.0
            self._factor = in_situ_factor(self)
        return self._factor

    @property
    def clock(self) -> float:
        """The sustained clock ratio at this bound (devicerates.sustained_clock: its range's fast end
        at low, its slow end at high)."""
        c = sustained_clock(self.profile, self.terms)
        lo, hi = c.range
        return {"mid": c.value, "low": hi, "high": lo}[self.bound]

    def gemm_tflops(self, m: int, n: int, k: int, precision: str = "bf16") -> float:
        """The rate of an (m, n, k) GEMM at `precision` (bf16, or fp8 at the device's float8 rate):
        its point's figures (devicerates.gemm_rate: the measured shape, or the best shape's scaled by
        the GEMM shape model) x the sustained clock, at this bound."""
        key = (m, n, k, precision)
        if key not in self._gemm:
            try:
                point, f = gemm_rate(self.profile, m, n, k, precision)
            except KeyError as exc:
                raise PredictError(f"{exc.args[0]}: measure them with `echobench calibrate --comm` or add `gemm` "
                                   "entries" + (" of dtype float8_e4m3fn" if precision == "fp8" else "")) from None
            f *= self.clock
            self._gemm[key] = bounded(point.tflops * f, point.tflops_max and point.tflops_max * f,
                                      point.tflops_min and point.tflops_min * f, self.bound)
        return self._gemm[key]

    def attention_tflops(self, seq_q: int, seq_k: int, head_dim: int, causal: bool = False,
                         kernel: str | None = None) -> float:
        """Attention's rate (flops.py's FLOPs, every score counted, per second) at this shape, causal
        or not, of `kernel` (None: whichever the profile has): devicerates.attention_points' points
        (their spread gives the bounds); a profile without attention points: the rate of the score
        GEMM (seq_q x seq_k x head_dim)."""
        key = (seq_q, seq_k, head_dim, causal, kernel)
        if key not in self._attention:
            points, factor, _ = attention_points(self.profile, head_dim, causal, kernel)
            if points:
                mid = factor * self.clock * interpolate_attention(points, seq_q, seq_k)
                spread = [(p.tflops_max or p.tflops) / p.tflops for p in points]
                low = [(p.tflops_min or p.tflops) / p.tflops for p in points]
                self._attention[key] = bounded(mid, mid * max(spread), mid * min(low), self.bound)
            else:
                self._attention[key] = self.gemm_tflops(seq_q, seq_k, head_dim)
        return self._attention[key]

    def memory_gbps(self, op: str = "add", nbytes: float | None = None) -> float:
        """The bandwidth of `op` (add: eager element-wise work; triton: compiled; adamw: the
        optimizer's step) over tensors of `nbytes` (None: the largest measured): the point measured
        nearest that size (a CPU profile has a cache-sized one beside its DRAM one; device_seconds
        asks a CPU's for the DRAM one); a profile without that op: its add (else its datasheet) figure
        (devicerates.memory_bandwidth's rule)."""
        if not self.profile.memory:
            raise PredictError(f"profile {self.profile.name!r} has no memory bandwidth: measure one with "
                               f"`echobench calibrate --comm` or add a `memory` entry")
        same = ([p for p in self.profile.memory if p.op == op] or [p for p in self.profile.memory if p.op == "add"]
                or self.profile.memory)
        sized = [p for p in same if p.nbytes]
        if nbytes and sized:
            point = min(sized, key=lambda p: abs(math.log(p.nbytes / nbytes)))
        else:
            point = max(same, key=lambda p: p.nbytes or 0)
        return bounded(point.gbps, point.gbps_max, point.gbps_min, self.bound)

    def collective_seconds(self, op: str, nbytes: float, group_size: int, link: str,
                           per_node: int | None = None) -> float:
        """One call's seconds at this bound (collective_cost's)."""
        if group_size <= 1 or nbytes <= 0:
            return 0.0
        return self.collective_cost(op, nbytes, group_size, link, per_node).seconds

    def collective_cost(self, op: str, nbytes: float, group_size: int, link: str,
                        per_node: int | None = None) -> CollectiveCost:
        """One call of `op` over `group_size` ranks on `link`, `per_node` of them on each node (None:
        the node's every rank), priced by hwprofile.collective_cost (the fit of the group's kind,
        the links it can use, NCCL's latency at its size), its seconds at this bound (the fit's
        rel_rms either way)."""
        try:
            cost = collective_cost(self.profile, op, nbytes, group_size, link, per_node)
        except KeyError as exc:
            have = ", ".join(self.profile.links) or "none"
            fix = ("calibrate across nodes: `echobench calibrate --comm` under torchrun on 2 or more nodes "
                   "(docs/reference/hardware-profiles.md), or give a profile of profiles/ that has an inter link"
                   if link == "inter" else "calibrate on this node: `echobench calibrate --comm --nproc N`")
            raise PredictError(f"{exc.args[0]}; link classes it has: {have}: {fix}") from None
        rms = cost.fit.rel_rms or 0.0
        return replace(cost, seconds=cost.seconds * {"mid": 1.0, "low": max(0.0, 1 - rms), "high": 1 + rms}[self.bound])


def bounded(mid: float, best: float | None, worst: float | None, bound: str) -> float:
    """The figure at `bound`: mid, else the best or worst measured (mid where there is none)."""
    if bound == "low":
        return best if best else mid
    if bound == "high":
        return worst if worst else mid
    return mid


def is_cpu(profile: HardwareProfile) -> bool:
    """Whether the profile's device is a CPU (hardware.device_name names one `CPU ...`): its host runs
    the kernels itself, so host time adds to the device's instead of hiding behind it."""
    return is_cpu_name(profile.device)


def is_cpu_name(device: str) -> bool:
    """is_cpu of a profile's device name."""
    return device.upper().startswith("CPU")


def device_type(profile_device: str) -> str:
    """The torch device type a run on the profile's device takes (cpu or cuda)."""
    return "cpu" if is_cpu_name(profile_device) else "cuda"


def priced(cfg: RunConfig, profile_device: str) -> RunConfig:
    """The run as it would run on the profile's device, its auto settings resolved (compile), as
    predict prices it: sequence parallelism as the same layout without it (its all-gathers and
    reduce-scatters move the bytes of the all-reduces they replace; the prediction's notes say so)."""
    device = device_type(profile_device)
    return replace(cfg, compile=cfg.compiled_on(device), sequence_parallel=False)


def compute_bytes(cfg: RunConfig, profile: HardwareProfile) -> int:
    """Bytes per element of the compute dtype: precision auto is the profile's dtype."""
    if cfg.precision == "auto":
        return 4 if profile.dtype == "float32" else 2
    return 4 if cfg.precision == "fp32" else 2


def profile_peak(profile: HardwareProfile) -> tuple[float, str] | None:
    """The datasheet entry of the profile's device, else the profile's best GEMM rate (calibrated);
    None without either."""
    if hit := table_peak(profile.device):
        return hit
    if profile.gemm:
        return max(p.tflops for p in profile.gemm), f"calibrated:{profile.dtype} GEMM (profile {profile.name})"
    return None


def run_peak(cfg: RunConfig, profile: HardwareProfile) -> tuple[float, str]:
    """The MFU denominator as the run would take it (hardware.resolve_peak's order): the run's
    peak_tflops (a flag, or the matrix's hardware.peak_tflops), else the datasheet entry of the
    profile's device, else the profile's best GEMM rate (calibrated)."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops, "flag"
    if hit := profile_peak(profile):
        return hit
    raise PredictError(f"no peak for {run_id(cfg)}: set peak_tflops (hardware.peak_tflops in the matrix) or give "
                       f"a profile with GEMM points")


def device_seconds(cfg: RunConfig, rates: Rates, eb: int) -> dict[str, float]:
    """The device's seconds of one step of an Echo run by phase and kind (no communication): its
    work (work.run_work) priced by work_seconds, attention at the kernel the run takes
    (attention_kernel; on a CPU the profile's own points, which measure the CPU's kernels), the
    element-wise bytes counted (elementwise.echo_elementwise);
    precision fp8 on a GPU: the float8 linears' GEMMs at the device's float8 rate and their casts'
    bytes (work.float8_work)."""
    mm, att = run_work(cfg)
    cpu = is_cpu(rates.profile)
    kernel = None if cpu else attention_kernel(cfg, rates.sdpa)
    (fwd, bwd), _ = echo_elementwise(cfg, eb)
    if cfg.precision == "fp8" and not cpu:  # float8 GEMMs at the device's float8 rate, and their casts
        mm, (cf, cb) = float8_work(mm, cfg.compile is True)
        fwd, bwd = fwd + cf, bwd + cb
    # A GPU's element-wise kernels at the point nearest a DiT activation's size. A CPU's at its largest
    # (DRAM) point whatever the tensors' size: in a traced tiny step (mb 4, 200 frames) they took
    # 17.7 ms for the 185 MB stepcount counts, 10.5 GB/s, not the cache-sized add's 91 GB/s (each op
    # writes a fresh allocation, which no cache holds; tools/trace_elementwise.py).
    tensor = None if cpu else cfg.micro_batch * cfg.audio_frames * cfg.model_config().width * eb
    mixes = None if cpu else {"dit_attention": dit_attention_mix(cfg, rates.sdpa), SPLIT_PART: {SPLIT_KERNEL: 1.0}}
    if (share := 0.0 if cpu else split_share(cfg)) > 0:
        att = split_attention(att, share)
        mf, mb = merge_bytes(cfg, eb)
        fwd, bwd = fwd + share * mf, bwd + share * mb
    return work_seconds(mm, att, (fwd, bwd), rank_params(cfg), rates, kernel, cfg.compile is True, tensor_bytes=tensor,
                        mixes=mixes)


def split_share(cfg: RunConfig) -> float:
    """The share of a GPU run's micro-batches whose DiT attends split (cfg_drop_attention split:
    components.merged_attention, two unmasked flash calls): those that drop a sample's conditioning
    (model.config.masked_share) in a run without padding, where split runs as set (the conditions of
    backends.torchtitan.cfg_drop_attention: torchtitan, SDPA's flash kernel not overridden by another
    pinned backend, bf16 or fp16, head_dim <= 256); 0 elsewhere."""
    if (cfg.cfg_drop_attention != "split" or cfg.framework != "torchtitan" or cfg.data != "synthetic"
            or cfg.sdpa_backend not in ("auto", "flash") or cfg.precision_on("cuda") == "fp32"
            or cfg.model_config().head_dim > 256):
        return 0.0
    return masked_share(cfg.micro_batch, cfg.model_config().cfg_dropout, cfg.cfg_drop)


SPLIT_PART = "dit_attention_split"  # the DiT's split calls, priced at SDPA's flash kernel whatever torch's choice
SPLIT_KERNEL = "flash2"  # merged_attention calls SDPA's flash kernel (FlashAttention-2) itself


def split_attention(att, share: float) -> tuple:
    """The work `att` with `share` of the DiT's attention as merged_attention runs it (SPLIT_PART):
    the latent queries over the latent keys, then over the conditioning keys (text and speaker, the
    rest of seq_k), two calls whose FLOPs sum to the joint call's."""
    out = []
    for a in att:
        if a.part != "dit_attention":
            out.append(a)
            continue
        cond = a.seq_k - a.seq_q
        out += [replace(a, flops=a.flops * (1 - share)),
                replace(a, part=SPLIT_PART, seq_k=a.seq_q, flops=a.flops * share * a.seq_q / a.seq_k),
                replace(a, part=SPLIT_PART, seq_k=cond, flops=a.flops * share * cond / a.seq_k)]
    return tuple(out)


def merge_bytes(cfg: RunConfig, eb: int) -> tuple[float, float]:
    """The element-wise bytes (forward, backward) of merged_attention's log-sum-exp merge in one
    micro-batch of one rank, over the DiT's layers: per layer, with O the output's elements (B x T x
    width) and L the log-sum-exp's (B x heads x T, fp32). Eager, its ATen ops one by one: each output
    cast to fp32 and scaled, the two summed and cast back, (3 eb + 40) O, and the log-sum-exp's fills,
    logaddexp and exps, 76 L; compiled, one fused kernel (assumed) reading both outputs and writing
    one, 3 eb O + 16 L. Backward sums the two query gradients, 3 eb O; AC full re-runs the forward."""
    m = cfg.model_config()
    o = cfg.micro_batch * cfg.audio_frames * m.width
    lse = cfg.micro_batch * m.heads * cfg.audio_frames
    fwd = (3 * eb * o + 16 * lse) if cfg.compile is True else ((3 * eb + 40) * o + 76 * lse)
    bwd = 3 * eb * o + (fwd if cfg.ac == "full" else 0)
    return fwd * m.layers, bwd * m.layers


def dit_attention_mix(cfg: RunConfig, chosen: str | None = None) -> dict[str, float]:
    """The kernels the DiT's attention takes and each one's share of its micro-batches: synthetic
    batches attend without a mask (attention_kernel) except where a sample drops its conditioning
    with cfg_drop mask (model.config.masked_share: 57% of micro-batches at micro-batch 8), which attend
    over a key mask (FlexAttention with key_masking flex or auto, else a masked SDPA) unless they run
    split (split_share: unmasked flash calls, split_attention); padded batches (shards) always do.
    `chosen`: the unmasked calls' kernel a record names (attention_kernel)."""
    kernel = attention_kernel(cfg, chosen)
    if cfg.data != "synthetic" or split_share(cfg) > 0:
        return {kernel: 1.0}
    masked = "flex" if cfg.key_masking in ("flex", "auto") else {"cudnn": "cudnn", "math": "math"}.get(
        cfg.sdpa_backend, "efficient")
    share = masked_share(cfg.micro_batch, cfg.model_config().cfg_dropout, cfg.cfg_drop)
    mix = {kernel: 1 - share}
    mix[masked] = mix.get(masked, 0.0) + share
    return {k: v for k, v in mix.items() if v > 0}


def elementwise_note(cfg: RunConfig, profile: HardwareProfile) -> str:
    """The prediction's note on how its element-wise bytes were had (elementwise.echo_elementwise)."""
    return echo_elementwise(cfg, compute_bytes(cfg, profile))[1]


# torch's SDPBackend names, as a record's sdpa_backends_predicted gives them, to the sdpa_backend setting
# that pins the same kernel; the profiles' kernel name follows from the setting (sdpa_kernel).
SDPA_SETTINGS = {"CUDNN_ATTENTION": "cudnn", "FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient",
                 "MATH": "math"}


def sdpa_kernel(setting: str) -> str:
    """The profiles' attention kernel (hwprofile.ATTENTION_KERNELS) an unmasked SDPA call runs under an
    sdpa_backend setting: SDPA's flash backend is FlashAttention-2, and torch's own choice (auto) puts
    it first (attention_kernel)."""
    return {"flash": "flash2", "auto": "flash2"}.get(setting, setting)


def attention_kernel(cfg: RunConfig, chosen: str | None = None) -> str | None:
    """The attention kernel an Echo run takes on a GPU, as the profiles' attention points name it
    (hwprofile.ATTENTION_KERNELS), from its settings (model.echo.attention_paths,
    model.components.attention): a batch with padded keys (data from shards, whose samples are
    shorter than the maxima) attends over a key mask: key_masking flex (auto on a GPU) runs
    FlexAttention, dense a masked SDPA, which torch serves with the memory-efficient kernel (cuDNN
    where sdpa_backend pins it; FlashAttention takes no mask). A batch without padding (synthetic
    data: every sample at the maxima) calls SDPA with no mask: its pinned backend, or torch's
    choice (auto), FlashAttention first in its priority (huggingface/transformers#48163: "picks its
    backend by a fixed priority that puts FlashAttention first"; cuDNN-first on H100 was reverted,
    pytorch/pytorch#128539). SDPA's flash backend is FlashAttention-2. The DiT's micro-batches whose
    samples drop their conditioning attend masked: dit_attention_mix prices that share apart. A
    measured run's unmasked calls are priced at the kernel its record names instead (`chosen`:
    measured.recorded_sdpa; torch 2.11 chose cuDNN on an H200); the split calls stay flash's
    (split_attention)."""
    if cfg.data != "synthetic":
        if cfg.key_masking in ("flex", "auto"):
            return "flex"
        return {"cudnn": "cudnn", "math": "math"}.get(cfg.sdpa_backend, "efficient")
    return chosen or sdpa_kernel(cfg.sdpa_backend)


def attention_notes(att, rates: Rates, kernel: str | None) -> list[str]:
    """A note per distinct attention of the work (head_dim, causality) whose kernel's points the
    profile lacks (devicerates.attention_points' fallback), naming what priced it instead."""
    notes = []
    for head_dim, causal in sorted({(a.head_dim, a.causal) for a in att}):
        points, _, why = attention_points(rates.profile, head_dim, causal, kernel)
        if why is None:
            continue
        wanted = f"{kernel or 'attention'} {'causal' if causal else 'non-causal'} head_dim {head_dim}"
        notes.append(f"no {wanted} points in the profile: priced at its {why}" if points else
                     f"no attention points in the profile: {wanted} at its score GEMM's rate")
    return notes


# A tiled attention kernel runs its forward faster than its forward + backward average, the rate a
# profile's attention point gives (echobench's count: backward 2x the forward). FlashAttention-3 and
# cuDNN on H100 run the forward at 1.29 .. 1.35 x that average at 4k .. 16k tokens (the FA3 paper's
# Fig. 5c / 6b, which the shipped points cite: cuDNN 609 / 451, 600 / 462, 595 / 460; FA3 638 / 485,
# 646 / 498, 648 / 500 TFLOP/s), more at shorter sequences (1.37 .. 1.69 at 512 .. 2k); the long
# sequences' 1.3 is taken for every tiled kernel. The forward, and a recompute's re-run of it, is
# priced at that multiple and the backward at the rate that keeps forward + backward at the point's,
# so a step that re-runs nothing is priced as the point says. Standard attention (`math`, unfused
# matmuls and softmax) runs its forward no faster (139 against 143 at 8k, same figures): no split.
FORWARD_OVER_MIX = 1.3
TILED_ATTENTION = frozenset({"flash2", "flash3", "cudnn", "triton", "flex", "efficient"})


def attention_phase_factor(kernel: str | None, phase: str) -> float:
    """The multiple of a point's forward + backward rate that `phase` of `kernel`'s attention runs
    at (FORWARD_OVER_MIX): forward and recompute faster, backward slower, 1 for untiled kernels."""
    if kernel not in TILED_ATTENTION:
        return 1.0
    return FORWARD_OVER_MIX if phase in ("forward", "recompute") else 2 / (3 - 1 / FORWARD_OVER_MIX)


def work_seconds(mm, att, elementwise: tuple[float, float], params: float, rates: Rates,
                 kernel: str | None = None, compiled: bool = False, kernels: tuple[float, float] = (0, 0),
                 tensor_bytes: float | None = None, mixes: dict | None = None) -> dict[str, float]:
    """The device's seconds of one step's work by phase and kind (no communication), whatever model
    it is of: GEMMs at the profile's rate of their precision and attention of `kernel` (its forward
    and backward apart: attention_phase_factor), the element-wise bytes (forward, backward) at its
    memory bandwidth (`compiled`: Triton's kernels), the optimizer's bytes of `params` parameters,
    and the device's idle gap (devicerates.kernel_gap) after each of `kernels` launches (forward,
    backward: `gap_forward`, `gap_backward`);
    `tensor_bytes`: the size of the element-wise ops' tensors (Rates.memory_gbps' nearest point);
    `mixes`: per attention part, the kernels its calls take and their shares (else all `kernel`)."""
    factor = rates.compute_factor
    out = dict.fromkeys(("gemm_forward", "gemm_backward", "attention_forward", "attention_backward"), 0.0)
    for w in mm:
        out[f"gemm_{'forward' if w.phase == 'forward' else 'backward'}"] += \
            w.flops / (rates.gemm_tflops(w.m, w.n, w.k, w.precision) * 1e12)
    for a in att:
        for k, share in (mixes or {}).get(a.part, {kernel: 1.0}).items():
            out[f"attention_{'forward' if a.phase == 'forward' else 'backward'}"] += \
                share * a.flops / (rates.attention_tflops(a.seq_q, a.seq_k, a.head_dim, a.causal, k) * 1e12
                                   * attention_phase_factor(k, a.phase))
    gbps = rates.memory_gbps("triton" if compiled else "add", tensor_bytes) * 1e9
    fwd, bwd = elementwise
    out["elementwise_forward"] = fwd / gbps
    out["elementwise_backward"] = bwd / gbps
    out = {key: seconds * factor for key, seconds in out.items()}
    gap = 0.0 if is_cpu(rates.profile) else kernel_gap(rates.profile).value
    out["gap_forward"], out["gap_backward"] = gap * kernels[0], gap * kernels[1]
    adamw = ADAMW_BYTES["foreach" if is_cpu(rates.profile) else "fused"]
    out["optimizer"] = params * (adamw / (rates.memory_gbps("adamw") * 1e9) + CLIP_BYTES / gbps)
    return out


def _rows(point) -> int:
    return point.micro_batch * point.audio_frames


def host_point(cfg: RunConfig, profile: HardwareProfile):
    """The profile's host point for the run's layout (its shortest step, where the host is most of
    it): megatron TP of any width, FSDP2 (for HSDP too), DDP, else single; None when the profile
    has none."""
    kind = ("megatron", None) if cfg.framework == "megatron" and cfg.tp > 1 else \
        ("torchtitan", cfg.layout.within_node.name)
    points = sorted(profile.host_steps, key=_rows)
    for p in points:
        if p.framework == kind[0] and (kind[1] is None or p.parallelism == kind[1]):
            return p
    return next((p for p in points if p.parallelism == "single"), None)


def point_run(point, profile: HardwareProfile) -> RunConfig:
    """The RunConfig of a host point's steps."""
    nodes = max(1, point.processes // (profile.gpus_per_node or point.processes))
    return RunConfig(scale=point.scale, micro_batch=point.micro_batch, audio_frames=point.audio_frames,
                     text_tokens=point.text_tokens, speaker_frames=point.speaker_frames, framework=point.framework,
                     parallelism=point.parallelism, nodes=nodes, gpus_per_node=point.processes // nodes)


def in_step_note(profile: HardwareProfile, fit: InStepFit | None = None) -> str | None:
    """The prediction's note on what is fitted in its compute (None: nothing): the GPU family's
    in-step clock fitted to published runs (devicerates.in_step_clock), and an in_step factor
    `echobench tune` fitted to the runs it measured."""
    notes = []
    clock = in_step_clock(profile, fit)
    if clock.value != 1:
        notes.append(f"GEMM and attention at {clock.value:.3g} x the isolated kernels' rate: {clock.source}")
    elif fit is not None and fit.no_clock and not profile.measured and gpu_family(profile.device):
        notes.append(f"GEMM and attention at the isolated kernels' rate: {clock.source}")
    if profile.in_step is not None:
        notes.append(f"GEMM, attention and element-wise time x {profile.in_step.factor:.3g}"
                     + f": the profile's in_step factor, FITTED by `echobench tune` to {len(profile.in_step.fitted_on)} "
                       "measured runs (its source says how)")
    return "; ".join(notes) or None


def in_situ_factor(rates: Rates) -> float:
    """The factor on a step's GEMM, attention and element-wise time beyond the physical rates: the
    profile's `in_step`, which only `echobench tune` fits (to the runs it measured); 1 otherwise. A
    CPU's kernels inside a step are priced as measured: the element-wise bytes counted at the DRAM
    add's bandwidth (device_seconds), the host's cost per op from its host points; no factor is
    fitted to the host steps (one that was took the model's error on the reference step for a
    property of the CPU)."""
    return rates.profile.in_step.factor if rates.profile.in_step else 1.0
