"""The bytes each collective of a training step moves, derived from the settings (what the
performance model prices; train/commvolume.py counts them in a real step, and tests/test_comm.py
holds one against the other).

ddp_bytes / fsdp_bytes / tp_bytes (step_bytes picks by layout) list a step's collectives (Traffic)
from the model structure. Sizes follow nccl-tests (hwprofile): the all-reduce buffer, the
all-gather output, the reduce-scatter input. Imports no torch until param_units builds the model's
modules on the meta device, and nothing of the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from echobench.hardware.profile import bus_factor
from echobench.model.flops import speaker_patches


@dataclass(frozen=True)
class OpTotal:
    calls: int
    bytes: int


# torchtitan backend: apply_ddp's bucket_cap_mb (first bucket too: a cap given explicitly is used
# for every bucket).
TORCHTITAN_DDP_BUCKET_BYTES = (100 * 2**20, 100 * 2**20)


def megatron_ddp_bucket_bytes(cfg) -> tuple[int, int]:
    """megatron backend: megatron-core DDP's default bucket, max(40M, 1M x dp) parameters, their
    gradients in the reduce dtype, closed as ddp_buckets closes them (at least the cap; the first too)."""
    cap = max(40_000_000, 1_000_000 * cfg.dp) * _reduce_dtype(cfg)[1]
    return cap, cap


# The plain DiT block's weights the TP DiT splits across ranks: the parts stacked in
# echobench.model.megatron.TPStateDictAdapter.SHARDED (kept here: no megatron-core import).
TP_SHARDED = ("attn.in_proj.weight", "attn.wkv_text.weight", "attn.wkv_speaker.weight", "attn.wo.weight",
              "mlp.gate_up.weight", "mlp.down.weight")
FRAME_COUNT_BYTES = 8  # bench_echo.global_frame_count: the int64 count of real frames, summed over the replicas
FP32 = 4


@dataclass(frozen=True)
class Traffic:
    """One kind of collective of a training step: `calls` calls of `op` over a `group` of
    `group_size` ranks, `nbytes` in all (nccl-tests' message size, summed over the calls), in
    `dtype`; `link`: "inter" when the group spans nodes, else "intra"; `per_node`: how many of the
    group's ranks share one node (a cross-node group's ranks on a node share its NICs)."""

    op: str
    group: str  # dp, dp_shard, dp_replicate, tp
    group_size: int
    calls: int
    nbytes: int
    dtype: str
    link: str
    what: str
    per_node: int = 1
    # Once per optimizer step (the gradients' reductions and norms: gradient accumulation syncs on
    # the last micro-batch only), not once per micro-batch (activations, gathers, the frame count).
    once: bool = False

    @property
    def bus_bytes(self) -> float:
        return bus_factor(self.op, self.group_size) * self.nbytes


@dataclass(frozen=True)
class ParamUnit:
    """Trainable parameters as the torchtitan backend's FSDP2 groups them: each speaker-encoder and
    DiT block, the text encoder when it trains, and the root (the rest)."""

    name: str
    kind: str  # speaker block, dit block, text encoder, root
    shapes: tuple[tuple[int, ...], ...]  # registration order

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def shard_numel(self, shards: int) -> int:
        """Elements of one rank's shard: FSDP2 chunks each parameter along dim 0 into `shards`
        pieces, the last padded, so every rank holds ceil(dim0 / shards) rows of each."""
        return sum(-(-s[0] // shards) * math.prod(s[1:]) for s in self.shapes)


@lru_cache(maxsize=32)
def param_units(model_cfg) -> tuple[ParamUnit, ...]:
    """The trainable parameters of EchoTTS(model_cfg), by FSDP2 unit, from the model's own modules
    built on the meta device (no memory, no weights): the speaker encoder, the DiT, the text
    projection, and the text encoder only when it trains (a frozen one has no gradients and is left
    out of sharding; building it needs transformers). Registration order, as EchoTTS's."""
    import torch  # lazy: the rest of the traffic is arithmetic, priced without torch's import

    from echobench.model.dit import EchoDiT
    from echobench.model.speaker import SpeakerEncoder
    from echobench.model.text_encoder import TextEncoder
    enc = model_cfg.text_encoder
    units, root = [], [(model_cfg.width, enc.hidden), (model_cfg.width,)]  # text_proj weight, bias
    with torch.device("meta"):
        if not model_cfg.frozen_encoder:
            text = TextEncoder(enc, None, frozen=False)
            units.append(ParamUnit("text_encoder", "text encoder",
                                   tuple(tuple(p.shape) for p in text.parameters() if p.requires_grad)))
        modules = {"speaker_encoder": SpeakerEncoder(model_cfg), "dit": EchoDiT(model_cfg)}
    for prefix, module in modules.items():
        kind = "speaker block" if prefix == "speaker_encoder" else "dit block"
        for i, block in enumerate(module.blocks):
            units.append(ParamUnit(f"{prefix}.blocks.{i}", kind, tuple(tuple(p.shape) for p in block.parameters())))
        root += [tuple(p.shape) for name, p in module.named_parameters() if not name.startswith("blocks.")]
    # Registration order: text encoder, text_proj (root), speaker encoder, DiT.
    return (*units, ParamUnit("root", "root", tuple(root)))


