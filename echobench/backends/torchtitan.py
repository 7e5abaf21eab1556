"""The torchtitan-style backend: the plain model, parallelised from outside.

Each technique is one small function applied to the built model, in torchtitan's order:
float8 conversion -> activation checkpointing -> compile (per block) -> DDP or FSDP2 / HSDP.
The model files know nothing of any of them: each model the backend trains (Echo, a card's
decoder) is described once by its ModelParts (as torchtitan's TrainSpec registers a model's
pieces), which the techniques read. A frozen text encoder is never trained, so it is left out of
FSDP sharding (it stays replicated, in the compute dtype, on every rank); a trainable one
(--train-encoder) is sharded as one more FSDP unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache, partial
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from echobench.model import flops as flops_model
from echobench.backends import TrainSetup
from echobench.backends.master import RECIPES, MasterWeights
from echobench.model.components import merged_attention_runs
from echobench.model.config import LATENT_DIM
from echobench.model.decoder import Decoder
from echobench.model.echo import EchoTTS


@dataclass(frozen=True)
class ModelParts:
    """One model as the backends see it: what the techniques below (and megatron's builds) read
    instead of asking which model they hold. ECHO_PARTS for Echo, decoder_parts(workload) for a card
    run's decoder; model_parts picks one."""

    name: str  # which model: a backend with a build of its own per model (megatron's TP) looks it up by name
    build: Callable[[Any, torch.device, torch.dtype], nn.Module]  # (cfg, device, dtype): the plain model, the run's seed
    blocks: Callable[[nn.Module], tuple[nn.ModuleList, ...]]  # its block stacks: the units of AC, compile and FSDP
    compiled_layers: Callable[[nn.Module], tuple[nn.ModuleList, ...]]  # more stacks compiled layer by layer (only)
    top_level: tuple[tuple[str, str], ...]  # (submodule, function): the work outside the blocks, compiled on its own
    recompute: dict[str, str]  # what each ac_mode re-runs in backward (the record's `recompute`)
    sharded: Callable[[nn.Module], tuple[nn.Module, ...]]  # FSDP units besides the blocks and the root
    frozen: Callable[[nn.Module], set[nn.Parameter]]  # parameters never trained: left out of sharding
    float8_plan: Callable[[Any, nn.Module], Float8Plan]  # (cfg, model): which linears run in float8
    info: Callable[[Any, nn.Module, torch.device, torch.dtype], dict]  # the record's fields of this model
    compiled: str  # what compile wraps, for the record's `compiled`


def each_layer(stacks: tuple[nn.ModuleList, ...]) -> list[tuple[nn.ModuleList, int]]:
    """(container, index) of every layer of the stacks (ModelParts.blocks, .compiled_layers)."""
    return [(container, i) for container in stacks for i in range(len(container))]


def key_masking(cfg, device: torch.device) -> str:
    """How attention skips padded keys here (components.key_mask): auto is flex on a GPU, dense on a CPU."""
    if cfg.key_masking == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if cfg.key_masking == "flex" and device.type != "cuda":
        raise ValueError("key_masking flex: torch has no FlexAttention backward on the CPU: use key_masking dense "
                         "(or auto)")
    return cfg.key_masking


def cfg_drop_attention(cfg, device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """How the DiT attends where samples drop their conditioning and nothing is padded
    (model.echo.CFG_DROP_ATTENTIONS), and why split runs masked here (None where it runs as set):
    split calls SDPA's flash kernel (components.merged_attention), so it runs where that kernel can
    and where no other SDPA kernel is pinned."""
    if cfg.cfg_drop_attention == "masked":
        return "masked", None
    if cfg.sdpa_backend not in ("auto", "flash"):
        return "masked", f"split calls the flash kernel: sdpa_backend {cfg.sdpa_backend} pins another"
    problem = merged_attention_runs(device, dtype, cfg.model_config().head_dim)
    return ("masked", f"split runs masked: {problem}") if problem else ("split", None)


def build_model(cfg, device: torch.device, dtype: torch.dtype) -> EchoTTS:
    # Same initial weights on every rank and in every backend. Built directly on the device:
    # an 8B model in fp32 fits on one GPU before it is sharded.
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = EchoTTS(cfg.model_config(), cfg.encoder_checkpoint, key_masking(cfg, device), cfg.cfg_drop,
                        cfg_drop_attention(cfg, device, dtype)[0])
    if cfg.frozen_encoder:
        # A frozen encoder keeps no fp32 master copy: store it in the compute dtype.
        model.text_encoder.to(dtype)
    return model


def build_decoder(cfg, workload, device: torch.device) -> Decoder:
    """A card run's decoder (model.decoder), with the run's seed: the same weights in every layout."""
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        return Decoder(workload.card, workload.seq)


# torch._scaled_mm(a, b) on CUDA, a (M, K) and b (K, N), needs K and N to be multiples of 16
# (M is free). torchao's Float8Linear, for an input x of `rows` x in and a weight W of out x in,
# runs three of them:
#   forward       x @ W.t()      (rows, in)  @ (in, out)    K = in,    N = out
#   grad_input    dy @ W         (rows, out) @ (out, in)    K = out,   N = in
#   grad_weight   dy.t() @ x     (out, rows) @ (rows, in)   K = rows,  N = in
# So in, out AND rows (micro_batch x tokens) must be multiples of 16. torchao's pad_inner_dim
# would pad K instead, copying both operands of every float8 GEMM inside the measured step;
# echobench refuses such a run before it starts rather than measure that copy.
SCALED_MM_ALIGN = 16
# The latent in / out projections (128 latent channels <-> width): one of their GEMMs' K or N is
# 128, too thin for float8 to pay back its amax, scale and cast kernels (torchtitan's filter
# leaves such small layers alone too).
LATENT_PROJECTIONS = ("dit.in_proj", "dit.out_proj")


@dataclass(frozen=True)
class Float8Plan:
    convert: frozenset[str]  # linears that become Float8Linear
    skipped: dict[str, str]  # linear -> why it stays in the compute dtype
    problem: str | None  # why float8 cannot run at this run's shapes (None: it can)


@lru_cache(maxsize=64)
def linear_inputs(model_cfg, audio_frames: int, text_tokens: int,
                  speaker_frames: int) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """(name, input shape, in, out) of every trainable linear outside the text encoder, for ONE
    sample at this run's padded lengths (static: the loader pads to them), from a forward on the
    meta device. Every input's leading dim is the batch: a micro-batch of B has B times the rows."""
    with torch.device("meta"):
        model = EchoTTS(model_cfg)
        batch = SimpleNamespace(  # what the model's forward reads of a data.Batch
            latent=torch.empty(1, audio_frames, model_cfg.latent_dim),
            latent_mask=torch.ones(1, audio_frames, dtype=torch.bool),
            ref=torch.empty(1, speaker_frames, model_cfg.latent_dim),
            ref_mask=torch.ones(1, speaker_frames, dtype=torch.bool),
            text_ids=torch.zeros(1, text_tokens, dtype=torch.long),
            text_mask=torch.ones(1, text_tokens, dtype=torch.bool))
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, tuple(args[0].shape))
        return hook

    hooks = [m.register_forward_pre_hook(record(name)) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and not name.startswith("text_encoder")]
    with torch.no_grad():
        model(batch)
    for h in hooks:
        h.remove()
    modules = dict(model.named_modules())
    return tuple((name, shape, modules[name].in_features, modules[name].out_features) for name, shape in seen.items())


def float8_plan(cfg) -> Float8Plan:
    """Which linears run in float8, and whether this run's shapes let them.

    Converted: the trainable linears that see tokens (an input with a token axis) with in and out
    features multiples of 16, but not the latent in / out projections (LATENT_PROJECTIONS). The AdaLN, timestep-MLP and final-AdaLN linears see one row per
    sample (micro_batch rows): too few for a float8 GEMM to pay, and rarely a multiple of 16, so
    they stay in the compute dtype, as torchtitan's float8 filter leaves small layers alone.
    A converted linear whose rows are not a multiple of 16 refuses the whole run.
    """
    convert, skipped, bad = set(), {}, []
    need = 1  # micro_batch must be a multiple of this for every converted linear's rows
    for name, sample, fan_in, fan_out in linear_inputs(cfg.model_config(), cfg.audio_frames, cfg.text_tokens,
                                                       cfg.speaker_frames):
        shape = (cfg.micro_batch, *sample[1:])
        if len(shape) < 3:
            skipped[name] = "one row per sample (no token axis)"
        elif fan_in % SCALED_MM_ALIGN or fan_out % SCALED_MM_ALIGN:
            skipped[name] = f"{fan_in} -> {fan_out} features: not multiples of {SCALED_MM_ALIGN}"
        elif name in LATENT_PROJECTIONS:
            skipped[name] = (f"{fan_in} -> {fan_out} features: a GEMM with K or N of {LATENT_DIM} (the latent's "
                             f"channels) gains less from float8 than its casts cost")
        else:
            convert.add(name)
            rows = math.prod(shape[:-1])
            tokens = rows // cfg.micro_batch
            need = math.lcm(need, SCALED_MM_ALIGN // math.gcd(tokens, SCALED_MM_ALIGN))
            if rows % SCALED_MM_ALIGN:
                bad.append((name, shape, rows, tokens))
    problem = None
    if bad:
        name, shape, rows, tokens = bad[0]
        more = f", as do {len(bad) - 1} more linears" if len(bad) > 1 else ""
        problem = (f"fp8: {name} has input {tuple(shape)}, {rows} rows (micro_batch {cfg.micro_batch} x {tokens} "
                   f"tokens){more}; torch._scaled_mm needs rows divisible by {SCALED_MM_ALIGN} for the weight "
                   f"gradient: use a micro_batch that is a multiple of {need}, or precision bf16")
    return Float8Plan(frozenset(convert), skipped, problem)


def card_float8_plan(model: Decoder) -> Float8Plan:
    """A card run's float8 linears: every block linear with in and out features multiples of 16 (its
    rows, micro_batch x seq, checks.card_problem holds to them); the LM head stays in the compute
    dtype, as torchtitan's and TransformerEngine's recipes leave it."""
    convert, skipped = set(), {"head": "the LM head stays in the compute dtype (torchtitan's recipe)"}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("blocks."):
            if module.in_features % SCALED_MM_ALIGN or module.out_features % SCALED_MM_ALIGN:
                skipped[name] = f"{module.in_features} -> {module.out_features} features: not multiples of {SCALED_MM_ALIGN}"
            else:
                convert.add(name)
    return Float8Plan(frozenset(convert), skipped, None)


def float8_emulated(device: torch.device) -> bool:
    # Real float8 GEMMs need SM 8.9+ (Ada, Hopper); elsewhere torchao emulates them.
    return device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)


def apply_float8(model: EchoTTS, plan: Float8Plan, emulate: bool, fsdp: bool, compiled: bool,
                 recipe: str = "tensorwise") -> dict:
    """torchao's float8 training on the planned linears, with its scaling recipe (tensorwise: one
    scale per tensor; rowwise: one per row of each operand, torchtitan's more accurate recipe).
    Under FSDP2 tensorwise weights are all-gathered in float8 (half the bytes of bf16), as torchtitan
    does (torchao all-gathers rowwise ones in bf16). Eager float8 runs its amax, scale and cast ops as
    separate kernels around every GEMM: the record says so (compile fuses them)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # lazy: torchao is optional

    if plan.problem:
        raise ValueError(plan.problem)
    config = replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                     enable_fsdp_float8_all_gather=fsdp and not emulate and recipe == "tensorwise")
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in plan.convert)
    converted = sorted(n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    info = {"float8": "emulated" if emulate else recipe, "float8_recipe": recipe, "float8_linears": len(converted),
            "float8_skipped": plan.skipped, "float8_all_gather": config.enable_fsdp_float8_all_gather}
    if not compiled:
        info["float8_note"] = ("eager float8: amax, scale and cast run as separate kernels around every GEMM; "
                               "compile fuses them (compile: true)")
    return info


# Selective AC: keep the outputs of matmuls and attention (SDPA's kernels and FlexAttention, a
# higher-order op that SAC's policy sees whole), recompute everything else (norms, RoPE,
# activations, gates). No matmul or attention is re-run, so recompute adds no FLOPs
# (flops.recompute_flops); without FlexAttention here, every masked micro-batch re-ran its
# attention forward in backward.
_SAVE_OPS = {
    torch.ops.higher_order.flex_attention,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_mm.default,  # float8
}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


# What each activation checkpointing mode (ac_mode) re-runs in backward, for the record's `backend`.
RECOMPUTE = {
    "none": "nothing",
    "full": "every DiT and speaker-encoder block re-run in backward (torch.utils.checkpoint, non-reentrant)",
    "selective": "element-wise ops of every DiT and speaker-encoder block re-run in backward, fused by the "
                 "compiler; matmul and attention outputs saved (torch.utils.checkpoint selective policy)",
    flops_model.TE_SELECTIVE: "element-wise ops of every block and the DiT blocks' TransformerEngine linears and "
                              "core attention re-run in backward (TE's kernels are not ATen ops the selective "
                              "policy can save); the other matmul outputs saved",
    flops_model.LAYER_SELECTIVE: "every second DiT and speaker-encoder block re-run in backward (layer-level "
                                 "selective, torchtitan's default; eager, where re-running element-wise kernels "
                                 "one by one would cost more than it saves)",
}


def ac_mode(ac: str, compiled: bool) -> str:
    """The checkpointing that runs: selective is op-level where the blocks compile (the recomputed
    element-wise ops fuse into backward's kernels) and layer-level where they run eager."""
    return flops_model.LAYER_SELECTIVE if ac == "selective" and not compiled else ac


# The same for a card run's decoder, whose blocks are its only stack.
CARD_RECOMPUTE = {
    "none": "nothing",
    "full": "every decoder block re-run in backward (torch.utils.checkpoint, non-reentrant)",
    "selective": "element-wise ops of every decoder block re-run in backward, fused by the compiler; matmul and "
                 "attention outputs saved (torch.utils.checkpoint selective policy)",
    flops_model.LAYER_SELECTIVE: "every second decoder block re-run in backward (layer-level selective, torchtitan's "
                                 "default; eager)",
}


def apply_ac(model: nn.Module, parts: ModelParts, mode: str) -> None:
    """Non-reentrant checkpointing of the blocks (mode: ac_mode): full, op-level selective (every
    block, the selective policy) or layer-level selective (every second block of each stack, whole)."""
    if mode == "none":
        return
    if mode not in parts.recompute:
        raise ValueError(f"unknown activation checkpointing mode {mode!r}: none, selective or full")
    kwargs = {"context_fn": _selective_context} if mode in ("selective", flops_model.TE_SELECTIVE) else {}
    for container, i in each_layer(parts.blocks(model)):
        if mode != flops_model.LAYER_SELECTIVE or i % 2 == 1:
            container[i] = checkpoint_wrapper(container[i], preserve_rng_state=False, **kwargs)


def text_encoder_layers(model: EchoTTS) -> nn.ModuleList:
    """The frozen (or trained) text encoder's repeated layers: T5Gemma2's `layers`, T5's `block`."""
    encoder = model.text_encoder.encoder
    return encoder.layers if hasattr(encoder, "layers") else encoder.encoder.block


# The model's work outside its modules' blocks, as functions compiled on their own (EchoDiT.embed
# / head, EchoTTS.noised / squared_error): compiling the whole forward would trace every block
# into one graph.
TOP_LEVEL = (("dit", "embed"), ("dit", "head"), ("", "noised"), ("", "squared_error"))


# A card run's decoder: its embedding, and its final norm, LM head and loss (model.decoder.Decoder).
CARD_TOP_LEVEL = (("", "embed"), ("", "head_loss"))


def apply_compile(model: nn.Module, parts: ModelParts, fullgraph: bool = True) -> None:
    """torch.compile in place: each block (the blocks repeat, so one graph serves them all), each
    of the parts' other compiled layers, and the top level's functions. Static shapes
    (dynamic=False): one graph per shape, a few with batching=bucket (compile_shapes sizes dynamo's
    recompile limit to them), never a dynamic one."""
    for container, i in each_layer(parts.blocks(model)) + each_layer(parts.compiled_layers(model)):
        container[i].compile(fullgraph=fullgraph, dynamic=False)
    for owner, name in parts.top_level:
        module = model.get_submodule(owner)
        setattr(module, name, torch.compile(getattr(module, name), fullgraph=fullgraph, dynamic=False))


def echo_info(cfg, model: EchoTTS, device: torch.device, dtype: torch.dtype) -> dict:
    """The record's fields of an Echo run: where its text encoder lives and how it attends."""
    info = {"text_encoder": text_encoder_layout(cfg, dtype), "key_masking": model.key_masking,
            "cfg_drop": model.cfg_drop, "cfg_drop_attention": model.cfg_drop_attention}
    if note := cfg_drop_attention(cfg, device, dtype)[1]:
        info["cfg_drop_attention_note"] = note
    return info


ECHO_PARTS = ModelParts(
    name="echo",
    build=build_model,
    blocks=lambda model: (model.speaker_encoder.blocks, model.dit.blocks),
    compiled_layers=lambda model: (text_encoder_layers(model),),
    top_level=TOP_LEVEL,
    recompute=RECOMPUTE,
    # A trainable text encoder is one more FSDP unit; a frozen one is never trained: not sharded.
    sharded=lambda model: () if model.cfg.frozen_encoder else (model.text_encoder,),
    frozen=lambda model: {p for p in model.text_encoder.parameters() if not p.requires_grad},
    float8_plan=lambda cfg, model: float8_plan(cfg),
    info=echo_info,
    compiled="DiT, speaker-encoder and text-encoder block",
)


def decoder_parts(workload) -> ModelParts:
    """A card run's decoder (workload: model.config.CardWorkload): its blocks are its one stack, all
    of it trained."""
    return ModelParts(
        name="decoder",
        build=lambda cfg, device, dtype: build_decoder(cfg, workload, device),
        blocks=lambda model: (model.blocks,),
        compiled_layers=lambda model: (),
        top_level=CARD_TOP_LEVEL,
        recompute=CARD_RECOMPUTE,
        sharded=lambda model: (),
        frozen=lambda model: set(),
        float8_plan=lambda cfg, model: card_float8_plan(model),
        info=lambda cfg, model, device, dtype: {
            "model": f"decoder from card {workload.label}: {workload.card.layers} blocks, seq {workload.seq}"},
        compiled="decoder block",
    )


def model_parts(workload=None) -> ModelParts:
    """The parts of the model a run trains: Echo's, or (workload: a card run's
    model.config.CardWorkload) the card's decoder's. The one place a backend tells them apart."""
    return ECHO_PARTS if workload is None else decoder_parts(workload)


REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_fsdp(model: nn.Module, parts: ModelParts, mesh, param_dtype: torch.dtype, force_sum: bool,
               reduce_dtype: torch.dtype, reshard_after_forward: bool) -> None:
    """FSDP2: each block, then the parts' other sharded units, then the root (the remaining trainable
    layers, the frozen ones left out); gradients reduced in reduce_dtype (bf16 halves the bytes).

    On a 2-D mesh (replicate, shard) this is HSDP. No unit casts its forward inputs
    (cast_forward_inputs=False): autocast already picks the compute dtype of every matmul, and a
    cast would also turn the float32 RoPE table entering each block (and the loss target at the
    root) into bf16, which single-process and DDP runs keep in float32. reshard_after_forward frees
    each block's gathered weights after its forward, except the last block's, which backward
    needs at once (as torchtitan does); the root keeps its own.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # lazy: seconds to import

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    blocks = each_layer(parts.blocks(model))
    for n, (container, i) in enumerate(blocks):
        fully_shard(container[i], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward and n < len(blocks) - 1)
    for unit in parts.sharded(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=parts.frozen(model), reshard_after_forward=False)
    if force_sum:  # gloo has no PREMUL_SUM: reduce with SUM and divide separately
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def apply_ddp(model: EchoTTS, mesh, reduce_dtype: torch.dtype) -> None:
    """DDP: gradients written straight into the reduction buckets (gradient_as_bucket_view: no copy
    per step, no second copy of the gradients in memory); bf16 reduction by DDP's compression hook."""
    replicate(model, device_mesh=mesh, bucket_cap_mb=100, gradient_as_bucket_view=True)
    # bf16 parameters (master_weights bf16-compute) have bf16 gradients: DDP reduces them as they are.
    if reduce_dtype == torch.bfloat16 and any(p.dtype != torch.bfloat16 for p in model.trainable_parameters()):
        model.register_comm_hook(None, bf16_compress_hook)


def build_mesh(cfg, device: torch.device):
    if cfg.layout.hybrid:
        return init_device_mesh(device.type, (cfg.nodes, cfg.gpus_per_node), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device.type, (cfg.world_size,), mesh_dim_names=("dp",))


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """Like torch's, for sharded (DTensor) gradients too: the norm is reduced over the mesh. With a
    fused optimizer over plain parameters the gradients are not scaled here: the optimizer's kernel
    divides each one by its grad_scale as it reads it (the hook AMP's unscaling uses), which saves
    clipping's own pass over every gradient (a read and a write of 4 bytes per parameter)."""
    from torch.distributed.tensor import DTensor  # lazy: seconds to import (FSDP runs have it already)

    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    # Sharded (DTensor) parameters: the fused kernel's DTensor dispatch would meet a plain-tensor
    # grad_scale beside DTensors, so those gradients are scaled here.
    if optimizer is not None and optimizer.defaults.get("fused") and not isinstance(params[0], DTensor):
        # 1 / torch's clip coefficient: grads x min(max_norm / (norm + 1e-6), 1)
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).float()
    else:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm


# The AdamW settings of every backend (the megatron backend's optimizer takes them too).
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.1}


