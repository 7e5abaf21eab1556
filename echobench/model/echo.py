"""Echo TTS: text encoder (frozen by default) + text projection + speaker encoder + DiT, and its loss."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Literal

import numpy as np
import torch
from torch import nn

from echobench.model.components import ConditioningDrop, key_mask
from echobench.model.config import EchoConfig
from echobench.model.dit import EchoDiT
from echobench.model.speaker import SpeakerEncoder
from echobench.model.text_encoder import TextEncoder


@dataclass
class DiffusionDraws:
    """The random draws of one training objective evaluation, per sample."""

    t: torch.Tensor  # (B,) diffusion time in [0, 1), on the device
    noise: torch.Tensor  # (B, T, C) standard normal, on the device
    # (B,) bool, on the HOST (numpy: reading it is no tensor op): False drops text and speaker
    # conditioning (CFG). The step knows without a device sync whether any sample drops it, hence
    # whether its attention needs a mask.
    keep: np.ndarray


# How the DiT attends in a micro-batch where samples drop their conditioning (cfg_drop mask) but no
# stream is padded (RunConfig.cfg_drop_attention): "split", two unmasked flash calls merged by their
# log-sum-exp (components.merged_attention), the "split" path; "masked", over the key mask
# (key_masking), as a padded micro-batch does.
CFG_DROP_ATTENTIONS = ("split", "masked")


def attention_paths(padding, conditioning_dropped: bool, key_masking: str, text_needs_mask: bool,
                    split_dropped: bool = False) -> dict:
    """The attention path each attention of a step takes: "none" (SDPA with no mask) where none of
    its keys is padding, else `key_masking` ("dense" or "flex", components.key_mask); the DiT's
    "split" (components.merged_attention, no mask) where its only masked keys are dropped
    conditioning's and split_dropped; the text encoder (transformers' SDPA) takes a dense mask where
    it needs one (TextEncoder.needs_mask). padding: the batch's data.Padding (which streams have
    padded positions)."""
    padded = padding.latent or padding.text or padding.speaker
    if padded:
        dit = key_masking
    elif conditioning_dropped:
        dit = "split" if split_dropped else key_masking
    else:
        dit = "none"
    return {"dit": dit,
            "speaker_encoder": key_masking if padding.speaker else "none",
            "text_encoder": "dense" if text_needs_mask else "none"}


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

    Generators reseeded per sample on the host (no device sync): 2 ranks x B samples draw exactly
    what 1 rank x 2B draws. The time and the CFG draw come from a host generator (the step reads
    `keep` on the host); the noise from `generator` (the device's), one random kernel per sample.
    """
    gen = generator or torch.Generator(device)
    host = torch.Generator()
    uniforms, noises = [], []
    for g in sample_ids:
        host.manual_seed(sample_seed(seed, g))
        uniforms.append(torch.rand(2, generator=host))
        gen.manual_seed(sample_seed(seed, g))
        noises.append(torch.randn(frames, channels, device=device, generator=gen))
    u = torch.stack(uniforms)
    t = u[:, 0].pin_memory() if torch.device(device).type == "cuda" else u[:, 0]
    return DiffusionDraws(t=t.to(device, non_blocking=True), noise=torch.stack(noises),
                          keep=(u[:, 1] >= cfg_dropout).numpy())


def loss_frames(batch) -> torch.Tensor:
    """What the loss averages over: real (unpadded) latent frames x channels, a device tensor.

    A data-parallel backend sums it over its replicas to normalise by the global batch."""
    return batch.latent_mask.sum() * batch.latent.shape[-1]


# How classifier-free guidance drops a sample's text and speaker conditioning (RunConfig.cfg_drop):
# "mask" leaves the DiT's joint attention no text or speaker key to attend to (their keys masked
# out), as the reference Echo TTS forms its unconditional prediction (jordandare/echo-tts,
# inference.py, sample_euler_cfg_independent_guidances: zeroed text and speaker masks, "masks prevent
# decoder from attending to unconds"); "null" replaces the streams by zeros that are attended: no
# mask where nothing is padded.
CFG_DROPS = ("mask", "null")


