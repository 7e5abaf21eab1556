"""The analytical FLOP and parameter model against the real modules (meta device, no allocation)."""

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import counted_model_flops
from echobench.model.flops import PARTS, hardware_flops, model_flops, param_counts, recompute_flops
from echobench.model.config import NOMINAL_PARAMS, PRESETS
from echobench.model.echo import EchoTTS


def meta_model(scale):
    with torch.device("meta"):
        return EchoTTS(PRESETS[scale])


def meta_batch(la, lt, ls, b=1):
    with torch.device("meta"):
        return SimpleNamespace(
            latent=torch.randn(b, la, 128), latent_mask=torch.ones(b, la, dtype=torch.bool),
            ref=torch.randn(b, ls, 128), ref_mask=torch.ones(b, ls, dtype=torch.bool),
            text_ids=torch.zeros(b, lt, dtype=torch.long), text_mask=torch.ones(b, lt, dtype=torch.bool),
        )


def counted_flops(model, batch) -> tuple[int, int]:
    """(forward + backward, forward) FLOPs that FlopCounterMode sees for one training step.

    Attention runs under the math SDPA backend: scores and values as bmm, backward 2x.
    A trainable encoder's embedding backward indexes by a mask (nonzero), which the meta device
    can only shape by assuming every element is non-zero; that changes no matmul.
    """
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(meta_nonzero_assume_all_nonzero=True), sdpa_kernel(SDPBackend.MATH), \
            FlopCounterMode(display=False) as counter:
        loss = model(batch)
        forward = counted_model_flops(counter)
        loss.backward()
    return counted_model_flops(counter), forward


@pytest.mark.parametrize("scale", list(PRESETS))
def test_param_counts_match_modules(scale):
    model = meta_model(scale)
    counts = param_counts(PRESETS[scale])
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.text_encoder.parameters())
    assert counts.trainable == trainable
    assert counts.frozen == frozen
    assert not any(p.requires_grad for p in model.text_encoder.parameters())
    # Per-part: the speaker encoder and text projection are separate modules.
    assert counts.parts["speaker_encoder"] == sum(p.numel() for p in model.speaker_encoder.parameters())
    assert counts.parts["text_projection"] == sum(p.numel() for p in model.text_proj.parameters())


@pytest.mark.parametrize("scale", ["800M", "3B", "8B"])
def test_presets_land_within_ten_percent_of_their_names(scale):
    trainable = param_counts(PRESETS[scale]).trainable
    assert abs(trainable / NOMINAL_PARAMS[scale] - 1) < 0.10, trainable


@pytest.mark.parametrize("scale", list(PRESETS))
def test_flop_model_matches_flop_counter_full_size(scale):
    lengths = (750, 256, 750) if scale != "tiny" else (60, 20, 40)
    total, forward = counted_flops(meta_model(scale), meta_batch(*lengths))
    predicted = model_flops(PRESETS[scale], *lengths)
    assert abs(predicted.total - total) / total < 0.01
    assert abs(predicted.forward - forward) / forward < 0.01


@pytest.mark.parametrize("lengths", [(37, 11, 61), (1, 1, 1), (200, 5, 3)])
def test_flop_model_matches_on_odd_lengths(lengths):
    # A speaker length that is not a multiple of the patch is padded to one (ceil).
    total, _ = counted_flops(meta_model("tiny"), meta_batch(*lengths))
    assert abs(model_flops(PRESETS["tiny"], *lengths).total - total) / total < 0.01


def test_flops_scale_with_batch_linearly():
    model = meta_model("tiny")
    one, _ = counted_flops(model, meta_batch(30, 10, 20, b=1))
    four, _ = counted_flops(model, meta_batch(30, 10, 20, b=4))
    assert four == 4 * one


def test_breakdown_parts_and_frozen_encoder_forward_only():
    f = model_flops(PRESETS["3B"], 750, 256, 750)
    assert set(f.parts) == set(PARTS)
    assert f.parts["text_encoder"].backward == 0 and f.parts["text_encoder"].forward > 0
    # Blocks dominate: attention + MLP are > 95% of an 800M-8B model's work.
    assert (f.parts["dit_attention"].total + f.parts["dit_mlp"].total) / f.total > 0.95
    # Backward is ~2x forward for trainable parts.
    assert 1.9 < f.parts["dit_mlp"].backward / f.parts["dit_mlp"].forward <= 2.0


def test_attention_grows_quadratically_with_audio_length():
    cfg = PRESETS["800M"]
    short, long = model_flops(cfg, 375, 0, 0), model_flops(cfg, 750, 0, 0)
    # Projections double, scores quadruple.
    assert long.parts["dit_mlp"].total == 2 * short.parts["dit_mlp"].total
    assert long.parts["dit_attention"].total > 2 * short.parts["dit_attention"].total


def test_hfu_counts_recompute_of_blocks_only_for_full_ac():
    cfg = PRESETS["800M"]
    f = model_flops(cfg, 750, 256, 750)
    assert hardware_flops(cfg, f, "none") == f.total
    assert hardware_flops(cfg, f, "selective") == f.total
    extra = recompute_flops(cfg, f, "full")
    # Recompute re-runs (nearly) the whole trainable forward: blocks, not the encoder or embeddings.
    trainable_forward = f.forward - f.parts["text_encoder"].forward
    assert 0.95 * trainable_forward < extra < trainable_forward
    with pytest.raises(ValueError, match="activation checkpointing"):
        recompute_flops(cfg, f, "bogus")


