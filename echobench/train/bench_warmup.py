"""What runs before the measured window, so that nothing in it compiles or meets a kernel for the
first time: one forward and backward of every variant of a micro-batch the window can meet, planned
on the host from the run's settings and data before the warm-up steps (echobench.train.bench); and, on a
GPU, the attention kernels each variant runs, from a profiled pass after the window.

A micro-batch's variant decides its graphs and kernels: its audio shape (audio_frames, or its
bucket) and the attention path each part takes (model.echo.attention_paths): the DiT's masked where
any stream has padding or, with cfg_drop mask, a sample drops its conditioning; the speaker
encoder's where the reference has padding; the text encoder's where the text does. Which of them a
run can meet: synthetic samples are known (their batches are collated here); a stream read from
shards may or may not be padded; conditioning is dropped in some micro-batches and not in others
unless cfg_dropout is 0 or 1. Two micro-batches per shape cover every path of every part: one with
each stream at its unpadded length and no sample dropped where the run can meet that, one padded and
dropped where it can.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from echobench.data import LATENT_DIM, collate, make_source
from echobench.data.dataset import SPEAKER_PATCH
from echobench.train.kernels import attention_kernels
from echobench.model.echo import diffusion_draws, loss_frames

STREAMS = ("latent", "text", "speaker")


@dataclass(frozen=True)
class Variant:
    """One kind of micro-batch: its audio shape, which streams have padding, whether a sample drops
    its conditioning."""

    frames: int
    latent: bool
    text: bool
    speaker: bool
    dropped: bool


def stream_options(cfg, tokenizer) -> dict[str, tuple[bool, ...]]:
    """Per stream, whether the run's micro-batches can have it (True) and lack it (False) padded.
    Synthetic data at full length: its few distinct samples repeat in order, so every batch is one
    of the rotations collated here; shards and drawn lengths: both."""
    if cfg.data != "synthetic" or cfg.synthetic_lengths != "full":
        return {s: (False, True) for s in STREAMS}
    samples = make_source("synthetic", micro_batch=cfg.micro_batch, seed=cfg.seed, audio_frames=cfg.audio_frames,
                          text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames).samples
    seen: dict[str, set] = {s: set() for s in STREAMS}
    for start in range(len(samples)):
        batch = collate([samples[(start + i) % len(samples)] for i in range(cfg.micro_batch)], tokenizer,
                        cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames)
        for s in STREAMS:
            seen[s].add(getattr(batch.padding, s))
    return {s: tuple(sorted(v)) for s, v in seen.items()}


def drop_options(cfg) -> tuple[bool, ...]:
    """Whether the run's micro-batches can have a sample that drops its conditioning (True) and lack
    one (False); dropping by null conditioning changes no path (no mask), so it is no variant."""
    p = cfg.model_config().cfg_dropout
    if cfg.cfg_drop == "null" or p <= 0:
        return (False,)
    return (True,) if p >= 1 else (False, True)


def warmup_variants(cfg, shapes: list[int] | None, tokenizer) -> list[Variant]:
    """The micro-batches warm-up runs: per audio shape (the buckets, else audio_frames), the least
    and the most masked variant the run can meet (one where both are the same)."""
    streams, drops = stream_options(cfg, tokenizer), drop_options(cfg)
    out: list[Variant] = []
    for frames in shapes or [cfg.audio_frames]:
        for pick in (min, max):
            v = Variant(frames, *(pick(streams[s]) for s in STREAMS), pick(drops))
            if v not in out:
                out.append(v)
    return out


def variant_micro_batch(cfg, variant: Variant, tokenizer, device: torch.device, generator):
    """A micro-batch of `variant` on the device, and its draws: the first sample one frame, one speaker
    patch and most of its text short of the maxima in each stream that is to be padded, the others
    full; every sample dropping its conditioning or none (dropped). Zero latents (the weights see
    only their shapes before the optimizer steps)."""
    model_cfg = cfg.model_config()
    full_text = "[S1]" + " warm" * (2 * cfg.text_tokens)  # longer than text_tokens in any tokenizer: cropped

    def sample(first: bool) -> dict:
        frames = variant.frames - (variant.latent and first)
        ref = max(1, cfg.speaker_frames - SPEAKER_PATCH) if variant.speaker and first else cfg.speaker_frames
        return {"latent": np.zeros((frames, LATENT_DIM), np.float16), "ref": np.zeros((ref, LATENT_DIM), np.float16),
                "text": "[S1]" if variant.text and first else full_text, "pad_frames": variant.frames, "index": -1}

    batch = collate([sample(i == 0) for i in range(cfg.micro_batch)], tokenizer, cfg.audio_frames, cfg.text_tokens,
                    cfg.speaker_frames)
    draws = diffusion_draws(cfg.seed, [-1] * cfg.micro_batch, variant.frames, model_cfg.latent_dim,
                            1.0 if variant.dropped else 0.0, device, generator)
    return batch.to(device), draws


def forward_backward(setup, batch, draws, device: torch.device) -> None:
    """One forward and backward of a micro-batch, its gradients then dropped (no optimizer step: the
    weights do not move)."""
    with torch.autocast(device.type, dtype=setup.autocast_dtype or torch.float32,
                        enabled=setup.autocast_dtype is not None):
        err = setup.model(batch, draws=draws, reduction="sum")
    (err / loss_frames(batch)).backward()
    setup.optimizer.zero_grad(set_to_none=True)


def warm_variants(setup, cfg, variants: list[Variant], tokenizer, device: torch.device, generator) -> None:
    """Each variant's micro-batch forward and backward, before the warm-up steps. Every rank runs the
    same variants in the same order (their collectives match)."""
    for variant in variants:
        forward_backward(setup, *variant_micro_batch(cfg, variant, tokenizer, device, generator), device)


def variant_label(variant: Variant, paths: dict) -> str:
    """`750 frames: dit flex, speaker_encoder none, text_encoder none`."""
    return f"{variant.frames} frames: " + ", ".join(f"{part} {path}" for part, path in paths.items())


def profile_variants(setup, echo, cfg, variants: list[Variant], tokenizer, device: torch.device,
                     generator) -> dict[str, dict[str, int]]:
    """On a GPU, after the measured window: each variant's micro-batch forward and backward under the
    profiler; per variant (labelled with the attention paths it takes), the attention kernels that ran
    and their launches (kernels.attention_kernels). Every rank runs it (collectives match)."""
    out = {}
    for variant in variants:
        batch, draws = variant_micro_batch(cfg, variant, tokenizer, device, generator)
        paths = echo.attention_paths(batch.padding, bool(not draws.keep.all()), batch.text_ids.shape[1])
        out[variant_label(variant, paths)] = profiled_attention_kernels(
            lambda: forward_backward(setup, batch, draws, device), device)
    return out


def profiled_attention_kernels(run, device: torch.device) -> dict[str, int]:
    """The attention kernels (kernels.attention_kernels) a GPU ran in run() under the profiler."""
    from torch.profiler import ProfilerActivity, profile  # lazy: the profiler's import is slow

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize(device)
    return attention_kernels(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
