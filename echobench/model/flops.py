"""Analytical parameter and FLOP model of Echo TTS: the MFU numerator.

Conventions (docs/explanation/mfu.md, How MFU is computed):
- 2 FLOPs per multiply-add; only matmuls count (linear layers and attention scores / values);
  element-wise work (norms, RoPE, softmax, activations, the loss) does not.
- Attention is counted in full (bidirectional, every query against every key), on the
  real (unpadded) lengths of a sample.
- Backward of a trainable matmul is 2x its forward (input and weight gradients), except for
  the first layer of each stream, whose input carries no gradient: only the weight gradient
  is computed there (1x). This is what autograd actually executes, and what
  torch.utils.flop_counter.FlopCounterMode measures.
- The frozen text encoder runs forward only (1x). A trainable one (frozen_encoder: false) counts
  its backward too (2x: its first matmuls read the embedding output, which has a gradient).
- Activation recompute is not model work: it is counted in hardware FLOPs (HFU) only.
- Padding is not model work either: padded_flops counts what the padded shapes cost the hardware
  (the same model at the padded lengths, recompute included), for the waterfall's padding loss.

The tests hold these formulas against FlopCounterMode on the real modules (meta device),
with attention under the math SDPA backend (scores and values as two bmm, backward 2x).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rich.table import Table
from rich.text import Text

from echobench.model.config import EchoConfig

PARTS = (
    "dit_attention",
    "dit_mlp",
    "dit_conditioning",
    "dit_io",
    "speaker_encoder",
    "text_projection",
    "text_encoder",
)


def speaker_patches(cfg: EchoConfig, speaker_frames: int) -> int:
    return -(-speaker_frames // cfg.speaker_patch)


def _linear(tokens: int, fan_in: int, fan_out: int) -> int:
    return 2 * tokens * fan_in * fan_out


@dataclass
class PartFlops:
    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def add(self, fwd: int, input_has_grad: bool = True) -> None:
        self.forward += fwd
        self.backward += (2 if input_has_grad else 1) * fwd


@dataclass
class FlopBreakdown:
    """Model FLOPs of ONE training sample, by part."""

    parts: dict[str, PartFlops]
    audio_frames: int
    text_tokens: int
    speaker_frames: int

    @property
    def forward(self) -> int:
        return sum(p.forward for p in self.parts.values())

    @property
    def total(self) -> int:
        return sum(p.total for p in self.parts.values())

    def as_dict(self) -> dict:
        return {
            "total": self.total,
            "forward": self.forward,
            "lengths": {"audio_frames": self.audio_frames, "text_tokens": self.text_tokens,
                        "speaker_frames": self.speaker_frames},
            "parts": {k: {**asdict(v), "total": v.total} for k, v in self.parts.items()},
        }


def model_flops(cfg: EchoConfig, audio_frames: int, text_tokens: int, speaker_frames: int,
                dit_keys: int | None = None) -> FlopBreakdown:
    """FLOPs of one sample's forward + backward (frozen encoder: forward) on real lengths.

    dit_keys: how many keys each latent query of the DiT's joint attention is scored against;
    default all of them (audio frames + text tokens + speaker patches). padded_flops sets it where
    the attention kernel skips padded keys.
    """
    d, La, Lt = cfg.width, audio_frames, text_tokens
    ds, P = cfg.speaker_width, speaker_patches(cfg, speaker_frames)
    keys = La + Lt + P if dit_keys is None else dit_keys
    parts = {name: PartFlops() for name in PARTS}

    # DiT blocks.
    attn, mlp, cond = parts["dit_attention"], parts["dit_mlp"], parts["dit_conditioning"]
    for _ in range(cfg.layers):
        attn.add(5 * _linear(La, d, d))  # q, k, v, gate, out
        attn.add(2 * _linear(Lt, d, d))  # text keys, values
        attn.add(2 * _linear(P, ds, d))  # speaker keys, values
        attn.add(2 * 2 * La * keys * d)  # scores q.k and weighted values
        mlp.add(3 * _linear(La, d, cfg.mlp))
        cond.add(_linear(1, d, cfg.adaln_rank) + _linear(1, cfg.adaln_rank, 6 * d))
    cond.add(_linear(1, d, cfg.adaln_rank) + _linear(1, cfg.adaln_rank, 2 * d))  # final AdaLN
    cond.add(_linear(1, cfg.timestep_dim, d), input_has_grad=False)  # timestep MLP
    cond.add(_linear(1, d, d))
    parts["dit_io"].add(_linear(La, cfg.latent_dim, d), input_has_grad=False)
    parts["dit_io"].add(_linear(La, d, cfg.latent_dim))

    # Speaker encoder.
    spk = parts["speaker_encoder"]
    spk.add(_linear(P, cfg.latent_dim * cfg.speaker_patch, ds), input_has_grad=False)
    for _ in range(cfg.speaker_layers):
        spk.add(4 * _linear(P, ds, ds))
        spk.add(2 * 2 * P * P * ds)
        spk.add(3 * _linear(P, ds, cfg.speaker_mlp))

    # Text: the encoder (frozen: forward only), then the trainable projection.
    enc = cfg.text_encoder
    parts["text_projection"].add(_linear(Lt, enc.hidden, d), input_has_grad=not cfg.frozen_encoder)
    q_dim, kv_dim = enc.heads * enc.head_dim, enc.kv_heads * enc.head_dim
    per_layer = (
        _linear(Lt, enc.hidden, q_dim) + 2 * _linear(Lt, enc.hidden, kv_dim) + _linear(Lt, q_dim, enc.hidden)
        + 2 * 2 * Lt * Lt * q_dim
        + (3 if enc.gated_mlp else 2) * _linear(Lt, enc.hidden, enc.mlp)
    )
    if cfg.frozen_encoder:
        parts["text_encoder"].forward = enc.layers * per_layer
    else:
        parts["text_encoder"].add(enc.layers * per_layer)
    return FlopBreakdown(parts, audio_frames, text_tokens, speaker_frames)


ATTENTIONS = ("dit", "speaker_encoder", "text_encoder")


def attention_flops(cfg: EchoConfig, audio_frames: int, text_tokens: int, speaker_frames: int) -> dict[str, int]:
    """Per attention, the FLOPs of one sample's scores and weighted values at these lengths, every key
    counted, forward and backward as model_flops counts them (backward 2x; a frozen text encoder's
    forward only): the DiT's joint attention, the speaker encoder's, the text encoder's."""
    P = speaker_patches(cfg, speaker_frames)
    enc = cfg.text_encoder
    return {"dit": 3 * cfg.layers * 4 * audio_frames * (audio_frames + text_tokens + P) * cfg.width,
            "speaker_encoder": 3 * cfg.speaker_layers * 4 * P * P * cfg.speaker_width,
            "text_encoder": (1 if cfg.frozen_encoder else 3) * enc.layers * 4 * text_tokens * text_tokens
            * enc.heads * enc.head_dim}


