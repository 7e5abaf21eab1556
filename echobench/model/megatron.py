"""The Echo DiT built from megatron-core parallel layers: the one place that builds layers from megatron-core.

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
fast kernel torch offers and what the plain model runs).

Weights move between the plain layout and the TP shards with TPStateDictAdapter (to_tp /
from_tp, exact inverses); the backend builds the plain model with the run's seed and loads its
shards, so both backends start from the same weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from echobench.model.components import LowRankAdaLN, RMSNorm, attention
from echobench.model.config import EchoConfig
from echobench.model.dit import BlockLayers, EchoDiT, joint_attention

# ---------------------------------------------------------------------------------------------
# Config and layer specs


def megatron_config(cfg: EchoConfig, tp: int, sequence_parallel: bool, use_cpu: bool) -> TransformerConfig:
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
        bias_activation_fusion=False,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_eps,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        params_dtype=torch.float32,  # fp32 master weights; bf16 compute comes from autocast
        use_cpu_initialization=use_cpu,
        perform_initialization=False,
        gradient_accumulation_fusion=False,
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


def pack_valid_keys(k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor):
    """Moves each sample's valid keys and values to the front, in order; the mask becomes a prefix.

    k, v: (B, H, Tk, D); key_mask: (B, Tk), True = attend. The joint key sequence is
    [latent | text | speaker], each padded to its own maximum, so valid keys have gaps; TE's
    fused attention reads a padding mask as a count of valid keys per sample (cu_seqlens), as if
    they came first. Attention does not depend on the order of its keys (RoPE is already applied),
    so packing changes nothing else. A stable sort on the device: no host sync, static shapes.
    """
    order = torch.sort((~key_mask).to(torch.uint8), dim=1, stable=True).indices  # valid keys first
    index = order[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    return k.gather(2, index), v.gather(2, index), key_mask.gather(1, order)


class TECoreAttention(nn.Module):
    """TransformerEngine's fused attention behind the same (B, H, T, D) interface.

    Queries and keys have different lengths, so TE takes the key-padding mask as a
    (query mask, key mask) pair, True = masked out, with the valid keys packed to the front.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        self.mask_type = AttnMaskType.padding
        self.attn = TEDotProductAttention(config, layer_number=1, attn_mask_type=self.mask_type,
                                          attention_type="cross")

    @staticmethod
    def te_inputs(q, k, v, key_mask):
        """(B, H, T, D) -> TE's sbhd layout (T, B, H, D), keys packed, and its (query, key) masks."""
        k, v, key_mask = pack_valid_keys(k, v, key_mask)
        q_mask = torch.zeros(q.shape[0], 1, 1, q.shape[2], dtype=torch.bool, device=q.device)
        q, k, v = (x.permute(2, 0, 1, 3).contiguous() for x in (q, k, v))
        return q, k, v, (q_mask, ~key_mask[:, None, None, :])

    def forward(self, q, k, v, key_mask):
        b, h, tq, d = q.shape
        if key_mask is None:  # no padded key: TE's attention without a mask
            from megatron.core.transformer.enums import AttnMaskType

            q, k, v = (x.permute(2, 0, 1, 3).contiguous() for x in (q, k, v))
            out = self.attn(q, k, v, attention_mask=None, attn_mask_type=AttnMaskType.no_mask)
        else:
            q, k, v, masks = self.te_inputs(q, k, v, key_mask)
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

    def __init__(self, config: TransformerConfig, submodules: JointAttentionSubmodules, speaker_width: int):
        super().__init__()
        width = config.hidden_size
        self.heads = config.num_attention_heads // config.tensor_model_parallel_size

        # The text and speaker streams stay whole under sequence parallelism: their
        # projections are plain column-parallel (no all-gather of the input).
        whole_config = replace(config, sequence_parallel=False) if config.sequence_parallel else config

        def column(spec, in_size, out_size, layer_config):
            return build_module(spec, in_size, out_size, config=layer_config, init_method=_no_init,
                                gather_output=False, bias=False, skip_bias_add=True, is_expert=False)

        self.linear_qkvg = column(submodules.linear_qkvg, width, 4 * width, config)
        self.linear_kv_text = column(submodules.linear_kv_text, width, 2 * width, whole_config)
        self.linear_kv_speaker = column(submodules.linear_kv_speaker, speaker_width, 2 * width, whole_config)
        self.core_attention = build_module(submodules.core_attention, config)
        self.linear_proj = build_module(submodules.linear_proj, width, width, config=config, init_method=_no_init,
                                        bias=False, input_is_parallel=True, skip_bias_add=True, is_expert=False)
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

    def __init__(self, cfg: EchoConfig, sequence_parallel: bool):
        super().__init__(cfg.width, cfg.adaln_rank, n_chunks=6)
        self.sequence_parallel = sequence_parallel

    def split(self, mods):
        if self.sequence_parallel:
            mods = copy_to_tensor_model_parallel_region(mods)
        return mods.unsqueeze(0).chunk(self.n_chunks, dim=-1)


