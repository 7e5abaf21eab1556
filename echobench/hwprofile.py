"""Hardware profiles: what one device and its links can do, the measurements a performance model
(echobench predict) reads. One typed, versioned YAML file per machine kind, every number with
its source.

A profile holds, for one device and compute dtype:
- gemm: the GEMM rate (TFLOP/s) at shapes (m, n, k), nn.Linear's x @ W^T of m rows, k input and
  n output features; gemm_tflops() looks a shape up;
- attention: the attention rate (TFLOP/s, forward + backward, FLOPs under echobench.flops'
  convention) at sequence lengths; attention_tflops() looks lengths up;
- memory: element-wise memory bandwidth (GB/s of bytes read + written); memory_gbps();
- host_steps: what a tiny training step of each layout costs the host per dispatched op (Python,
  dispatch, autograd, hooks, kernel launch), where measured;
- links: per link class ("intra" within a node, "inter" across nodes) and per collective
  (all_reduce, all_gather, reduce_scatter) an alpha-beta fit, latency alpha_s and bus bandwidth
  bus_gbps, with the raw points it was fitted to; collective_seconds() is its time;
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
from pathlib import Path
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from echobench.atomic import write_text_atomic
from echobench.yamltext import yaml_problem

PROFILE_SCHEMA_VERSION = 1
Op = Literal["all_reduce", "all_gather", "reduce_scatter"]
Link = Literal["intra", "inter"]
OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
LINKS: tuple[str, ...] = ("intra", "inter")
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"  # the shipped profiles (a source checkout)


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


class CommPoint(_Strict):
    """One timed collective: a message of nbytes (nccl-tests' size) over group_size ranks."""

    nbytes: int = Field(gt=0)
    group_size: int = Field(ge=2)
    seconds: float = Field(gt=0)  # median over the repeats, each the mean of back-to-back calls
    seconds_min: Optional[float] = None
    seconds_max: Optional[float] = None
    iters: Optional[int] = None


class AlphaBeta(_Strict):
    """time = alpha_s + bus_bytes / (bus_gbps * 1e9), fitted to `points` (or taken from `source`)."""

    alpha_s: float = Field(ge=0)
    bus_gbps: float = Field(gt=0)
    rel_rms: Optional[float] = None  # root mean square of the fit's relative residuals over the points
    source: str
    points: list[CommPoint] = []


class HardwareProfile(_Strict):
    schema_version: int = PROFILE_SCHEMA_VERSION
    name: str
    device: str  # as torch names it (torch.cuda.get_device_name, hardware.device_name)
    dtype: str  # the GEMM / attention dtype: bfloat16, float32
    measured: bool  # True: `echobench calibrate --comm` measured it; False: datasheets and published figures
    note: str = ""
    backend: Optional[str] = None  # the collectives' process-group backend (nccl, gloo)
    gpus_per_node: Optional[int] = Field(None, ge=1)
    gemm: list[GemmPoint] = []
    attention: list[AttentionPoint] = []
    memory: list[MemoryPoint] = []
    host_steps: list[HostPoint] = []  # the host's cost per op of a step, per layout (calibrate --comm)
    links: dict[Link, dict[Op, AlphaBeta]] = {}
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


def collective_seconds(profile: HardwareProfile, op: str, nbytes: float, group_size: int, link: str) -> float:
    """The alpha-beta time of one `op` of a message of `nbytes` (nccl-tests' size: the all-reduce
    buffer, the all-gather output, the reduce-scatter input) over `group_size` ranks on `link`:
    alpha_s + bus_factor(op, n) * nbytes / (bus_gbps * 1e9); 0 for a group of one rank or no bytes.
    A KeyError names a link class or collective the profile lacks."""
    if group_size <= 1 or nbytes <= 0:
        return 0.0
    fit = link_fit(profile, op, link)
    return fit.alpha_s + bus_factor(op, group_size) * nbytes / (fit.bus_gbps * 1e9)


def link_fit(profile: HardwareProfile, op: str, link: str) -> AlphaBeta:
    try:
        return profile.links[link][op]
    except KeyError:
        have = ", ".join(f"{lk}:{o}" for lk, ops in profile.links.items() for o in ops) or "none"
        raise KeyError(f"profile {profile.name!r} has no {link} {op} fit (it has {have})") from None


# ---- compute lookups ----

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


def gemm_tflops(profile: HardwareProfile, m: int, n: int, k: int) -> float:
    """TFLOP/s of an (m, n, k) GEMM: gemm_point's rate."""
    return gemm_point(profile, m, n, k).tflops


def attention_tflops(profile: HardwareProfile, seq_q: int, seq_k: int, head_dim: int | None = None) -> float:
    """Attention forward + backward TFLOP/s at seq_q queries x seq_k keys: piecewise linear in
    log(seq_q * seq_k) (the score matrix's size, which the kernel's efficiency follows) between the
    profile's points of this head_dim where it has any (else all of them), the nearest point's rate
    outside their range. Heads and batch of the points are not matched: calibrate measures at the
    run's own."""
    if not profile.attention:
        raise KeyError(f"profile {profile.name!r} has no attention points")
    same = [p for p in profile.attention if p.head_dim == head_dim] or profile.attention
    pts = sorted(((math.log(p.seq_q * p.seq_k), p.tflops) for p in same))
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
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the hardware profile ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise ProfileError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
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