# ac: selective where the blocks run eager: every second block of each stack checkpointed whole
# (backends.torchtitan.ac_mode); a mode of the run, not a setting.
LAYER_SELECTIVE = "selective-layer"
# ac: selective (op-level) where the DiT blocks' linears and core attention are TransformerEngine's
# (megatron with te, compiled): TE's GEMMs and fused attention are not ATen ops, so the selective
# policy cannot save their outputs and backward re-runs them (backends.megatron).
TE_SELECTIVE = "selective-te"


def recompute_flops(cfg: EchoConfig, flops: FlopBreakdown, ac: str) -> int:
    """Extra forward FLOPs that activation checkpointing re-executes in backward.

    full: every DiT block and speaker block is re-run forward. torch's non-reentrant checkpoint
    stops recomputing once every saved tensor is rebuilt, so the last matmul of a speaker block
    (the MLP down-projection, whose output only feeds a residual add) is not re-run; a DiT
    block's is, since its output is saved for the AdaLN gate's gradient.
    selective-layer: the same for every second block of each stack (floor(n / 2) of n).
    selective: matmul and attention outputs are saved, element-wise ops recomputed: no
    extra matmul FLOPs. selective-te: the same, but the DiT blocks' TransformerEngine linears and
    core attention are re-run (their attention and MLP forward; the AdaLN's plain linears saved).
    none: nothing.
    """
    if ac in ("none", "selective"):
        return 0
    if ac not in ("full", LAYER_SELECTIVE, TE_SELECTIVE):
        raise ValueError(f"unknown activation checkpointing mode {ac!r}: none, selective or full")
    p = flops.parts
    if ac == TE_SELECTIVE:
        return p["dit_attention"].forward + p["dit_mlp"].forward
    dit_blocks = p["dit_attention"].forward + p["dit_mlp"].forward
    dit_blocks += cfg.layers * _linear(1, cfg.width, cfg.adaln_rank) + cfg.layers * _linear(1, cfg.adaln_rank, 6 * cfg.width)
    patch_embed = _linear(speaker_patches(cfg, flops.speaker_frames), cfg.latent_dim * cfg.speaker_patch,
                          cfg.speaker_width)
    P = speaker_patches(cfg, flops.speaker_frames)
    speaker_down_proj = cfg.speaker_layers * _linear(P, cfg.speaker_mlp, cfg.speaker_width)
    speaker_blocks = p["speaker_encoder"].forward - patch_embed - speaker_down_proj
    if ac == LAYER_SELECTIVE:  # each block of a stack does the same work
        return dit_blocks // cfg.layers * (cfg.layers // 2) + speaker_blocks // cfg.speaker_layers * (cfg.speaker_layers // 2)
    return dit_blocks + speaker_blocks


