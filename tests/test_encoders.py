"""Swappable text encoders and the trainable-encoder option (FLOPs, parameters, training)."""

from types import SimpleNamespace

import pytest
import torch

from echobench.config import RunConfig
from echobench.flops import model_flops, param_counts
from echobench.model.config import TEXT_ENCODERS, get_preset, get_text_encoder
from echobench.model.echo import EchoTTS
from tests.test_flops import counted_flops, meta_batch

EXPECTED_HIDDEN = {"t5gemma-2-270m": 640, "t5gemma-2-1b": 1152, "t5gemma-2-4b": 2560, "t5-base": 768, "t5-large": 1024}


@pytest.mark.parametrize("name", list(EXPECTED_HIDDEN))
def test_each_encoder_builds_on_meta_with_its_hidden_size_and_params(name):
    cfg = get_preset("800M", name)
    with torch.device("meta"):
        model = EchoTTS(cfg)
    config = model.text_encoder.encoder.config
    hidden = getattr(config, "hidden_size", None) or config.d_model
    assert hidden == EXPECTED_HIDDEN[name] == cfg.text_encoder.hidden
    assert model.text_proj.in_features == hidden  # the projection follows the encoder
    assert param_counts(cfg).frozen == sum(p.numel() for p in model.text_encoder.parameters())
    assert param_counts(cfg).trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_t5_encoders_are_transformers_t5():
    from transformers import T5EncoderModel

    with torch.device("meta"):
        model = EchoTTS(get_preset("tiny", "t5-base"))
    assert isinstance(model.text_encoder.encoder, T5EncoderModel)
    # Published sizes: t5-base's encoder ~110M with its embedding, t5-large's ~335M.
    assert 105e6 < param_counts(get_preset("tiny", "t5-base")).frozen < 115e6
    assert 330e6 < param_counts(get_preset("tiny", "t5-large")).frozen < 345e6


def test_hub_names_alias_the_text_towers():
    assert get_text_encoder("t5gemma-2-1b-1b") is TEXT_ENCODERS["t5gemma-2-1b"]
    with pytest.raises(ValueError, match="unknown encoder_model 'bert'"):
        get_text_encoder("bert")


@pytest.mark.parametrize("encoder", ["tiny", "tiny-t5"])
@pytest.mark.parametrize("frozen", [True, False])
def test_flop_model_matches_counter_frozen_and_unfrozen(encoder, frozen):
    cfg = get_preset("tiny", encoder, frozen_encoder=frozen)
    with torch.device("meta"):
        model = EchoTTS(cfg)
    total, _ = counted_flops(model, meta_batch(60, 20, 40))
    predicted = model_flops(cfg, 60, 20, 40)
    assert abs(predicted.total - total) / total < 0.01
    enc = predicted.parts["text_encoder"]
    assert enc.backward == (0 if frozen else 2 * enc.forward)


@pytest.mark.parametrize("scale,encoder", [("800M", "t5gemma-2-270m"), ("3B", "t5-large")])
def test_flop_model_matches_counter_full_size_unfrozen(scale, encoder):
    cfg = get_preset(scale, encoder, frozen_encoder=False)
    with torch.device("meta"):
        model = EchoTTS(cfg)
    total, _ = counted_flops(model, meta_batch(750, 256, 750))
    assert abs(model_flops(cfg, 750, 256, 750).total - total) / total < 0.01


@pytest.mark.parametrize("encoder", ["tiny", "tiny-t5"])
@pytest.mark.parametrize("frozen", [True, False])
def test_encoder_weights_change_only_when_unfrozen(encoder, frozen):
    torch.manual_seed(0)
    model = EchoTTS(get_preset("tiny", encoder, frozen_encoder=frozen))
    params = model.trainable_parameters()
    enc_params = list(model.text_encoder.parameters())
    assert all(any(p is q for q in params) for p in enc_params) == (not frozen)
    opt = torch.optim.AdamW(params, lr=1e-2)
    before = [p.detach().clone() for p in enc_params]
    g = torch.Generator().manual_seed(0)
    batch = SimpleNamespace(
        latent=torch.randn(2, 12, 128, generator=g), latent_mask=torch.ones(2, 12, dtype=torch.bool),
        ref=torch.randn(2, 8, 128, generator=g), ref_mask=torch.ones(2, 8, dtype=torch.bool),
        text_ids=torch.randint(3, 300, (2, 6), generator=g), text_mask=torch.ones(2, 6, dtype=torch.bool))
    # AdaLN starts at zero (identity blocks): give the text path a signal to carry on step one.
    for m in model.modules():
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)
    model.cfg = model.cfg.__class__(**{**model.cfg.__dict__, "cfg_dropout": 0.0})
    model(batch, generator=g).backward()
    opt.step()
    changed = [not torch.equal(a, b) for a, b in zip(before, enc_params)]
    if frozen:
        assert not any(changed)
    else:
        assert sum(changed) > len(changed) // 2  # most encoder tensors moved (some, e.g. unused vocab rows' tensors, may not)


def test_mismatched_t5_hidden_dim_is_a_one_line_error():
    with pytest.raises(ValueError) as err:
        RunConfig(scale="tiny", encoder_model="t5-base", t5_hidden_dim=1024)
    message = str(err.value)
    assert "t5_hidden_dim=1024" in message and "768" in message and "\n" not in message
    assert RunConfig(scale="tiny", encoder_model="t5-base", t5_hidden_dim=768).t5_hidden_dim == 768