def build_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    # fused AdamW on GPU is the fast path torchtitan uses; foreach on CPU.
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, **ADAMW, fused=fused, foreach=not fused)


def text_encoder_layout(cfg, dtype: torch.dtype) -> str:
    if not cfg.frozen_encoder:
        return "trainable: sharded as one FSDP unit" if cfg.layout.shards_parameters else "trainable"
    return f"frozen, replicated on every rank (not sharded), {str(dtype).removeprefix('torch.')}"


def gradient_sync(model: nn.Module) -> Callable[[bool], None] | None:
    """Turns the data-parallel gradient reduction of the next backward on or off (off for the
    micro-batches before the last of a step): FSDP2 and replicate's set_requires_gradient_sync."""
    return getattr(model, "set_requires_gradient_sync", None)


def build(cfg, dist_info, dtype: torch.dtype, workload=None) -> TrainSetup:
    """The model, parallelised, and its step pieces; `cfg` passed validate() (backends.build_training
    checks it). workload: a card run's (model.config.CardWorkload): its decoder in Echo's place, the
    same techniques applied to its blocks (model_parts)."""
    device = dist_info.device
    parts = model_parts(workload)
    compiled = cfg.compiled_on(device.type)
    ac = ac_mode(cfg.ac, compiled)
    reduce_dtype = REDUCE_DTYPES[cfg.grad_reduce_dtype]
    info = {"backend": "torchtitan", "parallelism": cfg.parallelism, "sharding": "none"}
    model = parts.build(cfg, device, dtype)
    info.update(parts.info(cfg, model, device, dtype), recompute=parts.recompute[ac])
    info.update(ac=cfg.ac, ac_mode=ac, compile=compiled)
    if cfg.precision == "fp8":
        info.update(apply_float8(model, parts.float8_plan(cfg, model), float8_emulated(device),
                                 fsdp=cfg.layout.shards_parameters, compiled=compiled, recipe=cfg.float8_recipe))
    apply_ac(model, parts, ac)
    if compiled:
        apply_compile(model, parts)
        info["compiled"] = (f"torch.compile(fullgraph=True, dynamic=False) of each {parts.compiled} and of the top "
                            "level's functions")
    recipe, accum_dtype = cfg.master_weights_on(device.type), cfg.grad_accum_dtype_on(device.type)
    info.update(master_weights=recipe, master_weights_recipe=RECIPES[recipe], grad_accum_dtype=accum_dtype)
    # bf16-compute turns the parameters into bf16 before DDP makes its buckets of them.
    master = (MasterWeights(model.trainable_parameters(), lambda masters: build_optimizer(masters, device),
                            accumulate_fp32=accum_dtype == "fp32")
              if recipe == "bf16-compute" else None)
    if cfg.layout.data_parallel:
        mesh = build_mesh(cfg, device)
        info["mesh"] = dict(zip(mesh.mesh_dim_names, mesh.shape))
        info["process_group_backend"] = torch.distributed.get_backend()
        info["grad_reduce_dtype"] = cfg.grad_reduce_dtype
        if cfg.layout.replicates:
            apply_ddp(model, mesh, reduce_dtype)
            info["sharding"] = (f"replicated (DDP, {str(reduce_dtype).removeprefix('torch.')} gradient all-reduce, "
                                "gradients as bucket views)")
        else:
            force_sum = torch.distributed.get_backend() == "gloo"
            apply_fsdp(model, parts, mesh, dtype, force_sum, reduce_dtype, cfg.reshard_after_forward)
            info["sharding"] = ("FSDP2 per block + root" if not cfg.layout.hybrid
                                else "HSDP: replicate across nodes, FSDP2 per block + root inside a node")
            info["mixed_precision"] = {"param_dtype": str(dtype).removeprefix("torch."),
                                       "reduce_dtype": str(reduce_dtype).removeprefix("torch.")}
            info["reshard_after_forward"] = cfg.reshard_after_forward
            if force_sum:
                info["reduce_op"] = "sum (gloo lacks PREMUL_SUM)"
    if master is None:
        params = model.trainable_parameters()
        optimizer = build_optimizer(params, device)
        clip_grad = partial(clip_grad_norm_, params, 1.0, optimizer)
    else:  # clipping reads the fp32 gradients the step loads into the masters
        optimizer = master
        clip_grad = lambda: clip_grad_norm_(master.load_grads(), 1.0, master.optimizer)  # noqa: E731
    # Every rank is a data-parallel replica (HSDP: both mesh dimensions).
    dp_group = torch.distributed.group.WORLD if cfg.layout.data_parallel else None
    return TrainSetup(
        model=model,
        optimizer=optimizer,
        clip_grad=clip_grad,
        # bf16 runs under autocast in every layout (FSDP2 gathers its params in bf16; bf16-compute holds
        # them in bf16: autocast then casts activations only).
        autocast_dtype=dtype if dtype != torch.float32 else None,
        info=info,
        dp_group=dp_group,
        gradient_sync=gradient_sync(model),
    )
