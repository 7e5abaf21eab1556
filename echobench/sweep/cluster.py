"""The cluster's sections of a matrix, tune or site file: executor, slurm, local and hardware.

Each is a pydantic model that refuses an unknown key and checks every value that later reaches a
shell script (names, SLURM options, env), so that a mistake is one line naming the file, the key and
what is allowed (format_pydantic). echobench.sweep.matrix builds a matrix on them and
echobench.sweep.site a site file; the job script quotes the values again
(echobench.sweep.executors.slurm).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from echobench.records.config import unknown_key
from echobench.train.fabric import hca_problem

ExecutorName = Literal["local", "slurm"]  # by name; what one does: echobench.sweep.executors.Executor


class MatrixError(ValueError):
    """A matrix file that cannot be used; the message names the file and the key."""


class UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (plain YAML keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: merged (and overridable) as in safe_load
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise MatrixError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1}): each key once")
                seen.add(key)
            except TypeError:  # an unhashable key: safe_load's own error names it
                break
        return super().construct_mapping(node, deep)


# ---- values that reach a shell script: validated by pattern ----

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
SLURM_WORD_RE = r"^[A-Za-z0-9_.,:+-]{1,128}$"  # partition, account, qos
CONSTRAINT_RE = r"^[A-Za-z0-9_.,:+&|\[\]*()-]{1,256}$"
TIME_RE = r"^(\d+-)?\d{1,4}(:\d{1,2}){0,2}$"  # SLURM forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
# One long option, --name or --name=value; the value may hold anything but a line break or NUL:
# it is quoted where it is written (a #SBATCH line, an srun line).
OPTION_RE = r"^--[A-Za-z][A-Za-z0-9-]*(=[^\n\r\0]*)?$"
ENV_KEY_RE = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
MEM_RE = r"^\d+[KMGT]?$"


def check_text(pattern: str, what: str, value: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{value!r} is not a valid {what}: must match {pattern}")
    return value


def check_time(value) -> str:
    return check_text(TIME_RE, "time limit (e.g. 00:30:00, 90, 1-00:00:00)", str(value))


def parse_time(text: str) -> int:
    """SLURM time limit -> seconds ('30' is minutes, '1:30' min:sec, '2-12' days-hours, ...)."""
    days = 0
    if "-" in text:
        d, text = text.split("-", 1)
        days = int(d)
        parts = [int(p) for p in text.split(":")]
        h, m, s = (parts + [0, 0])[:3]
    else:
        parts = [int(p) for p in text.split(":")]
        if len(parts) == 1:
            h, m, s = 0, parts[0], 0
        elif len(parts) == 2:
            h, m, s = 0, parts[0], parts[1]
        else:
            h, m, s = parts
    return ((days * 24 + h) * 60 + m) * 60 + s


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


PORT_SPREAD = 2000  # jobs sharing a node take MASTER_PORT = master_port + SLURM_JOB_ID % PORT_SPREAD
EPHEMERAL = (32768, 60999)  # Linux's default ip_local_port_range


def _one_line(what: str, value: str) -> str:
    if any(c in value for c in "\n\r\0"):
        raise ValueError(f"{what} must be one line without NUL bytes")
    return value


class ContainerSettings(Strict):
    """The image every job runs in, with its runtime: pyxis (srun --container-image, an image such
    as nvcr.io#nvidia/pytorch:25.01-py3 or a squashfs file from `enroot import`; imported once per
    node and job, then reused by name), apptainer (`apptainer exec --nv IMAGE`, a .sif file or
    docker://...) or ce, CSCS's Container Engine (srun --environment=IMAGE, where IMAGE is an EDF:
    a name in ~/.edf or the path of a .toml file, which holds the image, mounts, workdir and hooks).
    pyxis and apptainer mount the sweep directory, echobench's source and a run's data directory at
    their own paths; under ce the EDF must mount them. The image must have echobench's dependencies
    (torch, transformers >= 5, pydantic, typer, ...): preflight checks it."""
    image: str
    runtime: Literal["pyxis", "apptainer", "ce"] = "pyxis"
    mounts: list[str] = []  # SRC[:DST[:FLAGS]] each, e.g. /lustre/data:/data:ro
    workdir: str | None = None  # the directory ranks start in, inside the image
    writable: bool = False  # pyxis --container-writable / apptainer --writable-tmpfs

    @field_validator("image", "workdir")
    @classmethod
    def _line(cls, v, info):
        return v if v is None else _one_line(f"container.{info.field_name}", v)

    @field_validator("mounts")
    @classmethod
    def _mounts(cls, v):
        for m in v:
            _one_line("a container mount", m)
            if "," in m or not m:
                raise ValueError(f"container mount {m!r}: one SRC[:DST[:FLAGS]] per entry, without commas")
        return v

    @model_validator(mode="after")
    def _edf_holds_the_rest(self):
        if self.runtime == "ce" and (self.mounts or self.workdir or self.writable):
            raise ValueError("runtime ce: the Container Engine takes mounts, workdir and writable from the EDF "
                             f"({self.image}): set them there")
        return self


class UenvSettings(Strict):
    """A uenv (CSCS): every srun of the job gets --uenv=IMAGE (and --view=VIEW), the first-node check
    and preflight included: the image is mounted in the job's steps, not in its batch shell."""
    image: str  # e.g. prgenv-gnu/24.11:v1, or a squashfs path
    view: str | None = None  # e.g. default

    @field_validator("image", "view")
    @classmethod
    def _word(cls, v, info):
        return v if v is None else check_text(r"^[A-Za-z0-9_.,:+/@=-]{1,256}$", f"uenv.{info.field_name}", v)


