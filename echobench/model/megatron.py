"""The Echo DiT built from megatron-core parallel layers: the one place that builds layers from megatron-core.

It computes the same function as the plain EchoDiT (echobench/model/dit.py), with the work of
every block split across the tensor-parallel (TP) group:
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

Weights move between the plain layout and the TP shards with `to_tp_state_dict` and
`from_tp_state_dicts` (exact inverses); the backend builds the plain model with the run's seed
and loads its shards, so both backends start from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
)
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from echobench.model.components import LowRankAdaLN, RMSNorm, TimestepEmbedding, apply_rope, rope_frequencies
from echobench.model.config import EchoConfig
from echobench.model.dit import EchoDiT

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
    q_layernorm: type | ModuleSpec
    k_layernorm: type | ModuleSpec


@dataclass
class DiTBlockSubmodules:
    attn_norm: type | ModuleSpec
    attention: ModuleSpec
    mlp_norm: type | ModuleSpec
    mlp: ModuleSpec


class LocalNorm(RMSNorm):
    """The plain model's RMSNorm behind megatron's norm signature (config, hidden_size, eps).

    megatron-core's local WrappedTorchNorm refuses sequence parallelism; this one has no such
    limit and is bit-identical to the plain model's norm.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)


class SDPACoreAttention(nn.Module):
    """Bidirectional attention with a key-padding mask on (B, H, T, D) tensors (torch SDPA)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()

    def forward(self, q, k, v, key_mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])


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
        q, k, v, masks = self.te_inputs(q, k, v, key_mask)
        out = self.attn(q, k, v, attention_mask=masks, attn_mask_type=self.mask_type)
        return out.view(tq, b, h, d).permute(1, 2, 0, 3)  # (Tq, B, H*D) -> (B, H, Tq, D)


def dit_block_spec(te: bool) -> ModuleSpec:
    """The block's layer spec: TransformerEngine kernels, or megatron-core's local layers."""
    if te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm, TERowParallelLinear

        column, row, norm, core = TEColumnParallelLinear, TERowParallelLinear, TENorm, TECoreAttention
    else:
        column, row, norm, core = ColumnParallelLinear, RowParallelLinear, LocalNorm, SDPACoreAttention
    attention = ModuleSpec(
        module=TPJointAttention,
        submodules=JointAttentionSubmodules(
            linear_qkvg=column, linear_kv_text=column, linear_kv_speaker=column, core_attention=core,
            linear_proj=row, q_layernorm=norm, k_layernorm=norm,
        ),
    )
    mlp = ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=column, linear_fc2=row))
    return ModuleSpec(module=TPDiTBlock,
                      submodules=DiTBlockSubmodules(attn_norm=norm, attention=attention, mlp_norm=norm, mlp=mlp))


# ---------------------------------------------------------------------------------------------
# The model


def _no_init(weight):  # weights come from the plain model's state dict
    return weight


def to_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(T, B, H*D) -> (B, H, T, D)"""
    t, b, _ = x.shape
    return x.view(t, b, heads, -1).permute(1, 2, 0, 3)


def from_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) -> (T, B, H*D)"""
    b, h, t, d = x.shape
    return x.permute(2, 0, 1, 3).reshape(t, b, h * d)


class TPJointAttention(nn.Module):
    """JointAttention of the plain DiT with this rank's share of the heads."""

    def __init__(self, config: TransformerConfig, submodules: JointAttentionSubmodules, speaker_width: int):
        super().__init__()
        width = config.hidden_size
        tp = config.tensor_model_parallel_size
        self.local_heads = config.num_attention_heads // tp
        self.local_width = width // tp
        self.sequence_parallel = config.sequence_parallel

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
        self.q_layernorm = build_module(submodules.q_layernorm, config, config.kv_channels, config.layernorm_epsilon)
        self.k_layernorm = build_module(submodules.k_layernorm, config, config.kv_channels, config.layernorm_epsilon)

    def forward(self, x, text, speaker, freqs, key_mask):
        """x: (T or T/tp, B, W); text (Tt, B, W); speaker (Ts, B, Ws). Returns x's shape."""
        h = self.local_heads
        q, k, v, gate = self.linear_qkvg(x)[0].chunk(4, dim=-1)  # full T after the SP all-gather
        k_text, v_text = self.linear_kv_text(text)[0].chunk(2, dim=-1)
        k_spk, v_spk = self.linear_kv_speaker(speaker)[0].chunk(2, dim=-1)
        q = apply_rope(self.q_layernorm(to_heads(q, h)), freqs)
        k = torch.cat([apply_rope(self.k_layernorm(to_heads(k, h)), freqs),
                       self.k_layernorm(to_heads(k_text, h)), self.k_layernorm(to_heads(k_spk, h))], dim=2)
        v = torch.cat([to_heads(v, h), to_heads(v_text, h), to_heads(v_spk, h)], dim=2)
        out = from_heads(self.core_attention(q, k, v, key_mask))
        return self.linear_proj(out * torch.sigmoid(gate))[0]