def _dtype_bytes(cfg, device: str | None) -> tuple[str, int]:
    """The compute dtype of cfg on `device` (default: cfg.device, a GPU where that is auto):
    bf16 (fp8 runs keep bf16 for everything that is not a float8 GEMM) or fp32."""
    device = device or (cfg.device if cfg.device != "auto" else "cuda")
    precision = cfg.precision_on(device)
    return ("float32", 4) if precision == "fp32" else ("bfloat16", 2)


def ddp_buckets(sizes: Sequence[int], first_cap: int, cap: int) -> int:
    """How many buckets DDP's reducer fills from gradients of `sizes` bytes, taken in the order
    they become ready: a bucket closes once it holds at least its cap (the first `first_cap`, the
    rest `cap`), as torch's compute_bucket_assignment_by_size does."""
    buckets, filled, limit = 0, 0, first_cap
    for size in sizes:
        filled += size
        if filled >= limit:
            buckets, filled, limit = buckets + 1, 0, cap
    return buckets + (filled > 0)


def _link(spans_nodes: bool) -> str:
    return "inter" if spans_nodes else "intra"


def _frame_count(group: str, size: int, spans_nodes: bool, per_node: int) -> Traffic:
    return Traffic("all_reduce", group, size, 1, FRAME_COUNT_BYTES, "int64", _link(spans_nodes),
                   "frame count of the loss (bench_echo.global_frame_count)", per_node)


def ddp_bytes(cfg) -> list[Traffic]:
    """torchtitan DDP (composable replicate) per step: the gradient all-reduce, one call per bucket,
    all trainable parameters' gradients in float32 (the parameters are float32 masters in every
    precision, and DDP reduces gradients in their dtype), plus the frame-count all-reduce.
    Buckets: 100 MiB caps (apply_ddp), gradients taken in reverse registration order (the reducer
    rebuilds buckets in the order gradients became ready in the first step, which is close to
    that; the bytes do not depend on it)."""
    units = param_units(cfg.model_config())
    n, spans = cfg.world_size, cfg.nodes > 1
    sizes = [math.prod(s) * FP32 for u in reversed(units) for s in reversed(u.shapes)]
    reduce_dtype, reduce_size = _reduce_dtype(cfg)
    grads = sum(sizes) * reduce_size // FP32  # the buckets hold float32 gradients; bf16 compresses them
    return [Traffic("all_reduce", "dp", n, ddp_buckets(sizes, *TORCHTITAN_DDP_BUCKET_BYTES), grads, reduce_dtype,
                    _link(spans), "gradient buckets", cfg.gpus_per_node, once=True),
            _frame_count("dp", n, spans, cfg.gpus_per_node)]


def _reduce_dtype(cfg) -> tuple[str, int]:
    """The data-parallel gradient reduction's dtype and bytes per element (grad_reduce_dtype)."""
    return ("bfloat16", 2) if cfg.grad_reduce_dtype == "bf16" else ("float32", FP32)


