"""The frozen T5Gemma2 text tower from `transformers`, built from a config (no download)."""

from __future__ import annotations

import torch
from torch import nn

from echobench.model.config import TextEncoderConfig


def t5gemma2_text_config(cfg: TextEncoderConfig):
    from transformers.models.t5gemma2.configuration_t5gemma2 import T5Gemma2TextConfig

    config = T5Gemma2TextConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.mlp,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        query_pre_attn_scalar=cfg.head_dim,
        sliding_window=cfg.sliding_window,
    )
    # The text config lacks these, and the encoder reads them (transformers 5.x).
    config.dropout_rate = 0.0
    config._attn_implementation = "sdpa"
    return config


def build_text_encoder(cfg: TextEncoderConfig, checkpoint: str | None = None) -> nn.Module:
    """Random weights from the config unless a local checkpoint directory is given.

    Throughput does not depend on the weights' values, so benchmarks need no download.
    """
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextEncoder

    if checkpoint:
        model = T5Gemma2TextEncoder.from_pretrained(checkpoint, local_files_only=True)
        model.config._attn_implementation = "sdpa"
    else:
        model = T5Gemma2TextEncoder(t5gemma2_text_config(cfg))
    return model


class FrozenTextEncoder(nn.Module):
    """Runs the encoder under no_grad in eval mode; its parameters never train."""

    def __init__(self, cfg: TextEncoderConfig, checkpoint: str | None = None):
        super().__init__()
        self.sliding_window = cfg.sliding_window
        self.encoder = build_text_encoder(cfg, checkpoint)
        self.encoder.requires_grad_(False)
        self.encoder.eval()

    def train(self, mode: bool = True):
        # Stay in eval mode whatever the parent does (no dropout in a frozen encoder).
        return super().train(False)

    def attention_masks(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Boolean (B, 1, T, T) masks for the full and sliding-window layers.

        Built here rather than by transformers, whose mask helper checks `mask.all()`
        on the host: a device sync every step, and impossible on the meta device.
        """
        t = mask.shape[1]
        keys = mask[:, None, None, :]
        pos = torch.arange(t, device=mask.device)
        window = (pos[:, None] - pos[None, :]).abs() < self.sliding_window
        return {"full_attention": keys, "sliding_attention": keys & window[None, None]}

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.encoder(input_ids=ids, attention_mask=self.attention_masks(mask)).last_hidden_state