def hardware_flops(cfg: EchoConfig, flops: FlopBreakdown, ac: str) -> int:
    return flops.total + recompute_flops(cfg, flops, ac)


STREAMS = ("latent", "text", "speaker")


def stream_tokens(cfg: EchoConfig, audio_frames: int, text_tokens: int, speaker_frames: int) -> dict[str, int]:
    """The tokens of each stream the model computes for these lengths: latent frames, text tokens
    and speaker patches (the speaker encoder folds speaker_patch reference frames into one, a
    partial last patch included)."""
    return {"latent": audio_frames, "text": text_tokens, "speaker": speaker_patches(cfg, speaker_frames)}


def padded_flops(cfg: EchoConfig, audio_frames: int, text_tokens: int, speaker_frames: int, ac: str,
                 real_keys: int | None = None) -> int:
    """What ONE batch row costs the hardware at the padded shapes, in hardware_flops' convention
    (matmuls only, AC recompute included): the same FLOP model at the lengths every row is padded to.

    The loader pads each row to the configured maxima (data.collate): the latent to audio_frames,
    the text to text_tokens, the reference to speaker_frames rounded up to a multiple of
    speaker_patch, which the speaker encoder folds into speaker_patches(speaker_frames) patches:
    so the lengths to pass are the run's audio_frames, text_tokens and speaker_frames. The masks
    change no shape: every linear layer runs on every padded token, and the masked attentions (torch
    SDPA in the DiT and the speaker encoder, the text encoder's) score every query against every key.
    A row counts whether it holds a sample or a stand-in for a skipped one (data.STAND_IN): the
    hardware computes it all the same.

    real_keys: where the DiT's joint attention reads its key mask as a count of valid keys per sample
    and skips the rest (TransformerEngine's fused attention, model.megatron.TECoreAttention), the
    row's real key count; its queries stay padded. A CFG-dropped sample's text and speaker keys are
    skipped there too, but model_flops counts them as well, so padded minus hardware FLOPs is still
    the padding alone.
    """
    return hardware_flops(cfg, model_flops(cfg, audio_frames, text_tokens, speaker_frames, dit_keys=real_keys), ac)


@dataclass
class ParamCounts:
    parts: dict[str, int]
    frozen_encoder: bool = True

    @property
    def trainable(self) -> int:
        return sum(v for k, v in self.parts.items() if k != "text_encoder" or not self.frozen_encoder)

    @property
    def frozen(self) -> int:
        return self.parts["text_encoder"] if self.frozen_encoder else 0

    def as_dict(self) -> dict:
        return {"trainable": self.trainable, "frozen": self.frozen, "parts": dict(self.parts)}


