"""One benchmark run's settings: a typed dataclass with defaults (the TorchTitan way).

The same keys appear in a matrix file's `defaults` and axes, and in `echobench run` flags.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

FRAMEWORKS = ("torchtitan", "megatron")
PRECISIONS = ("auto", "bf16", "fp32", "fp8")
AC_MODES = ("none", "selective", "full")
TE_MODES = ("auto", "on", "off")  # TransformerEngine kernels in the megatron backend
# Lower bounds of the integer settings; a matrix file's values are checked against them too.
MIN_VALUES = {"nodes": 1, "gpus_per_node": 1, "steps": 1, "micro_batch": 1, "audio_frames": 1, "text_tokens": 1,
              "speaker_frames": 1, "warmup_steps": 0, "repeat": 0, "fail_at_step": -1}


def check_min(key: str, value) -> None:
    """Raises ValueError naming the key when an integer setting is below its lower bound."""
    low = MIN_VALUES.get(key)
    if low is not None and value is not None and value < low:
        raise ValueError(f"{key}={value!r} is not valid: allowed an integer >= {low}")


@dataclass
class RunConfig:
    scale: str = "tiny"
    framework: str = "torchtitan"
    parallelism: str = "single"  # single | ddp | fsdp2 | hsdp | tpN
    nodes: int = 1
    gpus_per_node: int = 1  # processes per node (GPUs, or CPU processes on a CPU machine)
    steps: int = 30
    warmup_steps: int = 10
    micro_batch: int = 8
    precision: str = "auto"  # bf16 on GPU, fp32 on CPU (bf16 GEMMs crawl on most CPUs)
    audio_frames: int = 750
    text_tokens: int = 256
    speaker_frames: int = 750
    compile: bool = False
    ac: str = "none"
    data: str = "synthetic"  # "synthetic" or a directory of tar shards
    skip_bad_samples: bool = False
    seed: int = 0
    device: str = "auto"
    peak_tflops: float | None = None
    encoder_model: str | None = None  # text encoder by name; default: the preset's
    frozen_encoder: bool = True  # False: the encoder trains too (gradients, optimizer, FLOPs)
    t5_hidden_dim: int | None = None  # optional check: must equal the encoder's hidden size
    encoder_checkpoint: str | None = None
    tokenizer: str | None = None  # local Hugging Face tokenizer directory
    profile: bool = False
    fail_at_step: int | None = None  # failure injection for tests: raise at this step; -1: at start-up,
    # before the process group forms (a worker that dies while its peers wait to rendezvous)
    fail_rank: int | None = None  # ... on this rank only (all ranks when None)
    fail_kind: str = "error"  # error | oom
    collective_timeout_s: float = 300.0
    time_limit_s: float | None = None  # the run stops itself after this long, with status timeout
    te: str = "auto"  # megatron: TransformerEngine kernels when they import (auto), required (on), never (off)
    sequence_parallel: bool = False  # megatron, GPU only: split the latent stream along T between TP regions
    repeat: int = 0  # which independent launch of the same settings this is (`repeats: N` -> 0..N-1)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def bad(key, value, allowed):
            raise ValueError(f"{key}={value!r} is not valid: allowed {allowed}")

        from echobench.model.config import PRESETS

        if self.scale not in PRESETS:
            bad("scale", self.scale, ", ".join(PRESETS))
        if self.framework not in FRAMEWORKS:
            bad("framework", self.framework, ", ".join(FRAMEWORKS))
        if self.precision not in PRECISIONS:
            bad("precision", self.precision, ", ".join(PRECISIONS))
        if self.ac not in AC_MODES:
            bad("ac", self.ac, ", ".join(AC_MODES))
        if self.te not in TE_MODES:
            bad("te", self.te, ", ".join(TE_MODES))
        if self.fail_kind not in ("error", "oom"):
            bad("fail_kind", self.fail_kind, "error, oom")
        for key in MIN_VALUES:
            check_min(key, getattr(self, key))
        encoder = self.model_config().text_encoder
        if self.t5_hidden_dim is not None and self.t5_hidden_dim != encoder.hidden:
            raise ValueError(f"t5_hidden_dim={self.t5_hidden_dim} disagrees with encoder_model {encoder.name!r}, "
                             f"whose hidden size is {encoder.hidden}: drop t5_hidden_dim or choose a matching encoder")

    def model_config(self):
        """The model this run trains: the preset, its encoder choice and whether the encoder trains."""
        from echobench.model.config import get_preset

        return get_preset(self.scale, self.encoder_model, self.frozen_encoder)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tp(self) -> int:
        return int(self.parallelism[2:]) if self.parallelism.startswith("tp") else 1

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.dp

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown run key(s) {', '.join(unknown)}: allowed {', '.join(sorted(known))}")
        return cls(**data)


# Keys that do not change what is measured: left out of the run id.
NON_IDENTITY_KEYS = {"device", "profile", "collective_timeout_s", "time_limit_s", "encoder_checkpoint", "tokenizer"}
# ...and the keys that change how long or how often we measure, only check a setting or inject a
# failure for a test, not what is measured: a configuration leaves out both. The run id keeps these (a sweep's existing run
# directories must keep their ids, or it would rerun them).
MEASUREMENT_KEYS = NON_IDENTITY_KEYS | {"steps", "warmup_steps", "seed", "repeat", "t5_hidden_dim",
                                        "fail_at_step", "fail_rank", "fail_kind"}


def config_id(cfg: RunConfig) -> str:
    """Stable, readable id of the settings, the repeat index aside: what repeats of a run share."""
    identity = {k: v for k, v in cfg.to_dict().items() if k not in NON_IDENTITY_KEYS and k != "repeat"}
    digest = hashlib.sha1(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]
    par = cfg.parallelism
    return f"{cfg.scale}-{cfg.framework}-{par}-n{cfg.nodes}x{cfg.gpus_per_node}-mb{cfg.micro_batch}-{digest}"


def run_id(cfg: RunConfig) -> str:
    """Stable id of one run: same settings, same id, across sessions. Repeat 0 keeps the id the
    run had before repeats existed (a sweep does not redo it); repeat k > 0 adds `-rK`."""
    return config_id(cfg) if cfg.repeat == 0 else f"{config_id(cfg)}-r{cfg.repeat}"


def configuration(settings: dict, with_nodes: bool = True) -> dict:
    """What a run measures, from its settings (a RunConfig dict): every key but MEASUREMENT_KEYS
    (and `nodes` unless with_nodes: a configuration's scaling runs). A key the settings lack, as in
    a record older than the key, takes its default. The one definition of "configuration" that the
    dashboard, the tables and `compare` share: runs of equal configurations pool like repeats."""
    defaults = {f.name: f.default for f in fields(RunConfig)}
    merged = {**defaults, **settings}
    return {k: v for k, v in merged.items() if k not in MEASUREMENT_KEYS and (with_nodes or k != "nodes")}


def configuration_id(settings: dict) -> str:
    """Readable, stable id of configuration(settings), in the run id's form (one node count)."""
    ident = configuration(settings)
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:8]
    return (f"{ident['scale']}-{ident['framework']}-{ident['parallelism']}-n{ident['nodes']}x{ident['gpus_per_node']}"
            f"-mb{ident['micro_batch']}-{digest}")