def test_full_ac_recompute_matches_flop_counter():
    """With checkpointed blocks, the counter sees exactly the analytical hardware FLOPs."""
    from torch.utils.checkpoint import checkpoint

    model = meta_model("tiny")
    for blocks in (model.dit.blocks, model.speaker_encoder.blocks):
        for block in blocks:
            block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    total, _ = counted_flops(model, meta_batch(60, 20, 40))
    cfg = PRESETS["tiny"]
    assert hardware_flops(cfg, model_flops(cfg, 60, 20, 40), "full") == total


# ---- padding: what the padded shapes cost ----

def padded_batch(cfg, audio_frames, text_tokens, speaker_frames):
    """A batch from the loader's own collate (lengths below the maxima, and a stand-in for a skipped
    sample), on the meta device, with its real lengths per row."""
    import numpy as np

    from echobench.data import STAND_IN, build_tokenizer, collate

    def sample(frames, text, ref):
        return {"latent": np.zeros((frames, cfg.latent_dim), np.float16), "text": text,
                "ref": np.zeros((ref, cfg.latent_dim), np.float16)}

    samples = [sample(37, "[S1] short", 13), sample(audio_frames + 9, "[S1] " + "long text " * 20, speaker_frames + 3),
               STAND_IN]
    batch = collate(samples, build_tokenizer(cfg.text_encoder.vocab), audio_frames, text_tokens, speaker_frames)
    lengths = (batch.audio_len.tolist(), batch.text_len.tolist(), batch.ref_len.tolist())
    return batch.to("meta"), lengths


@pytest.mark.parametrize("ac", ["none", "full"])
def test_padded_flops_are_what_the_padded_batch_costs(ac):
    """The counter on a collated batch (masks change no shape) sees every row at the padded lengths:
    the FLOP model at the run's maxima, speaker_frames 42 padded to 44 frames, 11 patches; with full
    AC the blocks' recompute too. bench_echo.count_measured counts that for every row, stand-in included."""
    from torch.utils.checkpoint import checkpoint

    from echobench.train.bench_echo import count_measured
    from echobench.model.flops import padded_flops

    cfg, padded = PRESETS["tiny"], (60, 20, 42)
    batch, lengths = padded_batch(cfg, *padded)
    assert tuple(batch.latent.shape[:2]) == (3, 60) and batch.ref.shape[1] == 44 and batch.text_ids.shape[1] == 20
    model = meta_model("tiny")
    if ac == "full":
        for blocks in (model.dit.blocks, model.speaker_encoder.blocks):
            for block in blocks:
                block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    counted, _ = counted_flops(model, batch)
    per_row = padded_flops(cfg, *padded, ac)
    assert per_row == hardware_flops(cfg, model_flops(cfg, *padded), ac)
    assert counted == 3 * per_row
    counts = count_measured(cfg, ac, [lengths], [padded])
    assert counts["padded_flops"] == counted and counts["samples"] == 2  # the stand-in is no sample
    real = [model_flops(cfg, a, t, s) for a, t, s in zip(*lengths) if a]
    assert counts["hardware_flops"] == sum(hardware_flops(cfg, f, ac) for f in real) < counted
    # tokens per stream [real, computed]: speaker tokens are patches, a partial last patch is real
    a, t, s = lengths
    assert counts["tokens"] == {"latent": [37 + 60, 3 * 60], "text": [t[0] + t[1], 3 * 20],
                                "speaker": [4 + 11, 3 * 11]}
    assert (a[1], s[1], s[2]) == (60, 42, 1)  # cropped to the maxima; the stand-in's one reference frame


def test_padded_flops_with_attention_that_skips_padded_keys():
    """TransformerEngine's fused attention (megatron, te) scores the padded latent queries against
    the real keys only: only the DiT's attention scores and values change, forward, backward and
    recompute."""
    from echobench.train.bench_echo import count_measured
    from echobench.model.flops import padded_flops

    cfg, padded, real_keys = PRESETS["tiny"], (60, 20, 42), 37 + 5 + 4
    dense, skipping = model_flops(cfg, *padded), model_flops(cfg, *padded, dit_keys=real_keys)
    assert {k for k in PARTS if dense.parts[k] != skipping.parts[k]} == {"dit_attention"}
    fwd = cfg.layers * 2 * 2 * 60 * (60 + 20 + 11 - real_keys) * cfg.width
    assert dense.parts["dit_attention"].forward - skipping.parts["dit_attention"].forward == fwd
    for ac, passes in (("none", 3), ("full", 4)):  # forward, 2x backward (and the forward again)
        assert padded_flops(cfg, *padded, ac) - padded_flops(cfg, *padded, ac, real_keys) == passes * fwd
    counts = count_measured(cfg, "none", [([37], [5], [13])], [padded], real_keys_only=True)
    assert counts["padded_flops"] == padded_flops(cfg, *padded, "none", real_keys)
