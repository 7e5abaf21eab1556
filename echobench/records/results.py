"""The result record (`result.json`, one per run): one typed, versioned model that builds, saves,
loads, validates and migrates every record; the figures' conventions; reading records back.

As asv's results keep an api_version with an update function per older version: a record carries
`schema_version`; `Record.load` brings an older one up to SCHEMA_VERSION (MIGRATIONS), then
validates it; a record of an unknown or newer version is named, never read as if it were this one.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
from datetime import datetime, timezone
from pathlib import Path
from types import UnionType
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator

from echobench.records.atomic import write_json_atomic
from echobench.records.config import RunConfig, configuration_id, run_id, upgraded
from echobench.records.peaks import peak_precision_of, table_peak
from echobench.records.run_figures import max_of, peak_mem_figures, step_figures, window_figures
from echobench.records.states import RunState, Status

# 2: throughput and MFU over the whole measured window (1: from the median step); repeats,
#    peak_precision, fp8 MFU, allocator counters. Readers migrate older records (migrate()).
#    Figures added since (peak_mem_allocated_gib, the padding figures) default to None, which reads
#    as unknown in an older record: no new version, nothing to migrate.
# 3: sdpa_backends renamed sdpa_backends_predicted (torch's choice at the run's shapes, asked after the
#    run: not a kernel seen running; attention_kernels holds those); compiles inside the measured window
#    counted (compiles_in_window: unknown, None, in an older record).
SCHEMA_VERSION = 3
RECORD_FILE = "result.json"
PLAN_FILE = "plan.json"  # what a sweep's plan said about a run (its memory estimate), beside its record


def peak_mem_for_estimate(record: Record) -> float | None:
    """The measured peak that the plan's memory estimate (echobench.predict.memory) is compared with: the
    allocated peak where the record has one (GPU; from its ranks' memory stats in a record written
    before peak_mem_allocated_gib), which leaves out the allocator's cache, else peak_mem_gib."""
    if record.peak_mem_allocated_gib is not None:
        return record.peak_mem_allocated_gib
    allocated = max_of([r.memory for r in record.per_rank], "peak_allocated_gib")
    return allocated if allocated is not None else record.peak_mem_gib


# ---- the record ----

# What says where a job ran, read from the scheduler's variables (SLURM sets them in every task).
SCHEDULER_VARS = {"job_id": "SLURM_JOB_ID", "nodelist": "SLURM_JOB_NODELIST", "partition": "SLURM_JOB_PARTITION",
                  "cluster": "SLURM_CLUSTER_NAME", "account": "SLURM_JOB_ACCOUNT", "qos": "SLURM_JOB_QOS"}
COMM_PREFIXES = ("NCCL_", "FI_", "OFI_NCCL_", "UCX_", "TORCH_NCCL_")
# The image the job script names (slurm.container), then container runtimes' own variables: pyxis/enroot, apptainer, singularity, docker-style images.
CONTAINER_VARS = ("ECHOBENCH_CONTAINER_IMAGE", "SLURM_CONTAINER", "PYXIS_CONTAINER_IMAGE", "ENROOT_ROOTFS", "APPTAINER_CONTAINER",
                  "SINGULARITY_CONTAINER", "CONTAINER_IMAGE")


