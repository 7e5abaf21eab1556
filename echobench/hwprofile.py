"""Hardware profiles: what one device and its links can do, the measurements a performance model
(echobench predict) reads. One typed, versioned YAML file per machine kind, every number with
its source.

A profile holds, for one device and compute dtype:
- gemm: the GEMM rate (TFLOP/s) at shapes (m, n, k), nn.Linear's x @ W^T of m rows, k input and
  n output features; gemm_tflops() looks a shape up;
- sm_count: the device's SMs, where given: gemm_tflops() then models a shape no point stands for
  (tile and wave quantization, gemm_efficiency) from the best measured or published rate;
- attention: the attention rate (TFLOP/s, forward + backward, FLOPs under echobench.flops'
  convention) at sequence lengths, per kernel (ATTENTION_KERNELS) and causality;
  attention_tflops() looks lengths up, attention_points() says which points stand for a kernel;
- memory: element-wise memory bandwidth (GB/s of bytes read + written); memory_gbps();
- host_op: the host's cost per dispatched op where no host step was measured (assumed, with its
  source);
- in_step: how much longer a GPU's kernels take inside a training step than alone, a factor fitted
  to published runs (scripts/fit_in_step_factor.py), named as fitted;
- host_steps: what a tiny training step of each layout costs the host per dispatched op (Python,
  dispatch, autograd, hooks, kernel launch), where measured;
- links: per link class ("intra" within a node, "inter" across nodes) and per collective
  (all_reduce, all_gather, reduce_scatter) an alpha-beta fit, latency alpha_s and bus bandwidth
  bus_gbps, with the raw points it was fitted to and the kind of group it was taken on (group_size,
  per_node); link_kinds: fits of further kinds (calibrate fits one-rank-per-node groups apart);
  topology: the node's NICs and whether its NVLink is switched or pairwise; collective_cost() is a
  call's time on a group of any size and kind (the collective cost model below);
- where and when: versions, date, host, and `measured` (False for the shipped profiles in
  profiles/, gathered from datasheets and public measurements, not measured by echobench).

Collective sizes follow nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): a message
of `nbytes` is the all-reduce buffer, the all-gather OUTPUT and the reduce-scatter INPUT; its bus
bytes are 2(n-1)/n x nbytes for all-reduce and (n-1)/n x nbytes for all-gather and reduce-scatter
on n ranks, so that one bus bandwidth describes a link whatever n.

Loading refuses a file of another schema_version with one line naming it and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echobench import nccltuning as nt
from echobench.atomic import write_text_atomic
from echobench.yamltext import read_yaml

PROFILE_SCHEMA_VERSION = 1
Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
Link = Literal["intra", "inter"]
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
LINKS: tuple[str, ...] = ("intra", "inter")
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"  # the shipped profiles (a source checkout)
# Attention kernels as profiles name them: FlashAttention-2 (torch SDPA's flash backend), -3, cuDNN's
# fused attention, SDPA's memory-efficient kernel (xformers' cutlass kernels), FlexAttention
# (compiled, Triton), and SDPA's math path (matmul + softmax + matmul).
AttentionKernel = Literal["flash2", "flash3", "cudnn", "efficient", "flex", "math"]
ATTENTION_KERNELS: tuple[str, ...] = ("flash2", "flash3", "cudnn", "efficient", "flex", "math")


class ProfileError(ValueError):
    """A profile file that cannot be read as this echobench's hardware profile (one line)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GemmPoint(_Strict):
    """The rate of one GEMM shape: x (m, k) @ W^T (k, n), 2 m n k FLOPs."""

    m: int = Field(gt=0)
    n: int = Field(gt=0)
    k: int = Field(gt=0)
    tflops: float = Field(gt=0)  # the median (or the published figure)
    tflops_min: Optional[float] = None
    tflops_max: Optional[float] = None
    iters: Optional[int] = None  # timed matmuls (measured points)
    name: str = ""
    source: str


