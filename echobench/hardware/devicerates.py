"""What a device does at each kind of work, from its hardware profile (echobench.hardware.profile): the
physical rates echobench's performance models price a step with, each a plain function returning
its value and where it comes from (Rate). One place for them: `echobench predict` (predict.pricing)
and `stepcount`'s projection both call these, with or without a run.

- peak(profile, precision): the dense tensor-core peak of the datasheet (TFLOP/s);
- sustained_clock(profile): the clock the device holds through a training step under its power
  limit, as a ratio to the clock its GEMM points were measured at: the profile's `clock` (another
  power limit than the points' device: 1 where none) x in_step_clock, the share of an isolated
  GEMM loop's clock a GPU family holds while the whole step (HBM, NVLink, NCCL and the tensor cores
  at once) draws on its power budget: FITTED to published runs (validation/fit.json names them;
  `validate published` refits it leaving each source out), no measurement of it published; a run
  on one GPU is outside the fit's rows (8 to 6144 GPUs) and priced without it (run_fit);
- gemm(profile, m, n, k, precision): an (m, n, k) GEMM's rate: the profile's best point of that
  precision (bf16, or fp8 at the device's float8 rate) scaled by the shape model (tile and wave
  quantization over the SMs, a k-loop cost per tile and a launch cost per GEMM: gemm_model_tflops),
  x the sustained clock;
- attention(profile, seq_q, seq_k, head_dim, causal, kernel): forward + backward attention at those
  lengths, of that kernel (FlashAttention-2 / -3, cuDNN, SDPA's memory-efficient or math path,
  FlexAttention, FlashAttention's Triton port), FLOPs as echobench.model.flops counts them (every score),
  x the sustained clock;
- memory_bandwidth(profile, compiled): the achievable bandwidth of memory-bound work: eager ATen
  element-wise kernels (the profile's `add`), or Triton's generated ones under torch.compile (its
  `triton` figure where measured, else the `add` one: a fused kernel streams its inputs and outputs
  as an add does; what fusion saves is bytes, which the work lists count);
- optimizer_bandwidth(profile): AdamW's step as a bandwidth (`adamw`, else `add`);
- kernel_gap(profile): the device's idle time per kernel launched back to back.

Every figure names its source (the profile's `source` strings); `low` / `high` give the plausible
range where the profile gives one (a measured spread, an assumed clock range)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from echobench.hardware.profile import ATTENTION_KERNELS, AttentionPoint, GemmPoint, HardwareProfile, memory_gbps
from echobench.records.peaks import table_peak

PRECISION_DTYPES = {"bf16": ("bfloat16", "float16", "float32"), "fp8": ("float8_e4m3fn", "float8_e5m2", "float8")}
# GPU families that share an SM design and power behaviour: the in-step clock is fitted per family.
GPU_FAMILIES = {"hopper": ("GH200", "H200", "H100", "H800"), "ampere": ("A100", "A800")}
FIT_FILE = Path(__file__).resolve().parents[2] / "validation" / "fit.json"  # a source checkout's committed fit


@dataclass(frozen=True)
class Rate:
    """A device rate: `value` in `unit`, its `source`, `assumed` where no measurement or datasheet
    gives it, and the plausible range `low` .. `high` (None: the value)."""

    value: float
    unit: str
    source: str
    assumed: bool = False
    low: float | None = None
    high: float | None = None

    @property
    def range(self) -> tuple[float, float]:
        return (self.value if self.low is None else self.low, self.value if self.high is None else self.high)


def peak(profile: HardwareProfile, precision: str = "bf16") -> Rate:
    """The dense tensor-core peak of the profile's device at `precision` (the datasheet table, else
    the profile's best GEMM point of that precision, calibrated); KeyError without either."""
    if hit := table_peak(profile.device, precision):
        return Rate(hit[0], "TFLOP/s", hit[1])
    points = gemm_points(profile, precision)
    if points:
        return Rate(max(p.tflops for p in points), "TFLOP/s", f"calibrated: the best {precision} GEMM of profile {profile.name}")
    raise KeyError(f"profile {profile.name!r}: no {precision} peak (not in the datasheet table, no {precision} GEMM points)")


@dataclass(frozen=True)
class InStepFit:
    """The fitted in-step clock per GPU family (in_step_clock), the rows it was fitted on and how."""

    clock: dict = field(default_factory=dict)  # family -> ratio
    fitted_on: tuple = ()
    source: str = ""
    no_clock: str = ""  # why a fit that holds no clock prices none (run_fit's one GPU)


