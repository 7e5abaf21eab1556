"""Model configuration: typed dataclasses and the 800M, 3B and 8B scale presets (docs/explanation/model.md)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

LATENT_DIM = 128  # DAC-VAE latent channels (echobench.data.format has the same constant)


@dataclass(frozen=True)
class TextEncoderConfig:
    """A text encoder's sizes: the Gemma-3 text tower of T5Gemma2, or a classic T5 encoder.

    Sizes come from the published configs; the hidden size is what the text projection reads.
    """

    name: str
    hidden: int
    mlp: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    family: str = "t5gemma2"  # t5gemma2 (transformers T5Gemma2TextEncoder) or t5 (T5EncoderModel)
    sliding_window: int = 512
    gated_mlp: bool = True  # Gemma: gate/up/down; T5 v1.0: relu wi/wo
    relative_buckets: int = 32  # T5's relative position bias buckets


TEXT_ENCODERS = {
    # Tiny tower for tests: same architecture, toy sizes.
    "tiny": TextEncoderConfig("tiny", hidden=64, mlp=128, layers=2, heads=2, kv_heads=1, head_dim=32, vocab=512),
    "t5gemma-2-270m": TextEncoderConfig("t5gemma-2-270m", 640, 2048, 18, 4, 1, 256, 262144),
    "t5gemma-2-1b": TextEncoderConfig("t5gemma-2-1b", 1152, 6912, 26, 4, 1, 256, 262144),
    "t5gemma-2-4b": TextEncoderConfig("t5gemma-2-4b", 2560, 10240, 34, 8, 4, 256, 262144),
    "t5-base": TextEncoderConfig("t5-base", 768, 3072, 12, 12, 12, 64, 32128, family="t5", gated_mlp=False),
    "t5-large": TextEncoderConfig("t5-large", 1024, 4096, 24, 16, 16, 64, 32128, family="t5", gated_mlp=False),
    "tiny-t5": TextEncoderConfig("tiny-t5", 64, 128, 2, 2, 2, 32, 512, family="t5", gated_mlp=False),
}
# The hub names of the T5Gemma2 checkpoints (encoder-decoder sizes) map to their text towers.
ENCODER_ALIASES = {"t5gemma-2-270m-270m": "t5gemma-2-270m", "t5gemma-2-1b-1b": "t5gemma-2-1b",
                   "t5gemma-2-4b-4b": "t5gemma-2-4b"}


def get_text_encoder(name: str) -> TextEncoderConfig:
    name = ENCODER_ALIASES.get(name, name)
    if name not in TEXT_ENCODERS:
        raise ValueError(f"unknown encoder_model {name!r}: choose one of {', '.join([*TEXT_ENCODERS, *ENCODER_ALIASES])}")
    return TEXT_ENCODERS[name]


@dataclass(frozen=True)
class EchoConfig:
    """The Echo TTS DiT plus its speaker encoder and frozen text encoder."""

    name: str
    # DiT
    width: int
    layers: int
    heads: int
    mlp: int
    # speaker encoder (patches the reference latent by `speaker_patch`)
    speaker_width: int
    speaker_layers: int
    speaker_heads: int
    text_encoder: TextEncoderConfig
    speaker_patch: int = 4
    adaln_rank: int = 256
    timestep_dim: int = 256  # sinusoidal features fed to the timestep MLP
    latent_dim: int = LATENT_DIM
    cfg_dropout: float = 0.1  # classifier-free guidance: drop text and speaker this often
    frozen_encoder: bool = True  # False: the text encoder trains too (its backward is counted)
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def speaker_mlp(self) -> int:
        # 8/3 x width rounded up to a multiple of 256, the usual SwiGLU sizing.
        return -(-(8 * self.speaker_width // 3) // 256) * 256

    def __post_init__(self):
        if self.width % self.heads or self.speaker_width % self.speaker_heads:
            raise ValueError(f"{self.name}: width must be divisible by heads")


def _preset(name, w, l, h, mlp, sw, sl, sh, enc, **kw):
    return EchoConfig(name, w, l, h, mlp, sw, sl, sh, TEXT_ENCODERS[enc], **kw)


PRESETS: dict[str, EchoConfig] = {
    "tiny": _preset("tiny", 64, 2, 4, 172, 64, 2, 4, "tiny", adaln_rank=16, timestep_dim=64),
    "800M": _preset("800M", 1280, 24, 10, 3456, 768, 8, 6, "t5gemma-2-270m"),
    "3B": _preset("3B", 2560, 28, 20, 6912, 1024, 8, 8, "t5gemma-2-1b"),
    "8B": _preset("8B", 4096, 32, 32, 10240, 1536, 8, 12, "t5gemma-2-1b"),
}

# Trainable parameter count the preset's name promises (each preset lands within 10% of it).
NOMINAL_PARAMS = {"800M": 800e6, "3B": 3e9, "8B": 8e9}


def get_preset(scale: str, encoder_model: str | None = None, frozen_encoder: bool = True) -> EchoConfig:
    """A preset, optionally with another text encoder (by name) and a trainable encoder."""
    if scale not in PRESETS:
        raise ValueError(f"unknown scale {scale!r}: choose one of {', '.join(PRESETS)}")
    cfg = replace(PRESETS[scale], frozen_encoder=frozen_encoder)
    if encoder_model is not None:
        cfg = replace(cfg, text_encoder=get_text_encoder(encoder_model))
    return cfg


__all__ = ["EchoConfig", "TextEncoderConfig", "PRESETS", "TEXT_ENCODERS", "NOMINAL_PARAMS", "get_preset",
           "get_text_encoder"]


def masked_share(micro_batch: int, cfg_dropout: float, cfg_drop: str = "mask", padded: bool = False) -> float:
    """The expected share of micro-batches whose DiT attends over a key mask: every one where the data
    pads a stream (shards: samples shorter than the maxima); else, with cfg_drop mask, those in which
    at least one of micro_batch samples drops its conditioning, each with probability cfg_dropout
    (1 - 0.9^8 = 57% at micro-batch 8); none with null conditioning."""
    if padded:
        return 1.0
    return 0.0 if cfg_drop == "null" else 1 - (1 - cfg_dropout) ** micro_batch


# ---- a card run's decoder (model.decoder), here without torch: a plan or a check reads it ----

DECODER_POSITIONS = ("learned", "rotary", "none")  # what the decoder builds (a card may also say alibi)


def decoder_problem(card) -> str | None:
    """Why this model card cannot be built as echobench's decoder (None when it can)."""
    if card.positions not in DECODER_POSITIONS:
        return (f"card positions {card.positions}: echobench's decoder has {', '.join(DECODER_POSITIONS)} positions "
                "(ALiBi's score bias is not in SDPA's fast kernels): give a card with one of them")
    return None


@dataclass(frozen=True)
class CardWorkload:
    """What a card run trains and how its record names it, resolved by the command that reads the
    card (echobench.predict.cards.run.run_card): the card (a ModelCard), the sequence length, its label
    (the card file's stem or the published row's id), where it came from (FILE or FILE#ROW), the
    layout the card or row publishes (its `run` section, for the record) and, for a published row,
    its own FLOP convention (its formula's text and FLOPs per token) beside echobench's and the figures
    it publishes (validate.published_figures: step time, tokens/s per GPU, MFU under its convention),
    so that a record compares with its row without the rows file."""

    card: object
    seq: int
    label: str
    source: str
    published_layout: dict
    row_convention: str | None = None
    row_flops_per_token: float | None = None
    published: dict | None = None

    def as_record(self) -> dict:
        """The record's `card` before the run's figures (echobench's convention is flops_breakdown's)."""
        return {"label": self.label, "source": self.source, "model": asdict(self.card), "seq": self.seq,
                "published_layout": self.published_layout, "row_convention": self.row_convention,
                "row_flops_per_token": self.row_flops_per_token, "published": self.published}
