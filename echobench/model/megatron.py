"""The Echo DiT built from megatron-core parallel layers: the one place that builds layers from megatron-core
(decoder_tp.py takes its linears for a card run's decoder).

It is the plain EchoDiT (echobench/model/dit.py), same blocks and same forward, given megatron-core's
layers (a BlockLayers), so that the work of every block is split across the tensor-parallel (TP) group:
  - attention: q / k / v / gate fused in one ColumnParallelLinear (heads split across ranks),
    the text and speaker key/value projections column-parallel too, the output RowParallelLinear;
  - MLP: megatron-core's MLP (gate/up fused column-parallel, down row-parallel, SwiGLU);
  - norms, AdaLN, timestep embedding and the input / output projections replicated.
Inside the blocks activations are sequence-first (T, B, W), megatron's layout, so that sequence
parallelism (the latent stream split along T between the TP regions) is a flag.

A layer spec (megatron-core ModuleSpec / submodules) picks the kernels without changing the
model: TransformerEngine linear / norm / attention, or megatron-core's local layers with torch
SDPA attention (megatron's local DotProductAttention materialises the score matrix; SDPA is the
fast kernel torch offers and what the plain model runs). TPOptions says how the layers run
(sequence parallelism, bf16 parameters, fused SwiGLU, TE's overlap); every layer is given its TP
group, and blocks that will be compiled get TracedColumnParallelLinear, so that dynamo traces a
block whole.

Weights move between the plain layout and the TP shards with TPStateDictAdapter (to_tp /
from_tp, exact inverses); the backend builds the plain model with the run's seed and loads its
shards, so both backends start from the same weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from echobench.model.components import LowRankAdaLN, RMSNorm, attention
from echobench.model.config import EchoConfig
from echobench.model.dit import BlockLayers, EchoDiT, joint_attention

# ---------------------------------------------------------------------------------------------
# Config and layer specs


@dataclass(frozen=True)
class TPOptions:
    """How the TP blocks run; the backend picks each where it can run (backends/megatron.py)."""

    te: bool = False  # TransformerEngine's linear / norm / attention, else megatron-core's local layers
    sequence_parallel: bool = False  # the latent stream split along T between the TP regions
    traced: bool = False  # the blocks will be compiled: TracedColumnParallelLinear
    params_dtype: torch.dtype = torch.float32  # bf16 on a GPU, fp32 main params in the optimizer
    fused_swiglu: bool = False  # megatron-core's fused SwiGLU (bias_activation_fusion)
    grad_accum_fusion: bool = False  # weight gradients accumulated into DDP's main_grad in the GEMM
    tp_comm_overlap: bool = False  # TE's userbuffer overlap of the TP collectives with the GEMMs


def megatron_config(cfg: EchoConfig, tp: int, options: TPOptions, use_cpu: bool) -> TransformerConfig:
    """megatron-core's TransformerConfig for the DiT blocks.

    Weights are not initialised here (perform_initialization=False): they are loaded from the
    plain model's state dict so that every backend starts from the same weights.
    """
    return TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.width,
        num_attention_heads=cfg.heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.mlp,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        # With gated_linear_unit and no bias, megatron-core's MLP runs its SwiGLUFunction: one fused
        # kernel forward and one backward (its hand-written gradient), torch.compile'd.
        bias_activation_fusion=options.fused_swiglu,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=options.sequence_parallel,
        params_dtype=options.params_dtype,
        bf16=options.params_dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu,
        perform_initialization=False,
        gradient_accumulation_fusion=options.grad_accum_fusion,
        # megatron-core's own default ("full") warns on every rank that it is deprecated; [] means the same
        # (the whole layer, were CUDA graphs on: echobench does not capture them)
        cuda_graph_scope=[],
        tp_comm_overlap=options.tp_comm_overlap,
    )


@dataclass
class JointAttentionSubmodules:
    linear_qkvg: type | ModuleSpec  # column-parallel
    linear_kv_text: type | ModuleSpec  # column-parallel
    linear_kv_speaker: type | ModuleSpec  # column-parallel
    core_attention: type | ModuleSpec
    linear_proj: type | ModuleSpec  # row-parallel
    q_norm: type | ModuleSpec
    k_norm: type | ModuleSpec


class LocalNorm(RMSNorm):
    """The plain model's RMSNorm behind megatron's norm signature (config, hidden_size, eps).

    megatron-core's local WrappedTorchNorm refuses sequence parallelism; this one has no such
    limit and is bit-identical to the plain model's norm.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)


