"""The plain PyTorch model: parts behave as their names say, the objective trains."""

from types import SimpleNamespace

import pytest
import torch

from echobench.model.components import RMSNorm, apply_rope, rope_frequencies
from echobench.model.config import PRESETS, get_preset
from echobench.model.echo import EchoTTS


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


def test_padding_does_not_change_the_loss(model):
    """Key-padding masks: padded frames, tokens and reference frames are invisible."""
    model.eval()
    batch = tiny_batch(b=1)
    padded = SimpleNamespace(**vars(batch))
    padded.latent = torch.cat([batch.latent, torch.randn(1, 8, 128)], 1)
    padded.latent_mask = torch.cat([batch.latent_mask, torch.zeros(1, 8, dtype=torch.bool)], 1)
    padded.text_ids = torch.cat([batch.text_ids, torch.randint(3, 300, (1, 4))], 1)
    padded.text_mask = torch.cat([batch.text_mask, torch.zeros(1, 4, dtype=torch.bool)], 1)
    padded.ref = torch.cat([batch.ref, torch.randn(1, 8, 128)], 1)
    padded.ref_mask = torch.cat([batch.ref_mask, torch.zeros(1, 8, dtype=torch.bool)], 1)
    for m in model.modules():
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)
    # Compare each stream and the DiT prediction on the real positions.
    text_a = model.text_proj(model.text_encoder(batch.text_ids, batch.text_mask))
    text_b = model.text_proj(model.text_encoder(padded.text_ids, padded.text_mask))
    assert torch.allclose(text_a, text_b[:, :8], atol=1e-5)
    spk_a, mask_a = model.speaker_encoder(batch.ref, batch.ref_mask)
    spk_b, mask_b = model.speaker_encoder(padded.ref, padded.ref_mask)
    assert torch.allclose(spk_a, spk_b[:, : spk_a.shape[1]], atol=1e-5)
    t = torch.full((1,), 0.3)
    x = torch.randn(1, 24, 128)
    xp = torch.cat([x, torch.randn(1, 8, 128)], 1)
    with torch.no_grad():
        out_a = model.dit(x, t, batch.latent_mask, text_a, batch.text_mask, spk_a, mask_a)
        out_b = model.dit(xp, t, padded.latent_mask, text_b, padded.text_mask, spk_b, mask_b)
    assert torch.allclose(out_a, out_b[:, :24], atol=1e-5)


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