class AttentionPoint(_Strict):
    """Attention forward + backward at one shape: batch x heads, seq_q queries against seq_k keys
    of head_dim; tflops counts echobench.flops' FLOPs (forward 4 seq_q seq_k head_dim per head,
    backward 2x the forward)."""

    batch: int = Field(gt=0)
    heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    seq_q: int = Field(gt=0)
    seq_k: int = Field(gt=0)
    causal: bool = False
    kernel: Optional[AttentionKernel] = None  # None: whichever the measurement ran (calibrate: the run's own)
    tflops: float = Field(gt=0)
    tflops_min: Optional[float] = None
    tflops_max: Optional[float] = None
    iters: Optional[int] = None
    name: str = ""
    source: str


class MemoryPoint(_Strict):
    """Element-wise bandwidth: `op` over tensors of `nbytes` each; gbps counts bytes read + written
    (add: 2 read + 1 written, copy: 1 + 1) per second / 1e9."""

    op: str  # add, copy (measured), or datasheet (the vendor's peak memory bandwidth)
    nbytes: Optional[int] = Field(default=None, gt=0)  # per tensor (None: a datasheet figure)
    gbps: float = Field(gt=0)
    gbps_min: Optional[float] = None
    gbps_max: Optional[float] = None
    iters: Optional[int] = None
    source: str


class HostPoint(_Strict):
    """The host's side of a training step: steps of the `scale` preset in one layout (framework,
    parallelism, over `processes` ranks) at micro_batch x the lengths (the shortest, so that the
    device work is negligible), timed (median of `iters` steps, the slowest rank's), and the ATen
    ops one rank dispatches per step (counted once under a dispatch mode, views included).
    echobench.predict takes the layout's host cost per op from it: (step_s - the step's predicted
    device and communication time) / ops."""

    framework: str = "torchtitan"
    parallelism: str = "single"
    processes: int = Field(1, gt=0)
    scale: str
    micro_batch: int = Field(gt=0)
    audio_frames: int = Field(gt=0)
    text_tokens: int = Field(gt=0)
    speaker_frames: int = Field(gt=0)
    ops: int = Field(gt=0)
    step_s: float = Field(gt=0)
    step_s_min: Optional[float] = None
    step_s_max: Optional[float] = None
    iters: Optional[int] = None
    source: str


class HostOpCost(_Strict):
    """The host's seconds per dispatched ATen op (Python, dispatch, autograd, kernel launch) where
    the profile has no measured host step: `source` says where it comes from (or that it is assumed)."""

    seconds: float = Field(gt=0)
    source: str


class InStepFactor(_Strict):
    """How much longer a GPU's GEMMs, attention and element-wise kernels take inside a training step
    than the profile's isolated rates say (clocks under a whole step's power draw, NCCL's kernels
    sharing the SMs, gaps between kernels): a factor FITTED to published training runs, not
    measured; `fitted_on` names the rows it was fitted to, `source` how (and its error on the others)."""

    factor: float = Field(ge=1 / 3, le=3)
    fitted_on: list[str] = []
    source: str


class CommPoint(_Strict):
    """One timed collective: a message of nbytes (nccl-tests' size) over group_size ranks, per_node
    of them on each node (None: not recorded, a profile of before per_node)."""

    nbytes: int = Field(gt=0)
    group_size: int = Field(ge=2)
    seconds: float = Field(gt=0)  # median over the repeats, each the mean of back-to-back calls
    seconds_min: Optional[float] = None
    seconds_max: Optional[float] = None
    iters: Optional[int] = None
    per_node: Optional[int] = Field(None, ge=1)


class AlphaBeta(_Strict):
    """time = alpha_s + bus_bytes / (bus_gbps * 1e9), fitted to `points` (or taken from `source`),
    on groups of `group_size` ranks, `per_node` of them on each node (the kind of group: calibrate
    fits one rank per node apart from every rank of the nodes). None: not recorded (then the
    points' largest group, and for an inter-node fit the node's every rank)."""

    alpha_s: float = Field(ge=0)
    bus_gbps: float = Field(gt=0)
    rel_rms: Optional[float] = None  # root mean square of the fit's relative residuals over the points
    source: str
    group_size: Optional[int] = Field(None, ge=2)
    per_node: Optional[int] = Field(None, ge=1)
    points: list[CommPoint] = []