class SDPACoreAttention(nn.Module):
    """The plain model's attention (torch SDPA) behind megatron's core-attention signature."""

    def __init__(self, config: TransformerConfig):
        super().__init__()

    def forward(self, q, k, v, key_mask):
        return attention(q, k, v, key_mask)


class PackedKeys(NamedTuple):
    """The joint keys' padding as TE's fused attention reads it, made once per step (pack_keys) and
    used by every layer: the order that moves each sample's valid keys to the front, and TE's
    (query mask, key mask), True = masked out."""

    order: torch.Tensor  # (B, Tk) key indices, each sample's valid keys first
    masks: tuple[torch.Tensor, torch.Tensor]  # (B, 1, 1, Tq), (B, 1, 1, Tk)


def pack_keys(key_mask: torch.Tensor, queries: int) -> PackedKeys:
    """The packing of a (B, Tk) key mask (True = attend) for `queries` queries.

    The joint key sequence is [latent | text | speaker], each padded to its own maximum, so valid
    keys have gaps; TE's fused attention reads a padding mask as a count of valid keys per sample
    (cu_seqlens), as if they came first. Attention does not depend on the order of its keys (RoPE
    is already applied), so packing changes nothing else. A stable sort on the device: no host
    sync, static shapes; one per step, not one per layer (the mask is the same in every layer).
    """
    order = torch.sort((~key_mask).to(torch.uint8), dim=1, stable=True).indices  # valid keys first
    packed = key_mask.gather(1, order)  # now a prefix of each row
    q_mask = torch.zeros(key_mask.shape[0], 1, 1, queries, dtype=torch.bool, device=key_mask.device)
    return PackedKeys(order, (q_mask, ~packed[:, None, None, :]))


def gather_keys(k: torch.Tensor, v: torch.Tensor, order: torch.Tensor):
    """k, v (B, H, Tk, D) in the packed order (pack_keys)."""
    index = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    return k.gather(2, index), v.gather(2, index)


class TECoreAttention(nn.Module):
    """TransformerEngine's fused attention behind the same (B, H, T, D) interface.

    Queries and keys have different lengths, so TE takes the key-padding mask as a
    (query mask, key mask) pair, True = masked out, with the valid keys packed to the front: the
    model packs once per step (TPEchoDiT.run_blocks), each layer gathers its keys in that order.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        from megatron.core.extensions.transformer_engine import TEDotProductAttention  # lazy: TE is optional

        self.mask_type = AttnMaskType.padding
        self.attn = TEDotProductAttention(config, layer_number=1, attn_mask_type=self.mask_type,
                                          attention_type="cross")

    @staticmethod
    def te_inputs(q, k, v, packed: PackedKeys):
        """(B, H, T, D) -> TE's sbhd layout (T, B, H, D), keys packed, and its (query, key) masks."""
        k, v = gather_keys(k, v, packed.order)
        q, k, v = (x.permute(2, 0, 1, 3).contiguous() for x in (q, k, v))
        return q, k, v, packed.masks

    def forward(self, q, k, v, packed: PackedKeys | None):
        b, h, tq, d = q.shape
        if packed is None:  # no padded key: TE's attention without a mask
            q, k, v = (x.permute(2, 0, 1, 3).contiguous() for x in (q, k, v))
            out = self.attn(q, k, v, attention_mask=None, attn_mask_type=AttnMaskType.no_mask)
        else:
            q, k, v, masks = self.te_inputs(q, k, v, packed)
            out = self.attn(q, k, v, attention_mask=masks, attn_mask_type=self.mask_type)
        return out.view(tq, b, h, d).permute(1, 2, 0, 3)  # (Tq, B, H*D) -> (B, H, Tq, D)


# ---------------------------------------------------------------------------------------------
# The layers given to the plain DiT's blocks


def _no_init(weight):  # weights come from the plain model's state dict
    return weight