class RendezvousSettings(Strict):
    """Where the nodes meet (torchrun's MASTER_ADDR), where the first node's SLURM name is not the
    address they reach each other at: a suffix to that name (JSC's boosters: `i`, the InfiniBand
    name), the first node's IPv4 address on a network interface (`ib0`: `ip -4 addr` on that node),
    or a command run in the job after the setup lines whose first line of output is the address
    ($MASTER_ADDR holds the first node's name). The port is slurm.master_port. The runs' jobs, the
    preflight and the comm calibration all meet there."""
    suffix: str | None = None
    interface: str | None = None
    command: str | None = None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        return v if v is None else check_text(r"^[A-Za-z0-9.-]{1,64}$", "rendezvous.suffix (hostname characters)", v)

    @field_validator("interface")
    @classmethod
    def _interface(cls, v):
        return v if v is None else check_text(r"^[A-Za-z0-9_.:@-]{1,15}$", "rendezvous.interface (a network interface's name)", v)

    @field_validator("command")
    @classmethod
    def _command(cls, v):
        if v is not None and ("\0" in v or "\n" in v or not v.strip()):
            raise ValueError("rendezvous.command: one line of shell")
        return v

    @model_validator(mode="after")
    def _one(self):
        if [self.suffix, self.interface, self.command].count(None) != 2:
            raise ValueError("rendezvous: give one of suffix (e.g. i), interface (e.g. ib0) and command")
        return self


class TimeFromEstimate(Strict):
    """Per-run time limits from the plan's estimate (echobench.sweep.estimate): factor x estimate, at
    least floor, at most slurm.time (which stays the limit of runs the plan cannot estimate)."""
    factor: float = Field(3.0, ge=1)
    floor: str = "00:20:00"  # startup, a cold compile and the first steps are hard to estimate

    @field_validator("floor", mode="before")
    @classmethod
    def _floor(cls, v):
        return check_time(v)


INTERPRETER_KEYS = ("venv", "python", "container", "uenv")  # where the ranks' interpreter comes from: one choice


