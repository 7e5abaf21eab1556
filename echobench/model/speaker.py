"""Speaker encoder: patch the reference latent by 4 frames, then a small transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from echobench.model.components import GatedMLP, RMSNorm, SelfAttention, key_mask, rope_frequencies
from echobench.model.config import EchoConfig


class SpeakerBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int, eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(width, eps)
        self.attn = SelfAttention(width, heads, eps)
        self.mlp_norm = RMSNorm(width, eps)
        self.mlp = GatedMLP(width, mlp)

    def forward(self, x, freqs, mask):
        x = x + self.attn(self.attn_norm(x), freqs, mask)
        return x + self.mlp(self.mlp_norm(x))


class SpeakerEncoder(nn.Module):
    """(B, Ts, 128) reference latent -> (B, Ts/patch, speaker_width) speaker stream."""

    def __init__(self, cfg: EchoConfig):
        super().__init__()
        self.patch = cfg.speaker_patch
        self.heads = cfg.speaker_heads
        self.patch_embed = nn.Linear(cfg.latent_dim * cfg.speaker_patch, cfg.speaker_width)
        self.blocks = nn.ModuleList(
            SpeakerBlock(cfg.speaker_width, cfg.speaker_heads, cfg.speaker_mlp, cfg.norm_eps)
            for _ in range(cfg.speaker_layers)
        )
        self.norm = RMSNorm(cfg.speaker_width, cfg.norm_eps)

    def forward(self, ref: torch.Tensor, ref_mask: torch.Tensor, padded: bool = True,
                masking: str = "dense") -> tuple[torch.Tensor, torch.Tensor]:
        """padded: whether any reference has padded patches (known on the host: data.Batch); without,
        the self-attention takes no mask. masking: how it skips padded keys (components.key_mask)."""
        pad = -ref.shape[1] % self.patch
        if pad:  # a partial last patch is zero-filled and still carries voice
            ref = F.pad(ref, (0, 0, 0, pad))
            ref_mask = F.pad(ref_mask, (0, pad))
        b, t, c = ref.shape
        x = self.patch_embed(ref.reshape(b, t // self.patch, self.patch * c))
        # A patch is valid when any of its frames is: a partial last patch still carries voice.
        mask = ref_mask.reshape(b, t // self.patch, self.patch).any(-1)
        freqs = rope_frequencies(x.shape[1], x.shape[-1] // self.heads, device=x.device)
        keys = key_mask(mask, x.shape[1], masking) if padded else None
        for block in self.blocks:
            x = block(x, freqs, keys)
        return self.norm(x), mask
