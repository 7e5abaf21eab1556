"""One benchmark run's settings: a typed dataclass with defaults (the TorchTitan way).

Each field is one setting, written once: its type (a Literal lists the choices), default, help
text, lower bound and flag. From it come the `echobench run` flags (echobench.cli), the checks of
`--config` files and of matrix files (check_value: one message for all three) and the docs' table
of run settings (settings_table).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import types
import typing
from pathlib import Path
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from pydantic import TypeAdapter, ValidationError

from echobench.backends import BACKENDS
from echobench.records.layout import KINDS, Layout, allowed_text as layouts_text, is_layout
from echobench.model.config import ENCODER_ALIASES, PRESETS, TEXT_ENCODERS, get_preset

# Choices that live in a table elsewhere: the model presets, the text encoders, the backends.
Scale = Literal[tuple(PRESETS)]
EncoderModel = Literal[(*TEXT_ENCODERS, *ENCODER_ALIASES)]
Framework = Literal[tuple(BACKENDS)]


def setting(default, help: str, *, min: int | None = None, flag: str | None = None):
    """A RunConfig field: its default and help text, an integer's lower bound, and its flag's
    declaration when not --NAME ("--compile/--no-compile"; "" for none: set another way)."""
    return field(default=default, metadata={"help": help, "min": min, "flag": flag})


MAX_BUCKETS = 16  # shapes a run may bucket into (kernels.compile_graphs sizes dynamo's recompile limit to them)


def parse_buckets(text: str, max_frames: int | None = None) -> list[int]:
    """'250,500,750' -> [250, 500, 750]: ascending positive frame counts, none over max_frames
    (audio_frames, the last bucket: a boundary beyond it would never be used)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"buckets={text!r}: give audio-frame boundaries as ascending integers, e.g. '250,500,750'") from None
    if not values or any(v < 1 for v in values) or values != sorted(set(values)):
        raise ValueError(f"buckets={text!r}: give audio-frame boundaries as ascending integers, e.g. '250,500,750'")
    if max_frames is not None and (over := [v for v in values if v > max_frames]):
        raise ValueError(f"buckets={text!r}: {', '.join(map(str, over))} {'is' if len(over) == 1 else 'are'} over "
                         f"audio_frames={max_frames}, the longest audio and always the last bucket: give boundaries "
                         f"up to {max_frames}, or raise audio_frames")
    if (shapes := len(set(values) | ({max_frames} if max_frames else set()))) > MAX_BUCKETS:
        raise ValueError(f"buckets={text!r}: {shapes} shapes, at most {MAX_BUCKETS}: each shape is warmed up (and "
                         f"compiled) on its own before the measured steps; give fewer boundaries")
    return values