class EchoTTS(nn.Module):
    def __init__(self, cfg: EchoConfig, encoder_checkpoint: str | None = None, key_masking: str = "dense",
                 cfg_drop: str = "mask", cfg_drop_attention: str = "masked"):
        super().__init__()
        if cfg_drop not in CFG_DROPS:
            raise ValueError(f"unknown cfg_drop {cfg_drop!r}: allowed {', '.join(CFG_DROPS)}")
        if cfg_drop_attention not in CFG_DROP_ATTENTIONS:
            raise ValueError(f"unknown cfg_drop_attention {cfg_drop_attention!r}: allowed "
                             f"{', '.join(CFG_DROP_ATTENTIONS)}")
        self.cfg = cfg
        self.key_masking = key_masking  # how attention skips padded keys (components.key_mask)
        self.cfg_drop = cfg_drop
        self.cfg_drop_attention = cfg_drop_attention
        self.text_encoder = TextEncoder(cfg.text_encoder, encoder_checkpoint, frozen=cfg.frozen_encoder)
        self.text_proj = nn.Linear(cfg.text_encoder.hidden, cfg.width)
        self.speaker_encoder = SpeakerEncoder(cfg)
        self.dit = EchoDiT(cfg)

    def attention_paths(self, padding, conditioning_dropped: bool, text_tokens: int) -> dict:
        """What each attention of a step with this padding takes (attention_paths): the record's counts.
        Dropped conditioning masks keys with cfg_drop mask only."""
        return attention_paths(padding, conditioning_dropped and self.cfg_drop == "mask", self.key_masking,
                               self.text_encoder.needs_mask(padding.text, text_tokens),
                               split_dropped=self.cfg_drop_attention == "split")

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
            dropped = self.cfg.cfg_dropout > 0  # drawn on the device: the host cannot tell, so assume some
        else:
            t, noise = draws.t, draws.noise.to(x0.dtype)
            keep, dropped = torch.from_numpy(draws.keep), not draws.keep.all()  # on the host: no sync
        # Which streams have padding (data.Padding, on the host); a batch that does not say (a
        # hand-made one) is taken as padded everywhere: masks that change nothing cost only time.
        padding = getattr(batch, "padding", None) or SimpleNamespace(latent=True, text=True, speaker=True)
        paths = self.attention_paths(padding, dropped, batch.text_ids.shape[1])
        text = self.text_proj(self.text_encoder(batch.text_ids, batch.text_mask, padding.text)
                              .to(self.text_proj.weight.dtype))
        speaker, speaker_mask = self.speaker_encoder(batch.ref, batch.ref_mask, padding.speaker, self.key_masking)
        if self.cfg_drop == "null" and dropped:
            # Null conditioning: a dropped sample's text and speaker streams are zeros, still attended.
            held = keep.to(device, non_blocking=True)[:, None, None]
            text, speaker = text * held.to(text.dtype), speaker * held.to(speaker.dtype)
        keys = None
        if paths["dit"] == "split":  # dropped conditioning, no padding: no mask (components.merged_attention)
            keys = ConditioningDrop(keep.to(device, non_blocking=True))
        elif paths["dit"] != "none":
            # Classifier-free guidance (cfg_drop mask): drop text and speaker conditioning together
            # where keep is False. A row without audio frames (a stand-in for a skipped sample)
            # keeps them, so that its attention has keys: torch's SDPA gives zeros for a row that
            # attends to nothing; other kernels (TE) are not checked for it. It adds nothing to the loss.
            if self.cfg_drop == "null":
                keep = torch.ones_like(keep)
            keep = (keep.to(device, non_blocking=True) | ~batch.latent_mask.any(1))[:, None]
            keys = key_mask(torch.cat([batch.latent_mask, batch.text_mask & keep, speaker_mask & keep], dim=1),
                            x0.shape[1], self.key_masking)
        pred = self.dit(self.noised(x0, t, noise), t, text, speaker, keys)
        err = self.squared_error(pred, noise, batch.latent_mask)
        return err if reduction == "sum" else err / loss_frames(batch).clamp(min=1)

    # noised and squared_error: the objective's work outside the modules, each a function a
    # backend may compile on its own (as EchoDiT.embed / head).
    @staticmethod
    def noised(x0, t, noise):
        """The diffusion input at time t: cosine schedule, epsilon prediction."""
        alpha = torch.cos(t * math.pi / 2)[:, None, None]
        sigma = torch.sin(t * math.pi / 2)[:, None, None]
        return alpha * x0 + sigma * noise

    @staticmethod
    def squared_error(pred, noise, latent_mask):
        """The noise-prediction error summed over real frames and channels, in float32."""
        mask = latent_mask[..., None].to(pred.dtype)
        return ((pred.float() - noise.float()).pow(2) * mask).sum()
