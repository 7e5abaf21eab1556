"""What `echobench tune` searches, and what it drops before running anything: the tune file
(TuneFile), the search space of a scale on a node count (candidates), the rules and the memory
estimate that prune it, the predicted ranking of the rest, and the picks that get measured.

A candidate is a layout (torchtitan single / ddp / fsdp2 / hsdp, megatron tpN with sequence
parallelism as the run's auto resolves it), micro-batch, gradient accumulation, activation
checkpointing, compile, reshard-after-forward (FSDP2 / HSDP only) and precision (fp8 where the
profile's device has an fp8 peak), over the tune file's defaults. A layout family is the
parallelism without its width (ddp, fsdp2, hsdp, megatron TP of any width): the picks are the top K
by predicted samples/s of the whole job plus the best-ranked candidate of every family not among
them, so that a model that misjudges a whole family still measures its best.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from echobench.records.config import RunConfig, check_value, grad_accum_for, run_id
from echobench.records.layout import Layout, layouts_on
from echobench.hardware.profile import HardwareProfile
from echobench.sweep.cluster import ExecutorName, HardwareSettings, MatrixError, Strict, format_pydantic
from echobench.sweep.matrix import MatrixFile, with_hardware, wrong_kind_of_file
from echobench.sweep.site import SECTIONS, merge_site, read_site, site_path
from echobench.backends import layout_problem
from echobench.hardware.devicememory import device_memory_gib
from echobench.predict.memory import estimate_memory
from echobench.model.config import PRESETS
from echobench.records.peaks import table_peak
from echobench.predict import Prediction, PredictError, is_cpu, predict
from echobench.records.yamltext import read_yaml

# The axes a tune searches (search: in the tune file fixes or widens each); tpN parallelism runs on
# megatron, the others on torchtitan (so the framework follows from it).
AXES = ("parallelism", "micro_batch", "grad_accum", "ac", "compile", "reshard_after_forward", "precision")
MICRO_BATCHES = [1, 2, 4, 8, 16, 32]
# Set by the tune itself on every candidate: a tune file's defaults may not set them.
OWN_KEYS = ("scale", "framework", "nodes", "gpus_per_node", *AXES)


class TuneError(ValueError):
    """Bad input to a tune: one line naming the problem and the fix."""


class TuneFile(Strict):
    """A tune file: the matrix sections the measuring sweep takes (name, executor, slurm, local,
    hardware, defaults: as in a matrix file) and what to tune."""

    name: str
    site: str | None = None  # a site file (echobench.sweep.site), relative to this file: merged in before the check
    # (once loaded: the site file's path, and the tune file's own executor and sections apart)
    executor: ExecutorName = "local"
    slurm: dict[str, Any] = {}
    local: dict[str, Any] = {}
    hardware: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    scale: list[str] = []  # presets, each tuned on its own
    card: Path | None = None  # a model card file (predict.load_card_file): its layouts ranked, its picks measured
    nodes: list[int] = [1]  # node counts, each tuned on its own
    gpus_per_node: int = Field(1, ge=1)  # GPUs per node (CPU processes on a CPU machine)
    global_batch: int | None = Field(None, ge=1)  # held fixed: grad_accum = global_batch / (micro_batch x dp)
    search: dict[str, list[Any]] = {}  # an axis's values (fixes it, or widens it)
    top_k: int = Field(3, ge=1, le=20)  # candidates measured per scale and node count, besides the family picks
    budget_gpu_hours: float | None = Field(None, gt=0)  # stop measuring once this much device time is spent
    max_rounds: int = Field(3, ge=1, le=10)  # measure, recalibrate, re-rank at most this many times
    memory_margin: float = Field(0.10, ge=0, lt=1)  # a candidate fits when estimate x (1 + margin) <= capacity
    bias: float = Field(0.05, gt=0, lt=1)  # residuals all beyond this (same sign): recalibrate
    _own: dict = PrivateAttr(default_factory=dict)  # the tune file's own executor and sections, under its site

    def run_settings(self, settings: dict) -> dict:
        """A candidate's run settings over the defaults, with the hardware section applied as the
        measuring sweep applies it (sweep.matrix.with_hardware): the run ids the sweep gives them."""
        return with_hardware({**self.defaults, **settings}, HardwareSettings.model_validate(self.hardware))

    @field_validator("scale", mode="before")
    @classmethod
    def _one_or_many(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("scale")
    @classmethod
    def _presets(cls, v):
        if bad := [s for s in v if s not in PRESETS]:
            raise ValueError(f"unknown scale {', '.join(map(str, bad))}: one or more of {', '.join(PRESETS)}")
        return v

    @field_validator("nodes")
    @classmethod
    def _nodes(cls, v):
        if not v or any(n < 1 or n > 1024 for n in v):
            raise ValueError("node counts between 1 and 1024, e.g. [1, 4]")
        return v


def load_tune_file(path: Path, site: Path | None = None) -> TuneFile:
    """The tune file over its site file (`site`: --site FILE, else its site: key; echobench.sweep.site,
    as a matrix takes one), checked: its matrix sections as a matrix file's, its defaults and search
    values as run settings; TuneError with one line otherwise."""
    data = read_yaml(path, "tune file", TuneError)
    if not isinstance(data, dict):
        raise TuneError(f"{path}: expected a mapping with name, scale, nodes, gpus_per_node, search, ...")
    if problem := wrong_kind_of_file(data, path, "tune"):
        raise TuneError(problem)
    try:
        site_file = site_path(path, data, site)
        own = {k: data[k] for k in ("executor", *SECTIONS) if data.get(k)}
        data, _ = merge_site(read_site(site_file) if site_file else {}, data, f"site {site_file}", "tune file")
    except MatrixError as exc:
        raise TuneError(str(exc)) from None
    try:
        spec = TuneFile.model_validate(data)
        MatrixFile.model_validate({k: data[k] for k in ("name", "executor", "slurm", "local", "hardware") if k in data})
    except ValidationError as exc:
        raise TuneError(format_pydantic(path, exc, TuneFile)) from None
    if not spec.scale and spec.card is None:
        raise TuneError(f"{path}: give scale (one or more of {', '.join(PRESETS)}) or card (a model card file)")
    if spec.card is not None:
        spec = spec.model_copy(update={"card": path.parent / spec.card})
        if not spec.card.is_file():
            raise TuneError(f"{path}: card: no such file {spec.card}")
        if bad := sorted(set(spec.search) - {"micro_batch", "ac"}) if not spec.scale else []:
            raise TuneError(f"{path}: search.{bad[0]}: a card's tune searches micro_batch and ac (its layouts are its own)")
    for key, value in spec.defaults.items():
        if key in OWN_KEYS:
            raise TuneError(f"{path}: defaults.{key}: the tune sets it on every candidate: fix it with "
                            f"search: {{{'parallelism' if key == 'framework' else key}: [...]}}"
                            if key not in ("scale", "nodes", "gpus_per_node") else
                            f"{path}: defaults.{key}: set it at the top level of the tune file")
        try:
            check_value(key, value)
        except ValueError as exc:
            raise TuneError(f"{path}: defaults.{key}: {exc}") from None
    for axis, values in spec.search.items():
        if axis not in AXES:
            raise TuneError(f"{path}: search.{axis}: not a searched axis: one of {', '.join(AXES)}")
        if not values:
            raise TuneError(f"{path}: search.{axis}: give at least one value")
        for v in values:
            try:
                check_value(axis, v)
            except ValueError as exc:
                raise TuneError(f"{path}: search.{axis}: {exc}") from None
    if spec.global_batch is not None and "grad_accum" in spec.search:
        raise TuneError(f"{path}: search.grad_accum with global_batch: the global batch sets it (global_batch / "
                        "(micro_batch x data-parallel ranks)): drop one")
    if spec.scale and spec.executor == "local" and any(n > 1 for n in spec.nodes):  # a card's: ranked only there
        raise TuneError(f"{path}: nodes {spec.nodes}: the local executor runs on this one machine: nodes [1], or "
                        "executor: slurm")
    if site_file is not None:
        spec = spec.model_copy(update={"site": str(site_file.resolve())})
        spec._own = own
    return spec


def cluster_sections(spec: TuneFile, folder: Path) -> dict:
    """The executor and cluster sections of a matrix the tune writes into `folder`: with a site file,
    `site:` (its path from there) and the tune file's own values only, so that the matrix takes the
    site as it is when swept and stays small; else the tune file's sections."""
    if spec.site is None:
        return {"executor": spec.executor, **{k: v for k, v in (("slurm", spec.slurm), ("local", spec.local),
                                                                ("hardware", spec.hardware)) if v}}
    return {"site": os.path.relpath(spec.site, folder), **spec._own}