def cpu_device_name() -> str:
    """This machine's CPU as a record names its device: "CPU <model name> (<N> cores)"."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model} ({os.cpu_count()} cores)"


def scheduler_context(environ=None) -> dict:
    """The scheduler, fabric and container context of this process, for the record's env."""
    environ = os.environ if environ is None else environ
    scheduler = {k: environ[v] for k, v in SCHEDULER_VARS.items() if environ.get(v)}
    comm = {k: v for k, v in sorted(environ.items()) if k.startswith(COMM_PREFIXES)}
    container = next((environ[v] for v in CONTAINER_VARS if environ.get(v)), None)
    return {"scheduler": scheduler or None, "comm_env": comm or None, "container": container,
            "nccl_transport": environ.get("ECHOBENCH_NCCL_TRANSPORT") or None}  # set by the sweep from its preflight


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Env(BaseModel):
    """Where and with what a run ran (hardware.env_info); other echobench versions' keys are kept."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    device_name: str | None = None
    device_type: str | None = None
    hostname: str | None = None
    pid: int | None = None  # tells apart the launches of repeats
    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    cuda_device_max_connections: str | None = None
    cuda_alloc_conf: str | None = None  # PYTORCH_CUDA_ALLOC_CONF (bench sets expandable_segments on GPUs)
    cudnn: str | None = None  # the cuDNN torch loaded (its SDPA kernel's version matters)
    transformers: str | None = None
    megatron_core: str | None = None
    transformer_engine: str | None = None
    torchao: str | None = None
    echobench: str | None = None
    git_commit: str | None = None
    time: str | None = None
    recorded_by: str | None = None  # who wrote a record the run could not write itself
    driver: str | None = None  # the NVIDIA kernel driver (GPU hosts)
    scheduler: dict[str, str] | None = None  # job id, node list, partition, cluster (SCHEDULER_VARS)
    comm_env: dict[str, str] | None = None  # NCCL_* / FI_* / OFI_NCCL_* as the run saw them (the fabric)
    nccl_transport: str | None = None  # the network NCCL chose across nodes, as its sweep's preflight saw it
    container: str | None = None  # the image a container runtime reports


class RankEntry(BaseModel):
    """One rank's line in `per_rank`: its figures (a run that finished) or its failure."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    rank: int
    hostname: str | None = None
    median_step_time_s: float | None = None
    data_wait_frac: float | None = None
    peak_mem_gib: float | None = None
    memory: dict[str, Any] = {}
    losses: list[float] | None = None
    status: Status | None = None
    error: str | None = None
    failed_at: float | None = None  # time.time(): the first failure is the cause
    exit_code: int | None = None  # a worker that died without an error of its own: how (echobench.train.torchrun)
    signal: str | None = None


