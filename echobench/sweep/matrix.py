"""Matrix files: YAML -> validated settings -> the list of runs (and the skipped ones, with why).

A matrix (docs/reference/matrix.md) has `defaults`, `axes` (any RunConfig key; the runs are their
cartesian product), `configs` (optional: the configurations compared, each crossed with the axes
it does not set itself), `exclude` (drop combinations matching every key of an entry; a list value
matches any of its items) and `include` (extra single runs; an entry may carry its own
`time_limit`); `repeats: N` runs every run N times as independent launches (distinct run ids,
the same settings otherwise). `global_batch` or `global_batch_per_node` (x nodes), anywhere a run
key may stand, holds the global batch: each run's grad_accum is derived from it, and a run that
cannot reach it is skipped with the reason. The file is checked with pydantic, and run keys against their
RunConfig field: an unknown key, a wrong type or a bad value is an error naming the file, the key
and what is allowed. A combination that cannot run (a layout the framework lacks, TP wider than a
node, ...) is listed as skipped with its reason, never an error.

Everything that later reaches a shell script (names, SLURM options, env) is validated here;
the job script quotes it again (echobench.sweep.executors.slurm).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field, ValidationError, field_validator

from echobench import backends
from echobench.records.config import (FIELDS, RunConfig, base_type, check_value, choices, grad_accum_for, run_id,
                                      unknown_key, upgraded)
from echobench.hardware.devicememory import device_memory_gib
from echobench.records.layout import Layout, is_layout
from echobench.records.peaks import table_peak
from echobench.records.yamltext import yaml_problem
from echobench.sweep.cluster import (NAME_RE, ExecutorName, HardwareSettings, LocalSettings, MatrixError, SlurmSettings,
                                     Strict, UniqueKeyLoader, check_text, check_time,
                                     format_pydantic)
from echobench.sweep.site import merge_site, read_site, site_path

if TYPE_CHECKING:
    from echobench.predict.memory import MemoryEstimate

MAX_RUNS = 10_000  # a matrix expanding to more is refused (max_runs / --max-runs raise it)


class MatrixFile(Strict):
    name: str
    site: str | None = None  # a site file (echobench.sweep.site), relative to this file: merged in before the check
    executor: ExecutorName = "local"
    slurm: SlurmSettings = SlurmSettings()
    local: LocalSettings = LocalSettings()
    hardware: HardwareSettings = HardwareSettings()
    defaults: dict[str, Any] = {}
    axes: dict[str, list[Any]] = {}
    configs: list[dict[str, Any]] = []  # the configurations compared, each crossed with the axes it leaves unset
    exclude: list[dict[str, Any]] = []
    include: list[dict[str, Any]] = []
    repeats: int = Field(1, ge=1, le=100)  # independent launches of every run (repeat = 0 .. N-1)
    max_runs: int = Field(MAX_RUNS, ge=1)  # refuse a matrix that expands to more runs (a typo'd axis)

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return check_text(NAME_RE, "matrix name (letters, digits, . _ -)", v)


# Matrix keys that stand where run keys do but are no run setting: they set each run's grad_accum
# (global batch = micro_batch x data-parallel ranks x grad_accum; per node: times the run's nodes).
BATCH_KEYS = ("global_batch", "global_batch_per_node")


def _slot(key: str) -> str:
    """The two batch keys fill one slot: a layer that sets either replaces the other."""
    return "global_batch" if key in BATCH_KEYS else key


def check_matrix_value(key: str, value):
    """check_value, and the batch keys (integers >= 1)."""
    if key in BATCH_KEYS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} is not valid: allowed an integer >= 1 (samples per optimizer step"
                             f"{' per node' if key == 'global_batch_per_node' else ''})")
        return value
    if key not in FIELDS:
        raise ValueError(unknown_key([key], [*FIELDS, *BATCH_KEYS], "run key"))
    return check_value(key, value)


def card_beside(matrix_path: Path, card: str | None) -> str | None:
    """A matrix's `card` (FILE or FILE#ROW) with a relative FILE taken from the matrix file's folder, as
    a tune file's card is, and made absolute: the runs start wherever the sweep was started (a SLURM
    job in sbatch's folder), so a path relative to that would name another file, or none."""
    if not card:
        return card
    file, hash_, row = card.partition("#")
    return card if Path(file).is_absolute() else str((matrix_path.parent / file).resolve()) + hash_ + row