def sharing_warning(spec: TuneFile) -> str | None:
    """A tune compares runs: on SLURM, runs that share a node slow each other and the comparison
    measures the sharing. None where each run has its nodes to itself or runs alone."""
    if spec.executor != "slurm" or spec.slurm.get("exclusive") or spec.slurm.get("max_submitted") == 1:
        return None
    return ("slurm.exclusive is not true: the measured runs may share nodes and slow each other, and the tune would "
            "compare the sharing: set slurm.exclusive: true (or slurm.max_submitted: 1 where the nodes share one "
            "machine, as a test cluster's do)")


# ---- the search space ----

def family(cfg: RunConfig) -> str:
    """A layout family: the parallelism without its width (megatron TP of any width is one)."""
    return "megatron-tp" if cfg.framework == "megatron" else cfg.parallelism


def fp8_device(profile: HardwareProfile) -> bool:
    peak = table_peak(profile.device, "fp8")
    return not is_cpu(profile) and peak is not None


def default_axes(nodes: int, gpus_per_node: int, profile: HardwareProfile) -> dict[str, list]:
    """The axes a tune searches unless its file says otherwise."""
    gpu = not is_cpu(profile)
    layouts = [lay.name for lay in layouts_on(nodes, gpus_per_node)]
    return {"parallelism": layouts, "micro_batch": MICRO_BATCHES, "grad_accum": [1], "ac": ["none", "selective", "full"],
            # a CPU compile takes minutes per run: search it there by naming it (search: {compile: [false, true]})
            "compile": [True, False] if gpu else [False], "reshard_after_forward": [True, False],
            "precision": (["bf16", "fp8"] if fp8_device(profile) else ["bf16"]) if gpu else ["fp32"]}


