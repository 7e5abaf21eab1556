"""The plain PyTorch model: parts behave as their names say, the objective trains."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from echobench.model import components
from echobench.model.components import KEY_MASKINGS, RMSNorm, apply_rope, key_mask, rope_frequencies
from echobench.model.config import PRESETS, get_preset
from echobench.model.echo import EchoTTS, diffusion_draws


def tiny_batch(b=2, la=24, lt=8, ls=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        latent=torch.randn(b, la, 128, generator=g), latent_mask=torch.ones(b, la, dtype=torch.bool),
        ref=torch.randn(b, ls, 128, generator=g), ref_mask=torch.ones(b, ls, dtype=torch.bool),
        text_ids=torch.randint(3, 300, (b, lt), generator=g), text_mask=torch.ones(b, lt, dtype=torch.bool),
    )


@pytest.fixture
def model():
    torch.manual_seed(0)
    return EchoTTS(PRESETS["tiny"])


def test_rmsnorm_normalises_rms():
    x = torch.randn(4, 16) * 7 + 3
    y = RMSNorm(16)(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(4), atol=1e-3)


def test_rope_is_a_rotation_that_encodes_relative_position():
    freqs = rope_frequencies(8, 16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    rq = apply_rope(q.expand(1, 1, 8, 16), freqs)
    rk = apply_rope(k.expand(1, 1, 8, 16), freqs)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1).expand(1, 1, 8), atol=1e-5)
    dots = (rq[0, 0] @ rk[0, 0].T)
    # Same offset, same score: (2,0) vs (5,3).
    assert torch.allclose(dots[2, 0], dots[5, 3], atol=1e-4)


def test_training_step_lowers_loss_and_leaves_encoder_frozen(model):
    batch = tiny_batch()
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=3e-3)
    encoder_before = [p.clone() for p in model.text_encoder.parameters()]
    losses = []
    for step in range(12):
        g = torch.Generator().manual_seed(1)  # same noise every step: the loss must fall
        loss = model(batch, generator=g)
        loss.backward()
        assert all(p.grad is None for p in model.text_encoder.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert all(torch.equal(a, b) for a, b in zip(encoder_before, model.text_encoder.parameters()))
    assert model.text_encoder.encoder.training is False


def test_every_trainable_part_gets_gradients(model):
    # AdaLN up-projections start at zero (identity blocks); perturb them so gradients reach every part.
    for m in model.modules():
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)
    model.cfg = model.cfg.__class__(**{**model.cfg.__dict__, "cfg_dropout": 0.0})
    model(tiny_batch()).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)]
    assert missing == []


def perturb_adaln(model):
    # AdaLN up-projections start at zero (identity blocks); perturb them so that every path matters.
    for m in model.modules():
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)


def dit_keys(model, latent_mask, text_mask, speaker_mask, masking):
    return key_mask(torch.cat([latent_mask, text_mask, speaker_mask], 1), latent_mask.shape[1], masking)


@pytest.mark.parametrize("masking", KEY_MASKINGS)
def test_padding_does_not_change_the_output(model, masking):
    """Padded frames, tokens and reference frames are invisible, through either key masking."""
    model.eval()
    perturb_adaln(model)
    batch = tiny_batch(b=1)
    padded = SimpleNamespace(**vars(batch))
    padded.latent = torch.cat([batch.latent, torch.randn(1, 8, 128)], 1)
    padded.latent_mask = torch.cat([batch.latent_mask, torch.zeros(1, 8, dtype=torch.bool)], 1)
    padded.text_ids = torch.cat([batch.text_ids, torch.randint(3, 300, (1, 4))], 1)
    padded.text_mask = torch.cat([batch.text_mask, torch.zeros(1, 4, dtype=torch.bool)], 1)
    padded.ref = torch.cat([batch.ref, torch.randn(1, 8, 128)], 1)
    padded.ref_mask = torch.cat([batch.ref_mask, torch.zeros(1, 8, dtype=torch.bool)], 1)
    # Each stream and the DiT prediction on the real positions: the unpadded batch with no mask
    # at all, the padded one with its masks.
    with torch.no_grad():
        text_a = model.text_proj(model.text_encoder(batch.text_ids, batch.text_mask, padded=False))
        text_b = model.text_proj(model.text_encoder(padded.text_ids, padded.text_mask, padded=True))
        assert torch.allclose(text_a, text_b[:, :8], atol=1e-5)
        spk_a, mask_a = model.speaker_encoder(batch.ref, batch.ref_mask, padded=False)
        spk_b, mask_b = model.speaker_encoder(padded.ref, padded.ref_mask, padded=True, masking=masking)
        assert torch.allclose(spk_a, spk_b[:, : spk_a.shape[1]], atol=1e-5)
        t = torch.full((1,), 0.3)
        x = torch.randn(1, 24, 128)
        xp = torch.cat([x, torch.randn(1, 8, 128)], 1)
        out_a = model.dit(x, t, text_a, spk_a, None)
        out_b = model.dit(xp, t, text_b, spk_b, dit_keys(model, padded.latent_mask, padded.text_mask, mask_b, masking))
    assert torch.allclose(out_a, out_b[:, :24], atol=1e-5)


def padded_dit_inputs(b=3, la=40, lt=12, ls=24, device="cpu"):
    """DiT inputs with samples padded differently in every stream, one with its conditioning
    dropped: keys [latent | text | speaker] with gaps, each stream padded on its own."""
    lengths = torch.tensor([[40, 12, 6], [17, 5, 3], [29, 0, 0]], device=device)  # latent, text, speaker patches
    masks = (torch.arange(la, device=device) < lengths[:, :1], torch.arange(lt, device=device) < lengths[:, 1:2],
             torch.arange(ls // 4, device=device) < lengths[:, 2:])
    g = torch.Generator(device).manual_seed(0)
    x, t = torch.randn(b, la, 128, device=device, generator=g), torch.rand(b, device=device, generator=g)
    text = torch.randn(b, lt, 64, device=device, generator=g)
    speaker = torch.randn(b, ls // 4, 64, device=device, generator=g)
    return x, t, text, speaker, masks


def test_flex_and_dense_masks_give_the_same_outputs(model):
    """FlexAttention's block mask from the key mask equals SDPA with the dense mask (forward: torch
    has no FlexAttention backward on the CPU; tests/test_gpu.py holds the gradients on a GPU)."""
    perturb_adaln(model)
    x, t, text, speaker, masks = padded_dit_inputs()
    with torch.no_grad():
        dense, flex = (model.dit(x, t, text, speaker, dit_keys(model, *masks, masking)) for masking in KEY_MASKINGS)
    assert torch.allclose(dense[masks[0]], flex[masks[0]], atol=1e-5)


def test_a_batch_without_padding_attends_without_a_mask_and_matches_the_masked_step(model):
    """A full-length batch whose samples all keep their conditioning takes no mask anywhere, and
    its loss and gradients equal those of the same step with (all-true) dense masks."""
    from echobench.data.dataset import Padding

    perturb_adaln(model)
    full = SimpleNamespace(**vars(tiny_batch(b=2)), padding=Padding(latent=False, text=False, speaker=False))
    draws = diffusion_draws(0, [0, 1], 24, 128, 0.0, torch.device("cpu"))
    assert model.attention_paths(full.padding, False, 8) == {"dit": "none", "speaker_encoder": "none",
                                                             "text_encoder": "none"}
    seen = []
    real = components.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append(attn_mask is None)
        return real(q, k, v, attn_mask=attn_mask, **kw)

    results = []
    for batch in (full, SimpleNamespace(**{**vars(full), "padding": Padding()})):
        model.zero_grad()
        seen.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(components.F, "scaled_dot_product_attention", spy)
            loss = model(batch, draws=draws)
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.trainable_parameters()], list(seen)))
    (loss_a, grads_a, seen_a), (loss_b, grads_b, seen_b) = results
    assert seen_a and all(seen_a)  # every DiT and speaker attention without a mask
    assert seen_b and not any(seen_b)
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads_a, grads_b))


def test_a_dropped_conditioning_or_any_padding_masks_the_dit(model):
    from echobench.data.dataset import Padding

    none = Padding(latent=False, text=False, speaker=False)
    assert model.attention_paths(none, True, 8)["dit"] == "dense"  # a sample dropped its conditioning
    for stream in ("latent", "text", "speaker"):
        paths = model.attention_paths(Padding(**{**vars(none), stream: True}), False, 8)
        assert paths["dit"] == "dense"
        assert (paths["speaker_encoder"] == "dense") == (stream == "speaker")
        assert (paths["text_encoder"] == "dense") == (stream == "text")
    # The text encoder's sliding window (512 tokens) needs a mask beyond it, padded or not.
    assert model.attention_paths(none, False, 600)["text_encoder"] == "dense"


def test_collate_knows_which_streams_are_padded():
    from echobench.data import build_tokenizer, collate

    tok = build_tokenizer(512)
    full = {"latent": np.zeros((20, 128), np.float16), "ref": np.zeros((13, 128), np.float16),
            "text": "x" * 40}
    batch = collate([full, full], tok, audio_frames=20, text_tokens=8, speaker_frames=13)
    # 13 reference frames pad to 16 (4 patches): the last patch is partial, not padding.
    assert (batch.padding.latent, batch.padding.text, batch.padding.speaker) == (False, False, False)
    short = {**full, "latent": full["latent"][:15], "ref": full["ref"][:8], "text": "x"}
    batch = collate([full, short], tok, audio_frames=20, text_tokens=8, speaker_frames=13)
    assert (batch.padding.latent, batch.padding.text, batch.padding.speaker) == (True, True, True)
    assert batch.to("cpu").padding == batch.padding


def test_cfg_dropout_removes_conditioning(model):
    for m in model.modules():
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)
    outputs = []
    model.dit.register_forward_hook(lambda mod, args, out: outputs.append(out))
    batch = tiny_batch(b=1)
    other = tiny_batch(b=1, seed=5)
    batch2 = SimpleNamespace(**{**vars(batch), "text_ids": other.text_ids, "ref": other.ref})

    def predictions(dropout):
        model.cfg = model.cfg.__class__(**{**model.cfg.__dict__, "cfg_dropout": dropout})
        outputs.clear()
        with torch.no_grad():
            model(batch, generator=torch.Generator().manual_seed(0))
            model(batch2, generator=torch.Generator().manual_seed(0))
        return outputs

    a, b = predictions(1.0)
    assert torch.allclose(a, b)  # conditioning dropped: text and speaker cannot matter
    c, d = predictions(0.0)
    assert (c - d).abs().max() > 1e-4


def test_null_conditioning_removes_conditioning_without_a_mask():
    """cfg_drop null: a dropped sample's text and speaker streams are zeros, attended: the prediction
    is the same whatever its text and reference, and the DiT attends without a key mask where nothing
    is padded (the masked reference's path is dense, as with cfg_drop mask)."""
    torch.manual_seed(0)
    model = EchoTTS(PRESETS["tiny"], cfg_drop="null")
    for m in model.modules():
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)
    keys = []
    model.dit.register_forward_pre_hook(lambda mod, args: keys.append(args[4]))
    outputs = []
    model.dit.register_forward_hook(lambda mod, args, out: outputs.append(out))
    full = SimpleNamespace(latent=False, text=False, speaker=False)
    batch = SimpleNamespace(**vars(tiny_batch(b=1)), padding=full)
    other = tiny_batch(b=1, seed=5)
    batch2 = SimpleNamespace(**{**vars(batch), "text_ids": other.text_ids, "ref": other.ref})
    dropped = diffusion_draws(0, [0], 24, 128, 1.0, torch.device("cpu"))
    with torch.no_grad():
        model(batch, draws=dropped)
        model(batch2, draws=dropped)
    assert torch.allclose(outputs[0], outputs[1]) and keys == [None, None]
    assert model.attention_paths(full, True, 8)["dit"] == "none"
    assert EchoTTS(PRESETS["tiny"]).attention_paths(full, True, 8)["dit"] == "dense"
    with pytest.raises(ValueError, match="unknown cfg_drop 'zero': allowed mask, null"):
        EchoTTS(PRESETS["tiny"], cfg_drop="zero")


def test_text_encoder_is_the_transformers_t5gemma2_tower():
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2TextEncoder

    model = EchoTTS(PRESETS["tiny"])
    assert isinstance(model.text_encoder.encoder, T5Gemma2TextEncoder)
    with torch.device("meta"):
        big = EchoTTS(get_preset("800M"))
    assert big.text_encoder.encoder.config.hidden_size == 640
    assert big.text_encoder.encoder.config.num_hidden_layers == 18


def test_unknown_scale_and_encoder_are_clear_errors():
    with pytest.raises(ValueError, match="unknown scale 'XL'.*tiny, 800M, 3B, 8B"):
        get_preset("XL")
    with pytest.raises(ValueError, match="unknown encoder_model"):
        get_preset("tiny", "bert")
