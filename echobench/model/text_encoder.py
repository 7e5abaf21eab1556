"""The text encoder from `transformers`, built from a config (no download).

T5Gemma2's Gemma-3 text tower (the default) or a classic T5 encoder. Frozen by default:
run under no_grad in eval mode; with frozen=False it trains with the rest of the model.
"""

from __future__ import annotations

import torch
from torch import nn

from echobench.model.config import TextEncoderConfig


def t5gemma2_text_config(cfg: TextEncoderConfig):
    from transformers.models.t5gemma2.configuration_t5gemma2 import T5Gemma2TextConfig  # lazy: see build_text_encoder

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


def t5_config(cfg: TextEncoderConfig):
    from transformers import T5Config  # lazy: see build_text_encoder

    return T5Config(
        vocab_size=cfg.vocab, d_model=cfg.hidden, d_ff=cfg.mlp, num_layers=cfg.layers, num_heads=cfg.heads,
        d_kv=cfg.head_dim, relative_attention_num_buckets=cfg.relative_buckets,
        feed_forward_proj="gated-gelu" if cfg.gated_mlp else "relu", dropout_rate=0.0,
    )


def build_text_encoder(cfg: TextEncoderConfig, checkpoint: str | None = None) -> nn.Module:
    """Random weights from the config unless a local checkpoint directory is given.

    Throughput does not depend on the weights' values, so benchmarks need no download.
    """
    if cfg.family == "t5":
        from transformers import T5EncoderModel  # lazy: transformers takes seconds; only building needs it

        if checkpoint:
            return T5EncoderModel.from_pretrained(checkpoint, local_files_only=True)
        return T5EncoderModel(t5_config(cfg))
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextEncoder  # lazy: as above

    if checkpoint:
        model = T5Gemma2TextEncoder.from_pretrained(checkpoint, local_files_only=True)
        model.config._attn_implementation = "sdpa"
        return model
    return T5Gemma2TextEncoder(t5gemma2_text_config(cfg))


def scaled_word_embedding(embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What transformers' T5Gemma2TextScaledWordEmbedding computes, without a host sync.

    transformers writes the end-of-image embedding through a boolean mask
    (`emb[ids == eoi] = ...`): an index_put that runs nonzero() on the GPU and makes the host
    wait for it every step. Text rarely holds that token, but a tokenizer can emit it, so the
    same rows are selected with torch.where instead: same values, static shapes.
    """
    emb = nn.Embedding.forward(embed, ids) * embed.embed_scale.to(embed.weight.dtype)
    is_eoi = (ids == embed.eoi_token_index)[..., None]
    return torch.where(is_eoi, embed.eoi_embedding.to(emb.dtype), emb)


def check_checkpoint_size(cfg: TextEncoderConfig, model: nn.Module) -> None:
    config = model.config
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    if hidden != cfg.hidden:
        raise ValueError(f"encoder checkpoint has hidden size {hidden}, but encoder_model {cfg.name!r} has "
                         f"{cfg.hidden}: pick the encoder_model that matches the checkpoint")


class TextEncoder(nn.Module):
    """(B, T) token ids + mask -> (B, T, hidden). Frozen: no_grad, eval mode, no trainable parameters."""

    def __init__(self, cfg: TextEncoderConfig, checkpoint: str | None = None, frozen: bool = True):
        super().__init__()
        self.family = cfg.family
        self.sliding_window = cfg.sliding_window
        self.frozen = frozen
        self.encoder = build_text_encoder(cfg, checkpoint)
        if checkpoint:
            check_checkpoint_size(cfg, self.encoder)
        if frozen:
            self.encoder.requires_grad_(False)
            self.encoder.eval()

    def train(self, mode: bool = True):
        # A frozen encoder stays in eval mode whatever the parent does.
        return super().train(mode and not self.frozen)

    def needs_mask(self, padded: bool, tokens: int) -> bool:
        """Whether the encoder's attention takes a mask: where the text has padding, where the
        sliding window is shorter than the text, and always for T5 (its position bias is added as
        a mask). Without one, T5Gemma2's SDPA runs maskless (FlashAttention on a GPU)."""
        return padded or self.family == "t5" or tokens > self.sliding_window

    def attention_masks(self, mask: torch.Tensor, dtype: torch.dtype, padded: bool = True):
        """Masks built here rather than by transformers, whose helper checks `mask.all()`
        on the host: a device sync every step, and impossible on the meta device.

        T5Gemma2: boolean (B, 1, 1, T) masks for its full and sliding-window layers, or None for
        both where needs_mask says none is needed (padded: whether the text has padding, known on
        the host). T5: an additive float mask, which T5 adds to its relative position bias.
        """
        keys = mask[:, None, None, :]
        if self.family == "t5":
            return torch.zeros(keys.shape, dtype=dtype, device=mask.device).masked_fill(~keys, torch.finfo(dtype).min)
        t = mask.shape[1]
        if not self.needs_mask(padded, t):
            return {"full_attention": None, "sliding_attention": None}
        pos = torch.arange(t, device=mask.device)
        window = (pos[:, None] - pos[None, :]).abs() < self.sliding_window
        return {"full_attention": keys, "sliding_attention": keys & window[None, None]}

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return next(self.encoder.parameters()).dtype

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, padded: bool = True) -> torch.Tensor:
        dtype = self.compute_dtype(mask.device)
        masks = self.attention_masks(mask, dtype, padded)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            if self.family == "t5":
                out = self.encoder(input_ids=ids, attention_mask=masks)
            else:
                embeds = scaled_word_embedding(self.encoder.embed_tokens, ids)
                out = self.encoder(inputs_embeds=embeds, attention_mask=masks)
        return out.last_hidden_state