@dataclass
class Candidate:
    """One point of the search space: its settings (over the tune file's defaults), and either why
    it was pruned or its prediction."""

    settings: dict
    cfg: RunConfig | None = None
    pruned: str | None = None  # "memory: ...", "rule: ...", "batch: ..."
    prediction: Prediction | None = None

    @property
    def run_id(self) -> str:
        return run_id(self.cfg) if self.cfg is not None else ",".join(f"{k}={v}" for k, v in self.settings.items())

    @property
    def family(self) -> str:
        return family(self.cfg)

    @property
    def samples_per_s(self) -> float:
        """Predicted samples/s of the whole job (a model card's candidates: the same, by predict_card)."""
        return self.prediction.samples_per_s

    def priced(self, profile: HardwareProfile) -> Prediction:
        return predict(self.cfg, profile)

    def rate_on(self, profile: HardwareProfile) -> float:
        """Predicted samples/s on `profile` (the loop's recalibration)."""
        return predict(self.cfg, profile).samples_per_s


@dataclass
class Problem:
    """One scale on one node count: its candidates (pruned or predicted), ranked."""

    scale: str
    nodes: int
    gpus_per_node: int
    capacity_gib: float | None
    capacity_source: str
    candidates: list[Candidate] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.scale}@{self.nodes}x{self.gpus_per_node}"

    @property
    def ranked(self) -> list[Candidate]:
        """The candidates not pruned, by predicted samples/s of the whole job (ties: less memory)."""
        kept = [c for c in self.candidates if c.prediction is not None]
        # Ties (settings the model prices alike): the plainer setting first.
        return sorted(kept, key=lambda c: (-round(c.prediction.samples_per_s, 9), c.prediction.memory_gib,
                                           c.cfg.precision == "fp8", c.cfg.compile is not True,
                                           not c.cfg.reshard_after_forward, c.run_id))

    @property
    def pruned(self) -> list[Candidate]:
        return [c for c in self.candidates if c.pruned is not None]

    @property
    def measurable(self) -> list[Candidate]:
        """The ranked candidates the tune can measure: all of them (the backends' rules pruned the rest)."""
        return self.ranked


