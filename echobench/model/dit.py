"""The Echo diffusion transformer: DiT blocks with joint self + cross attention.

The block's forward is written once, for any layers: a block is built from a BlockLayers (the
layer-spec idea of megatron-core, without megatron), and the joint attention's math is one
function over the layers it is given. The plain layers are here; model/megatron.py gives
megatron-core's tensor-parallel ones to the same block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from echobench.model.components import (
    ConditioningDrop,
    GatedMLP,
    LowRankAdaLN,
    QKNormAttention,
    RMSNorm,
    TimestepEmbedding,
    apply_rope,
    attention,
    merge_heads,
    merged_attention,
    modulate,
    rope_frequencies,
    split_heads,
)
from echobench.model.config import EchoConfig


def joint_attention(attn: nn.Module, x, text, speaker, freqs, key_mask):
    """Latent queries attend to [latent; text; speaker] keys and values in one softmax.

    The math of every joint attention, plain or tensor-parallel; `attn` gives the layers:
    project(x, text, speaker) -> (q, k, v, gate), (k, v) of text, (k, v) of speaker, in x's layout;
    q_norm / k_norm (per head); attend(q, k, v, key_mask) on (B, H, T, D); out(x); and `heads`
    (its number of heads), `seq_first` (activations (T, B, W) rather than (B, T, W)).
    QK-norm per head, shared by the three key streams; RoPE on the latent queries and keys; the
    output gated by sigmoid(gate) before the output projection. A ConditioningDrop key mask (no
    padding, some samples' conditioning dropped) attends through merged_attention: no mask.
    """
    (q, k, v, gate), (k_text, v_text), (k_spk, v_spk) = attn.project(x, text, speaker)

    def heads(t):
        return split_heads(t, attn.heads, attn.seq_first)

    q = apply_rope(attn.q_norm(heads(q)), freqs)
    k, k_text, k_spk = apply_rope(attn.k_norm(heads(k)), freqs), attn.k_norm(heads(k_text)), attn.k_norm(heads(k_spk))
    v, v_text, v_spk = heads(v), heads(v_text), heads(v_spk)
    if isinstance(key_mask, ConditioningDrop):  # the dropped samples attend to the latent keys only
        out = merged_attention(q, k, v, torch.cat([k_text, k_spk], dim=2), torch.cat([v_text, v_spk], dim=2),
                               key_mask.keep)
    else:
        out = attn.attend(q, torch.cat([k, k_text, k_spk], dim=2), torch.cat([v, v_text, v_spk], dim=2), key_mask)
    return attn.out(merge_heads(out, attn.seq_first) * torch.sigmoid(gate))


class JointAttention(QKNormAttention):
    """joint_attention on plain linears: q / k / v / gate from the latent stream (one GEMM), text
    keys and values from the projected text stream (width), speaker keys and values from the
    speaker encoder output (speaker_width), each pair one GEMM."""

    seq_first = False
    forward = joint_attention

    def __init__(self, width: int, heads: int, speaker_width: int, eps: float = 1e-6):
        super().__init__(width, heads, eps, projections=4)  # in_proj: q / k / v / gate
        self.wkv_text = nn.Linear(width, 2 * width, bias=False)
        self.wkv_speaker = nn.Linear(speaker_width, 2 * width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)

    def project(self, x, text, speaker):
        # One GEMM per stream: a fused projection reads its input once and runs one larger GEMM.
        return (self.project_in(x), self.wkv_text(text).chunk(2, dim=-1), self.wkv_speaker(speaker).chunk(2, dim=-1))

    def attend(self, q, k, v, key_mask):
        return attention(q, k, v, key_mask)

    def out(self, x):
        return self.wo(x)


@dataclass(frozen=True)
class BlockLayers:
    """What a DiT block is built of: each field makes one layer from the model config."""

    adaln: Callable[[EchoConfig], nn.Module]  # cond -> 6 modulations that broadcast over x
    norm: Callable[[EchoConfig], nn.Module]
    attention: Callable[[EchoConfig], nn.Module]  # (x, text, speaker, freqs, key_mask) -> x's shape
    mlp: Callable[[EchoConfig], nn.Module]  # x -> x's shape


PLAIN_LAYERS = BlockLayers(
    adaln=lambda cfg: LowRankAdaLN(cfg.width, cfg.adaln_rank, n_chunks=6),
    norm=lambda cfg: RMSNorm(cfg.width, cfg.norm_eps),
    attention=lambda cfg: JointAttention(cfg.width, cfg.heads, cfg.speaker_width, cfg.norm_eps),
    mlp=lambda cfg: GatedMLP(cfg.width, cfg.mlp),
)


class DiTBlock(nn.Module):
    def __init__(self, cfg: EchoConfig, layers: BlockLayers = PLAIN_LAYERS):
        super().__init__()
        self.adaln = layers.adaln(cfg)
        self.attn_norm = layers.norm(cfg)
        self.attn = layers.attention(cfg)
        self.mlp_norm = layers.norm(cfg)
        self.mlp = layers.mlp(cfg)

    def forward(self, x, cond, text, speaker, freqs, key_mask):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(cond)
        x = x + gate1 * self.attn(modulate(self.attn_norm(x), shift1, scale1), text, speaker, freqs, key_mask)
        x = x + gate2 * self.mlp(modulate(self.mlp_norm(x), shift2, scale2))
        return x


class EchoDiT(nn.Module):
    """Predicts the noise in a (B, T, 128) latent given time, text and speaker streams."""

    def __init__(self, cfg: EchoConfig, layers: BlockLayers = PLAIN_LAYERS):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.latent_dim, cfg.width)
        self.time_embed = TimestepEmbedding(cfg.timestep_dim, cfg.width)
        self.blocks = nn.ModuleList(DiTBlock(cfg, layers) for _ in range(cfg.layers))
        self.out_adaln = LowRankAdaLN(cfg.width, cfg.adaln_rank, n_chunks=2)
        self.out_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.width, cfg.latent_dim)

    def forward(self, x_t, t, text, speaker, key_mask):
        """key_mask: what `components.attention` takes for the joint keys [latent; text; speaker]
        (None: every key, no mask)."""
        x, cond, freqs = self.embed(x_t, t)
        return self.head(self.run_blocks(x, cond, text, speaker, freqs, key_mask), cond)

    # embed and head: the DiT's work outside its blocks, each a function a backend may compile
    # on its own (compiling forward whole would trace every block into one graph).
    def embed(self, x_t, t):
        """(B, T, 128) latents and (B,) times -> the blocks' input, the conditioning vector, RoPE."""
        freqs = rope_frequencies(x_t.shape[1], self.cfg.head_dim, device=x_t.device)
        return self.in_proj(x_t), self.time_embed(t), freqs

    def head(self, x, cond):
        shift, scale = self.out_adaln(cond)
        return self.out_proj(modulate(self.out_norm(x), shift, scale))

    def run_blocks(self, x, cond, text, speaker, freqs, key_mask):
        """(B, T, W) through every block (the TP model runs them sequence-first around this)."""
        for block in self.blocks:
            x = block(x, cond, text, speaker, freqs, key_mask)
        return x
