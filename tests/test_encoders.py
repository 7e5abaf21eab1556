"""Swappable text encoders and the trainable-encoder option (FLOPs, parameters, training)."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from echobench.records.config import RunConfig
from echobench.model.flops import model_flops, param_counts
from echobench.model.config import TEXT_ENCODERS, get_preset, get_text_encoder
from echobench.model.echo import EchoTTS
from test_flops import counted_flops, meta_batch

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


RUN_FILES = sorted((Path(__file__).resolve().parent.parent / "matrices" / "runs").glob("*.yaml"))


@pytest.mark.parametrize("path", RUN_FILES, ids=lambda p: p.stem)
def test_shipped_run_files_are_valid_on_four_gpus(path):
    from echobench.backends import parallelism_problem

    settings = yaml.safe_load(path.read_text())
    cfg = RunConfig.from_dict({**settings, "gpus_per_node": 4})
    assert parallelism_problem(cfg) is None
    assert cfg.scale in path.stem.upper() or cfg.scale.lower() in path.stem


def test_run_file_with_overrides_runs_on_cpu(cli, tmp_path):
    import json

    run_file = next(p for p in RUN_FILES if p.stem == "torchtitan-800m-ddp")
    out = tmp_path / "run"
    proc = cli("run", "--config", run_file, "--scale", "tiny", "--nproc", "2", "--steps", "2", "--warmup-steps", "1",
               "--micro-batch", "1", "--precision", "auto", "--audio-frames", "50", "--text-tokens", "16", "--speaker-frames", "40",
               "--encoder-model", "tiny-t5", "--train-encoder", "--peak-tflops", "1", "--out", out, timeout=600)
    record = json.loads((out / "result.json").read_text())
    assert proc.returncode == 0, record["error"]
    # From the file: framework and parallelism; from the flags: scale, sizes, encoder, trainable encoder.
    assert (record["scale"], record["framework"], record["parallelism"], record["world_size"]) == \
        ("tiny", "torchtitan", "ddp", 2)
    assert record["encoder_model"] == "tiny-t5" and record["frozen_encoder"] is False
    assert record["config"]["warmup_steps"] == 1 and record["config"]["precision"] == "auto"
    breakdown = record["flops_breakdown"]
    assert breakdown["frozen_encoder"] is False
    assert breakdown["breakdown"]["parts"]["text_encoder"]["backward"] > 0


@pytest.mark.parametrize("frozen", [True, False])
def test_embedding_without_host_sync_matches_transformers(frozen):
    """echobench's embedding (torch.where, no boolean-mask write) equals transformers' own, the
    end-of-image token included, and so does the encoder's output (and gradient when trained)."""
    from echobench.model.text_encoder import TextEncoder, scaled_word_embedding

    torch.manual_seed(0)
    enc = TextEncoder(TEXT_ENCODERS["tiny"], frozen=frozen)
    embed = enc.encoder.embed_tokens
    embed.eoi_token_index = 7  # inside the tiny vocabulary, so the special row is exercised
    with torch.no_grad():
        embed.eoi_embedding.normal_()
    ids = torch.tensor([[2, 7, 40, 7, 1, 0], [2, 9, 7, 1, 0, 0]])
    mask = ids != 0
    assert torch.equal(scaled_word_embedding(embed, ids), embed(ids))
    assert torch.equal(scaled_word_embedding(embed, ids)[0, 1], embed.eoi_embedding * 1.0)
    out = enc(ids, mask)
    ref = enc.encoder(input_ids=ids, attention_mask=enc.attention_masks(mask, torch.float32)).last_hidden_state
    assert torch.equal(out, ref)
    if not frozen:
        grads = []
        for o in (out, ref):
            enc.zero_grad()
            (o * mask[..., None]).pow(2).sum().backward(retain_graph=True)
            grads.append([p.grad.clone() for p in (embed.weight, embed.eoi_embedding)])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b)