def capacity(spec: TuneFile, profile: HardwareProfile) -> tuple[float | None, str]:
    """A device's memory for the fit check: hardware.memory_gib, else the profile device's table
    entry, else (a CPU) this machine's memory over its processes."""
    try:
        gib = device_memory_gib(spec.hardware.get("memory_gib"), None if is_cpu(profile) else profile.device)
    except ValueError as exc:
        raise TuneError(str(exc).replace("in the matrix", "in the tune file")) from None
    if gib is not None:
        return gib, "hardware.memory_gib" if spec.hardware.get("memory_gib") else f"{profile.device} datasheet"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return total / spec.gpus_per_node, f"this machine's {total:.0f} GiB over {spec.gpus_per_node} processes"


def axes_for(spec: TuneFile, nodes: int, profile: HardwareProfile) -> dict[str, list]:
    axes = {**default_axes(nodes, spec.gpus_per_node, profile), **spec.search}
    if spec.global_batch is not None:
        axes["grad_accum"] = [None]  # derived per candidate
    return axes


def space(spec: TuneFile, scale: str, nodes: int, profile: HardwareProfile) -> list[dict]:
    """Every combination of the axes as run settings (reshard-after-forward varied only where FSDP2
    shards; grad_accum from the global batch where one is held)."""
    axes = axes_for(spec, nodes, profile)
    keys = list(axes)
    out, seen = [], set()
    for values in itertools.product(*(axes[k] for k in keys)):
        point = dict(zip(keys, values))
        layout = point.pop("parallelism")
        if not Layout.parse(layout).shards_parameters:
            point["reshard_after_forward"] = True
        settings = {"scale": scale, "framework": Layout.parse(layout).framework, "parallelism": layout, "nodes": nodes,
                    "gpus_per_node": spec.gpus_per_node, **point}
        key = tuple(sorted((k, str(v)) for k, v in settings.items()))
        if key not in seen:
            seen.add(key)
            out.append(settings)
    return out


def _batch_problem(spec: TuneFile, settings: dict, cfg: RunConfig) -> str | None:
    if spec.global_batch is None:
        return None
    try:
        grad_accum_for(spec.global_batch, cfg.micro_batch, cfg.dp)
    except ValueError as exc:
        return f"batch: {exc}"
    return None