def param_counts(cfg: EchoConfig) -> ParamCounts:
    d, ds, r = cfg.width, cfg.speaker_width, cfg.adaln_rank
    hd = cfg.head_dim
    attn = 7 * d * d + 2 * ds * d + 2 * hd  # 7 square projections, speaker k/v, q/k norms
    norms = 2 * d
    block_cond = d * r + r * 6 * d + 6 * d
    parts = {
        "dit_attention": cfg.layers * attn,
        "dit_mlp": cfg.layers * (3 * d * cfg.mlp + norms),
        "dit_conditioning": cfg.layers * block_cond
        + (d * r + r * 2 * d + 2 * d)
        + (cfg.timestep_dim * d + d) + (d * d + d),
        "dit_io": (cfg.latent_dim * d + d) + (d * cfg.latent_dim + cfg.latent_dim) + d,
        "speaker_encoder": (cfg.latent_dim * cfg.speaker_patch * ds + ds)
        + cfg.speaker_layers * (4 * ds * ds + 2 * (ds // cfg.speaker_heads) + 3 * ds * cfg.speaker_mlp + 2 * ds)
        + ds,
        "text_projection": cfg.text_encoder.hidden * d + d,
    }
    parts["text_encoder"] = text_encoder_params(cfg.text_encoder)
    return ParamCounts(parts, cfg.frozen_encoder)


def text_encoder_params(enc) -> int:
    q_dim, kv_dim = enc.heads * enc.head_dim, enc.kv_heads * enc.head_dim
    projections = enc.hidden * (q_dim + 2 * kv_dim) + q_dim * enc.hidden
    mlp = (3 if enc.gated_mlp else 2) * enc.hidden * enc.mlp
    if enc.family == "t5":
        # two layer norms per layer; the first layer holds the relative position bias; final norm
        layer = projections + mlp + 2 * enc.hidden
        return enc.vocab * enc.hidden + enc.layers * layer + enc.relative_buckets * enc.heads + enc.hidden
    # Gemma-3: q / k norms and four RMSNorms per layer; the embedding table, its
    # end-of-image embedding, and the final norm.
    layer = projections + mlp + 2 * enc.head_dim + 4 * enc.hidden
    return enc.vocab * enc.hidden + enc.hidden + enc.layers * layer + enc.hidden


def flops_report(cfg: EchoConfig, audio_frames: int, text_tokens: int, speaker_frames: int, ac: str = "none") -> dict:
    """Everything `echobench flops` prints, as one JSON-able dict."""
    f = model_flops(cfg, audio_frames, text_tokens, speaker_frames)
    return {
        "scale": cfg.name,
        "encoder_model": cfg.text_encoder.name,
        "frozen_encoder": cfg.frozen_encoder,
        "params": param_counts(cfg).as_dict(),
        "model_flops_per_sample": f.total,
        "hardware_flops_per_sample": hardware_flops(cfg, f, ac),
        "ac": ac,
        "breakdown": f.as_dict(),
    }


def flops_table(report: dict, cfg) -> list:
    """`echobench flops`: the report's parameters and FLOPs by part, and the totals, as rich renderables."""
    params, total = report["params"], report["model_flops_per_sample"]
    table = Table(title=f"Echo TTS {cfg.scale}: {cfg.audio_frames} audio frames, {cfg.text_tokens} text tokens, "
                        f"{cfg.speaker_frames} speaker frames")
    for col in ("part", "params (M)", "forward GFLOP", "backward GFLOP", "total GFLOP", "share"):
        table.add_column(col, justify="right" if col != "part" else "left")
    for name, part in report["breakdown"]["parts"].items():
        table.add_row(name, f"{params['parts'][name] / 1e6:.1f}", f"{part['forward'] / 1e9:.1f}",
                      f"{part['backward'] / 1e9:.1f}", f"{part['total'] / 1e9:.1f}", f"{part['total'] / total:.1%}")
    table.add_row("total", f"{(params['trainable'] + params['frozen']) / 1e6:.1f}", "", "", f"{total / 1e9:.1f}", "100%")
    return [table, Text(f"trainable parameters: {params['trainable'] / 1e6:.1f}M; frozen text encoder: "
                        f"{params['frozen'] / 1e6:.1f}M"),
            Text(f"model FLOPs per sample: {total / 1e12:.3f} TFLOP; with ac={cfg.ac}: "
                 f"{report['hardware_flops_per_sample'] / 1e12:.3f} TFLOP (HFU numerator)")]
