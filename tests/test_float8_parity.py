"""float8 training keeps parity with bf16: torchao's float8 linears (emulated on the CPU: the same
scaling and float8 rounding of each GEMM's operands, the product in high precision) follow the bf16
run's losses over real steps, and their weight gradients stay near the fp32 reference while showing
float8's coarser rounding, tensorwise and rowwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_master_weights import setup_of, train_losses

pytest.importorskip("torchao")

RECIPES = ("tensorwise", "rowwise")
# The float8 rule's shapes on the tiny model (test_torchtitan's FP8_SHAPE): every float8 GEMM's rows a
# multiple of 16.
FP8_SHAPES = dict(scale="tiny", micro_batch=2, audio_frames=48, text_tokens=16, speaker_frames=32, device="cpu")


def test_float8_keeps_loss_parity_with_bf16():
    """10 steps: each recipe's losses within 1% of bf16's, and it trains. (From Echo's zero-initialised
    gates the float8 GEMMs weigh little in the first steps' loss: the gradient test below is the
    sharper check of their numerics.)"""
    bf16, _ = train_losses(10, 1, FP8_SHAPES, precision="bf16", master_weights="fp32-autocast")
    for recipe in RECIPES:
        fp8, info = train_losses(10, 1, FP8_SHAPES, precision="fp8", float8_recipe=recipe)
        assert info["float8"] == "emulated" and info["float8_linears"] > 0
        gap = np.abs(np.array(fp8) / np.array(bf16) - 1).max()
        assert gap < 0.01, (recipe, gap)
        assert np.mean(fp8[-3:]) < np.mean(fp8[:3])


def weight_grads(**kw) -> tuple[dict[str, torch.Tensor], list[str]]:
    """One micro-batch's weight gradients from weights drawn at random (N(0, 0.05), the same in every
    run: no zero gate), and the names of the float8 linears' weights."""
    from echobench.data import build_tokenizer, make_loader
    from echobench.model.echo import diffusion_draws, loss_frames

    cfg, setup = setup_of(FP8_SHAPES, **kw)
    draw = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in setup.model.trainable_parameters():
            p.copy_(torch.randn(p.shape, generator=draw) * 0.05)
    model_cfg = cfg.model_config()
    loader = make_loader("synthetic", micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None))
    try:
        batch = next(loader)
    finally:
        loader.close()
    draws = diffusion_draws(0, batch.index.tolist(), cfg.audio_frames, model_cfg.latent_dim, model_cfg.cfg_dropout,
                            torch.device("cpu"))
    with torch.autocast("cpu", dtype=setup.autocast_dtype or torch.float32, enabled=setup.autocast_dtype is not None):
        err = setup.model(batch, draws=draws, reduction="sum")
    (err / loss_frames(batch)).backward()
    float8 = [f"{name}.weight" for name, m in setup.model.named_modules() if type(m).__name__ == "Float8Linear"]
    return {n: p.grad.float() for n, p in setup.model.named_parameters() if p.grad is not None}, float8


def test_float8_gemm_gradients_stay_near_the_reference():
    """Per float8 linear, its weight gradient's relative error against fp32's: under 25% (parity),
    and above twice bf16's error in the median (the GEMMs did round their operands to float8)."""
    fp32, _ = weight_grads(precision="fp32")
    bf16, _ = weight_grads(precision="bf16", master_weights="fp32-autocast")

    def errors(grads, names):
        return np.array([float((grads[n] - fp32[n]).norm() / fp32[n].norm()) for n in names])

    for recipe in RECIPES:
        fp8, names = weight_grads(precision="fp8", float8_recipe=recipe)
        assert len(names) == 18, names  # test_torchtitan counts which linears the float8 rule converts
        err, err_bf16 = errors(fp8, names), errors(bf16, names)
        assert err.max() < 0.25, (recipe, dict(zip(names, err)))
        assert np.median(err) > 2 * np.median(err_bf16), (recipe, np.median(err), np.median(err_bf16))