def build_problem(spec: TuneFile, scale: str, nodes: int, profile: HardwareProfile) -> Problem:
    """The candidates of one scale on one node count: pruned by the rules (the backends' own checks:
    TP over heads, fp8 shapes, layouts a node count cannot run), the global batch and the memory
    estimate with its margin; the rest predicted on `profile`. TuneError when the profile cannot
    price them (a missing link class)."""
    gib, source = capacity(spec, profile)
    problem = Problem(scale, nodes, spec.gpus_per_node, gib, source)
    for settings in space(spec, scale, nodes, profile):
        c = Candidate(settings)
        problem.candidates.append(c)
        full = spec.run_settings(settings)
        if full.get("grad_accum") is None:
            full["grad_accum"] = 1
        try:
            c.cfg = RunConfig.from_dict(full)
        except (TypeError, ValueError) as exc:
            c.pruned = f"rule: {exc}"
            continue
        if (why := _batch_problem(spec, settings, c.cfg)) is not None:
            c.pruned = why
            continue
        if spec.global_batch is not None:
            c.cfg = RunConfig.from_dict({**full, "grad_accum": spec.global_batch // (c.cfg.micro_batch * c.cfg.dp)})
            c.settings["grad_accum"] = c.cfg.grad_accum
        if (why := layout_problem(c.cfg, spec.executor)) is not None:
            c.pruned = f"rule: {why}"
            continue
        need = estimate_memory(c.cfg).total_gib
        if gib is not None and need * (1 + spec.memory_margin) > gib:
            c.pruned = (f"memory: ~{need:.1f} GiB per device + {spec.memory_margin:.0%} margin > {gib:.1f} GiB "
                        f"({source})")
            continue
        try:
            c.prediction = predict(c.cfg, profile)
        except PredictError as exc:
            raise TuneError(str(exc)) from None
    if not problem.ranked:
        raise TuneError(nowhere_message(spec, scale, nodes, profile, problem))
    return problem


def nowhere_message(spec: TuneFile, scale: str, nodes: int, profile: HardwareProfile, problem: Problem) -> str:
    """Why nothing is left of a scale on a node count: where memory pruned everything, the smallest
    node count (doubling, up to 1024) at which some candidate of the same axes fits."""
    reasons = sorted({c.pruned.split(":")[0] for c in problem.pruned})
    where = f"{scale} on {nodes} node(s) x {spec.gpus_per_node}"
    if reasons != ["memory"] and "memory" not in reasons:
        first = problem.pruned[0].pruned if problem.pruned else "no candidates"
        return f"{where}: no candidate is left ({first}): widen search (e.g. search: {{parallelism: [...]}})"
    smallest = min(estimate_memory(c.cfg).total_gib for c in problem.pruned if c.pruned.startswith("memory"))
    n = nodes * 2
    while n <= 1024:
        for settings in space(spec, scale, n, profile):
            full = {**spec.run_settings(settings), "grad_accum": 1}
            try:
                cfg = RunConfig.from_dict(full)
            except (TypeError, ValueError):
                continue
            if layout_problem(cfg, "slurm") is None and \
                    estimate_memory(cfg).total_gib * (1 + spec.memory_margin) <= (problem.capacity_gib or 0):
                return (f"{where} fits nowhere: the smallest estimate is ~{smallest:.1f} GiB per device + "
                        f"{spec.memory_margin:.0%} margin, over {problem.capacity_gib:.1f} GiB ({problem.capacity_source});"
                        f" the smallest node count where a candidate fits is {n} ({cfg.parallelism}, micro_batch "
                        f"{cfg.micro_batch}, ac {cfg.ac}): tune at nodes: [{n}]")
        n *= 2
    return (f"{where} fits nowhere: the smallest estimate is ~{smallest:.1f} GiB per device, over "
            f"{problem.capacity_gib:.1f} GiB ({problem.capacity_source}), and no node count up to 1024 fits it")


def tied(a: Candidate, b: Candidate) -> bool:
    """Whether the model cannot tell two candidates apart: one family, predicted samples/s within 0.1%."""
    pa, pb = a.samples_per_s, b.samples_per_s
    return a.family == b.family and abs(pa - pb) <= 1e-3 * max(pa, pb)


def picks(ranked: list[Candidate], top_k: int, measured: set[str] = frozenset()) -> list[Candidate]:
    """What to measure: the top K of the ranking (a candidate tied with one chosen, which the model
    cannot tell apart from it, left out), then the best-ranked candidate of each layout family none
    of whose candidates is among them or measured already."""
    chosen: list[Candidate] = []
    for c in ranked:
        if len(chosen) == top_k:
            break
        if not any(tied(c, d) for d in chosen):
            chosen.append(c)
    covered = {c.family for c in chosen} | {c.family for c in ranked if c.run_id in measured}
    for c in ranked:
        if c.family not in covered:
            chosen.append(c)
            covered.add(c.family)
    return chosen