class TPJointAttention(nn.Module):
    """The plain joint attention (dit.joint_attention) with this rank's share of the heads."""

    seq_first = True
    forward = joint_attention

    def __init__(self, config: TransformerConfig, submodules: JointAttentionSubmodules, speaker_width: int,
                 tp_group):
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads // config.tensor_model_parallel_size

        # The text and speaker streams stay whole under sequence parallelism: their
        # projections are plain column-parallel (no all-gather of the input), and TE's userbuffers
        # (tp_comm_overlap) exist only for the latent stream's shape.
        whole_config = replace(config, sequence_parallel=False, tp_comm_overlap=False)

        def column(spec, in_size, out_size, layer_config, buffer=None):
            return build_module(spec, in_size, out_size, config=layer_config, init_method=_no_init,
                                gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
                                tp_comm_buffer_name=buffer, tp_group=tp_group)

        # "qkv" / "proj": TE's userbuffer names for these GEMMs (the MLP's are "fc1" / "fc2").
        self.linear_qkvg = column(submodules.linear_qkvg, width, 4 * width, config, "qkv")
        self.linear_kv_text = column(submodules.linear_kv_text, width, 2 * width, whole_config)
        self.linear_kv_speaker = column(submodules.linear_kv_speaker, speaker_width, 2 * width, whole_config)
        self.core_attention = build_module(submodules.core_attention, config)
        self.linear_proj = build_module(submodules.linear_proj, width, width, config=config, init_method=_no_init,
                                        bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False,
                                        tp_comm_buffer_name="proj", tp_group=tp_group)
        self.q_norm = build_module(submodules.q_norm, config, config.kv_channels, config.layernorm_epsilon)
        self.k_norm = build_module(submodules.k_norm, config, config.kv_channels, config.layernorm_epsilon)

    def project(self, x, text, speaker):
        """x: (T or T/tp under sequence parallelism, B, W); full T after the all-gather."""
        return (self.linear_qkvg(x)[0].chunk(4, dim=-1), self.linear_kv_text(text)[0].chunk(2, dim=-1),
                self.linear_kv_speaker(speaker)[0].chunk(2, dim=-1))

    def attend(self, q, k, v, key_mask):
        return self.core_attention(q, k, v, key_mask)

    def out(self, x):
        return self.linear_proj(x)[0]


class TracedColumnParallelLinear(ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear with its communication in megatron's region functions
    (copy-to-region, or the sequence-parallel all-gather) around a matmul that communicates nothing:
    for compiled blocks. megatron's own forward issues the input-gradient all-reduce (or the
    sequence-parallel all-gather and reduce-scatter) inside the matmul's backward with
    async_op=True, to overlap them with the weight-gradient GEMM in eager; dynamo does not trace an
    async collective and breaks the graph at every such linear. The region functions' collectives
    are synchronous, which dynamo traces; the sums are the same."""

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is not None or runtime_gather_output or self.gather_output or not self.skip_bias_add:
            raise NotImplementedError("TracedColumnParallelLinear: own weight, no gathered output, bias skipped")
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = self._forward_impl(input=x, weight=self.weight, bias=None,
                                 gradient_accumulation_fusion=self.gradient_accumulation_fusion,
                                 allreduce_dgrad=False, sequence_parallel=False, tp_group=self.tp_group)
        return out, self.bias


class GroupRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear, its matmul given the layer's TP group: megatron-core 0.16's
    passes tp_group=None there, so the matmul looks the default group up on every call (and warns
    on rank 0), a graph break where compiled. The row-parallel matmul itself communicates nothing
    (its all-reduce or reduce-scatter follows it), so the group changes no result."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        return super()._forward_impl(input, weight, *args, **{**kwargs, "tp_group": self.tp_group})


class TPMLP(MLP):
    """megatron-core's MLP (gate/up fused column-parallel, down row-parallel, SwiGLU), output only
    (it returns (output, bias); the bias is None: add_bias_linear=False)."""

    def forward(self, x):
        return super().forward(x)[0]


class SequenceFirstAdaLN(LowRankAdaLN):
    """The plain AdaLN with modulations (1, B, W) for sequence-first activations.

    Under sequence parallelism each rank modulates only its slice of the sequence, so the
    modulations' gradient is all-reduced over the TP group (copy-to-region's backward).
    """

    def __init__(self, cfg: EchoConfig, sequence_parallel: bool, tp_group):
        super().__init__(cfg.width, cfg.adaln_rank, n_chunks=6)
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def split(self, mods):
        if self.sequence_parallel:
            mods = copy_to_tensor_model_parallel_region(mods, group=self.tp_group)
        return mods.unsqueeze(0).chunk(self.n_chunks, dim=-1)


def tp_block_layers(config: TransformerConfig, te: bool, tp_group, traced: bool = False) -> BlockLayers:
    """The layers of a TP DiT block, each given the TP group (megatron-core looks the default group up
    otherwise, on every call: a graph break where compiled); the layer spec picks TransformerEngine
    kernels or megatron-core's local layers."""
    if te:
        from megatron.core.extensions.transformer_engine import (  # lazy: TE is optional
            TEColumnParallelLinear, TENorm, TERowParallelLinear)

        column, row, norm, core = TEColumnParallelLinear, TERowParallelLinear, TENorm, TECoreAttention
    else:
        column = TracedColumnParallelLinear if traced else ColumnParallelLinear
        row, norm, core = GroupRowParallelLinear, LocalNorm, SDPACoreAttention
    attention_spec = JointAttentionSubmodules(linear_qkvg=column, linear_kv_text=column, linear_kv_speaker=column,
                                              core_attention=core, linear_proj=row, q_norm=norm, k_norm=norm)
    mlp_spec = MLPSubmodules(linear_fc1=column, linear_fc2=row)
    return BlockLayers(
        adaln=lambda cfg: SequenceFirstAdaLN(cfg, config.sequence_parallel, tp_group),  # replicated
        norm=lambda cfg: build_module(norm, config, cfg.width, cfg.norm_eps),
        attention=lambda cfg: TPJointAttention(config, attention_spec, cfg.speaker_width, tp_group),
        mlp=lambda cfg: TPMLP(config, mlp_spec, ffn_hidden_size=cfg.mlp, tp_group=tp_group),
    )