def adaln_modulation(adaln: nn.Module, cond: torch.Tensor, sequence_parallel: bool) -> tuple[torch.Tensor, ...]:
    """The plain LowRankAdaLN's chunks as (1, B, W) for sequence-first activations.

    Under sequence parallelism each rank modulates only its slice of the sequence, so the
    modulation's gradient is all-reduced over the TP group (copy-to-region's backward).
    """
    mods = adaln.up(adaln.down(F.silu(cond)))
    if sequence_parallel:
        mods = copy_to_tensor_model_parallel_region(mods)
    return mods.unsqueeze(0).chunk(adaln.n_chunks, dim=-1)


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class TPDiTBlock(nn.Module):
    def __init__(self, config: TransformerConfig, submodules: DiTBlockSubmodules, cfg: EchoConfig):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.adaln = LowRankAdaLN(cfg.width, cfg.adaln_rank, n_chunks=6)  # replicated
        self.attn_norm = build_module(submodules.attn_norm, config, cfg.width, cfg.norm_eps)
        self.attention = build_module(submodules.attention, config, speaker_width=cfg.speaker_width)
        self.mlp_norm = build_module(submodules.mlp_norm, config, cfg.width, cfg.norm_eps)
        self.mlp = build_module(submodules.mlp, config, ffn_hidden_size=cfg.mlp)

    def forward(self, x, cond, text, speaker, freqs, key_mask):
        shift1, scale1, gate1, shift2, scale2, gate2 = adaln_modulation(self.adaln, cond, self.sequence_parallel)
        x = x + gate1 * self.attention(modulate(self.attn_norm(x), shift1, scale1), text, speaker, freqs, key_mask)
        x = x + gate2 * self.mlp(modulate(self.mlp_norm(x), shift2, scale2))[0]
        return x


class TPEchoDiT(nn.Module):
    """Same signature and function as EchoDiT; (B, T, C) in and out, sequence-first inside."""

    def __init__(self, cfg: EchoConfig, config: TransformerConfig, spec: ModuleSpec):
        super().__init__()
        self.cfg = cfg
        self.sequence_parallel = config.sequence_parallel
        self.tp = config.tensor_model_parallel_size
        self.in_proj = nn.Linear(cfg.latent_dim, cfg.width)
        self.time_embed = TimestepEmbedding(cfg.timestep_dim, cfg.width)
        self.blocks = nn.ModuleList(build_module(spec, config, cfg=cfg) for _ in range(cfg.layers))
        self.out_adaln = LowRankAdaLN(cfg.width, cfg.adaln_rank, n_chunks=2)
        self.out_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.width, cfg.latent_dim)
        mark_sharded_parameters(self)
        if self.sequence_parallel:
            # Replicated weights that see only this rank's slice of the sequence: their
            # gradients are partial sums, all-reduced over the TP group after backward.
            for block in self.blocks:
                for norm in (block.attn_norm, block.mlp_norm):
                    for p in norm.parameters():
                        p.sequence_parallel = True

    def forward(self, x_t, t, latent_mask, text, text_mask, speaker, speaker_mask):
        seq_len = x_t.shape[1]
        if self.sequence_parallel and seq_len % self.tp:
            raise ValueError(f"sequence parallelism needs audio frames ({seq_len}) divisible by tp={self.tp}")
        freqs = rope_frequencies(seq_len, self.cfg.head_dim, device=x_t.device)
        key_mask = torch.cat([latent_mask, text_mask, speaker_mask], dim=1)
        cond = self.time_embed(t)
        x = self.in_proj(x_t).transpose(0, 1)  # (T, B, W)
        text, speaker = text.transpose(0, 1), speaker.transpose(0, 1)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x)
        for block in self.blocks:
            x = block(x, cond, text, speaker, freqs, key_mask)
        if self.sequence_parallel:
            # Every rank then runs the replicated head on the full sequence: backward just splits.
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
        shift, scale = self.out_adaln(cond)
        x = x.transpose(0, 1)  # back to (B, T, W)
        return self.out_proj(modulate(self.out_norm(x), shift, scale))


# ---------------------------------------------------------------------------------------------
# Weight layouts: plain EchoDiT state dict <-> TP shards

# Fused column-parallel weights: TP name -> the plain weights stacked in it, in order. Each
# rank's shard is [part_0 rows of this rank; part_1 rows of this rank; ...] so that chunking
# the local output recovers this rank's heads (or MLP columns) of every part.
FUSED_COLUMNS = {
    "attention.linear_qkvg.weight": ("attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wgate.weight"),
    "attention.linear_kv_text.weight": ("attn.wk_text.weight", "attn.wv_text.weight"),
    "attention.linear_kv_speaker.weight": ("attn.wk_speaker.weight", "attn.wv_speaker.weight"),
    "mlp.linear_fc1.weight": ("mlp.gate.weight", "mlp.up.weight"),
}
# Row-parallel weights: split along the input dimension.
ROWS = {"attention.linear_proj.weight": "attn.wo.weight", "mlp.linear_fc2.weight": "mlp.down.weight"}
# Replicated weights that change name.
RENAMED = {"attention.q_layernorm.weight": "attn.q_norm.weight", "attention.k_layernorm.weight": "attn.k_norm.weight"}