@dataclass
class RunConfig:
    scale: Scale = setting("tiny", "Model preset: tiny (0.35M parameters, a CPU smoke test) or Echo TTS's 800M, 3B, 8B. "
                           "`echobench run` requires it (no default there); a matrix's runs default to tiny.")
    framework: Framework = setting("torchtitan", "Training backend.")
    parallelism: str = setting("single", "Layout of the processes (--tp N sets tpN).")
    nodes: int = setting(1, "Nodes (--nnodes with --nproc).", min=1, flag="")
    gpus_per_node: int = setting(1, "Processes per node: GPUs, or CPU processes on a CPU machine (--nproc).",
                                 min=1, flag="")
    steps: int = setting(30, "Measured steps.", min=1)
    warmup_steps: int = setting(10, "Warm-up steps, excluded from timing (compile happens here).", min=0)
    micro_batch: int = setting(8, "Samples per data-parallel rank per step.", min=1)
    precision: Literal["auto", "bf16", "fp32", "fp8"] = setting(
        "auto", "auto: bf16 on GPU, fp32 on CPU (bf16 GEMMs crawl on most CPUs).")
    audio_frames: int = setting(750, "Max audio latent frames (25 per second).", min=1)
    text_tokens: int = setting(256, "Max text tokens.", min=1)
    speaker_frames: int = setting(750, "Max speaker reference frames.", min=1)
    float8_recipe: Literal["tensorwise", "rowwise"] = setting(
        "tensorwise", "precision fp8: torchao's scaling, tensorwise (one scale per tensor) or rowwise (one per row of "
        "each GEMM operand, torchtitan's more accurate recipe).")
    compile: bool | Literal["auto"] = setting(
        "auto", "torch.compile each block, the text encoder's layers and the rest of the forward (auto: on a GPU, "
        "not on a CPU); the record says what compiled.", flag="--compile/--no-compile")
    ac: Literal["none", "selective", "full"] = setting(
        "none", "Activation checkpointing of the blocks: full re-runs every block in backward; selective saves the "
        "matmul and attention outputs and re-runs the element-wise ops where compiled (fused into backward), and "
        "re-runs every second block where eager (re-run element-wise kernels would cost more than they save).")
    master_weights: Literal["auto", "fp32-autocast", "bf16-compute"] = setting(
        "auto", "The bf16 recipe of the torchtitan backend's single and ddp runs: fp32-autocast, fp32 parameters "
        "that autocast casts to bf16 in every micro-batch's forward (torch's AMP); bf16-compute, bf16 parameters "
        "used as they are, bf16 gradients (accumulated and, with ddp, reduced in bf16: grad_reduce_dtype bf16), "
        "cast once per step to an fp32 master copy that the optimizer updates and copies back. auto: bf16-compute "
        "on a GPU where it can run, fp32-autocast on a CPU; fsdp2 / hsdp gather bf16 weights from fp32 shards "
        "(MixedPrecisionPolicy) either way. The record's backend says which ran (master_weights).")
    grad_accum_dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "The dtype the micro-batches' gradients are summed in under master_weights bf16-compute: fp32, each "
        "micro-batch's bf16 gradients added into the fp32 masters' as backward writes them (Megatron's main "
        "gradients); bf16, summed in the bf16 parameters' gradients and cast to fp32 once per step. auto: fp32 on one "
        "process, bf16 with ddp (DDP sums and reduces in its bf16 buckets). fp32 parameters sum in fp32, fsdp2 / hsdp "
        "in grad_reduce_dtype; the record's backend says which ran (grad_accum_dtype).")
    grad_accum: int = setting(1, "Micro-batches per optimizer step (gradient accumulation); gradients sync on the "
                              "last. A step and global_batch count all of them.", min=1)
    key_masking: Literal["auto", "dense", "flex"] = setting(
        "auto", "How attention skips the padded keys of a batch that has some (a batch without padding attends with "
        "no mask): flex, a FlexAttention block mask (auto on a GPU); dense, a boolean mask to SDPA (auto on a CPU, "
        "where torch has no FlexAttention backward).")
    cfg_drop: Literal["mask", "null"] = setting(
        "mask", "How classifier-free guidance drops a sample's text and speaker conditioning (10% of samples): mask, "
        "their keys masked out of the DiT's attention, as the reference Echo TTS does (a micro-batch with a dropped "
        "sample attends over a key mask); null, the streams replaced by zeros and attended (no mask).")
    cfg_drop_attention: Literal["split", "masked"] = setting(
        "split", "How the DiT attends in a micro-batch where samples drop their conditioning (cfg_drop mask) and "
        "no stream is padded: split, with no mask, the latent keys and the conditioning keys in two flash-attention "
        "calls merged by their log-sum-exp, a dropped sample's conditioning weighted zero (the masked result); "
        "masked, over the key mask (key_masking), as a padded micro-batch does. Split runs masked where the flash "
        "kernel cannot (a GPU in fp32, another sdpa_backend pinned, megatron); the record says which ran "
        "(backend_info, attention_paths).")
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = setting(
        "auto", "Pins the SDPA kernel (auto: torch's choice; the record says what torch predicts, "
        "sdpa_backends_predicted, and on a GPU which kernels ran, attention_kernels).")
    reshard_after_forward: bool = setting(True, "fsdp2 / hsdp: free each block's gathered weights after its forward "
                                          "(gathered again in backward); false keeps them, trading memory for one "
                                          "all-gather per block.", flag="--reshard-after-forward/--no-reshard-after-forward")
    grad_reduce_dtype: Literal["fp32", "bf16"] = setting(
        "fp32", "Data-parallel gradient reduction dtype (ddp, fsdp2, hsdp, megatron's DP): bf16 halves the bytes.")
    data: str = setting("synthetic", "'synthetic' (in memory) or a directory of tar shards.")
    synthetic_lengths: Literal["full", "drawn"] = setting(
        "full", "data synthetic: full, every sample at the maximum lengths (nothing padded: the MFU is an upper "
        "bound of padded data's); drawn, lengths drawn as `echobench data synth` draws them (audio log-normal, median "
        "8 s, sigma 0.6, clipped to [2 s, audio_frames]; text ~14 characters per second), padded or bucketed as "
        "shards are.")
    skip_bad_samples: bool = setting(False, "Count and skip corrupt samples instead of failing.")
    batching: Literal["pad", "bucket"] = setting("pad", "pad: every batch to the maximum lengths; bucket: samples "
                                                 "grouped by audio length into a few static shapes (shards only).")
    buckets: str | None = setting(None, "bucket: audio-frame boundaries, e.g. '250,500' (default: quartiles of the "
                                  "shards' lengths); the maximum, audio_frames, is always the last.")
    seed: int = setting(0, "Seed of the weights and the data order.")
    device: Literal["auto", "cuda", "cpu"] = setting("auto", "auto: cuda when torch sees a GPU, else cpu.")
    peak_tflops: float | None = setting(None, "Dense bf16 peak TFLOP/s per device for MFU (else table / calibration).")
    encoder_model: EncoderModel | None = setting(None, "Text encoder (default: the preset's).")
    frozen_encoder: bool = setting(True, "Freeze the text encoder (default) or train it (gradients, optimizer, "
                                   "FLOPs).", flag="--frozen-encoder/--train-encoder")
    t5_hidden_dim: int | None = setting(None, "Expected encoder hidden size (checked against encoder_model).")
    encoder_checkpoint: str | None = setting(None, "Local checkpoint directory for the text encoder.")
    tokenizer: str | None = setting(None, "Local Hugging Face tokenizer directory (else byte-level).")
    trace: bool = setting(False, "Trace 3 steps after the measured ones (untimed) with torch.profiler: "
                          "OUT/trace-rankN.json and the time breakdown OUT/breakdown.json (echobench explain).",
                          flag="--trace")
    fail_at_step: int | None = setting(None, "Testing: inject a failure at this step (-1: at start-up, before the "
                                       "process group forms).", min=-1)
    fail_rank: int | None = setting(None, "Testing: fail on this rank only (default: all ranks).")
    fail_kind: Literal["error", "oom", "sigkill", "hang"] = setting(
        "error", "Testing: the failure injected (sigkill: the rank kills itself, leaving no error of its own; "
        "hang: the rank stops in its loop, idle, as one stuck in a collective: only a time limit ends it).")
    collective_timeout_s: float = setting(300.0, "How long a live rank waits for a dead one in a collective.", flag="")
    time_limit_s: float | None = setting(None, "Stop the run after this many seconds (status timeout); it ends with "
                                         "the measured steps (--trace's after them: trace_limit_s).")
    trace_limit_s: float | None = setting(120.0, "Bound on --trace's work after the measured steps (the traced "
                                          "steps, trace export and breakdown): reached, tracing stops and the run "
                                          "keeps its figures, without a breakdown (0 or null: no bound).")
    log_metrics: Literal["none", "tensorboard", "wandb"] = setting(
        "none", "Also log rank 0's progress figures and the record's to TensorBoard (OUT/tensorboard) or Weights & "
        "Biases (project WANDB_PROJECT, default echobench); needs the package (pip install 'echobench[tensorboard]' "
        "or '[wandb]'). The record stays what to quote.")
    progress_every_s: float | None = setting(30.0, "Rank 0 prints a progress line (step, loss, step time, samples/s, "
                                             "TFLOP/s, MFU, memory) at most this often, in seconds, into the job "
                                             "log too (0: every step; null: none, nor the phase lines).")
    te: Literal["auto", "on", "off"] = setting("auto", "megatron: TransformerEngine kernels when they import (auto), "
                                                "required (on), never (off).")
    sequence_parallel: bool | Literal["auto"] = setting(
        "auto", "megatron: split the latent stream (a card's decoder: its hidden states) along the sequence between "
        "TP regions (auto: on for tp > 1 on a GPU, as Megatron-LM runs TP).", flag="--sequence-parallel/--no-sequence-parallel")
    distributed_optimizer: bool = setting(False, "megatron, GPU only: shard the optimizer state and fp32 main weights "
                                          "over the data-parallel group (megatron-core's distributed optimizer, "
                                          "ZeRO-1).",
                                          flag="--distributed-optimizer/--no-distributed-optimizer")
    loader_workers: int = setting(0, "Shard-reading worker processes per rank (0: read in the loader's thread).",
                                  min=0)
    gc_every: int = setting(50, "Run Python's garbage collector every N steps, automatic collection off (as "
                            "torchtitan does: no collection pauses at random steps); 0 leaves it automatic.", min=0)
    card: str | None = setting(
        None, "Train a plain decoder from a model card instead of Echo: a card file (as tunes/card-small.yaml) or "
        "FILE#ROW, a row of a published-runs file (validation/published-runs.yaml#lf-mpt-1b-8gpu). The card gives the "
        "model and the sequence length (its synthetic token batches); the run's settings give the layout, "
        "micro-batch, accumulation, precision, AC and compile; the Echo shape settings do not apply. The record's "
        "`card` names it, the layout it publishes and its FLOP convention.")
    repeat: int = setting(0, "Which independent launch of the same settings this is (repeats: N -> 0 .. N-1).",
                          min=0, flag="")

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for f in fields(self):
            check_value(f.name, getattr(self, f.name))
        if self.batching == "bucket" and self.data == "synthetic" and self.synthetic_lengths == "full":
            raise ValueError("batching=bucket groups samples by their lengths: it needs shards (data: DIR) or "
                             "synthetic_lengths drawn; synthetic samples are otherwise all full-length")
        if self.synthetic_lengths != "full" and self.data != "synthetic":
            raise ValueError(f"synthetic_lengths={self.synthetic_lengths} applies to data synthetic; data={self.data!r} "
                             "has its own lengths: drop synthetic_lengths")
        if self.card is not None:
            if not self.card.strip() or self.card.endswith("#"):
                raise ValueError(f"card={self.card!r}: give a card file, or FILE#ROW (a row id of a published-runs file)")
            if self.data != "synthetic":
                raise ValueError(f"card with data={self.data!r}: a card run trains on synthetic token batches at the "
                                 "card's sequence length: drop data")
        if self.buckets is not None:
            parse_buckets(self.buckets, self.audio_frames)
            if self.batching != "bucket":
                raise ValueError("buckets is set but batching is pad: set batching=bucket, or drop buckets")
        encoder = self.model_config().text_encoder
        if self.t5_hidden_dim is not None and self.t5_hidden_dim != encoder.hidden:
            raise ValueError(f"t5_hidden_dim={self.t5_hidden_dim} disagrees with encoder_model {encoder.name!r}, "
                             f"whose hidden size is {encoder.hidden}: drop t5_hidden_dim or choose a matching encoder")

    @property
    def workload(self) -> str:
        """What the run trains and its record calls its scale: the Echo preset, or card_label(card)."""
        return self.scale if self.card is None else card_label(self.card)

    def model_config(self):
        """The model this run trains: the preset, its encoder choice and whether the encoder trains."""
        return get_preset(self.scale, self.encoder_model, self.frozen_encoder)

    def compiled_on(self, device_type: str) -> bool:
        """Whether this run compiles on a device of this type ("cuda", "cpu"): auto compiles on a GPU."""
        return device_type == "cuda" if self.compile == "auto" else self.compile

    def precision_on(self, device_type: str) -> str:
        """The precision this run trains in on a device of this type ("cuda", "cpu"): auto is bf16 on a
        GPU, fp32 on a CPU (hardware.device.default_dtype's rule, without torch)."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if device_type == "cuda" else "fp32"

    def master_weights_on(self, device_type: str) -> str:
        """The recipe of this run's weights on a device of this type (backends.master.RECIPES): fp32
        where it trains in fp32; fsdp2 / hsdp's MixedPrecisionPolicy; megatron's own; else the setting,
        auto being bf16-compute on a GPU in bf16 (with ddp, where gradients reduce in bf16) and
        fp32-autocast elsewhere (a CPU, fp8: torchao's float8 linears keep fp32 weights)."""
        precision = self.precision_on(device_type)
        if self.framework != "torchtitan":
            return "megatron" if precision != "fp32" else "fp32"
        if precision == "fp32":
            return "fp32"
        if self.layout.shards_parameters:
            return "fsdp2"
        if self.master_weights != "auto":
            return self.master_weights
        lean = (device_type == "cuda" and precision == "bf16"
                and (not self.layout.replicates or self.grad_reduce_dtype == "bf16"))
        return "bf16-compute" if lean else "fp32-autocast"

    def grad_accum_dtype_on(self, device_type: str) -> str | None:
        """The dtype this run's micro-batch gradients are summed in on a device of this type
        (master_weights_on's recipe): bf16-compute's setting, auto being fp32 except with ddp; FSDP2's
        grad_reduce_dtype (it accumulates unsharded gradients in its reduce dtype); fp32 parameters'
        fp32; None for megatron (its own)."""
        recipe = self.master_weights_on(device_type)
        if recipe == "bf16-compute":
            if self.grad_accum_dtype != "auto":
                return self.grad_accum_dtype
            return "bf16" if self.layout.replicates else "fp32"
        if recipe == "fsdp2":
            return self.grad_reduce_dtype
        return None if recipe == "megatron" else "fp32"

    def may_compile(self) -> bool:
        """Whether this run compiles as far as a plan can tell: device auto counts as a GPU, so a time
        limit or a preflight errs on the side of the compile."""
        return self.compiled_on("cpu" if self.device == "cpu" else "cuda")

    def sequence_parallel_on(self, device_type: str) -> bool:
        """Whether this run splits the sequence between TP regions on a device of this type: auto
        does for megatron with tp > 1 on a GPU."""
        if self.sequence_parallel == "auto":  # where it can run: every padded length divisible by tp (a card's
            # seq is not known here: backends.checks.card_problem refuses one that tp does not divide)
            return (self.framework == "megatron" and self.tp > 1 and device_type == "cuda"
                    and (self.card is not None or self.audio_frames % self.tp == 0 and self.batching == "pad"))
        return self.sequence_parallel

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def layout(self) -> Layout:
        """The parallelism setting as a Layout (what it splits, over which ranks)."""
        return Layout.parse(self.parallelism)

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp(self.world_size)

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step: micro-batch x data-parallel ranks x accumulated micro-batches."""
        return self.micro_batch * self.dp * self.grad_accum

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise ValueError(unknown_key(unknown, sorted(FIELDS), "run key"))
        return cls(**data)


FIELDS = {f.name: f for f in fields(RunConfig)}

# Keys that runs stored under a former name (records and run.yaml files written before the rename):
# read under the new name there, and nowhere else (a matrix, tune or --config file gives the new).
FORMER_NAMES = {"profile": "trace", "profile_limit_s": "trace_limit_s"}


def upgraded(settings: dict) -> dict:
    """Stored settings (a record's config, a run.yaml) with FORMER_NAMES under their new names."""
    return {FORMER_NAMES.get(k, k): v for k, v in settings.items()}


def card_label(card: str) -> str:
    """A card setting's short name: the row id of FILE#ROW, else the card file's stem."""
    path, _, row = card.partition("#")
    return row or Path(path).stem


def grad_accum_for(global_batch: int, micro_batch: int, dp: int) -> int:
    """grad_accum = global_batch / (micro_batch x dp) where that is a whole number >= 1; else
    ValueError naming why, and the largest smaller micro-batch that would make it where one would."""
    per_step = micro_batch * dp
    accum, left = divmod(global_batch, per_step)
    if accum >= 1 and not left:
        return accum
    why = (f"global batch {global_batch} is smaller than micro_batch {micro_batch} x {dp} data-parallel ranks "
           f"({per_step})" if accum < 1 else
           f"global batch {global_batch} is not a whole number of micro_batch {micro_batch} x {dp} data-parallel "
           f"ranks ({per_step})")
    smaller = next((mb for mb in range(micro_batch - 1, 0, -1) if global_batch % (mb * dp) == 0), None)
    hint = (f": micro_batch {smaller} would make it (grad_accum {global_batch // (smaller * dp)})"
                   if smaller else f": no micro-batch makes it on {dp} data-parallel ranks")
    raise ValueError(why + hint)


def unknown_key(keys: list[str], allowed: list[str], what: str = "key", prefix: str = "") -> str:
    """One line for keys that are not among `allowed` (each named `prefix` + key, as "slurm.time"):
    each with the one or two allowed keys nearest in spelling (a typo's likely fix), then the allowed keys."""
    named = []
    for key in keys:
        near = " or ".join(map(repr, difflib.get_close_matches(str(key), allowed, n=2, cutoff=0.6)))
        named.append(f"{prefix + str(key)!r}" + (f" (did you mean {near}?)" if near else ""))
    return f"unknown {what}{'s' if len(keys) > 1 else ''} {', '.join(named)}: allowed {', '.join(allowed)}"


HINTS = typing.get_type_hints(RunConfig)


@functools.cache
def base_type(key: str):
    """The field's type without its None: int for `int | None`; bool for `bool | Literal["auto"]`
    (a switch that may be left to the run: its flag is --NAME/--no-NAME)."""
    args = [a for a in typing.get_args(HINTS[key]) if a is not type(None)]
    union = typing.get_origin(HINTS[key]) in (typing.Union, types.UnionType)
    if union and len(args) == 2 and bool in args:
        return bool
    return args[0] if union and len(args) == 1 else HINTS[key]


def auto_switch(key: str) -> bool:
    """A switch that may also be "auto" (`bool | Literal["auto"]`)."""
    return base_type(key) is bool and HINTS[key] is not bool


@functools.cache
def choices(key: str) -> tuple[str, ...] | None:
    """The values a setting may take, when they are a list: a Literal's, or the backends' layouts."""
    if key == "parallelism":
        return KINDS
    kind = base_type(key)
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def allowed_text(key: str) -> str:
    """What a setting may be, in words: for its error message, its flag's help and the docs' table."""
    if key == "parallelism":
        return layouts_text()
    if allowed := choices(key):
        return ", ".join(allowed)
    low = FIELDS[key].metadata["min"]
    if auto_switch(key):
        return "auto, true or false"
    words = {int: "an integer", float: "a number", bool: "true or false", str: "text"}[base_type(key)]
    return f"{words} >= {low}" if low is not None else words


@functools.cache
def _adapter(key: str):
    return TypeAdapter(HINTS[key])


def check_value(key: str, value):
    """`value`, checked against the field `key`: its type, choices and lower bound. Raises
    ValueError with one line, `key=value is not valid: allowed ...`, the same whether the value came
    from a flag, a --config file or a matrix file. Returns the value as the field's type."""
    if key not in FIELDS:
        raise ValueError(unknown_key([key], list(FIELDS), "run key"))
    allowed = choices(key)
    if allowed is not None and value is not None:
        if key == "parallelism":
            ok = is_layout(value)
        else:
            ok = isinstance(value, str) and value in allowed
        if not ok:  # YAML reads a bare on / off / yes / no as a boolean
            quote = "; quote the value in YAML" if isinstance(value, bool) else ""
            raise ValueError(f"{key}={value!r} is not valid: allowed {allowed_text(key)}{quote}")
    try:
        value = _adapter(key).validate_python(value, strict=True)
    except ValidationError:
        if auto_switch(key):
            raise ValueError(f"{key}={value!r} is not valid: allowed {allowed_text(key)}") from None
        kind = base_type(key)
        raise ValueError(f"{key}={value!r} has the wrong type: expected {getattr(kind, '__name__', kind)}") from None
    low = FIELDS[key].metadata["min"]
    if low is not None and value is not None and value < low:
        raise ValueError(f"{key}={value!r} is not valid: allowed {allowed_text(key)}")
    return value


def settings_table() -> str:
    """The table of run settings (markdown), from the fields: docs/reference/settings.md, written by
    tools/docs_reference.py (tests/test_docs.py holds the page to it)."""
    rows = ["| setting | `run` flag | default | allowed | what |", "| --- | --- | --- | --- | --- |"]
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-") if f.metadata["flag"] is None else f.metadata["flag"]
        default = json.dumps(f.default)  # as a matrix or --config file writes it (YAML reads JSON)
        allowed = allowed_text(name) + (" or null" if HINTS[name] != base_type(name) and not auto_switch(name) else "")
        rows.append(f"| `{name}` | {f'`{flag}`' if flag else '-'} | `{default}` | {allowed} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


# Keys that do not change what is measured: left out of the run id.
NON_IDENTITY_KEYS = {"device", "trace", "collective_timeout_s", "time_limit_s", "trace_limit_s", "encoder_checkpoint",
                     "tokenizer", "progress_every_s", "log_metrics"}
# ...and the keys that change how long or how often we measure, only check a setting or inject a
# failure for a test, not what is measured: a configuration leaves out both. The run id keeps these (a sweep's existing run
# directories must keep their ids, or it would rerun them).
MEASUREMENT_KEYS = NON_IDENTITY_KEYS | {"steps", "warmup_steps", "seed", "repeat", "t5_hidden_dim",
                                        "fail_at_step", "fail_rank", "fail_kind"}


def _readable_id(ident: dict) -> str:
    """SCALE-FRAMEWORK-LAYOUT-nNODESxGPUS-mbMICRO-DIGEST (a card run: its card_label for SCALE): the
    settings one reads at a glance, and a digest of all of `ident` (sorted keys: the same settings
    give the same id in any session)."""
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:8]
    workload = card_label(ident["card"]) if ident.get("card") else ident["scale"]
    return (f"{workload}-{ident['framework']}-{ident['parallelism']}-n{ident['nodes']}x{ident['gpus_per_node']}"
            f"-mb{ident['micro_batch']}-{digest}")


# Keys added after sweeps were stored: hashed only when not at their default, so that the runs of
# an older sweep keep their ids (and are not rerun).
LATER_KEYS = {"batching": "pad", "buckets": None, "grad_accum": 1, "key_masking": "auto", "sdpa_backend": "auto",
              "reshard_after_forward": True, "grad_reduce_dtype": "fp32", "distributed_optimizer": False,
              "loader_workers": 0, "gc_every": 50, "cfg_drop": "mask", "cfg_drop_attention": "split", "master_weights": "auto", "float8_recipe": "tensorwise", "card": None,
              "synthetic_lengths": "full", "grad_accum_dtype": "auto"}


def config_id(cfg: RunConfig) -> str:
    """Stable, readable id of the settings, the repeat index aside: what repeats of a run share."""
    return _readable_id({k: v for k, v in cfg.to_dict().items() if k not in NON_IDENTITY_KEYS and k != "repeat"
                         and not (k in LATER_KEYS and v == LATER_KEYS[k])})


def run_id(cfg: RunConfig) -> str:
    """Stable id of one run: same settings, same id, across sessions. Repeat 0 keeps the id the
    run had before repeats existed (a sweep does not redo it); repeat k > 0 adds `-rK`."""
    return config_id(cfg) if cfg.repeat == 0 else f"{config_id(cfg)}-r{cfg.repeat}"


# Settings whose default changed to auto: settings without the key (a record older than it) ran
# with the default of their time. A record of a run states what ran (results.Record.of_settings).
FORMER_DEFAULTS = {"compile": False, "sequence_parallel": False}


# Keys added after runs were recorded whose default is not what those runs did: stored settings
# without the key (a record older than it) ran this value. Applied where a record is read for what
# it ran (as_ran: validate measured), not in its identity (config_id, configuration), so that old
# and new runs of one configuration keep their ids and still pool.
RAN_BEFORE_KEY = {"cfg_drop_attention": "masked", "master_weights": "fp32-autocast"}


def as_ran(settings: dict) -> dict:
    """Stored settings (upgraded) with RAN_BEFORE_KEY's values for the keys they lack."""
    return {**RAN_BEFORE_KEY, **settings}


def configuration(settings: dict, with_nodes: bool = True) -> dict:
    """What a run measures, from its settings (a RunConfig dict): every key but MEASUREMENT_KEYS
    (and `nodes` unless with_nodes: a configuration's scaling runs). A key the settings lack, as in
    a record older than the key, takes its default. The one definition of "configuration" that the
    dashboard, the tables and `compare` share: runs of equal configurations pool like repeats.
    (FORMER_DEFAULTS: the keys whose default changed take their former one; FORMER_NAMES are read
    under their new names.)"""
    merged = {**{name: f.default for name, f in FIELDS.items()}, **FORMER_DEFAULTS, **upgraded(settings)}
    return {k: v for k, v in merged.items() if k not in MEASUREMENT_KEYS and (with_nodes or k != "nodes")}


def configuration_id(settings: dict) -> str:
    """Readable, stable id of configuration(settings), in the run id's form (one node count)."""
    return _readable_id(configuration(settings))
