"""Echo TTS: text encoder (frozen by default) + text projection + speaker encoder + DiT, and its loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from echobench.model.config import EchoConfig
from echobench.model.dit import EchoDiT
from echobench.model.speaker import SpeakerEncoder
from echobench.model.text_encoder import TextEncoder


@dataclass
class DiffusionDraws:
    """The random draws of one training objective evaluation, per sample."""

    t: torch.Tensor  # (B,) diffusion time in [0, 1)
    noise: torch.Tensor  # (B, T, C) standard normal
    keep: torch.Tensor  # (B,) bool: False drops text and speaker conditioning (CFG)


def sample_seed(seed: int, index: int) -> int:
    """A well-mixed 32-bit seed of (run seed, global sample index): splitmix64, folded to 32 bits
    because the CPU generator (mt19937) only uses the low 32 bits of a seed."""
    m = 0xFFFFFFFFFFFFFFFF
    z = ((((seed & 0xFFFFFFFF) << 32) | (index & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def diffusion_draws(seed: int, sample_ids: Sequence[int], frames: int, channels: int, cfg_dropout: float,
                    device: torch.device, generator: torch.Generator | None = None) -> DiffusionDraws:
    """Draws that depend only on (seed, global sample index), not on how samples split across ranks.

    One generator, reseeded per sample on the host (no device sync): 2 ranks x B samples draw
    exactly what 1 rank x 2B draws. Two small random kernels per sample.
    """
    gen = generator or torch.Generator(device)
    uniforms, noises = [], []
    for g in sample_ids:
        gen.manual_seed(sample_seed(seed, g))
        uniforms.append(torch.rand(2, device=device, generator=gen))
        noises.append(torch.randn(frames, channels, device=device, generator=gen))
    u = torch.stack(uniforms)
    return DiffusionDraws(t=u[:, 0], noise=torch.stack(noises), keep=u[:, 1] >= cfg_dropout)


def loss_frames(batch) -> torch.Tensor:
    """What the loss averages over: real (unpadded) latent frames x channels, a device tensor.

    A data-parallel backend sums it over its replicas to normalise by the global batch."""
    return batch.latent_mask.sum() * batch.latent.shape[-1]


class EchoTTS(nn.Module):
    def __init__(self, cfg: EchoConfig, encoder_checkpoint: str | None = None):
        super().__init__()
        self.cfg = cfg
        self.text_encoder = TextEncoder(cfg.text_encoder, encoder_checkpoint, frozen=cfg.frozen_encoder)
        self.text_proj = nn.Linear(cfg.text_encoder.hidden, cfg.width)
        self.speaker_encoder = SpeakerEncoder(cfg)
        self.dit = EchoDiT(cfg)

    def trainable_parameters(self):
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, batch, generator: torch.Generator | None = None, draws: DiffusionDraws | None = None,
                reduction: Literal["mean", "sum"] = "mean") -> torch.Tensor:
        """One training objective evaluation: the masked noise-prediction MSE.

        The random draws come from `draws` when given (see diffusion_draws), else from `generator`.
        reduction "sum" returns the squared error summed over real frames, for the caller to divide
        by loss_frames summed over every data-parallel replica.
        """
        x0 = batch.latent
        b = x0.shape[0]
        device = x0.device
        if draws is None:
            t = torch.rand(b, device=device, generator=generator)
            noise = torch.randn(x0.shape, device=device, dtype=x0.dtype, generator=generator)
            keep = torch.rand(b, device=device, generator=generator) >= self.cfg.cfg_dropout
        else:
            t, noise, keep = draws.t, draws.noise.to(x0.dtype), draws.keep
        # Cosine schedule, epsilon prediction.
        alpha = torch.cos(t * math.pi / 2)[:, None, None]
        sigma = torch.sin(t * math.pi / 2)[:, None, None]
        x_t = alpha * x0 + sigma * noise

        # Classifier-free guidance: drop text and speaker conditioning together where keep is False.
        # A row without audio frames (a stand-in for a skipped sample) keeps them, so that its
        # attention has keys: torch's SDPA gives zeros for a row that attends to nothing; other
        # kernels (TE) are not checked for it. It adds nothing to the loss.
        keep = keep | ~batch.latent_mask.any(1)
        text = self.text_proj(self.text_encoder(batch.text_ids, batch.text_mask).to(self.text_proj.weight.dtype))
        text_mask = batch.text_mask & keep[:, None]
        speaker, speaker_mask = self.speaker_encoder(batch.ref, batch.ref_mask)
        speaker_mask = speaker_mask & keep[:, None]

        pred = self.dit(x_t, t, batch.latent_mask, text, text_mask, speaker, speaker_mask)
        mask = batch.latent_mask[..., None].to(pred.dtype)
        err = ((pred.float() - noise.float()).pow(2) * mask).sum()
        return err if reduction == "sum" else err / loss_frames(batch).clamp(min=1)