# The fit's domain is its rows': 8 to 6144 GPUs, each sharing its SMs, HBM and power with the collectives
# it overlaps. A run on one GPU is outside it, and echobench's own H200 records say the isolated rate
# holds there: the profiled 3B compiled step spent 0.123 s in GEMMs, priced 0.132 s at the isolated
# rate and 0.184 s at the fitted 0.715; two dense decoders ran at 52-61% MFU, which 0.715 cannot reach.
ONE_GPU = ("one GPU, outside the fit's 8 to 6144-GPU rows; on one H200 echobench measured GEMMs at their "
           "isolated rate (reports/h200-2026-12-04.md)")


def run_fit(gpus: int | None, fit: InStepFit | None = None) -> InStepFit:
    """The in-step clock a run on `gpus` GPUs is priced with: `fit`'s (None: the committed one); on one
    GPU none (ONE_GPU: the fit's rows are all multi-GPU, and one GPU measured the isolated rate)."""
    fit = committed_fit() if fit is None else fit
    return InStepFit({}, fit.fitted_on, fit.source, ONE_GPU) if gpus == 1 else fit


def gpu_family(device: str) -> str | None:
    """The GPU_FAMILIES entry whose name is a word of the device name (None: a CPU, another GPU)."""
    for fam, names in GPU_FAMILIES.items():
        if any(re.search(rf"(?<![A-Za-z0-9]){n}(?![A-Za-z0-9])", device, re.IGNORECASE) for n in names):
            return fam
    return None


@lru_cache(maxsize=4)
def committed_fit(path: Path = FIT_FILE) -> InStepFit:
    """The fit `echobench validate published --write-fit` committed (an empty fit where the file is
    not there: an installed echobench without its validation/)."""
    if not path.is_file():
        return InStepFit(source=f"no {path.name}: no in-step clock fitted")
    data = json.loads(path.read_text())
    return InStepFit(dict(data["clock"]), tuple(data["fitted_on"]), data["source"])


def in_step_clock(profile: HardwareProfile, fit: InStepFit | None = None) -> Rate:
    """The share of its isolated GEMM loop's clock the profile's GPU family holds in a training step
    (module docstring): `fit`'s (None: the committed fit's); 1 for a CPU, a GPU of another family,
    or a profile `echobench calibrate` measured (its points are the machine's own)."""
    fit = committed_fit() if fit is None else fit
    fam = gpu_family(profile.device)
    if profile.measured or fam is None or fam not in fit.clock:
        why = "a measured profile" if profile.measured else fit.no_clock or f"no fitted {fam or 'family'} clock"
        return Rate(1.0, "ratio", f"no in-step clock ({why})")
    return Rate(fit.clock[fam], "ratio", f"FITTED in-step clock of the {fam} family, {fit.clock[fam]:.3g}: "
                                         f"{fit.source} ({len(fit.fitted_on)} rows)")


def sustained_clock(profile: HardwareProfile, fit: InStepFit | None = None) -> Rate:
    """The clock the device holds through a training step, as a ratio to its GEMM points': the
    profile's `clock` (1 without one) x in_step_clock (`fit`; None: the committed one)."""
    step = in_step_clock(profile, fit)
    c = profile.clock
    if c is None:
        return Rate(step.value, "ratio", step.source, low=step.value, high=step.value)
    return Rate(c.ratio * step.value, "ratio", f"{c.source}; x {step.source}", assumed="assumed" in c.source.lower(),
                low=(c.low or c.ratio) * step.value, high=(c.high or c.ratio) * step.value)