class SlurmSettings(Strict):
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time: str = "00:30:00"  # a run's time limit (the most one asks for, with time_from_estimate)
    time_from_estimate: TimeFromEstimate | None = None  # {factor: 3, floor: "00:20:00"}: per-run limits
    gpus_per_node: int = Field(1, ge=1, le=64)  # processes per node (GPUs; CPU processes on a CPU cluster)
    request_gpus: bool = True  # emit --gpus-per-node (false on a CPU-only cluster)
    cpus_per_task: int | None = Field(None, ge=1)  # CPUs of each node's one task (its launcher and ranks)
    cpus_per_gpu: int = Field(8, ge=1)  # when GPUs are requested and cpus_per_task is not set (not with exclusive)
    numa_binding: Literal["node", "socket", "exclusive", "core-complex"] | None = None  # torchrun --numa-binding
    # NCCL / libfabric profile (echobench.train.fabric); None: not chosen, which multi-node GPU runs refuse
    fabric: Literal["none", "infiniband", "slingshot", "tcp"] | None = None
    mem: str | None = None  # per node, e.g. 0 (all) or 200G
    exclusive: bool = False
    extra: list[str] = []  # further sbatch options, one per entry: "--reservation=abc" (values quoted)
    srun_args: list[str] = []  # further options of the srun that starts the ranks: "--mpi=pmix"
    container: ContainerSettings | None = None
    uenv: UenvSettings | None = None
    setup: list[str] = []  # shell commands run before the launch (module load ..., source venv); yours, as written
    env: dict[str, str | int | float | bool] = {}  # exported for every run (the local executor too)
    master_port: int = Field(29500, ge=1024, le=65535)
    rendezvous: RendezvousSettings | None = None  # the address the nodes meet at; default: the first node's name
    # Where the ranks' interpreter and echobench come from (echobench.sweep.executors.slurm_script.job_environment):
    # venv (VENV/bin/python, echobench installed there), python (an interpreter), a container or uenv (the image's
    # python3, echobench installed there), each with pythonpath's entries first on its import path (mounted in a
    # container). Naming none of them, the interpreter running the sweep and this checkout.
    venv: str | None = None
    python: str | None = None
    pythonpath: list[str] | None = None
    # Jobs of the sweep in the queue at once (pending or running): more are submitted as they end.
    # None: no cap (a refusal for a submit limit still only delays a run: it is retried).
    max_submitted: int | None = Field(None, ge=1)

    @field_validator("partition", "account", "qos")
    @classmethod
    def _word(cls, v, info):
        return v if v is None else check_text(SLURM_WORD_RE, info.field_name, v)

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v):
        return v if v is None else check_text(CONSTRAINT_RE, "constraint", v)

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v):
        return check_time(v)

    @field_validator("mem", mode="before")
    @classmethod
    def _mem(cls, v):
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)  # `mem: 0` (all of the node's memory) is an integer in YAML
        return v if v is None else check_text(MEM_RE, "memory size (e.g. 0, 200G)", v)

    @field_validator("master_port")
    @classmethod
    def _port(cls, v):
        # The job adds SLURM_JOB_ID % PORT_SPREAD: the range must stay out of Linux's ephemeral ports
        # (32768-60999 by default), where an outgoing connection may hold the port already.
        if not (v + PORT_SPREAD <= EPHEMERAL[0] or v > EPHEMERAL[1]):
            raise ValueError(f"master_port {v}: the job uses {v}..{v + PORT_SPREAD - 1}, which meets the ephemeral "
                             f"range {EPHEMERAL[0]}-{EPHEMERAL[1]}: use at most {EPHEMERAL[0] - PORT_SPREAD} "
                             f"(default 29500)")
        return v

    @field_validator("extra", "srun_args")
    @classmethod
    def _options(cls, v, info):
        what = "sbatch" if info.field_name == "extra" else "srun"
        return [check_text(OPTION_RE, f"{what} option (one --name or --name=value per entry, on one line)", x) for x in v]

    @field_validator("setup")
    @classmethod
    def _setup(cls, v):
        for line in v:
            if "\0" in line:
                raise ValueError("setup commands cannot contain NUL bytes")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        out = {}
        for key, value in v.items():
            check_text(ENV_KEY_RE, "environment variable name", key)
            value = str(value).lower() if isinstance(value, bool) else str(value)
            if "\0" in value:
                raise ValueError(f"env {key}: value cannot contain NUL bytes")
            out[key] = value
        return out

    @field_validator("python", "venv")
    @classmethod
    def _python(cls, v, info):
        if v is not None and ("\0" in v or "\n" in v or not v.strip()):
            raise ValueError(f"{info.field_name} must be a path on one line")
        return v

    @field_validator("pythonpath")
    @classmethod
    def _pythonpath(cls, v):
        for entry in v or []:
            if not entry.startswith("/") or any(c in entry for c in ":,\n\r\0"):
                raise ValueError(f"pythonpath entry {entry!r}: an absolute path (the nodes', not relative to where "
                                 "the job starts), without : or ,")
        return v

    @model_validator(mode="after")
    def _environment(self):
        if self.container is not None and self.uenv is not None:
            raise ValueError("container and uenv: a job runs in one of them, choose one")
        if self.venv is not None and self.python is not None:
            raise ValueError(f"venv and python: venv names the interpreter ({self.venv}/bin/python): give one")
        if problem := hca_problem(self.env):
            raise ValueError(f"env: {problem}")
        return self

    def names_interpreter(self) -> bool:
        """The site names the ranks' interpreter (INTERPRETER_KEYS), not the submitting checkout's."""
        return any(getattr(self, key) for key in INTERPRETER_KEYS)