def fsdp_bytes(cfg, device: str | None = None) -> list[Traffic]:
    """torchtitan FSDP2 (fsdp2: one shard group of all ranks; hsdp: shard within a node, replicate
    across nodes) per step, per kind of unit (ParamUnit):
    - all-gather of each unit's parameters in the compute dtype (MixedPrecisionPolicy param_dtype):
      the output is shard group x the padded shard (ParamUnit.shard_numel), every block twice
      (forward, and again in backward: reshard_after_forward) but the last, which backward finds
      gathered, the root once (kept gathered from forward to backward); with
      reshard_after_forward false every unit once;
    - reduce-scatter of each unit's gradients in grad_reduce_dtype (reduce_dtype), input = shard
      group x the padded shard, once per unit;
    - hsdp only: all-reduce of each unit's gradient shard over the replicate group (reduce dtype);
    - the gradient norm (clip_grad_norm_): one all-reduce of a float32 per trainable parameter
      (torch.nn.utils.get_total_norm of the sharded gradients: DTensor reduces the stacked
      per-parameter norms) over the shard group;
    - the frame-count all-reduce over all ranks.
    `device` picks the compute dtype where cfg.precision is auto (default cfg.device, cuda for auto).
    Held against a counted fsdp2 step on gloo (tests/test_comm.py); hsdp's replicate all-reduce and
    norm group follow FSDP2's HSDP design, not a counted step."""
    hsdp = cfg.layout.hybrid
    shard = cfg.layout.shard_ranks(cfg.nodes, cfg.gpus_per_node)
    shard_spans = cfg.nodes > 1 and not hsdp
    dtype, size = _dtype_bytes(cfg, device)
    reduce_dtype, reduce_size = _reduce_dtype(cfg)
    units = param_units(cfg.model_config())
    last_block = [u.name for u in units if u.kind.endswith("block")][-1]

    def gathers(u: ParamUnit) -> int:  # as backends.torchtitan.apply_fsdp reshards them
        return 2 if cfg.reshard_after_forward and u.kind != "root" and u.name != last_block else 1

    out = []
    for kind in dict.fromkeys(u.kind for u in units):
        mine = [u for u in units if u.kind == kind]
        padded = sum(u.shard_numel(shard) for u in mine) * shard
        out.append(Traffic("all_gather", "dp_shard", shard, sum(map(gathers, mine)),
                           sum(gathers(u) * u.shard_numel(shard) for u in mine) * shard * size, dtype,
                           _link(shard_spans), f"parameters of each {kind}"
                           + (", forward and backward" if any(gathers(u) == 2 for u in mine) else
                              " (once: kept from forward to backward)"), cfg.gpus_per_node))
        out.append(Traffic("reduce_scatter", "dp_shard", shard, len(mine), padded * reduce_size, reduce_dtype,
                           _link(shard_spans), f"gradients of each {kind}", cfg.gpus_per_node, once=True))
        if hsdp and cfg.nodes > 1:  # one rank of each node: the replicas of a shard
            out.append(Traffic("all_reduce", "dp_replicate", cfg.nodes, len(mine), padded // shard * reduce_size,
                               reduce_dtype, "inter", f"gradient shards of each {kind} across the replicas", 1, once=True))
    tensors = sum(len(u.shapes) for u in units)
    out.append(Traffic("all_reduce", "dp_shard", shard, 1, tensors * FP32, "float32", _link(shard_spans),
                       "gradient norm: one float32 per trainable parameter", cfg.gpus_per_node, once=True))
    out.append(_frame_count("dp", cfg.world_size, cfg.nodes > 1, cfg.gpus_per_node))
    return out