def gemm_points(profile: HardwareProfile, precision: str = "bf16") -> list[GemmPoint]:
    """The profile's GEMM points of `precision` (bf16: its own dtype's; fp8: float8 operands)."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"unknown precision {precision!r}: one of {', '.join(PRECISION_DTYPES)}")
    return [p for p in profile.gemm if (p.dtype or profile.dtype) in PRECISION_DTYPES[precision]]


def gemm(profile: HardwareProfile, m: int, n: int, k: int, precision: str = "bf16",
         fit: InStepFit | None = None) -> Rate:
    """TFLOP/s of an (m, n, k) GEMM at `precision` (gemm_rate's point and shape factor) x the
    sustained clock; KeyError where the profile has no GEMM point of that precision."""
    point, factor = gemm_rate(profile, m, n, k, precision)
    clock = sustained_clock(profile, fit)
    lo, hi = clock.range
    shape = "" if factor == 1 else f"; x {factor:.3f}: the shape model (tile and wave quantization over " \
                                   f"{profile.sm_count} SMs) at {m}x{n}x{k} / at the point's shape"
    return Rate(point.tflops * factor * clock.value, "TFLOP/s",
                f"{point.source}{shape}" + ("" if clock.value == 1 else f"; x {clock.value:.3g} sustained clock ({clock.source})"),
                assumed=clock.assumed, low=point.tflops * factor * lo, high=point.tflops * factor * hi)


def attention(profile: HardwareProfile, seq_q: int, seq_k: int, head_dim: int, causal: bool = False,
              kernel: str | None = None, fit: InStepFit | None = None) -> Rate:
    """Forward + backward attention TFLOP/s (echobench's count: every score, backward 2x forward) of
    `kernel` at seq_q x seq_k (attention_points' points, or the fallback it names) x the sustained
    clock; without attention points, the score GEMM's rate (seq_q x seq_k x head_dim)."""
    points, factor, why = attention_points(profile, head_dim, causal, kernel)
    clock = sustained_clock(profile, fit)
    if not points:
        g = gemm(profile, seq_q, seq_k, head_dim, fit=fit)
        return Rate(g.value, "TFLOP/s", f"no attention points: the score GEMM's rate ({g.source})", assumed=True,
                    low=g.low, high=g.high)
    rate = factor * interpolate_attention(points, seq_q, seq_k)
    lo, hi = clock.range
    source = points[0].source + ("" if why is None else f" (standing in: {why})") + \
        ("" if clock.value == 1 else f"; x {clock.value:.3g} sustained clock ({clock.source})")
    return Rate(rate * clock.value, "TFLOP/s", source, assumed=why is not None or clock.assumed,
                low=rate * lo, high=rate * hi)


def memory_bandwidth(profile: HardwareProfile, compiled: bool = False) -> Rate:
    """GB/s of memory-bound work: eager ATen element-wise kernels at the profile's `add` figure;
    compiled (Triton's fused kernels) at its `triton` figure where it has one, else its `add` (a
    fused kernel streams its operands as an add does; fusion saves bytes, not bandwidth). KeyError
    without memory figures."""
    op = "triton" if compiled and any(p.op == "triton" for p in profile.memory) else "add"
    point = _memory_point(profile, op)
    source = point.source if op == "triton" or not compiled else \
        f"{point.source}; Triton's fused kernels taken at the add kernel's bandwidth (none measured apart)"
    return Rate(memory_gbps(profile, op), "GB/s", source, assumed=source.startswith("assumed") or compiled and op != "triton",
                low=point.gbps_min, high=point.gbps_max)


def optimizer_bandwidth(profile: HardwareProfile) -> Rate:
    """AdamW's step as a bandwidth (GB/s of its bytes): the profile's measured `adamw` figure, else `add`."""
    op = "adamw" if any(p.op == "adamw" for p in profile.memory) else "add"
    point = _memory_point(profile, op)
    return Rate(point.gbps, "GB/s", point.source, assumed=point.source.startswith("assumed"))


def kernel_gap(profile: HardwareProfile) -> Rate:
    """Seconds the device idles per kernel launched back to back (profile `kernel_gap`; 0 without)."""
    if profile.kernel_gap is None:
        return Rate(0.0, "s", f"profile {profile.name}: no kernel gap given (0)", assumed=True)
    return Rate(profile.kernel_gap.seconds, "s", profile.kernel_gap.source,
                assumed=profile.kernel_gap.source.startswith("assumed"))


def _memory_point(profile: HardwareProfile, op: str):
    if not profile.memory:
        raise KeyError(f"profile {profile.name!r} has no memory bandwidth")
    same = [p for p in profile.memory if p.op == op] or profile.memory
    return max(same, key=lambda p: p.nbytes or 0)


# ---- the GEMM shape model and the attention points ----

# Output tiles (rows x columns of C per thread block) the GEMM shape model lets cuBLAS choose from
# on Hopper: CUTLASS's sm90 warp-specialized kernels and cuBLAS's sm90 kernels are built on
# 128x256, 256x128 and 128x128 tiles (a 128x256 tile is ml-engineering's Hopper example of wave
# quantization, sources in gemm_efficiency). Each is taken at the same per-SM rate (assumed).
GEMM_TILES: tuple[tuple[int, int], ...] = ((128, 256), (256, 128), (128, 128))
SPLIT_K_MIN = 512  # a split-K slice keeps at least this much of k (assumed): split-K never cuts k finer
SHAPE_NEAR = math.log(1.1)  # a point within 10% of a shape in every dimension (log distance) stands for it
# FITTED (gemm_model_tflops): the rate scale, the k each tile's prologue and epilogue cost, and a fixed
# time per GEMM, fitted (least mean |log error|, grid search) to every second row, in sorted (m, n, k)
# order, of the bf16 b = 1 rows of at least 2^31 FLOPs (1024^3 and up: training's GEMMs are larger) of
# OpenXLA's measured H100 (sm_90) matmul table (github.com/tensorflow/tensorflow, third_party/xla/xla/
# service/gpu/model/matmul_interpolator_data.h at 372d578bb861cc5804e56d37d93aec931a59762c; m, n, k
# 256 .. 4096); on the other 36 rows, not used to fit: mean |log error| 5.9%, max 18%; on the smaller
# GEMMs (launch-bound, outside the fit) 31% (tests/test_compute_pricing.py holds them; tools/fit_gemm_model.py
# reproduces the fit).
GEMM_FIT = {"tflops": 900.0, "k0": 30.0, "t0_s": 7.5e-6}


def _log_distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return math.sqrt(sum(math.log(x / y) ** 2 for x, y in zip(a, b)))


def gemm_point(profile: HardwareProfile, m: int, n: int, k: int, precision: str = "bf16") -> GemmPoint:
    """The measured shape that stands for (m, n, k): the same shape if measured, else the nearest in
    log space (Euclidean distance of (log m, log n, log k)). Nearest, not interpolated: GEMM rates
    jump with tile and wave quantisation, so a blend of two unrelated shapes is no better a guess
    than the closest one, and the profile's points are the model's own shapes (calibrate times
    every linear of the run, forward and backward) where it was calibrated for the run. Points of
    `precision` only (gemm_points)."""
    points = gemm_points(profile, precision)
    if not points:
        raise KeyError(f"profile {profile.name!r} has no {'' if precision == 'bf16' else precision + ' '}GEMM points")
    return min(points, key=lambda p: _log_distance((p.m, p.n, p.k), (m, n, k)))


def gemm_efficiency(m: int, n: int, k: int, sm_count: int) -> float:
    """The share of the device's tensor-core time an (m, n, k) GEMM's useful work fills, under
    tile and wave quantization: C = ceil(m/Tm) ceil(n/Tn) output tiles (padded to whole tiles)
    run in ceil(C/S) waves of S = sm_count thread blocks, a wave costing the same full or not
    (NVIDIA's "Matrix Multiplication Background" user guide, docs.nvidia.com/deeplearning/
    performance/dl-performance-matrix-multiplication; ml-engineering training/performance "Tile and
    wave quantization", 132 SMs on H100 / H200, a 128 x 256 tile). A shape of fewer tiles than
    SMs may split k (split-K) into as many slices as fill the SMs, each at least SPLIT_K_MIN long.
    The best of GEMM_TILES (the library picks its kernel per shape). 1.0: every SM busy on useful
    work for the whole GEMM (gemm_model_tflops adds the k-loop's and the launch's fixed costs)."""
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        split = max(1, min(sm_count // tiles, k // SPLIT_K_MIN)) if tiles < sm_count else 1
        waves = math.ceil(tiles * split / sm_count)
        best = max(best, m * n * split / (waves * sm_count * tm * tn))
    return min(best, 1.0)


def gemm_model_tflops(m: int, n: int, k: int, sm_count: int, speed: float = 1.0) -> float:
    """The shape model's TFLOP/s of an (m, n, k) GEMM: time = 2mnk / (GEMM_FIT rate x speed x
    gemm_efficiency) x (1 + k0 / k) + t0, the k-loop's fixed cost per tile and a fixed cost per GEMM
    (launch and tail) on top of tile and wave quantization; its constants are fitted (GEMM_FIT).
    `speed`: the tensor cores' rate over bf16's (2 for float8: the same tiles twice as fast, so the
    fixed costs weigh twice as much)."""
    flops = 2 * m * n * k
    busy = flops / (GEMM_FIT["tflops"] * speed * 1e12 * gemm_efficiency(m, n, k, sm_count)) * (1 + GEMM_FIT["k0"] / k)
    return flops / (busy + GEMM_FIT["t0_s"]) / 1e12


def gemm_rate(profile: HardwareProfile, m: int, n: int, k: int, precision: str = "bf16") -> tuple[GemmPoint, float]:
    """The point whose figures price an (m, n, k) GEMM and the factor on them. A point within
    SHAPE_NEAR of the shape (a calibration measures the run's own shapes), or a profile without
    sm_count: gemm_point's, factor 1. Else (a shipped profile's one best-shape point): the best
    point, scaled by the shape's gemm_model_tflops over the best shape's, at most 1 (the best
    shape's rate is the most the device was seen to reach). Not modelled: operands whose k or n is
    not a multiple of 8 elements (16 bytes), which cuBLAS serves with slower kernels. `precision`
    fp8: the float8 points, the shape model at twice bf16's tensor-core speed."""
    point = gemm_point(profile, m, n, k, precision)
    if profile.sm_count is None or _log_distance((point.m, point.n, point.k), (m, n, k)) <= SHAPE_NEAR:
        return point, 1.0
    best = max(gemm_points(profile, precision), key=lambda p: p.tflops)
    speed = 2.0 if precision == "fp8" else 1.0
    shape = gemm_model_tflops(m, n, k, profile.sm_count, speed)
    return best, min(1.0, shape / gemm_model_tflops(best.m, best.n, best.k, profile.sm_count, speed))


def gemm_tflops(profile: HardwareProfile, m: int, n: int, k: int, precision: str = "bf16") -> float:
    """TFLOP/s of an (m, n, k) GEMM (gemm_rate), the points as measured (no clock term)."""
    point, factor = gemm_rate(profile, m, n, k, precision)
    return point.tflops * factor


# Which other kernel's points stand for a kernel the profile lacks, in this order: FlashAttention-2
# first (SDPA's default on Hopper), then cuDNN, FA3, FlexAttention, the memory-efficient kernel, math,
# FlashAttention's Triton port.
FALLBACK_KERNELS: tuple[str, ...] = ("flash2", "cudnn", "flash3", "flex", "efficient", "math", "triton")


def attention_points(profile: HardwareProfile, head_dim: int | None, causal: bool = False,
                     kernel: str | None = None) -> tuple[list[AttentionPoint], float, str | None]:
    """The attention points that stand for `kernel` at this causality, the factor on their rates,
    and what stood in (None: the kernel's own points, or unlabelled ones where no kernel was asked).
    Order: the kernel's points at this causality; unlabelled points (a calibration's measurement
    of the run's own path); the kernel's, then unlabelled, points of the other causality, x2 for a
    causal run from non-causal points (a causal kernel computes about half the scores echobench
    counts) and x0.5 the other way (assumed: a causal kernel's own rate is 0.6-0.97x the
    non-causal one, fa3-paper); then FALLBACK_KERNELS' in order, the same way. Points of this
    head_dim where there are any, else of the nearest head_dim (said too). ([], 1, why) when there
    are none."""
    if kernel is not None and kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: one of {', '.join(ATTENTION_KERNELS)}")
    order = [kernel, None] if kernel else [None]
    order += [k for k in FALLBACK_KERNELS if k not in order]
    tries = [(k, causal) for k in order[:2]] + [(k, not causal) for k in order[:2]]
    tries += [(k, c) for k in order[2:] for c in (causal, not causal)]
    for k, c in tries:
        same = [p for p in profile.attention if p.kernel == k and p.causal == c]
        if not same:
            continue
        near = head_dim
        if head_dim is not None:
            near = min({p.head_dim for p in same}, key=lambda d: abs(math.log(d / head_dim)))
            same = [p for p in same if p.head_dim == near]
        factor = 1.0 if c == causal else (2.0 if causal else 0.5)
        exact = (k == kernel or (kernel is None and k is None)) and c == causal and near == head_dim
        why = None if exact else \
            (f"{k or 'unlabelled'} {'causal' if c else 'non-causal'} points"
             + (f" at head_dim {near}" if near != head_dim else "")
             + (f" x{factor:g}" if factor != 1 else "")
             + ("" if k else " (a calibration's: the kernel SDPA chose there)"))
        return same, factor, why
    return [], 1.0, f"profile {profile.name!r} has no attention points"


def attention_tflops(profile: HardwareProfile, seq_q: int, seq_k: int, head_dim: int | None = None,
                     causal: bool = False, kernel: str | None = None) -> float:
    """Attention forward + backward TFLOP/s at seq_q queries x seq_k keys, of `kernel` at this
    causality (attention_points): piecewise linear in log(seq_q * seq_k) (the score matrix's size,
    which the kernel's efficiency follows) between the points, the nearest point's rate outside
    their range. Heads and batch of the points are not matched: calibrate measures at the run's own."""
    points, factor, _ = attention_points(profile, head_dim, causal, kernel)
    if not points:
        raise KeyError(f"profile {profile.name!r} has no attention points")
    return factor * interpolate_attention(points, seq_q, seq_k)


def interpolate_attention(points: list[AttentionPoint], seq_q: int, seq_k: int) -> float:
    """The points' rate at seq_q x seq_k, piecewise linear in log(seq_q * seq_k)."""
    pts = sorted(((math.log(p.seq_q * p.seq_k), p.tflops) for p in points))
    x = math.log(seq_q * seq_k)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")