class Record(BaseModel):
    """One run's `result.json`. Fields without a default are in every record; figures stay None
    until measured, so a failed run keeps its settings and why it failed. Free-form mappings
    (flops_breakdown, backend, breakdown, config) belong to their writers. Unknown top-level keys
    (from another echobench version) are dropped on reading; assigning one is an error."""

    model_config = ConfigDict(extra="ignore", validate_assignment=True, protected_namespaces=())
    NOT_COLUMNS: ClassVar[frozenset[str]] = frozenset({"traceback_tail", "log_tail"})  # long text: not in the table

    schema_version: int = SCHEMA_VERSION
    run_id: str
    repeat: int = 0
    status: Status
    error: str = ""
    # the settings (all of them in `config`, the run's RunConfig)
    scale: str  # the Echo preset, or a card run's card label (config.card_label)
    framework: str
    parallelism: str
    tp: int
    dp: int
    nodes: int
    gpus_per_node: int
    world_size: int
    micro_batch: int
    global_batch: int
    audio_frames: int
    text_tokens: int
    speaker_frames: int
    precision: str
    compile: bool | None  # whether it compiled (what ran: bench); None where unknown (compile auto, no run)
    # what compile produced (kernels.compile_counts): dynamo graphs, graph breaks and their first reasons
    compile_graphs: int | None = None
    compile_graph_breaks: int | None = None
    compile_break_reasons: list[str] | None = None
    compile_note: str | None = None
    ac: str
    grad_accum: int = 1  # micro-batches per optimizer step; global_batch counts them all
    # per attention (dit, speaker_encoder, text_encoder): measured micro-batches per path (none: no
    # mask; split: the DiT's dropped conditioning without a mask, model.components.merged_attention; flex; dense) and each path's share of the window's attention FLOPs (bench_record.attention_figures);
    # on a GPU, the attention kernels each warm-up variant ran (a profiled pass: their names and launches);
    # the SDPA kernels torch would choose at the run's shapes (kernels.sdpa_choices: predicted)
    attention_paths: dict[str, dict[str, int]] | None = None
    attention_flop_shares: dict[str, dict[str, float]] | None = None
    attention_kernels: dict[str, dict[str, int]] | None = None
    sdpa_backends_predicted: dict[str, str] | None = None
    # compiles (kernels.CompileWatch): inside the measured window the figures come from (0: none; a
    # run with any is an error), the windows measured again because torch compiled in them, the
    # micro-batch variants warm-up ran (bench_warmup), every compile of the run by its trigger
    compiles_in_window: int | None = None
    window_restarts: list[dict[str, Any]] | None = None
    warmup_variants: list[str] | None = None
    compiles: dict[str, int] | None = None
    te: bool | None = None  # whether TransformerEngine kernels ran (the backend's info)
    # a card run (setting card): the card, its source, the layout it publishes, the FLOP convention of
    # the MFU numerator and, for a published row, the row's own convention and the MFU under it
    card: dict[str, Any] | None = None
    encoder_model: str | None = None
    frozen_encoder: bool | None = None
    steps: int
    warmup_steps: int
    data: str | None = None
    seed: int | None = None
    # step times: each measured step at its slowest rank
    step_times_s: list[float] | None = None
    step_time_s: float | None = None
    step_time_p10_s: float | None = None
    step_time_p90_s: float | None = None
    step_time_mean_s: float | None = None
    step_time_mean_vs_median: float | None = None
    # the measured window (window_figures)
    measured_steps: int | None = None
    measured_time_s: float | None = None
    measured_samples: int | None = None
    measured_model_flops: int | None = None
    measured_hardware_flops: int | None = None
    # padding (padding_figures): None in a record written before they were counted, i.e. unknown
    measured_padded_flops: int | None = None
    padded_flops_frac: float | None = None
    padded_frac_latent: float | None = None
    padded_frac_text: float | None = None
    padded_frac_speaker: float | None = None
    bucket_steps: dict[int, int] | None = None  # batching=bucket: measured steps per bucket (audio frames padded to)
    samples_per_s: float | None = None
    audio_seconds_per_s: float | None = None
    model_flops_per_sample: float | None = None
    hardware_flops_per_sample: float | None = None
    flops_breakdown: dict[str, Any] | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    hfu: float | None = None
    mfu_vs_ceiling: float | None = None
    mfu_fp8_peak: float | None = None
    # the MFU denominator (hardware.resolve_peak)
    peak_tflops: float | None = None
    peak_source: str | None = None
    peak_precision: str | None = None
    peak_fp8_tflops: float | None = None
    ceiling_tflops: float | None = None
    # memory, data, ranks (peak_mem_figures: max over ranks)
    peak_mem_gib: float | None = None  # reserved on GPU, RSS on CPU
    peak_mem_allocated_gib: float | None = None  # GPU: the allocator's peak of live tensors
    peak_mem_reserved_gib: float | None = None  # GPU: ... with its cache (= peak_mem_gib there)
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    data_wait_frac: float | None = None
    data_wait_clock: str | None = None  # what data_wait_frac measures: cuda_events or host
    slowest_rank: int | None = None
    losses: list[float] | None = None
    skipped_samples: int | None = None
    backend: dict[str, Any] | None = None
    per_rank: list[RankEntry] = []
    # --trace (trace: true)
    profile_traces: list[str | None] | None = None
    profiled_steps: list[int] | None = None
    breakdown: dict[str, Any] | None = None
    # a failure: the rank that explains it, and what the job's log and its own record said
    traceback_tail: str | None = None
    cause_rank: int | None = None  # the rank whose failure explains the run (originating_failure)
    failed_ranks: list[int] | None = None
    log_tail: str | None = None
    run_error: str | None = None
    migrated_from: int | None = None
    config: dict[str, Any] | None = None
    env: Env

    _path: Path | None = PrivateAttr(default=None)

    @field_validator("te", mode="before")
    @classmethod
    def _te_setting_is_unknown(cls, value):
        # Records written for jobs that died (stub_record before this model) kept the *setting*
        # (auto / on / off) here, not whether the kernels ran: that is unknown.
        return None if value in ("auto", "on", "off") else value

    # ---- building ----

    @classmethod
    def of_settings(cls, cfg: RunConfig, resolved: dict | None = None, **fields) -> Record:
        """A record of cfg's settings, no figures; `fields` add to it (status, precision, env...).
        `resolved`: the auto settings as the run resolved them on its device (compile,
        sequence_parallel); they replace the settings in `config` too, so that reports group runs
        by what ran."""
        config = {**cfg.to_dict(), **(resolved or {})}
        return cls(run_id=run_id(cfg), repeat=cfg.repeat, scale=cfg.workload, framework=cfg.framework,
                   parallelism=cfg.parallelism, tp=cfg.tp, dp=cfg.dp, nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node,
                   world_size=cfg.world_size, micro_batch=cfg.micro_batch, global_batch=cfg.global_batch,
                   audio_frames=cfg.audio_frames, text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                   compile=None if config["compile"] == "auto" else config["compile"], ac=cfg.ac,
                   grad_accum=cfg.grad_accum,
                   encoder_model=cfg.model_config().text_encoder.name, frozen_encoder=cfg.frozen_encoder,
                   steps=cfg.steps, warmup_steps=cfg.warmup_steps, data=cfg.data, seed=cfg.seed, config=config,
                   **fields)

    @classmethod
    def without_run(cls, cfg: RunConfig, status: str, error: str, env: Env | None = None, **details) -> Record:
        """The record of a run that died before writing one (timeout, cancel, node failure, a crash
        before the benchmark started): its settings, no figures, and why; `env`, where and by whom it
        was written (by default: the sweep, here)."""
        env = env or Env(time=now_iso(), hostname=socket.gethostname(),
                         recorded_by="echobench sweep (the job left no record of its own)")
        return cls.of_settings(cfg, status=status, error=error, precision=cfg.precision, peak_tflops=cfg.peak_tflops,
                               env=env, **details)

    def fail(self, failures: list[dict]) -> Record:
        """This run failed on the ranks that left these failures (OUT/ranks/rank-N.json): the one
        that explains it (originating_failure) gives status, error and traceback."""
        first = originating_failure(failures)
        self.update(status=first["status"], error=first["error"], traceback_tail=first.get("traceback_tail"),
                    cause_rank=first["rank"], failed_ranks=sorted(f["rank"] for f in failures),
                    per_rank=[{k: v for k, v in f.items() if k != "traceback_tail"} for f in failures])
        if mems := [f["memory"] for f in failures if f.get("memory")]:
            self.update(**peak_mem_figures(mems))
        return self

    def update(self, **fields) -> Record:
        """Sets fields, each checked against its type (an unknown name is an error)."""
        for name, value in fields.items():
            setattr(self, name, value)
        return self

    # ---- storing ----

    def save(self, out_dir: Path) -> Path:
        """Writes OUT_DIR/result.json atomically; returns its path."""
        path = Path(out_dir) / RECORD_FILE
        write_json_atomic(path, self.model_dump())
        return path

    @classmethod
    def load(cls, path: Path) -> Record:
        """Reads one record, migrated to SCHEMA_VERSION and validated; a ValueError naming the
        file (and the field) when it is not one this echobench reads."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable result record ({exc})") from exc
        record = cls.parse(data, str(path))
        record._path = path
        return record

    @classmethod
    def parse(cls, data, where: str = "record") -> Record:
        """A record from its JSON object (migrated, validated); ValueError naming `where` if not one."""
        if not isinstance(data, dict) or "status" not in data or "run_id" not in data:
            raise ValueError(f"{where}: not a result record (no run_id / status)")
        try:
            return cls.model_validate(migrate(data, where))
        except ValidationError as exc:
            raise ValueError(f"{where}: invalid result record: {validation_text(exc)}") from None

    @property
    def path(self) -> Path | None:
        """The file the record was loaded from (None for one built in this process)."""
        return self._path

    # ---- the table ----

    @classmethod
    def columns(cls) -> list[str]:
        """The table's columns (records_frame): every single-valued field, env's too, then two derived."""
        return [*_scalar_fields(cls), *_scalar_fields(Env), "samples_per_s_per_gpu", "path"]

    def to_row(self) -> dict:
        row = {name: getattr(self, name) for name in _scalar_fields(Record)}
        row.update({name: getattr(self.env, name) for name in _scalar_fields(Env)})
        row["samples_per_s_per_gpu"] = self.samples_per_s / self.world_size if self.samples_per_s else None
        row["path"] = str(self.path) if self.path else None
        return row


def _scalar_fields(model: type[BaseModel]) -> list[str]:
    """Fields holding one number, string or flag (not a list, mapping or nested model)."""
    return [name for name, info in model.model_fields.items()
            if name not in getattr(model, "NOT_COLUMNS", ()) and _single_valued(info.annotation)]


def _single_valued(annotation) -> bool:
    if get_origin(annotation) is Literal:
        return True
    if get_origin(annotation) in (Union, UnionType):  # X | None
        return all(_single_valued(a) for a in get_args(annotation))
    return annotation in (int, float, str, bool, type(None))


def validation_text(exc: ValidationError) -> str:
    """A pydantic error as one line: the missing fields, then each wrong one with what is wrong."""
    missing, wrong = [], []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "missing":
            missing.append(field)
        else:
            wrong.append(f"{field}: {err['msg']} (got {err.get('input')!r:.60})")
    return "; ".join(([f"missing {', '.join(missing)}"] if missing else []) + wrong)


# ---- failures: which rank explains a run ----

# An OOM or a time limit anywhere explains the other ranks' errors.
STATUS_RANK = {RunState.OOM: 0, RunState.TIMEOUT: 1, RunState.CANCELLED: 2, RunState.PREEMPTED: 2, RunState.ERROR: 3}
# What a rank says when another one is gone (gloo, NCCL, c10d's store): a consequence, not a cause.
PEER_LOST = re.compile(r"connection (?:reset|closed|refused)|broken pipe|remote process exited|"
                       r"communicator was aborted|watchdog caught|timed out (?:after \d+ seconds )?waiting|wait timeout|got 0 bytes|"
                       r"DistNetworkError",
                       re.IGNORECASE)
# Signals that stop a worker from outside as part of a teardown (srun --kill-on-bad-exit, scancel).
TEARDOWN_SIGNALS = {"SIGTERM", "SIGINT", "SIGHUP"}


def is_consequence(failure: dict) -> bool:
    """Whether a failure reads as what a rank meets when another one is gone (or being stopped)."""
    if failure.get("stopped"):  # no word of its own: stopped with the run (echobench.train.launch.every_rank)
        return True
    if failure.get("signal"):
        return failure["signal"] in TEARDOWN_SIGNALS
    return bool(PEER_LOST.search(f"{failure.get('error', '')}\n{failure.get('traceback_tail') or ''}"))


def originating_failure(failures: list[dict]) -> dict:
    """The failure that explains the run: an OOM first; then a rank's own failure (an error, a
    worker killed by a signal) before what its peers met when it was gone ("connection reset by
    peer", a collective timeout); then the earliest one."""
    return min(failures, key=lambda f: (STATUS_RANK.get(f["status"], 3), is_consequence(f),
                                        f.get("failed_at") or float("inf"), f["rank"]))


# ---- older records ----

def _from_v1(record: dict) -> None:
    """Version 1 took samples/s and MFU from the median step. Its records keep the slowest rank's
    time of every measured step, so the window figures are recomputed from them; the counts v1
    did not keep are derived (samples = samples/s x median step x steps) or left to Record's defaults."""
    record.setdefault("peak_precision", peak_precision_of(record.get("peak_source")))
    times = record.get("step_times_s")
    needed = ("samples_per_s", "step_time_s", "model_flops_per_sample", "audio_seconds_per_s", "peak_tflops",
              "world_size")
    if record.get("status") != RunState.OK or not times or any(record.get(k) is None for k in needed):
        return
    n, median = len(times), record["step_time_s"]
    samples = round(record["samples_per_s"] * median * n)
    hw_per_sample = record.get("hardware_flops_per_sample") or record["model_flops_per_sample"]
    if record.get("precision") == "fp8" and (record.get("env") or {}).get("device_name"):
        fp8 = table_peak(record["env"]["device_name"], "fp8")
        record["peak_fp8_tflops"] = fp8[0] if fp8 else None
    record.update(step_figures(times))
    record.update(measured_samples=samples, measured_model_flops=round(record["model_flops_per_sample"] * samples),
                  measured_hardware_flops=round(hw_per_sample * samples))
    record.update(window_figures(
        measured_time_s=record["measured_time_s"], samples=samples, model_flops=record["measured_model_flops"],
        hardware_flops=record["measured_hardware_flops"],
        audio_seconds=record["audio_seconds_per_s"] * median * n, world_size=record["world_size"],
        peak_tflops=record["peak_tflops"], ceiling_tflops=record.get("ceiling_tflops"),
        peak_fp8_tflops=record.get("peak_fp8_tflops")))


def _from_v2(record: dict) -> None:
    """Version 2 -> 3: sdpa_backends was torch's choice asked at the run's shapes, not a kernel seen running."""
    record["sdpa_backends_predicted"] = record.pop("sdpa_backends", None)


MIGRATIONS = {1: _from_v1, 2: _from_v2}  # version -> the function that brings a record to the next version


def migrate(record: dict, where: str = "record") -> dict:
    """Brings a record's JSON object of an older schema version up to SCHEMA_VERSION, in place."""
    version = record.get("schema_version", 1)
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise ValueError(f"{where}: schema_version {version!r} is not one this echobench reads (1 to "
                         f"{SCHEMA_VERSION}): a newer echobench wrote it, or it is not a result record")
    while version < SCHEMA_VERSION:
        MIGRATIONS[version](record)
        record["migrated_from"] = record.get("migrated_from") or version
        version += 1
        record["schema_version"] = version
    return record


# ---- collection: reports and status read only stored records ----

def find_record_files(paths) -> list[Path]:
    """result.json files under each path (a record file, a run dir or a sweep dir). A sweep's
    earlier attempts (RUN/attempts/N/result.json) are left out: they never stand in for a run's
    current record (an attempt directory named itself is read)."""
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            for f in sorted(p.rglob(RECORD_FILE)):
                rel = f.relative_to(p).parts
                if not (len(rel) >= 3 and rel[-3] == "attempts" and rel[-2].isdigit()):
                    found.append(f)
    return found


def load_records(paths) -> tuple[list[Record], list[str]]:
    """All records under paths, newest per run_id; corrupt ones reported, never fatal.

    Returns (records, problems) where problems are one-line messages naming the file.
    """
    newest: dict[str, Record] = {}
    problems = []
    for path in find_record_files(paths):
        try:
            record = Record.load(path)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        held = newest.get(record.run_id)
        if held is None or (record.env.time or "") >= (held.env.time or ""):
            newest[record.run_id] = record
    return list(newest.values()), problems


def read_plan(record: Record) -> dict:
    """What the sweep's plan said about a record's run (PLAN_FILE beside it; {} without one)."""
    if record.path is None:
        return {}
    try:
        plan = json.loads(record.path.with_name(PLAN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return plan if isinstance(plan, dict) else {}


# ---- what a reader must know beside the MFU ----

def peak_notes(record: Record) -> list[str]:
    """Warnings that belong next to a record's MFU: a calibrated denominator, a peak for another
    precision than the run's, an fp8 run (whose MFU against the fp8 peak is a figure of its own).
    The same for every repeat of a configuration: no per-run numbers."""
    notes = []
    source, pp, precision = record.peak_source or "", record.peak_precision, record.precision
    if source.startswith("calibrated"):
        notes.append(f"MFU is against a calibrated GEMM rate ({source.removeprefix('calibrated:')}), not a datasheet "
                     "peak: it reads higher than datasheet-based MFU")
    if precision == "fp8":
        notes.append(f"fp8 run: MFU is against the {pp or 'given'} peak, "
                     + ("and against the dense fp8 peak in a figure of its own" if record.mfu_fp8_peak is not None
                        else "and no fp8 peak is known for this device"))
    elif precision and pp and precision != pp:
        notes.append(f"{precision} run measured against the {pp} peak")
    return notes


# ---- repeats: records of one configuration ----

def record_settings(record: Record) -> dict:
    """The settings a run was launched with: the record's `config` (its RunConfig), else (a record
    without one) its top-level fields of the same names that it has."""
    if record.config is not None:
        return upgraded(record.config)
    return {k: getattr(record, k) for k in RunConfig.__dataclass_fields__ if k in record.model_fields_set}


def configuration_key(record: Record) -> str:
    """What the runs of one configuration at one node count share (echobench.records.config.configuration):
    reports give the median over them, `compare` pairs them. Unlike the run id, it leaves out how
    long and how often we measured: runs of two sweeps with different step counts pool."""
    return configuration_id(record_settings(record))


def gpu_hours_per_million_samples(gpus: int | None, samples_per_s: float | None) -> float | None:
    """What a million training samples cost at this throughput, in GPU-hours (the run's GPUs, held
    for the time): the figure to compare layouts by cost rather than by speed."""
    if not gpus or not samples_per_s or samples_per_s <= 0:
        return None
    return gpus / samples_per_s * 1e6 / 3600


def over_repeats(values) -> dict | None:
    """Median, min, max and count of one figure over repeats (missing and non-finite values left out)."""
    values = [x for x in (float(v) for v in values if v is not None) if math.isfinite(x)]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def slower_p_value(old_steps: list[float], new_steps: list[float]) -> float:
    """p-value of 'new steps are no slower than old' (one-sided Mann-Whitney U)."""
    from scipy.stats import mannwhitneyu  # lazy: scipy is optional; only `compare` needs it

    return float(mannwhitneyu(new_steps, old_steps, alternative="greater").pvalue)


# ---- the table ----

def records_frame(records: list[Record]):
    """One row per record (Record.to_row): its single-valued fields and env's."""
    import pandas as pd  # lazy: pandas takes seconds to import; only the tables need it

    return pd.DataFrame([r.to_row() for r in records], columns=Record.columns())


def export_table(frame, out_dir: Path, stem: str = "results") -> list[Path]:
    """Writes the table as CSV and Parquet (atomically); returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, write in ((".csv", lambda p: frame.to_csv(p, index=False)),
                          (".parquet", lambda p: frame.to_parquet(p, index=False))):
        path = out_dir / f"{stem}{suffix}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        write(tmp)
        os.replace(tmp, path)
        written.append(path)
    return written
