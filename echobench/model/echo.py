"""Echo TTS: text encoder (frozen by default) + text projection + speaker encoder + DiT, and its loss."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from echobench.model.config import EchoConfig
from echobench.model.dit import EchoDiT
from echobench.model.speaker import SpeakerEncoder
from echobench.model.text_encoder import TextEncoder


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

    def forward(self, batch, generator: torch.Generator | None = None) -> torch.Tensor:
        """One training objective evaluation: the masked noise-prediction MSE."""
        x0 = batch.latent
        b = x0.shape[0]
        device = x0.device
        # Diffusion time and noise; cosine schedule, epsilon prediction.
        t = torch.rand(b, device=device, generator=generator)
        noise = torch.randn(x0.shape, device=device, dtype=x0.dtype, generator=generator)
        alpha = torch.cos(t * math.pi / 2)[:, None, None]
        sigma = torch.sin(t * math.pi / 2)[:, None, None]
        x_t = alpha * x0 + sigma * noise

        # Classifier-free guidance: drop text and speaker conditioning together for some samples.
        keep = torch.rand(b, device=device, generator=generator) >= self.cfg.cfg_dropout
        text = self.text_proj(self.text_encoder(batch.text_ids, batch.text_mask).to(self.text_proj.weight.dtype))
        text_mask = batch.text_mask & keep[:, None]
        speaker, speaker_mask = self.speaker_encoder(batch.ref, batch.ref_mask)
        speaker_mask = speaker_mask & keep[:, None]

        pred = self.dit(x_t, t, batch.latent_mask, text, text_mask, speaker, speaker_mask)
        mask = batch.latent_mask[..., None].to(pred.dtype)
        err = (pred.float() - noise.float()).pow(2) * mask
        return err.sum() / (mask.sum() * x0.shape[-1]).clamp(min=1.0)