class TPEchoDiT(EchoDiT):
    """EchoDiT on TP blocks: same signature and function, (B, T, C) in and out, sequence-first inside."""

    def __init__(self, cfg: EchoConfig, config: TransformerConfig, options: TPOptions, tp_group):
        super().__init__(cfg, tp_block_layers(config, options.te, tp_group, options.traced))
        self.config = config  # megatron-core's TransformerConfig (its DDP and optimizer read it)
        self.sequence_parallel = config.sequence_parallel
        self.tp = config.tensor_model_parallel_size
        self.tp_group = tp_group
        self.packs_keys = options.te  # TE's attention takes its keys packed (TECoreAttention)
        mark_tp_parameters(self)

    def run_blocks(self, x, cond, text, speaker, freqs, key_mask):
        if self.sequence_parallel and x.shape[1] % self.tp:
            raise ValueError(f"sequence parallelism needs audio frames ({x.shape[1]}) divisible by tp={self.tp}")
        if self.packs_keys and key_mask is not None:
            key_mask = pack_keys(key_mask, x.shape[1])  # once for every layer
        x, text, speaker = (a.transpose(0, 1) for a in (x, text, speaker))  # (T, B, W)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, group=self.tp_group)
        x = super().run_blocks(x, cond, text, speaker, freqs, key_mask)
        if self.sequence_parallel:
            # Every rank then runs the replicated head on the full sequence: backward just splits.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        return x.transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# Weight layouts: plain EchoDiT state dict <-> TP shards


