"""Hardware profiles: what one device and its links can do, the measurements a performance model
(echobench predict) reads. One typed, versioned YAML file per machine kind, every number with
its source.

A profile holds, for one device and compute dtype:
- gemm: the GEMM rate (TFLOP/s) at shapes (m, n, k), nn.Linear's x @ W^T of m rows, k input and
  n output features (`dtype` float8_e4m3fn: a float8 GEMM's); sm_count: the device's SMs, where
  given (the shape model prices a shape no point stands for from the best point);
- attention: the attention rate (TFLOP/s, forward + backward, FLOPs under echobench.model.flops'
  convention) at sequence lengths, per kernel (ATTENTION_KERNELS) and causality;
- memory: element-wise memory bandwidth (GB/s of bytes read + written): add, copy, adamw, datasheet;
- clock: the clock the device sustains in a long training step as a ratio to its GEMM points',
  where it differs (another power limit), with its plausible range and source;
- kernel_gap: the device's idle time per kernel launched back to back (source);
- host_op: the host's cost per dispatched op where no host step was measured (assumed, with its
  source);
- in_step: a factor `echobench tune` fits to the runs it measured (the shipped profiles have none);
- host_steps: what a tiny training step of each layout costs the host per dispatched op (Python,
  dispatch, autograd, hooks, kernel launch), where measured;
- links: per link class ("intra" within a node, "inter" across nodes) and per collective
  (all_reduce, all_gather, reduce_scatter) an alpha-beta fit, latency alpha_s and bus bandwidth
  bus_gbps, with the raw points it was fitted to and the kind of group it was taken on (group_size,
  per_node); link_kinds: fits of further kinds (calibrate fits one-rank-per-node groups apart);
  topology: the node's NICs and whether its NVLink is switched or pairwise, the latency of a network
  step where measured, and the spine's oversubscription where links are shared; collective_cost() is
  a call's time on a group of any size and kind (the collective cost model below);
- jitter: each rank's step-to-step spread, whose maximum over a step's ranks is the straggler
  term (straggler_share);
- where and when: versions, date, host, and `measured` (False for the shipped profiles in
  profiles/, gathered from datasheets and public measurements, not measured by echobench).

Collective sizes follow nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md): a message
of `nbytes` is the all-reduce buffer, the all-gather OUTPUT and the reduce-scatter INPUT; its bus
bytes are 2(n-1)/n x nbytes for all-reduce and (n-1)/n x nbytes for all-gather and reduce-scatter
on n ranks, so that one bus bandwidth describes a link whatever n.

echobench.hardware.devicerates turns a profile's compute figures into rates (gemm, attention,
memory_bandwidth, kernel_gap, ...), each with its source.

Loading refuses a file of another schema_version with one line naming it and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echobench.hardware.nccltuning import cheapest, least_latency_s
from echobench.records.atomic import write_text_atomic
from echobench.records.yamltext import read_yaml

PROFILE_SCHEMA_VERSION = 1
Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
Link = Literal["intra", "inter"]
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
LINKS: tuple[str, ...] = ("intra", "inter")
PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"  # the shipped profiles (a source checkout)
# Attention kernels as profiles name them: FlashAttention-2 (torch SDPA's flash backend), -3, cuDNN's
# fused attention, SDPA's memory-efficient kernel (xformers' cutlass kernels), FlexAttention
# (compiled, Triton), SDPA's math path (matmul + softmax + matmul), and FlashAttention's Triton port
# (flash_attn_triton.py; llm-foundry's attn_impl triton).
AttentionKernel = Literal["flash2", "flash3", "cudnn", "efficient", "flex", "math", "triton"]
ATTENTION_KERNELS: tuple[str, ...] = ("flash2", "flash3", "cudnn", "efficient", "flex", "math", "triton")


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
    dtype: Optional[str] = None  # the operands' dtype where not the profile's (float8_e4m3fn: a float8 GEMM)


class AttentionPoint(_Strict):
    """Attention forward + backward at one shape: batch x heads, seq_q queries against seq_k keys
    of head_dim; tflops counts echobench.model.flops' FLOPs (forward 4 seq_q seq_k head_dim per head,
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
    """A factor on a step's GEMM, attention and element-wise time that `echobench tune` FITS to the
    runs it measured (their shared bias); `fitted_on` names those runs, `source` how. The shipped
    profiles carry none: their rates are physical terms (echobench.hardware.devicerates)."""

    factor: float = Field(ge=1 / 3, le=3)
    fitted_on: list[str] = []
    source: str


class SustainedClock(_Strict):
    """The clock a device sustains in a long training step under its power limit, as a ratio to the
    clock its GEMM points were measured at (1: the same); `low` / `high`: the plausible range where
    it is not measured (a power limit other than the points' device's), `source` says which."""

    ratio: float = Field(gt=0.3, le=1.2)
    low: Optional[float] = Field(None, gt=0.3, le=1.2)
    high: Optional[float] = Field(None, gt=0.3, le=1.2)
    source: str