class Topology(_Strict):
    """How a node's GPUs reach each other and the network, for pricing a group by the links it can
    use: `nics_per_node` network interfaces NCCL drives (one per GPU on HGX H100/H200 and GH200 quad
    nodes); `nvlink` "switch" (NVSwitch: any group of a node's GPUs gets each GPU's whole NVLink
    bandwidth) or "direct" (GPUs wired pairwise, each pair its own links: a group of k of a node's
    g GPUs uses k - 1 of each GPU's g - 1 peers' links)."""

    nics_per_node: Optional[int] = Field(None, ge=1)
    nvlink: Literal["switch", "direct"] = "switch"
    source: str


class HardwareProfile(_Strict):
    schema_version: int = PROFILE_SCHEMA_VERSION
    name: str
    device: str  # as torch names it (torch.cuda.get_device_name, hardware.device_name)
    dtype: str  # the GEMM / attention dtype: bfloat16, float32
    measured: bool  # True: `echobench calibrate --comm` measured it; False: datasheets and published figures
    note: str = ""
    backend: Optional[str] = None  # the collectives' process-group backend (nccl, gloo)
    gpus_per_node: Optional[int] = Field(None, ge=1)
    sm_count: Optional[int] = Field(None, ge=1)  # streaming multiprocessors: the GEMM shape model's wave size
    gemm: list[GemmPoint] = []
    attention: list[AttentionPoint] = []
    memory: list[MemoryPoint] = []
    host_steps: list[HostPoint] = []  # the host's cost per op of a step, per layout (calibrate --comm)
    host_op: Optional[HostOpCost] = None  # the cost per op where host_steps has no point for the run
    in_step: Optional[InStepFactor] = None  # a GPU's kernels inside a step vs alone (fitted; None: 1)
    links: dict[Link, dict[Op, AlphaBeta]] = {}
    link_kinds: dict[Link, dict[Op, list[AlphaBeta]]] = {}  # fits of further kinds of group (ranks per node)
    topology: Optional[Topology] = None  # NICs per node, NVLink switch or pairwise (None: price as measured)
    link_notes: dict[Link, str] = {}  # what each link class is (NVLink via NVSwitch, Slingshot-11, ...)
    versions: dict[str, Optional[str]] = {}  # torch, echobench git commit, nccl, cuda
    date: str
    host: Optional[str] = None
    sources: dict[str, str] = {}  # short names -> URLs the `source` strings refer to


# ---- the collective cost model ----