def tp_bytes(cfg, device: str | None = None) -> list[Traffic]:
    """megatron tensor parallelism (tpN, without sequence parallelism) per step, from the TP DiT's
    layers (echobench/model/megatron.py), B = micro-batch, in the compute dtype:
    - forward, per block, the all-reduce of each row-parallel output (attention out projection,
      MLP down projection): 2 x B x audio_frames x width; run again in backward under activation
      checkpointing, selective too (the policy recomputes the collective, not only element-wise ops);
    - backward, per block, the all-reduce of each column-parallel input's gradient: q/k/v/gate and
      MLP gate/up (B x audio_frames x width each), text k/v (B x text_tokens x width), speaker k/v
      (B x speaker patches x speaker_width);
    - clipping: one float32 all-reduce of the per-head QK-norm weights' partial gradients (layers x
      2 x head_dim) and one of the squared gradient norm (a float32);
    - megatron-core's DDP over the data-parallel group (of one rank too) of this rank's gradients
      (replicated parameters whole, the TP_SHARDED weights 1/tp; megatron_ddp_bucket_bytes buckets, in
      the grad_reduce_dtype; the distributed optimizer's reduce-scatter and all-gather priced as this
      all-reduce) and, dp > 1, the frame count.
    Held against a counted tp2 step on gloo in fp32 (tests/test_comm.py); bf16 (2 bytes per
    activation) and dp > 1 are derived, not counted (megatron-core's backward does not run under
    CPU autocast)."""
    if cfg.sequence_parallel_on(device):
        raise ValueError("tp_bytes: sequence parallelism (GPU only) is not derived here: no counted step to hold "
                         "its all-gathers and reduce-scatters against")
    m = cfg.model_config()
    tp, dp, b = cfg.tp, cfg.dp, cfg.micro_batch
    dtype, size = _dtype_bytes(cfg, device)
    latent, text = b * cfg.audio_frames * m.width * size, b * cfg.text_tokens * m.width * size
    speaker = b * speaker_patches(m, cfg.speaker_frames) * m.speaker_width * size
    out = []
    if tp > 1:
        forward = 2 if cfg.ac == "none" else 4  # recomputed in backward under AC
        out += [replace(t, per_node=tp) for t in (  # a TP group is within one node
            Traffic("all_reduce", "tp", tp, forward * m.layers, forward * m.layers * latent, dtype, "intra",
                    "row-parallel outputs (attention out, MLP down)" + ("" if cfg.ac == "none" else
                                                                        ", forward and recomputed")),
            Traffic("all_reduce", "tp", tp, 2 * m.layers, 2 * m.layers * latent, dtype, "intra",
                    "column-parallel input gradients (q/k/v/gate, MLP gate/up)"),
            Traffic("all_reduce", "tp", tp, m.layers, m.layers * text, dtype, "intra", "text k/v input gradients"),
            Traffic("all_reduce", "tp", tp, m.layers, m.layers * speaker, dtype, "intra",
                    "speaker k/v input gradients"),
            Traffic("all_reduce", "tp", tp, 1, m.layers * 2 * m.head_dim * FP32, "float32", "intra",
                    "partial gradients of the per-head QK-norms", once=True),
            Traffic("all_reduce", "tp", tp, 1, FP32, "float32", "intra", "squared gradient norm", once=True),
        )]
    grad_dtype, grad_bytes = _reduce_dtype(cfg)  # megatron's buffers hold the gradients in it
    units = param_units(m)
    shares = [math.prod(s) * grad_bytes // (tp if u.kind == "dit block" and name in TP_SHARDED else 1)
              for u in reversed(units) for name, s in reversed(list(zip(_block_names(m, u), u.shapes)))]
    spans, per_node = cfg.nodes > 1, max(1, cfg.gpus_per_node // tp)  # one rank of each TP group per node
    out.append(Traffic("all_reduce", "dp", dp, ddp_buckets(shares, *megatron_ddp_bucket_bytes(cfg)),
                       sum(shares), grad_dtype, _link(spans), "gradient buckets (this rank's TP shard)", per_node,
                       once=True))
    if dp > 1:
        out.append(_frame_count("dp", dp, spans, per_node))
    return out


@lru_cache(maxsize=32)
def _dit_block_names(model_cfg) -> tuple[str, ...]:
    import torch  # lazy: as param_units

    from echobench.model.dit import EchoDiT
    with torch.device("meta"):
        block = EchoDiT(model_cfg).blocks[0]
    return tuple(name for name, _ in block.named_parameters())


def _block_names(model_cfg, unit: ParamUnit) -> tuple[str, ...]:
    """Parameter names within a DiT block (other units: placeholders that match nothing)."""
    return _dit_block_names(model_cfg) if unit.kind == "dit block" else ("",) * len(unit.shapes)


def step_bytes(cfg, device: str | None = None) -> list[Traffic]:
    """A training step's collectives for cfg's layout (single: none)."""
    if cfg.framework == "megatron":
        return tp_bytes(cfg, device)
    if cfg.layout.replicates:
        return ddp_bytes(cfg)
    if cfg.layout.shards_parameters:
        return fsdp_bytes(cfg, device)
    return []


def totals(traffic: Sequence[Traffic]) -> dict[str, OpTotal]:
    """Per collective: calls and bytes, as CollectiveLog.by_op() counts them."""
    out: dict[str, OpTotal] = {}
    for t in traffic:
        prev = out.get(t.op, OpTotal(0, 0))
        out[t.op] = OpTotal(prev.calls + t.calls, prev.bytes + t.nbytes)
    return out
