"""Counts the ATen ops one rank dispatches per training step, by phase, for predict's host-op
table (echobench.predict.HOST_OPS, AC_BACKWARD_OPS): each layout's fixed part and its ops per DiT,
speaker-encoder and text-encoder layer.

The tiny preset is built with 1 or 2 layers of each stack (four models); a step of each is
counted eagerly on the CPU under commbench.count_ops, forward / backward / optimizer apart, and
the per-layer figures solved from the differences. Layouts of several ranks (ddp, fsdp2, megatron
tp2) run as two gloo processes; rank 0's counts are kept.

  python3 tools/count_host_ops.py            # every layout, AC none; then AC full on single
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's echobench

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SHAPE = dict(scale="tiny", device="cpu", micro_batch=3, audio_frames=150, text_tokens=24, speaker_frames=60,
             precision="fp32", compile=False)
# (DiT layers, speaker layers, text-encoder layers) of the four models
VARIANTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]
LAYOUTS = {"single": ("torchtitan", "single", 1), "ddp": ("torchtitan", "ddp", 2),
           "fsdp2": ("torchtitan", "fsdp2", 2), "tp": ("megatron", "tp2", 2)}


def patch_tiny(dit: int, speaker: int, text: int) -> None:
    """The tiny preset with these layer counts (in this process)."""
    from echobench.model import config

    tiny = config.PRESETS["tiny"]
    config.PRESETS["tiny"] = dataclasses.replace(tiny, layers=dit, speaker_layers=speaker,
                                                 text_encoder=dataclasses.replace(tiny.text_encoder, layers=text))


def phase_ops(settings: dict, rank: int, world: int, store: str | None) -> dict[str, int]:
    """Ops per phase of one step (after one warm-up step) of the run `settings` on this rank."""
    from echobench.backends import build_training
    from echobench.calibrate.commbench import count_ops
    from echobench.records.config import RunConfig
    from echobench.data import build_tokenizer, make_loader
    from echobench.train.distributed import DistInfo
    from echobench.model.echo import diffusion_draws

    torch.set_num_threads(1)
    if store is not None:
        torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = RunConfig(**settings, gpus_per_node=world)
    info = DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"))
    setup = build_training(cfg, info, torch.float32)
    model_cfg = cfg.model_config()
    dp = max(1, world // cfg.tp)
    loader = make_loader("synthetic", micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None), rank=rank // cfg.tp,
                         world_size=dp, seed=0)
    from echobench.train.bench_echo import global_frame_count

    counts = {}
    try:
        for counted in (False, True):
            batch = next(loader)
            draws = diffusion_draws(0, batch.index.tolist(), cfg.audio_frames, model_cfg.latent_dim,
                                    model_cfg.cfg_dropout, info.device)
            with count_ops() as forward:
                frames, work = global_frame_count([batch], setup.dp_group)
                err = setup.model(batch, draws=draws, reduction="sum")
                if work is not None:
                    work.wait()
                loss = err / frames.clamp(min=1) * dp
            with count_ops() as backward:
                loss.backward()
            with count_ops() as optimizer:
                setup.clip_grad()
                setup.optimizer.step()
                setup.optimizer.zero_grad(set_to_none=True)
            if counted:
                counts = {"forward": forward.total, "backward": backward.total, "optimizer": optimizer.total}
    finally:
        loader.close()
    return counts


def _worker(rank: int, world: int, store: str, settings: dict, variant: tuple, out: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    patch_tiny(*variant)
    counts = phase_ops(settings, rank, world, store)
    if rank == 0:
        Path(out).write_text(json.dumps(counts))
    torch.distributed.destroy_process_group()


def count(settings: dict, world: int, variant: tuple) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, f"{tmp}/store", settings, variant, f"{tmp}/out.json"), nprocs=world, join=True)
        return json.loads(Path(tmp, "out.json").read_text())


def coefficients(settings: dict, world: int) -> dict[str, tuple[int, int, int, int]]:
    """phase -> (fixed, per DiT layer, per speaker layer, per text-encoder layer)."""
    base, dit, speaker, text = (count(settings, world, v) for v in VARIANTS)
    out = {}
    for phase in base:
        d, s, t = dit[phase] - base[phase], speaker[phase] - base[phase], text[phase] - base[phase]
        out[phase] = (base[phase] - d - s - t, d, s, t)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args()
    table = {}
    for name in args.layouts.split(","):
        framework, parallelism, world = LAYOUTS[name]
        table[name] = coefficients({**SHAPE, "framework": framework, "parallelism": parallelism, "te": "off"}, world)
        print(f"{name}: {table[name]}", flush=True)
    if "single" in table:  # eager selective checkpoints every second block whole: half of full's, per layer
        with_ac = coefficients({**SHAPE, "framework": "torchtitan", "parallelism": "single", "ac": "full"}, 1)
        extra = tuple(with_ac["backward"][i] - table["single"]["backward"][i] for i in (1, 2))
        print(f"AC full: backward ops per DiT / speaker layer {extra}", flush=True)


if __name__ == "__main__":
    main()