class KernelGap(_Strict):
    """The device's idle time between two kernels launched back to back on one stream (the
    front end fetching and setting up the next launch), where the host keeps ahead: `source`."""

    seconds: float = Field(ge=0, le=1e-4)
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
    g GPUs uses k - 1 of each GPU's g - 1 peers' links); `nvls` whether those NVSwitches reduce in
    the switch (NVLink SHARP, an all-reduce algorithm of NCCL's within the node)."""

    nics_per_node: Optional[int] = Field(None, ge=1)
    nvlink: Literal["switch", "direct"] = "switch"
    # NVLink SHARP (NCCL's NVLS all-reduce) in the node's NVSwitches: third-generation NVSwitch (HGX
    # H100 / H200 and later); A100's second-generation NVSwitch has none, and NCCL runs ring or tree there.
    nvls: bool = True
    # The latency one step of a ring (or a tree's hop) across the network adds, every protocol alike
    # (None: NCCL's own per-protocol figures, nccltuning.HOP_LATENCY_US "net"); `source` says where from.
    net_step_latency_s: Optional[float] = Field(None, gt=0, le=1e-3)
    # Links shared past a leaf switch: a group over more than nodes_per_leaf nodes crosses the spine,
    # which carries 1 / oversubscription of what the leaves' nodes inject (1: non-blocking, not shared).
    nodes_per_leaf: Optional[int] = Field(None, ge=1)
    oversubscription: float = Field(1.0, ge=1.0, le=16.0)
    source: str


class StepJitter(_Strict):
    """How much one rank's step time varies from step to step, as a share of the step: `cv` the
    standard deviation over the mean, each rank's steps independent draws of `distribution`. A
    synchronous step ends with its slowest rank: straggler_share. `echobench calibrate --comm`
    measures it from every rank's own steps (commcalibrate.step_jitter); `source` says where from."""

    cv: float = Field(ge=0, le=0.2)
    distribution: Literal["gaussian"] = "gaussian"
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
    in_step: Optional[InStepFactor] = None  # a factor `echobench tune` fitted to measured runs (None: 1)
    clock: Optional[SustainedClock] = None  # the sustained clock vs the GEMM points' (None: the same)
    kernel_gap: Optional[KernelGap] = None  # idle device time per kernel launch (None: 0)
    links: dict[Link, dict[Op, AlphaBeta]] = {}
    link_kinds: dict[Link, dict[Op, list[AlphaBeta]]] = {}  # fits of further kinds of group (ranks per node)
    topology: Optional[Topology] = None  # NICs per node, NVLink switch or pairwise (None: price as measured)
    jitter: Optional[StepJitter] = None  # each rank's step-to-step spread (None: none priced)
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
    for this message (ring; for all-reduce tree, and NVLink SHARP within a node whose NVSwitches have it; LL,
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
    top = profile.topology
    nvls = link == "intra" and top is not None and top.nvlink == "switch" and top.nvls
    net_us = net_step_us(profile)
    fixed = max(0.0, fit.alpha_s - least_latency_s(op, size0, nodes0, nvls, net_us))
    choice = cheapest(op, nbytes, n, nodes, gbps, bus_bytes, nvls, net_us)
    return CollectiveCost(fixed + choice.seconds, fixed + choice.latency_s, choice.bus_gbps, choice.algorithm,
                          choice.protocol, fit)


def net_step_us(profile: HardwareProfile) -> float | None:
    """The profile's latency per network step in microseconds (None: NCCL's own figures)."""
    top = profile.topology
    return None if top is None or top.net_step_latency_s is None else top.net_step_latency_s * 1e6


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
    Past a leaf switch, where the topology says the spine is shared, that share over its
    oversubscription (spine_contention).
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
    share = min(share, min(per_node, nics) / nics) if nics else share
    return share / spine_contention(top, -(-group_size // max(1, per_node)))


def spine_contention(top: Topology, nodes: int) -> float:
    """How many times more traffic than bandwidth a group over `nodes` nodes meets where it crosses
    the spine (the topology's oversubscription once the group spans more nodes than a leaf holds;
    1 where the topology says nothing is shared: no leaf size, or a non-blocking spine)."""
    if top.nodes_per_leaf is None or nodes <= top.nodes_per_leaf:
        return 1.0
    return top.oversubscription


def link_fit(profile: HardwareProfile, op: str, link: str) -> AlphaBeta:
    try:
        return profile.links[link][op]
    except KeyError:
        have = ", ".join(f"{lk}:{o}" for lk, ops in profile.links.items() for o in ops) or "none"
        raise KeyError(f"profile {profile.name!r} has no {link} {op} fit (it has {have})") from None


# ---- stragglers ----

@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal draws]: 0 for one, 1 / sqrt(pi) for two, about
    sqrt(2 ln n) for many (slowly from below); integrated numerically, x n phi(x) Phi(x)^(n-1)."""
    if n <= 1:
        return 0.0
    h, total = 0.005, 0.0
    for i in range(-2400, 2401):  # -12 .. 12 standard deviations
        x = i * h
        density = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        below = 0.5 * (1 + math.erf(x / math.sqrt(2)))  # the chance one draw is under x
        total += x * n * density * below ** (n - 1)
    return total * h


def straggler_share(profile: HardwareProfile, ranks: int) -> float:
    """The share of a synchronous step its slowest of `ranks` ranks adds (0: the profile has no
    jitter, or one rank): each rank's step a Gaussian draw of the profile's relative spread cv, the
    step the expected maximum, cv x expected_max_normal(ranks)."""
    if profile.jitter is None or ranks <= 1:
        return 0.0
    return profile.jitter.cv * expected_max_normal(ranks)


# ---- lookups (the GEMM, attention and element-wise rates are echobench.hardware.devicerates') ----

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
    from echobench.records.paths import cache_dir, cached_name

    return cache_dir() / "profiles" / f"{cached_name(device)}-{dtype}.yaml"


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
