"""The torchtitan-style backend: the plain model, parallelised from outside.

Single device for now; DDP / FSDP2 / HSDP, compile, activation checkpointing and float8
are applied by small named functions here (see the torchtitan backend issue).
"""

from __future__ import annotations

import torch

from echobench.backends import TrainSetup
from echobench.model.echo import EchoTTS

SUPPORTED = ("single",)


def validate(cfg) -> str | None:
    if cfg.parallelism not in SUPPORTED:
        return f"torchtitan has no parallelism {cfg.parallelism!r}: choose {', '.join(SUPPORTED)}"
    if cfg.parallelism == "single" and cfg.world_size != 1:
        return f"parallelism 'single' runs on one process, not {cfg.world_size}"
    return None


def build_model(cfg, device: torch.device, dtype: torch.dtype) -> EchoTTS:
    torch.manual_seed(cfg.seed)  # same initial weights on every rank and in every backend
    with torch.device(device):
        model = EchoTTS(cfg.model_config(), cfg.encoder_checkpoint)
    if cfg.frozen_encoder:
        # A frozen encoder keeps no fp32 master copy: store it in the compute dtype.
        model.text_encoder.to(dtype)
    return model


def build_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    # fused AdamW on GPU is the fast path torchtitan uses; foreach on CPU.
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fused, foreach=not fused)


def build(cfg, dist_info, dtype: torch.dtype) -> TrainSetup:
    if problem := validate(cfg):
        raise ValueError(problem)
    model = build_model(cfg, dist_info.device, dtype)
    params = model.trainable_parameters()
    optimizer = build_optimizer(params, dist_info.device)
    return TrainSetup(
        model=model,
        optimizer=optimizer,
        clip_grad=lambda: torch.nn.utils.clip_grad_norm_(params, 1.0),
        autocast_dtype=dtype if dtype != torch.float32 else None,
        info={"backend": "torchtitan", "sharding": "none"},
    )