def _block_prefix(name: str) -> tuple[str, str] | None:
    """'blocks.3.attn.wq.weight' -> ('blocks.3.', 'attn.wq.weight')"""
    if not name.startswith("blocks."):
        return None
    index, rest = name[len("blocks."):].split(".", 1)
    return f"blocks.{index}.", rest


def to_tp_state_dict(plain: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This TP rank's state dict of TPEchoDiT from a plain EchoDiT state dict."""
    consumed = set()
    out = {}
    prefixes = sorted({p[0] for name in plain if (p := _block_prefix(name))})
    for prefix in prefixes:
        for tp_name, parts in FUSED_COLUMNS.items():
            shards = [plain[prefix + part].chunk(tp_size, dim=0)[tp_rank] for part in parts]
            out[prefix + tp_name] = torch.cat(shards, dim=0).clone()
            consumed.update(prefix + part for part in parts)
        for tp_name, part in ROWS.items():
            out[prefix + tp_name] = plain[prefix + part].chunk(tp_size, dim=1)[tp_rank].clone()
            consumed.add(prefix + part)
        for tp_name, part in RENAMED.items():
            out[prefix + tp_name] = plain[prefix + part].clone()
            consumed.add(prefix + part)
    for name, value in plain.items():
        if name not in consumed:  # replicated, same name (norms, AdaLN, embeddings, projections)
            out[name] = value.clone()
    return out


def from_tp_state_dicts(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The plain EchoDiT state dict from every TP rank's state dict (rank order)."""
    first = shards[0]
    consumed = set()
    out = {}
    prefixes = sorted({p[0] for name in first if (p := _block_prefix(name))})
    for prefix in prefixes:
        for tp_name, parts in FUSED_COLUMNS.items():
            per_rank = [s[prefix + tp_name].chunk(len(parts), dim=0) for s in shards]
            for i, part in enumerate(parts):
                out[prefix + part] = torch.cat([chunks[i] for chunks in per_rank], dim=0).clone()
            consumed.add(prefix + tp_name)
        for tp_name, part in ROWS.items():
            out[prefix + part] = torch.cat([s[prefix + tp_name] for s in shards], dim=1).clone()
            consumed.add(prefix + tp_name)
        for tp_name, part in RENAMED.items():
            out[prefix + part] = first[prefix + tp_name].clone()
            consumed.add(prefix + tp_name)
    for name, value in first.items():
        if name not in consumed:
            out[name] = value.clone()
    return out


def mark_sharded_parameters(model: nn.Module) -> None:
    """Sets megatron's `tensor_model_parallel` attributes on the sharded weights.

    megatron-core sets them only when it initialises the weights itself, and these weights
    are loaded from the plain model instead; the gradient norm relies on them.
    """
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    dims = {**{name: 0 for name in FUSED_COLUMNS}, **{name: 1 for name in ROWS}}
    for name, param in model.named_parameters():
        dim = next((d for suffix, d in dims.items() if name.endswith(suffix)), None)
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    delattr(param, attr)
            set_tensor_model_parallel_attributes(param, True, dim, 1)


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


# ---------------------------------------------------------------------------------------------
# Gradients across the TP group


def tp_partial_grad_params(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters whose gradient on each TP rank covers only that rank's share.

    The per-head QK-norm weights see only this rank's heads (always), and under sequence
    parallelism the block norms see only this rank's slice of the sequence.
    """
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if "q_layernorm" in name or "k_layernorm" in name or getattr(p, "sequence_parallel", False):
            out.append(p)
    return out


def allreduce_partial_grads(params: list[nn.Parameter], group) -> None:
    """Sums the partial gradients of `params` over the TP group (one flat all-reduce)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or torch.distributed.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def tp_grad_norm(params: list[nn.Parameter], group) -> torch.Tensor:
    """Global L2 norm of the gradients of a TP model, each element counted once.

    Sharded parameters (megatron marks them `tensor_model_parallel`) contribute from every
    rank; replicated ones only from TP rank 0 (megatron's param_is_not_tensor_parallel_duplicate).
    """
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, group)]
    device = params[0].device
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        sq = sq + g.detach().float().pow(2).sum()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(sq, group=group)
    return sq.sqrt()


def build_tp_dit(cfg: EchoConfig, plain: EchoDiT, tp_rank: int, tp: int, te: bool, sequence_parallel: bool,
                 device: torch.device) -> TPEchoDiT:
    """The TP DiT for this rank, with the plain DiT's weights (sharded)."""
    config = megatron_config(cfg, tp, sequence_parallel, use_cpu=device.type == "cpu")
    with torch.device(device):
        model = TPEchoDiT(cfg, config, dit_block_spec(te))
    load_tp_state_dict(model, to_tp_state_dict(plain.state_dict(), tp_rank, tp))
    return model


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()