def tp_block_layers(config: TransformerConfig, te: bool) -> BlockLayers:
    """The layers of a TP DiT block; the layer spec picks TransformerEngine kernels or megatron-core's local layers."""
    if te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear

        column, row, norm, core = TEColumnParallelLinear, TERowParallelLinear, TENorm, TECoreAttention
    else:
        column, row, norm, core = ColumnParallelLinear, RowParallelLinear, LocalNorm, SDPACoreAttention
    attention_spec = JointAttentionSubmodules(linear_qkvg=column, linear_kv_text=column, linear_kv_speaker=column,
                                              core_attention=core, linear_proj=row, q_norm=norm, k_norm=norm)
    mlp_spec = MLPSubmodules(linear_fc1=column, linear_fc2=row)
    return BlockLayers(
        adaln=lambda cfg: SequenceFirstAdaLN(cfg, config.sequence_parallel),  # replicated
        norm=lambda cfg: build_module(norm, config, cfg.width, cfg.norm_eps),
        attention=lambda cfg: TPJointAttention(config, attention_spec, cfg.speaker_width),
        mlp=lambda cfg: TPMLP(config, mlp_spec, ffn_hidden_size=cfg.mlp),
    )


class TPEchoDiT(EchoDiT):
    """EchoDiT on TP blocks: same signature and function, (B, T, C) in and out, sequence-first inside."""

    def __init__(self, cfg: EchoConfig, config: TransformerConfig, te: bool):
        super().__init__(cfg, tp_block_layers(config, te))
        self.sequence_parallel = config.sequence_parallel
        self.tp = config.tensor_model_parallel_size
        mark_tp_parameters(self)

    def run_blocks(self, x, cond, text, speaker, freqs, key_mask):
        if self.sequence_parallel and x.shape[1] % self.tp:
            raise ValueError(f"sequence parallelism needs audio frames ({x.shape[1]}) divisible by tp={self.tp}")
        x, text, speaker = (a.transpose(0, 1) for a in (x, text, speaker))  # (T, B, W)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        x = super().run_blocks(x, cond, text, speaker, freqs, key_mask)
        if self.sequence_parallel:
            # Every rank then runs the replicated head on the full sequence: backward just splits.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
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
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

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


def build_tp_dit(cfg: EchoConfig, plain: EchoDiT, tp_rank: int, tp: int, te: bool, sequence_parallel: bool,
                 device: torch.device) -> TPEchoDiT:
    """The TP DiT for this rank, with the plain DiT's weights (sharded)."""
    config = megatron_config(cfg, tp, sequence_parallel, use_cpu=device.type == "cpu")
    with torch.device(device):
        model = TPEchoDiT(cfg, config, te)
    load_tp_state_dict(model, TPStateDictAdapter(tp).to_tp(plain.state_dict(), tp_rank))
    return model