def _check_run_mapping(path: Path, where: str, mapping: dict, allow_lists: bool) -> dict:
    """Each run key's value checked against its RunConfig field (type, choices, bound) as a flag is;
    a card's file taken from the matrix's folder (card_beside)."""
    out = {}
    for key, value in mapping.items():
        try:
            if allow_lists and isinstance(value, list):
                out[key] = [check_matrix_value(key, v) for v in value]
            else:
                out[key] = check_matrix_value(key, value)
        except ValueError as exc:
            raise MatrixError(f"{path}: {where}.{key}: {exc}") from None
        if key == "card":
            out[key] = [card_beside(path, v) for v in out[key]] if isinstance(out[key], list) else \
                card_beside(path, out[key])
    if all(k in mapping for k in BATCH_KEYS):
        raise MatrixError(f"{path}: {where}: global_batch and global_batch_per_node both given: give one "
                          f"(global_batch_per_node x nodes is the global batch)")
    return out


@dataclass
class Matrix:
    path: Path
    text: str  # the file as read: the sweep directory keeps a copy
    spec: MatrixFile
    defaults: dict
    axes: dict[str, list]
    exclude: list[dict]
    include: list[dict]
    include_limits: list[str | None]  # per include entry: its time_limit, if any
    configs: list[dict] = field(default_factory=list)  # a list value: that key's values for the entry alone
    site: Path | None = None  # the site file it took (echobench.sweep.site), if any
    site_text: str = ""  # that file as read (the preflight's hash covers it; the sweep keeps a copy)
    site_flag: bool = False  # the site came from --site (commands the sweep starts are given it again)
    origins: dict[str, str] = field(default_factory=dict)  # "slurm.partition" -> "site FILE" / "matrix"

    @property
    def name(self) -> str:
        return self.spec.name


# Keys only a tune file has (echobench.tune.space.TuneFile; tests/test_matrix.py holds them so), and
# keys only a matrix file has: a file given to the wrong command is named as what it is.
TUNE_ONLY_KEYS = frozenset({"search", "top_k", "budget_gpu_hours", "max_rounds", "memory_margin", "bias"})  # card: a run setting too
MATRIX_ONLY_KEYS = frozenset({"axes", "configs", "exclude", "include", "repeats", "max_runs"})


def wrong_kind_of_file(data: dict, path: Path, expected: str) -> str | None:
    """One line when `data` (a YAML mapping given as a `expected` file: "matrix" or "tune") is plainly
    another kind of echobench file, naming the command that takes it; else None."""
    keys = set(data)
    if "name" not in keys and keys and keys <= set(FIELDS):
        return f"{path}: this is a run file (run settings only): `echobench run --config {path}`"
    if "name" not in keys and keys and keys <= {"executor", "slurm", "local", "hardware"}:
        return f"{path}: this is a site file (the cluster's sections only): `--site {path}`, or site: in a {expected} file"
    if expected == "matrix" and keys & TUNE_ONLY_KEYS and not keys & MATRIX_ONLY_KEYS:
        return f"{path}: this is a tune file ({', '.join(sorted(keys & TUNE_ONLY_KEYS))}): `echobench tune {path}`"
    if expected == "tune" and keys & MATRIX_ONLY_KEYS and not keys & TUNE_ONLY_KEYS:
        return (f"{path}: this is a matrix file ({', '.join(sorted(keys & MATRIX_ONLY_KEYS))}): "
                f"`echobench plan {path}`, `echobench sweep {path}`")
    return None