def bus_factor(op: str, group_size: int) -> float:
    """nccl-tests' bus bytes per message byte: 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}: one of {', '.join(OPS)}")
    if group_size < 1:
        raise ValueError(f"group_size {group_size}: must be >= 1")
    share = (group_size - 1) / group_size
    return 2 * share if op == "all_reduce" else share


@dataclass(frozen=True)
class CollectiveCost:
    """One call priced: `seconds` = alpha_s + bus bytes / (bus_gbps * 1e9), alpha_s the latency at
    this group (the fit's fixed part + NCCL's hop latency of the algorithm taken), bus_gbps the bus
    bandwidth the message moved at (the fit's, scaled to the links the group can use, of the
    protocol taken); `algorithm` ring / tree as NCCL's tuner picks, or "alpha-beta" (the fit as
    measured: a gloo profile, or a fit that does not say at which group size it was taken);
    `fit` the fit priced from."""

    seconds: float
    alpha_s: float
    bus_gbps: float
    algorithm: str
    protocol: str
    fit: AlphaBeta


def collective_seconds(profile: HardwareProfile, op: str, nbytes: float, group_size: int, link: str,
                       per_node: int | None = None) -> float:
    """The time of one `op` of a message of `nbytes` (nccl-tests' size: the all-reduce buffer, the
    all-gather output, the reduce-scatter input) over `group_size` ranks on `link`, `per_node` of
    them on each node (None: the node's every rank): collective_cost's seconds; 0 for a group of
    one rank or no bytes. A KeyError names a link class or collective the profile lacks."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    return collective_cost(profile, op, nbytes, group_size, link, per_node).seconds


def collective_cost(profile: HardwareProfile, op: str, nbytes: float, group_size: int, link: str,
                    per_node: int | None = None) -> CollectiveCost:
    """One call priced from the fit of the group's kind (pick_fit: the one whose ranks per node
    are nearest), its bus bandwidth scaled to the links this group can use (link_share), its
    latency grown with the group as NCCL's tuner grows it (nccltuning): the fit's alpha is NCCL's
    least latency at the group it was taken on plus a fixed part (launch, the framework's call)
    that stays; the hop latency is NCCL's at this group, of the cheapest algorithm and protocol
    for this message (ring; for all-reduce tree, and NVLink SHARP within an NVSwitch node; LL,
    LL128, Simple). A gloo profile (NCCL's tuner is not gloo's), or a fit that records no group
    size, is priced as fitted: alpha + bus bytes / bandwidth."""
    n = max(2, group_size)
    nodes, ppn = group_layout(profile, link, n, per_node)
    fit = pick_fit(profile, op, link, ppn)
    size0, ppn0 = fit_layout(profile, fit, link)
    gbps = fit.bus_gbps * link_share(profile, link, n, ppn) / link_share(profile, link, size0 or n, ppn0)
    bus_bytes = bus_factor(op, n) * nbytes
    if size0 is None or not nccl_priced(profile):
        return CollectiveCost(fit.alpha_s + bus_bytes / (gbps * 1e9), fit.alpha_s, gbps, "alpha-beta", "", fit)
    nodes0, _ = group_layout(profile, link, size0, ppn0)
    nvls = link == "intra" and profile.topology is not None and profile.topology.nvlink == "switch"
    fixed = max(0.0, fit.alpha_s - nt.least_latency_s(op, size0, nodes0, nvls))
    choice = nt.cheapest(op, nbytes, n, nodes, gbps, bus_bytes, nvls)
    return CollectiveCost(fixed + choice.seconds, fixed + choice.latency_s, choice.bus_gbps, choice.algorithm,
                          choice.protocol, fit)


def nccl_priced(profile: HardwareProfile) -> bool:
    """Whether NCCL's tuner model prices the profile's collectives: an NCCL profile, or one that does
    not name its backend and is not of a CPU."""
    return profile.backend == "nccl" or (profile.backend is None and not profile.device.upper().startswith("CPU"))


def group_layout(profile: HardwareProfile, link: str, group_size: int, per_node: int | None) -> tuple[int, int]:
    """(nodes, ranks per node) of a group: within a node all of it; across nodes `per_node` ranks
    on each (None: the node's every rank, gpus_per_node, as far as the group holds them), at
    least 2 nodes."""
    if link == "intra":
        return 1, group_size
    ppn = per_node or min(group_size // 2, profile.gpus_per_node or 1) or 1
    return max(2, -(-group_size // ppn)), ppn


def fit_layout(profile: HardwareProfile, fit: AlphaBeta, link: str) -> tuple[int | None, int]:
    """(group size, ranks per node) of the groups a fit was taken on: its own fields, else its
    points' largest group and their ranks per node, else (None: no size recorded) the node's every
    rank."""
    size = fit.group_size or max((p.group_size for p in fit.points), default=None)
    if link == "intra":
        return size, size or profile.gpus_per_node or 1
    recorded = {p.per_node for p in fit.points if p.per_node}
    ppn = fit.per_node or (max(recorded) if recorded else None)
    if ppn is None:
        ppn = min(profile.gpus_per_node or 1, (size or 2) // 2) or 1
    return size, ppn


def link_fits(profile: HardwareProfile, op: str, link: str) -> list[AlphaBeta]:
    """The profile's fits of `op` on `link`: links' own, then link_kinds' (other kinds of group)."""
    return [link_fit(profile, op, link), *profile.link_kinds.get(link, {}).get(op, [])]


def pick_fit(profile: HardwareProfile, op: str, link: str, per_node: int) -> AlphaBeta:
    """The fit of the group's kind: among link_fits, the one taken at ranks per node nearest to
    `per_node` (in ratio; ties: the first, links' own). Within a node there is one kind."""
    fits = link_fits(profile, op, link)
    if link == "intra" or len(fits) == 1:
        return fits[0]
    return min(fits, key=lambda f: abs(math.log(fit_layout(profile, f, link)[1] / per_node)))


def link_share(profile: HardwareProfile, link: str, group_size: int, per_node: int) -> float:
    """The share of the link class's bandwidth one group of this kind gets (1: all of it), from the
    profile's topology (none: 1, priced as measured).
    Across nodes: every rank of a node runs a group like this one at once (a data-parallel group
    per TP rank, a replica group per shard rank), so the node's gpus_per_node / per_node groups
    share its NICs: a group gets at most per_node / gpus_per_node of the node's network, and no
    more NICs than it has ranks on the node (NCCL's rings of one GPU run through that GPU's own
    NIC, rail-aligned; PXN reaches another GPU's NIC over NVLink, but that NIC carries its own
    GPU's group): min(per_node, nics, nics x per_node / gpus_per_node) / nics.
    Within a node: NVSwitch gives any group each GPU's whole NVLink bandwidth; pairwise-wired
    GPUs (topology.nvlink direct) give a group of k of the node's g GPUs (k - 1) / (g - 1) of it."""
    top, gpn = profile.topology, profile.gpus_per_node
    if link == "intra":
        if top is None or top.nvlink == "switch" or not gpn or gpn < 2:
            return 1.0
        return (min(group_size, gpn) - 1) / (gpn - 1)
    if top is None or not gpn:
        return 1.0
    share = min(per_node, gpn) / gpn
    nics = top.nics_per_node
    return min(share, min(per_node, nics) / nics) if nics else share


def link_fit(profile: HardwareProfile, op: str, link: str) -> AlphaBeta:
    try:
        return profile.links[link][op]
    except KeyError:
        have = ", ".join(f"{lk}:{o}" for lk, ops in profile.links.items() for o in ops) or "none"
        raise KeyError(f"profile {profile.name!r} has no {link} {op} fit (it has {have})") from None


# ---- compute lookups ----

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
# GEMMs (launch-bound, outside the fit) 31% (tests/test_compute_pricing.py holds them; scripts/fit_gemm_model.py
# reproduces the fit).
GEMM_FIT = {"tflops": 900.0, "k0": 30.0, "t0_s": 7.5e-6}


def _log_distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return math.sqrt(sum(math.log(x / y) ** 2 for x, y in zip(a, b)))


def gemm_point(profile: HardwareProfile, m: int, n: int, k: int) -> GemmPoint:
    """The measured shape that stands for (m, n, k): the same shape if measured, else the nearest in
    log space (Euclidean distance of (log m, log n, log k)). Nearest, not interpolated: GEMM rates
    jump with tile and wave quantisation, so a blend of two unrelated shapes is no better a guess
    than the closest one, and the profile's points are the model's own shapes (calibrate times
    every linear of the run, forward and backward) where it was calibrated for the run."""
    if not profile.gemm:
        raise KeyError(f"profile {profile.name!r} has no GEMM points")
    return min(profile.gemm, key=lambda p: _log_distance((p.m, p.n, p.k), (m, n, k)))


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


def gemm_model_tflops(m: int, n: int, k: int, sm_count: int) -> float:
    """The shape model's TFLOP/s of an (m, n, k) GEMM: time = 2mnk / (GEMM_FIT rate x
    gemm_efficiency) x (1 + k0 / k) + t0, the k-loop's fixed cost per tile and a fixed cost per GEMM
    (launch and tail) on top of tile and wave quantization; its constants are fitted (GEMM_FIT)."""
    flops = 2 * m * n * k
    busy = flops / (GEMM_FIT["tflops"] * 1e12 * gemm_efficiency(m, n, k, sm_count)) * (1 + GEMM_FIT["k0"] / k)
    return flops / (busy + GEMM_FIT["t0_s"]) / 1e12


def gemm_rate(profile: HardwareProfile, m: int, n: int, k: int) -> tuple[GemmPoint, float]:
    """The point whose figures price an (m, n, k) GEMM and the factor on them. A point within
    SHAPE_NEAR of the shape (a calibration measures the run's own shapes), or a profile without
    sm_count: gemm_point's, factor 1. Else (a shipped profile's one best-shape point): the best
    point, scaled by the shape's gemm_model_tflops over the best shape's, at most 1 (the best
    shape's rate is the most the device was seen to reach). Not modelled: operands whose k or n is
    not a multiple of 8 elements (16 bytes), which cuBLAS serves with slower kernels."""
    point = gemm_point(profile, m, n, k)
    if profile.sm_count is None or _log_distance((point.m, point.n, point.k), (m, n, k)) <= SHAPE_NEAR:
        return point, 1.0
    best = max(profile.gemm, key=lambda p: p.tflops)
    shape = gemm_model_tflops(m, n, k, profile.sm_count)
    return best, min(1.0, shape / gemm_model_tflops(best.m, best.n, best.k, profile.sm_count))


def gemm_tflops(profile: HardwareProfile, m: int, n: int, k: int) -> float:
    """TFLOP/s of an (m, n, k) GEMM (gemm_rate)."""
    point, factor = gemm_rate(profile, m, n, k)
    return point.tflops * factor


# Which other kernel's points stand for a kernel the profile lacks, in this order: FlashAttention-2
# first (SDPA's default on Hopper), then cuDNN, FA3, FlexAttention, the memory-efficient kernel, math.
FALLBACK_KERNELS: tuple[str, ...] = ("flash2", "cudnn", "flash3", "flex", "efficient", "math")


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


def memory_gbps(profile: HardwareProfile, op: str = "add") -> float:
    """Element-wise bandwidth (GB/s) of `op` (default add) at the largest tensors measured; a
    profile without that op gives its other figures' (a datasheet peak where that is all it has)."""
    if not profile.memory:
        raise KeyError(f"profile {profile.name!r} has no memory bandwidth")
    same = [p for p in profile.memory if p.op == op] or profile.memory
    return max(same, key=lambda p: p.nbytes or 0).gbps


# ---- files ----

def load_profile(path: Path | str) -> HardwareProfile:
    """A profile from its YAML file; ProfileError (one line, naming the file) when it is not one
    this echobench reads: unreadable, not YAML, another schema_version, or invalid fields."""
    path = Path(path)
    data = read_yaml(path, "hardware profile", ProfileError)
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: not a hardware profile (expected a mapping)")
    version = data.get("schema_version")
    if version != PROFILE_SCHEMA_VERSION:
        raise ProfileError(f"{path}: hardware profile schema_version {version!r}, this echobench reads "
                           f"{PROFILE_SCHEMA_VERSION}: recalibrate with `echobench calibrate --comm --out {path}` "
                           f"or take a shipped profile from profiles/")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(f"{path}: invalid hardware profile: {_one_line(exc)}") from None


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{where} is required" if err["type"] == "missing" else f"{where}: {err['msg']}")
    return "; ".join(parts)


def save_profile(profile: HardwareProfile, path: Path | str) -> Path:
    """Writes the profile as YAML (atomically); returns the path."""
    path = Path(path)
    write_text_atomic(path, yaml.safe_dump(profile.model_dump(mode="json", exclude_none=True), sort_keys=False, width=120))
    return path


def calibrated_profile_path(device: str, dtype: str) -> Path:
    """Where `echobench calibrate --comm` keeps this machine's profile: echobench's cache
    (ECHOBENCH_CACHE), profiles/DEVICE-DTYPE.yaml."""
    from echobench.hardware import _slug, cache_dir  # lazy: imports torch; predict reads profiles without it

    return cache_dir() / "profiles" / f"{_slug(device)}-{dtype}.yaml"


def shipped_profiles() -> dict[str, Path]:
    """The shipped profiles by name (file stem), from profiles/ of this checkout."""
    return {p.stem: p for p in sorted(PROFILES_DIR.glob("*.yaml"))}


def find_profile(name_or_path: str | Path) -> Path:
    """A profile's file: an existing path, else a shipped profile's name (profiles/NAME.yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    shipped = shipped_profiles()
    if str(name_or_path) in shipped:
        return shipped[str(name_or_path)]
    raise ProfileError(f"no hardware profile {str(name_or_path)!r}: give a YAML file or one of "
                       f"{', '.join(shipped) or '(none shipped)'}")