class LocalSettings(Strict):
    time: str = "00:30:00"  # per-run time limit on the local executor
    # Processes of a run that is not `single` (ddp, tp2, ...) on the local executor; unset: slurm.gpus_per_node
    # (the older form, still read), else 1.
    gpus_per_node: int | None = Field(None, ge=1, le=64)

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, v):
        return check_time(v)


class CommLimits(Strict):
    """Bounds of the sweep's `echobench calibrate --comm` (hardware.calibrate_comm): its flags of the
    same names, with their bounds; None: calibrate's own defaults."""
    budget_s: float | None = Field(None, ge=0.1)  # seconds of GEMMs
    comm_budget_s: float | None = Field(None, ge=0.1)  # seconds of collectives
    max_bytes: int | None = Field(None, ge=1024)  # the largest message

    def flags(self) -> list[str]:
        """The calibrate flags these set (numbers only: nothing here needs quoting)."""
        return [word for key, value in self.model_dump().items() if value is not None
                for word in (f"--{key.replace('_', '-')}", str(value))]


class HardwareSettings(Strict):
    peak_tflops: float | None = Field(None, gt=0)  # per device, for MFU; else the run's device table / calibration
    memory_gib: float | None = Field(None, gt=0)  # per device, for the fit check; else from `device`
    device: str | None = None  # a device name for the memory table (GH200, H200, H100, ...)
    assumed_mfu: float = Field(0.4, gt=0, le=1)  # only for the GPU-hours estimate of `plan`
    # The sweep measures a hardware profile (`calibrate --comm`) once, where its runs run, before them:
    # SWEEP/profile.yaml, which `validate measured SWEEP` prices its runs with.
    calibrate_comm: bool = False
    comm_limits: CommLimits = CommLimits()


def _loc(parts) -> str:
    return ".".join(str(p) for p in parts) or "(top level)"


def format_pydantic(path: Path, exc: ValidationError, top: type[BaseModel]) -> str:
    """Every problem pydantic found, on one line after the file's name (`top`: the file's model)."""
    problems = []
    for err in exc.errors():
        loc = _loc(err["loc"])
        if err["type"] == "extra_forbidden":
            model = top
            for part in err["loc"][:-1]:
                model = model.model_fields[part].annotation if isinstance(part, str) else model
            allowed = list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []
            head, _, key = loc.rpartition(".")
            problems.append(unknown_key([key], allowed, prefix=f"{head}." if head else ""))
        elif err["type"] == "missing":
            problems.append(f"{loc} is required")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(f"{loc}: {msg} (got {err.get('input')!r})")
    return f"{path}: " + "; ".join(problems)