def parse_matrix(text: str, path: Path | str = "<matrix>", site: Path | None = None) -> Matrix:
    """The matrix in `text` (read from `path`), over its site file (`site`: --site FILE, else the
    file's `site:` key; echobench.sweep.site), checked; MatrixError with one line otherwise."""

    path = Path(path)
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except MatrixError as exc:
        raise MatrixError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise MatrixError(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise MatrixError(f"{path}: expected a mapping with name, axes, defaults, ...")
    if problem := wrong_kind_of_file(data, path, "matrix"):
        raise MatrixError(problem)
    site_file = site_path(path, data, site)
    site_data = read_site(site_file) if site_file is not None else {}
    data, origins = merge_site(site_data, data, f"site {site_file}")
    try:
        spec = MatrixFile.model_validate(data)
    except ValidationError as exc:
        raise MatrixError(format_pydantic(path, exc, MatrixFile)) from None
    try:
        device_memory_gib(spec.hardware.memory_gib, spec.hardware.device)
    except ValueError as exc:
        raise MatrixError(f"{path}: hardware.device: {exc}") from None
    defaults = _check_run_mapping(path, "defaults", spec.defaults, allow_lists=False)
    axes = {}
    for key, values in spec.axes.items():
        if not values:
            raise MatrixError(f"{path}: axes.{key}: an axis needs at least one value")
        axes.update(_check_run_mapping(path, "axes", {key: values}, allow_lists=True))
    _check_run_mapping(path, "axes", {k: v[0] for k, v in axes.items()}, allow_lists=False)  # both batch keys?
    configs = []
    for i, entry in enumerate(spec.configs):
        if empty := next((k for k, v in entry.items() if v == []), None):
            raise MatrixError(f"{path}: configs[{i}].{empty}: give at least one value")
        configs.append(_check_run_mapping(path, f"configs[{i}]", entry, allow_lists=True))
    exclude = [_check_run_mapping(path, f"exclude[{i}]", e, allow_lists=True) for i, e in enumerate(spec.exclude)]
    include, include_limits = [], []
    for i, entry in enumerate(spec.include):
        entry = dict(entry)
        limit = entry.pop("time_limit", None)  # a per-run time limit (slurm.time / local.time otherwise)
        if limit is not None:
            try:
                limit = check_time(limit)
            except ValueError as exc:
                raise MatrixError(f"{path}: include[{i}].time_limit: {exc}") from None
        include.append(_check_run_mapping(path, f"include[{i}]", entry, allow_lists=False))
        include_limits.append(limit)
    for i, e in enumerate(exclude):
        if not e:
            raise MatrixError(f"{path}: exclude[{i}] is empty: it would exclude every run")
    return Matrix(path, text, spec, defaults, axes, exclude, include, include_limits, configs, site_file,
                  site_file.read_text() if site_file is not None else "", site is not None, origins)


def load_matrix(path: Path | str, site: Path | None = None) -> Matrix:
    """The matrix file at `path` (parse_matrix), over `site` (--site FILE) where given."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"{path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise MatrixError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): "
                          f"save the file as UTF-8") from None
    return parse_matrix(text, path, site)


# ---- expansion ----

@dataclass
class PlannedRun:
    id: str
    cfg: RunConfig
    settings: dict  # the keys the matrix set (what `--only` and the run.yaml see)
    time_limit: str | None = None  # this run's own limit (an include's time_limit), else the matrix's
    memory: Any = None  # echobench.predict.memory.MemoryEstimate
    fits: bool | None = None  # None: device memory unknown


@dataclass
class SkippedRun:
    settings: dict
    reason: str
    cfg: RunConfig | None = None  # None when the settings themselves are invalid


@dataclass
class Plan:
    matrix: Matrix
    runs: list[PlannedRun] = field(default_factory=list)
    skipped: list[SkippedRun] = field(default_factory=list)
    excluded: int = 0
    duplicates: int = 0

    def by_id(self, rid: str) -> PlannedRun | None:
        return next((r for r in self.runs if r.id == rid), None)


def _matches(settings: dict, entry: dict) -> bool:
    for key, want in entry.items():
        values = want if isinstance(want, list) else [want]
        if settings.get(key) not in values:
            return False
    return True


def _values(value) -> list:
    return value if isinstance(value, list) else [value]


def _crossed_axes(matrix: Matrix, entry: dict) -> dict[str, list]:
    """The axes a configs entry is crossed with: those whose key (slot) it does not set itself."""
    own = {_slot(k) for k in entry}
    return {k: v for k, v in matrix.axes.items() if _slot(k) not in own}


def _product(mapping: dict) -> list[dict]:
    """Every combination of a mapping's values (a list is its values, anything else one value)."""
    keys = list(mapping)
    return [dict(zip(keys, values)) for values in itertools.product(*(_values(mapping[k]) for k in keys))]


def _combinations(matrix: Matrix) -> list[dict]:
    """The axes' product; with configs, each entry's own product crossed with the axes it leaves unset."""
    if not matrix.configs:
        return _product(matrix.axes) if matrix.axes or not matrix.include else []
    return [{**a, **c} for entry in matrix.configs for c in _product(entry)
            for a in _product(_crossed_axes(matrix, entry))]


def _merge(*layers: dict) -> dict:
    """Later layers override earlier ones key by key; the two batch keys count as one key."""
    out: dict = {}
    for layer in layers:
        if any(k in layer for k in BATCH_KEYS):
            for k in BATCH_KEYS:
                out.pop(k, None)
        out.update(layer)
    return out


def check_size(matrix: Matrix, max_runs: int | None = None) -> None:
    """Refuses a matrix whose axes, configs and includes give more than max_runs runs (default: the
    file's max_runs), counted from the sizes before anything is expanded."""
    limit = max_runs or matrix.spec.max_runs
    sizes = {k: len(v) for k, v in matrix.axes.items()}

    def count(mapping: dict) -> int:
        return math.prod(len(_values(v)) for v in mapping.values())

    if matrix.configs:
        combos = sum(count(e) * count(_crossed_axes(matrix, e)) for e in matrix.configs)
    else:
        combos = math.prod(sizes.values()) if sizes else (0 if matrix.include else 1)
    total = (combos + len(matrix.include)) * matrix.spec.repeats
    if total > limit:
        shape = " x ".join([f"{len(matrix.configs)} configs"] * bool(matrix.configs)
                           + [f"{k} {n}" for k, n in sizes.items()])
        raise MatrixError(f"{matrix.path}: axes: {total:,} runs ({shape}"
                          + (f", + {len(matrix.include)} included" if matrix.include else "")
                          + (f", x {matrix.spec.repeats} repeats" if matrix.spec.repeats > 1 else "")
                          + f") are over the limit of {limit:,}: split the matrix, or raise the limit "
                            f"(max_runs: N in the file, or --max-runs N)")


def with_hardware(settings: dict[str, Any], hardware: HardwareSettings) -> dict[str, Any]:
    """A run's settings (a RunConfig dict) as a matrix's hardware section makes them: its peak_tflops
    where the run sets none, and device auto made cuda where hardware.device names a GPU (a datasheet
    row: every row is one), since without one the run is an error (bench.no_gpu_problem). The sweep's
    runs and the tune's candidates both take it, so that their run ids agree."""
    out = dict(settings)
    if hardware.peak_tflops is not None and "peak_tflops" not in out:
        out["peak_tflops"] = hardware.peak_tflops
    if out.get("device", "auto") == "auto" and hardware.device is not None and table_peak(hardware.device) is not None:
        out["device"] = "cuda"
    return out


def expand(matrix: Matrix, executor: str | None = None, max_runs: int | None = None) -> Plan:
    """Every run of the matrix, in file order; invalid combinations become SkippedRun.
    Raises MatrixError when it would give more than max_runs runs (check_size)."""
    check_size(matrix, max_runs)
    spec = matrix.spec
    executor = executor or spec.executor
    base = dict(matrix.defaults)
    # Processes per node of a run that is not `single`: local.gpus_per_node on the local executor,
    # else (and where it is unset) slurm.gpus_per_node.
    per_node = (spec.local.gpus_per_node if executor == "local" else None) or spec.slurm.gpus_per_node
    # no axes nor configs: the runs are the includes alone (not also the bare defaults)
    plan = Plan(matrix)
    candidates = []
    for combo in _combinations(matrix):
        settings = _merge(base, combo)
        if any(_matches(settings, e) for e in matrix.exclude):
            plan.excluded += 1
            continue
        candidates.append((settings, None))
    candidates += [(_merge(base, inc), limit) for inc, limit in zip(matrix.include, matrix.include_limits)]
    seen = set()
    for settings, limit in candidates:
        full = {k: v for k, v in settings.items() if k not in BATCH_KEYS}
        if "gpus_per_node" not in full:
            layout = full.get("parallelism", FIELDS["parallelism"].default)
            full["gpus_per_node"] = 1 if is_layout(layout) and Layout.parse(layout).single else per_node
        try:
            cfg = RunConfig.from_dict(with_hardware(full, spec.hardware))
        except (TypeError, ValueError) as exc:
            plan.skipped.append(SkippedRun(settings, str(exc)))
            continue
        if problem := backends.layout_problem(cfg, executor) or card_run_problem(cfg):
            plan.skipped.append(SkippedRun(settings, problem, cfg))
            continue
        if any(k in settings for k in BATCH_KEYS):
            try:
                cfg = _hold_global_batch(matrix, settings, cfg)
            except MatrixError:
                raise  # the file contradicts itself: no run of it is right
            except ValueError as exc:
                plan.skipped.append(SkippedRun(settings, str(exc)))
                continue
            settings = {**settings, "grad_accum": cfg.grad_accum}
        if (first := run_id(cfg)) in seen:
            plan.duplicates += 1
            continue
        for k in range(spec.repeats):
            repeat = cfg if k == 0 else replace(cfg, repeat=cfg.repeat + k)
            rid = first if k == 0 else run_id(repeat)
            seen.add(rid)
            plan.runs.append(PlannedRun(rid, repeat, settings, limit))
    if executor == "slurm":
        check_fabric_named(matrix, plan.runs)
    capacity = device_memory_gib(spec.hardware.memory_gib, spec.hardware.device)
    for run in plan.runs:
        run.memory = run_memory(run.cfg)
        run.fits = None if capacity is None else run.memory.total_gib <= capacity
    return plan


def run_memory(cfg: RunConfig) -> MemoryEstimate:
    """A planned run's per-GPU memory: Echo's estimate (predict.memory); a card run's from its card
    (predict.cards.memory at the layout `validate measured` prices the run with, autocast included),
    with the same overhead beside it (on a CPU without the resident baseline its run measures)."""
    from echobench.predict.memory import MemoryEstimate, estimate_memory, on_gpu, overhead_bytes

    if cfg.card is None:
        return estimate_memory(cfg)
    from echobench.predict.cards.memory import card_memory_parts
    from echobench.predict.cards.run import measured_layout, run_card

    workload = run_card(cfg.card)
    precision = cfg.precision_on("cpu" if cfg.device == "cpu" else "cuda")
    part = card_memory_parts(workload.card, measured_layout(cfg, workload.seq, precision, cfg.compile is True))
    tensors = sum(part.values())
    return MemoryEstimate(part["weights"], part["gradients"], part["optimizer"], part["activations"], 0.0, 0.0,
                          overhead_bytes(tensors, on_gpu(cfg)))


def card_run_problem(cfg: RunConfig) -> str | None:
    """Why a card run cannot run (its card not there or not valid, a layout the card refuses), found
    before any job is submitted, as `echobench run --card` finds it before its launch; None for Echo."""
    if cfg.card is None:
        return None
    from echobench.backends.checks import card_problem
    from echobench.predict.cards.run import run_card
    from echobench.predict.errors import PredictError

    try:
        return card_problem(cfg, run_card(cfg.card))
    except PredictError as exc:
        return str(exc)


def _hold_global_batch(matrix: Matrix, settings: dict, cfg: RunConfig) -> RunConfig:
    """cfg with the grad_accum that makes the settings' global batch (global_batch, or
    global_batch_per_node x nodes); ValueError (the run is skipped) where none does; MatrixError
    where the settings also give a grad_accum that makes another."""
    key = next(k for k in BATCH_KEYS if k in settings)
    want = settings[key] * (cfg.nodes if key == "global_batch_per_node" else 1)
    how = f"global_batch_per_node {settings[key]} x {cfg.nodes} nodes = " if key == "global_batch_per_node" else ""
    try:
        accum, problem = grad_accum_for(want, cfg.micro_batch, cfg.dp), None
    except ValueError as exc:
        accum, problem = None, str(exc)
    if "grad_accum" not in settings:
        if problem:
            raise ValueError(how + problem)
        return replace(cfg, grad_accum=accum)
    if accum != cfg.grad_accum:
        raise MatrixError(f"{matrix.path}: run {run_id(cfg)}: grad_accum {cfg.grad_accum} makes global batch "
                          f"{cfg.global_batch} (micro_batch {cfg.micro_batch} x {cfg.dp} data-parallel ranks x "
                          f"{cfg.grad_accum}), but {how}global batch {want} "
                          + (f"needs grad_accum {accum}" if accum is not None else f"cannot be made ({problem})")
                          + ": drop grad_accum or the global batch")
    return cfg


def gpu_run(run: PlannedRun, slurm: SlurmSettings) -> bool:
    """Whether a SLURM run of this matrix runs on GPUs (it asks for them and is not a CPU run)."""
    return slurm.request_gpus and run.cfg.device != "cpu"


def check_fabric_named(matrix: Matrix, runs: list[PlannedRun]) -> None:
    """Multi-node GPU runs need slurm.fabric named: a silent default would run NCCL on whatever it
    finds, sockets included, and report a low MFU as a result."""
    slurm = matrix.spec.slurm
    if slurm.fabric is None and any(r.cfg.nodes > 1 and gpu_run(r, slurm) for r in runs):
        raise MatrixError(f"{matrix.path}: slurm.fabric: runs on several GPU nodes need their fabric named: "
                          f"infiniband, slingshot, tcp, or none (NCCL's own choices, e.g. where the cluster's "
                          f"modules set its variables)")


def parse_only(items: list[str]) -> dict[str, list]:
    """--only KEY=VALUE (repeatable; the same key twice means either value)."""
    wanted: dict[str, list] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep:
            raise MatrixError(f"--only {item!r}: expected KEY=VALUE, e.g. --only scale=3B")
        if key not in FIELDS:
            raise MatrixError(f"--only {item!r}: {unknown_key([key], list(FIELDS), 'run key')}")
        # Text settings stay text ("800M", "on"); others are read as YAML (numbers, true / false).
        value = text if base_type(key) is str or choices(key) else yaml.safe_load(text) if text else text
        try:
            wanted.setdefault(key, []).append(check_value(key, value))
        except ValueError as exc:
            raise MatrixError(f"--only {item!r}: {exc}") from None
    return wanted


def settings_match(settings: dict, only: dict[str, list]) -> bool:
    """Whether stored settings (a run.yaml, a record's config) have every --only value; a key they
    lack (older than it) takes its default."""
    full = {**{name: f.default for name, f in FIELDS.items()}, **upgraded(settings)}
    return all(full.get(k) in vs for k, vs in only.items())


def select(runs: list[PlannedRun], only: dict[str, list]) -> list[PlannedRun]:
    return [r for r in runs if all(getattr(r.cfg, k) in vs for k, vs in only.items())]
