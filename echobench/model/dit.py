"""The Echo diffusion transformer: DiT blocks with joint self + cross attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from echobench.model.components import (
    GatedMLP,
    LowRankAdaLN,
    RMSNorm,
    TimestepEmbedding,
    apply_rope,
    attention,
    merge_heads,
    modulate,
    rope_frequencies,
    split_heads,
)
from echobench.model.config import EchoConfig


class JointAttention(nn.Module):
    """Latent queries attend to [latent; text; speaker] keys and values in one softmax.

    q / k / v / gate come from the latent stream, text keys and values from the
    projected text stream (width), speaker keys and values from the speaker encoder
    output (speaker_width). QK-norm per head; RoPE on the latent queries and keys.
    The output is gated by sigmoid(gate(x)) before the output projection.
    """

    def __init__(self, width: int, heads: int, speaker_width: int, eps: float = 1e-6):
        super().__init__()
        self.heads = heads
        head_dim = width // heads
        self.wq = nn.Linear(width, width, bias=False)
        self.wk = nn.Linear(width, width, bias=False)
        self.wv = nn.Linear(width, width, bias=False)
        self.wgate = nn.Linear(width, width, bias=False)
        self.wk_text = nn.Linear(width, width, bias=False)
        self.wv_text = nn.Linear(width, width, bias=False)
        self.wk_speaker = nn.Linear(speaker_width, width, bias=False)
        self.wv_speaker = nn.Linear(speaker_width, width, bias=False)
        self.wo = nn.Linear(width, width, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)  # shared by the three key streams

    def forward(self, x, text, speaker, freqs, key_mask):
        h = self.heads
        q = apply_rope(self.q_norm(split_heads(self.wq(x), h)), freqs)
        k = apply_rope(self.k_norm(split_heads(self.wk(x), h)), freqs)
        k_text = self.k_norm(split_heads(self.wk_text(text), h))
        k_spk = self.k_norm(split_heads(self.wk_speaker(speaker), h))
        k = torch.cat([k, k_text, k_spk], dim=2)
        v = torch.cat(
            [split_heads(self.wv(x), h), split_heads(self.wv_text(text), h), split_heads(self.wv_speaker(speaker), h)],
            dim=2,
        )
        out = merge_heads(attention(q, k, v, key_mask))
        return self.wo(out * torch.sigmoid(self.wgate(x)))


class DiTBlock(nn.Module):
    def __init__(self, cfg: EchoConfig):
        super().__init__()
        self.adaln = LowRankAdaLN(cfg.width, cfg.adaln_rank, n_chunks=6)
        self.attn_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.attn = JointAttention(cfg.width, cfg.heads, cfg.speaker_width, cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.width, cfg.mlp)

    def forward(self, x, cond, text, speaker, freqs, key_mask):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaln(cond)
        x = x + gate1 * self.attn(modulate(self.attn_norm(x), shift1, scale1), text, speaker, freqs, key_mask)
        x = x + gate2 * self.mlp(modulate(self.mlp_norm(x), shift2, scale2))
        return x


class EchoDiT(nn.Module):
    """Predicts the noise in a (B, T, 128) latent given time, text and speaker streams."""

    def __init__(self, cfg: EchoConfig):
        super().__init__()
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.latent_dim, cfg.width)
        self.time_embed = TimestepEmbedding(cfg.timestep_dim, cfg.width)
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.layers))
        self.out_adaln = LowRankAdaLN(cfg.width, cfg.adaln_rank, n_chunks=2)
        self.out_norm = RMSNorm(cfg.width, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.width, cfg.latent_dim)

    def forward(self, x_t, t, latent_mask, text, text_mask, speaker, speaker_mask):
        freqs = rope_frequencies(x_t.shape[1], self.cfg.head_dim, device=x_t.device)
        key_mask = torch.cat([latent_mask, text_mask, speaker_mask], dim=1)
        cond = self.time_embed(t)
        x = self.in_proj(x_t)
        for block in self.blocks:
            x = block(x, cond, text, speaker, freqs, key_mask)
        shift, scale = self.out_adaln(cond)
        return self.out_proj(modulate(self.out_norm(x), shift, scale))