class TPStateDictAdapter:
    """The plain EchoDiT state dict <-> each TP rank's TPEchoDiT state dict (exact inverses).

    One table: each sharded TP weight of a block, the plain weight it comes from, how many
    projections that weight stacks (the plain model fuses q / k / v / gate, k / v, gate / up) and
    the dimension split across ranks (0: column-parallel rows, 1: row-parallel columns). Rank r's
    shard is [part_0's r-th slice; part_1's r-th slice; ...], so that chunking the local output
    recovers this rank's heads (or MLP columns) of every part. Every other weight is replicated
    under the same name (norms, AdaLN, embeddings, projections).
    """

    SHARDED = {
        "attn.linear_qkvg.weight": ("attn.in_proj.weight", 4, 0),
        "attn.linear_kv_text.weight": ("attn.wkv_text.weight", 2, 0),
        "attn.linear_kv_speaker.weight": ("attn.wkv_speaker.weight", 2, 0),
        "attn.linear_proj.weight": ("attn.wo.weight", 1, 1),
        "mlp.linear_fc1.weight": ("mlp.gate_up.weight", 2, 0),
        "mlp.linear_fc2.weight": ("mlp.down.weight", 1, 1),
    }

    def __init__(self, tp: int):
        self.tp = tp

    @staticmethod
    def _blocks(state: dict) -> list[str]:
        return sorted({m.group(0) for name in state if (m := re.match(r"blocks\.\d+\.", name))})

    def to_tp(self, plain: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
        """This TP rank's state dict from a plain one."""
        blocks = self._blocks(plain)
        sharded = {b + plain_name for b in blocks for plain_name, _, _ in self.SHARDED.values()}
        out = {name: value.clone() for name, value in plain.items() if name not in sharded}
        for b in blocks:
            for name, (plain_name, parts, dim) in self.SHARDED.items():
                out[b + name] = torch.cat([part.chunk(self.tp, dim)[rank]
                                           for part in plain[b + plain_name].chunk(parts, 0)], dim)
        return out

    def from_tp(self, shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The plain state dict from every TP rank's (in rank order)."""
        assert len(shards) == self.tp, f"{len(shards)} shards for tp={self.tp}"
        blocks = self._blocks(shards[0])
        fused = {b + name for b in blocks for name in self.SHARDED}
        out = {name: value.clone() for name, value in shards[0].items() if name not in fused}
        for b in blocks:
            for name, (plain_name, parts, dim) in self.SHARDED.items():
                per_rank = [shard[b + name].chunk(parts, dim) for shard in shards]
                out[b + plain_name] = torch.cat([torch.cat([chunks[i] for chunks in per_rank], dim)
                                                 for i in range(parts)], 0)
        return out


# Replicated weights whose gradient on a TP rank covers only that rank's share carry this
# attribute (megatron's finalize_model_grads finds the same ones): the backend sums them over
# the TP group before clipping.
PARTIAL_GRAD = "tp_partial_grad"


def mark_tp_parameters(model: TPEchoDiT) -> None:
    """Sets megatron's `tensor_model_parallel` attributes on the sharded weights, and PARTIAL_GRAD
    on the per-head QK-norms (this rank's heads) and, under sequence parallelism, the block norms
    (this rank's slice of the sequence).

    megatron-core sets the first only when it initialises the weights itself, and these weights
    are loaded from the plain model instead; the gradient norm relies on them.
    """
    for name, param in model.named_parameters():
        dim = next((d for suffix, (_, _, d) in TPStateDictAdapter.SHARDED.items() if name.endswith(suffix)), None)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    delattr(param, attr)
            set_tensor_model_parallel_attributes(param, True, dim, 1)
    for block in model.blocks:
        partial = [block.attn.q_norm, block.attn.k_norm]
        partial += [block.attn_norm, block.mlp_norm] if model.sequence_parallel else []
        for param in (p for norm in partial for p in norm.parameters()):
            setattr(param, PARTIAL_GRAD, True)


def load_tp_state_dict(model: TPEchoDiT, state: dict[str, torch.Tensor]) -> None:
    """Copies a TP state dict into the model's parameters (and checks both name sets match).

    Parameters are matched by name rather than with load_state_dict: TransformerEngine layers
    add `_extra_state` entries that a converted state dict does not carry.
    """
    params = dict(model.named_parameters())
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise KeyError(f"TP state dict does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != state[name].shape:
                raise ValueError(f"{name}: shard shape {tuple(state[name].shape)} != parameter {tuple(param.shape)}")
            param.copy_(state[name])


def tp_state_dict(model: TPEchoDiT) -> dict[str, torch.Tensor]:
    """This rank's parameters by name (the inverse of load_tp_state_dict)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def build_tp_dit(cfg: EchoConfig, plain: EchoDiT, tp_rank: int, tp: int, options: TPOptions,
                 device: torch.device) -> TPEchoDiT:
    """The TP DiT for this rank, with the plain DiT's weights (sharded, in options.params_dtype)."""
    config = megatron_config(cfg, tp, options, use_cpu=device.type == "cpu")
    with torch.device(device):
        model = TPEchoDiT(cfg, config, options, parallel_state.get_tensor_model_parallel_group())
    load_tp_state_dict(model, TPStateDictAdapter(tp).to_tp(plain.state_dict(), tp_rank))
    return model.to(options.params_dtype)  # the replicated layers too
