"""A bare PyTorch training loop of the Echo TTS model: the yardstick for echobench's own overhead.

It builds the same model as `echobench run` on the torchtitan backend with parallelism single
(same preset, seed and weights; the frozen text encoder stored in the compute dtype; with
--compile each block compiled the same way), takes ONE batch from the same synthetic source with
the same diffusion draws, moves both to the device once, and then runs nothing but forward,
backward, gradient clipping, the fused AdamW step and zero_grad: no loader, no per-step draws, no
bookkeeping. Each step is timed with CUDA events on the compute stream (the host clock on CPU),
warm-up (and compile) excluded. Its median step time against `echobench run`'s median with the
same settings is the harness's overhead.

  python3 -m tools.device.bare_step --scale 3B --micro-batch 8 --compile --json bare.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from echobench.train.bench import resolve_dtype
from echobench.records.config import RunConfig
from echobench.data import build_tokenizer, make_loader
from echobench.model.echo import EchoTTS, diffusion_draws
from echobench.records.run_figures import step_figures


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="tiny")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--audio-frames", type=int, default=750)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--speaker-frames", type=int, default=750)
    p.add_argument("--compile", action="store_true", help="torch.compile each block, as `echobench run --compile`")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="Write the result here too.")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # The run settings echobench would use: same validation, same model preset.
    cfg = RunConfig(scale=args.scale, micro_batch=args.micro_batch, steps=args.steps, warmup_steps=args.warmup_steps,
                    audio_frames=args.audio_frames, text_tokens=args.text_tokens,
                    speaker_frames=args.speaker_frames, compile=args.compile, seed=args.seed, device=args.device)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = resolve_dtype("auto", device)
    model_cfg = cfg.model_config()

    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = EchoTTS(model_cfg)
    if model_cfg.frozen_encoder:
        model.text_encoder.to(dtype)
    if cfg.compile:
        for container in (model.speaker_encoder.blocks, model.dit.blocks):
            for block in container:
                block.compile(fullgraph=True)
    model.train()
    params = model.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda, foreach=not cuda)

    loader = make_loader("synthetic", micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab), seed=cfg.seed)
    try:
        batch = next(loader).to(device)
    finally:
        loader.close()
    draws = diffusion_draws(cfg.seed, range(cfg.micro_batch), cfg.audio_frames, model_cfg.latent_dim,
                            model_cfg.cfg_dropout, device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(batch, draws=draws)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(cfg.warmup_steps):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    warmup_s = time.perf_counter() - t0

    # Its own loop and timer, not bench.run_loop / StepTimer: a yardstick for the harness must not
    # share the harness's code. Only the statistic is shared (step_figures), so the two compare.
    marks = []

    def mark():
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())

    mark()
    for _ in range(cfg.steps):
        loss = step()
        mark()
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
    else:
        times = [b - a for a, b in zip(marks, marks[1:])]
    result = {
        "kind": "bare",
        "scale": cfg.scale,
        "micro_batch": cfg.micro_batch,
        "compile": cfg.compile,
        "audio_frames": cfg.audio_frames,
        "text_tokens": cfg.text_tokens,
        "speaker_frames": cfg.speaker_frames,
        "precision": str(dtype).removeprefix("torch."),
        "steps": cfg.steps,
        "warmup_steps": cfg.warmup_steps,
        **step_figures(times),
        "step_times_s": times,
        "warmup_s": warmup_s,
        "last_loss": float(loss.detach()),
        "peak_mem_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,  # as the record's
        "peak_mem_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
    }
    print(f"bare {cfg.scale} mb{cfg.micro_batch}{' compile' if cfg.compile else ''}: "
          f"median step {result['step_time_s']:.4f} s over {cfg.steps} steps (warm-up {warmup_s:.1f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
