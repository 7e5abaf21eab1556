"""Echo in the measured loop (echobench.train.bench): the Workload that trains the Echo TTS DiT on the
run's data (synthetic, or shards), its loss over the step's real audio frames, its warm-up variants
(bench_warmup) and the counts of its measured micro-batches.

Model FLOPs are counted on the real lengths of every measured sample; padded FLOPs on every row at
the padded lengths (count_measured).
"""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import torch

from echobench.backends import build_training
from echobench.data import build_tokenizer, make_loader
from echobench.data.dataset import Padding
from echobench.model import flops as flops_model
from echobench.model.echo import diffusion_draws, loss_frames
from echobench.records.config import RunConfig, parse_buckets
from echobench.train.bench_warmup import profile_variants, variant_label, warm_variants, warmup_variants
from echobench.train.kernels import compile_graphs, sdpa_choices, size_recompile_limit
from echobench.train.workload import Normaliser, StepLoss, Workload


class EchoLoss(StepLoss):
    """Echo's loss: a micro-batch (batch, draws) summed over its real frames, over the step's frames
    summed across the replicas (global_frame_count)."""

    def loss_sum(self, model, micro_batch) -> torch.Tensor:
        batch, draws = micro_batch
        return model(batch, draws=draws, reduction="sum")

    def normaliser(self, micro_batches: list, dp_group) -> Normaliser:
        return Normaliser(*global_frame_count([batch for batch, _ in micro_batches], dp_group))


ECHO_LOSS = EchoLoss()


def global_frame_count(batches: list, dp_group):
    """The loss's frame count (loss_frames) of a step's micro-batches summed over the data-parallel
    replicas: started before the forward, which it overlaps; wait() the returned work (None: one
    replica) before using it. The count stays on the device (no .item()), so the step gains no
    host sync."""
    frames = sum(loss_frames(batch) for batch in batches)
    if dp_group is None:
        return frames, None
    return frames, torch.distributed.all_reduce(frames, group=dp_group, async_op=True)


@lru_cache(maxsize=4096)
def _sample_flops(model_cfg, ac: str, la: int, lt: int, ls: int) -> tuple[int, int]:
    f = flops_model.model_flops(model_cfg, la, lt, ls)
    return f.total, flops_model.hardware_flops(model_cfg, f, ac)


@lru_cache(maxsize=4096)
def _padded_row_flops(model_cfg, ac: str, padded: tuple[int, int, int], real_keys: int | None) -> int:
    return flops_model.padded_flops(model_cfg, *padded, ac, real_keys)


def skips_padded_keys(backend_info: dict) -> bool:
    """Whether the DiT's joint attention skips padded keys: TransformerEngine's fused attention
    (megatron with te) reads the key mask as a count of valid keys per sample (model.megatron
    .TECoreAttention); torch SDPA scores every key, masked."""
    return backend_info.get("backend") == "megatron" and bool(backend_info.get("te"))


def count_measured(model_cfg, ac: str, lengths, padded, real_keys_only: bool = False) -> dict:
    """The counts of the measured steps' batches: samples, model and hardware FLOPs on each sample's
    real lengths, padded FLOPs of every row at the padded lengths (flops.padded_flops), audio frames,
    and per stream [real tokens, computed tokens] (flops.stream_tokens).

    lengths: per step, the batch's real (audio, text, reference) lengths, one per row; padded: per
    step, the lengths every row is padded to (audio frames: audio_frames, or the batch's bucket;
    text_tokens; speaker_frames). A stand-in for a
    skipped sample (data.STAND_IN, no audio frames) is no sample: no model FLOPs, no real tokens,
    but its row is computed, so it counts in the padded FLOPs and the computed tokens.
    real_keys_only: skips_padded_keys.
    """
    tokens = {s: [0, 0] for s in flops_model.STREAMS}
    counts = {"samples": 0, "model_flops": 0, "hardware_flops": 0, "padded_flops": 0, "audio_frames": 0}
    for (la, lt, ls), shape in zip(lengths, padded, strict=True):
        row_tokens = flops_model.stream_tokens(model_cfg, *shape)
        for a, t, s in zip(la, lt, ls):
            real = flops_model.stream_tokens(model_cfg, a, t, s)
            counts["padded_flops"] += _padded_row_flops(model_cfg, ac, shape,
                                                        sum(real.values()) if real_keys_only else None)
            for stream, n in row_tokens.items():
                tokens[stream][1] += n
            if a == 0:  # a stand-in for a skipped sample (data.STAND_IN): no work to count
                continue
            m, h = _sample_flops(model_cfg, ac, a, t, s)
            counts["model_flops"] += m
            counts["hardware_flops"] += h
            counts["samples"] += 1
            counts["audio_frames"] += a
            for stream, n in real.items():
                tokens[stream][0] += n
    return {**counts, "tokens": tokens}


def attention_flops_by_path(model_cfg, paths: list[dict], padded: list[tuple]) -> dict[str, dict[str, int]]:
    """Per attention and path, the attention FLOPs of the measured micro-batches that took it (each at
    the shape it was padded to: what its kernel was given, every key counted): the record's shares
    (bench_record.attention_figures)."""
    out: dict[str, Counter] = {}
    for took, shape in zip(paths, padded, strict=True):
        per_sample = _attention_flops(model_cfg, *shape)
        for part, path in took.items():
            out.setdefault(part, Counter())[path] += per_sample[part]
    return {part: dict(c) for part, c in out.items()}


@lru_cache(maxsize=256)
def _attention_flops(model_cfg, la: int, lt: int, ls: int) -> dict[str, int]:
    return flops_model.attention_flops(model_cfg, la, lt, ls)



class EchoWorkload(Workload):
    """Echo at the run's scale, on the run's data."""

    loss = ECHO_LOSS

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.model_cfg = cfg.model_config()
        self.loader = None

    def flops_report(self, ac: str) -> dict:
        cfg = self.cfg
        return flops_model.flops_report(self.model_cfg, cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames, ac)

    def title(self) -> str:
        return self.cfg.scale

    def build(self, info, dtype):
        self.info = info
        return build_training(self.cfg, info, dtype)

    def open(self, setup, dp_rank: int, dp_size: int) -> None:
        cfg, info = self.cfg, self.info
        self.echo = getattr(setup.model, "module", setup.model)  # the EchoTTS inside a DDP wrapper
        self.tokenizer = build_tokenizer(self.model_cfg.text_encoder.vocab, cfg.tokenizer)
        self.loader = make_loader(
            cfg.data, micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames, text_tokens=cfg.text_tokens,
            speaker_frames=cfg.speaker_frames, tokenizer=self.tokenizer, rank=dp_rank, world_size=dp_size,
            seed=cfg.seed, skip_bad_samples=cfg.skip_bad_samples, batching=cfg.batching,
            buckets=parse_buckets(cfg.buckets) if cfg.buckets else None, num_workers=cfg.loader_workers,
            synthetic_lengths=cfg.synthetic_lengths,
        )
        # Eager runs compile too (FlexAttention's kernel, megatron's fused SwiGLU): a graph per shape.
        size_recompile_limit(compile_graphs(self.loader.bucket_frames))
        self.variants = warmup_variants(cfg, self.loader.bucket_frames, self.tokenizer)
        # Every layout reads one global sample order (data.LocalTarDataset); noise, time and CFG draws
        # are a function of (seed, global sample index): the same samples get the same draws whatever
        # the number of ranks (diffusion_draws).
        self.generator = torch.Generator(device=info.device)

    def warmup_label(self) -> str:
        return f"{len(self.variants)} shape(s)"

    def warm_up(self, setup) -> None:
        warm_variants(setup, self.cfg, self.variants, self.tokenizer, self.info.device, self.generator)

    def next_batch(self):
        return next(self.loader)

    def prepare(self, batch):
        """The batch (still on the host) and its draws."""
        cfg, model_cfg = self.cfg, self.model_cfg
        sample_ids = batch.index.tolist()  # still on the host: no device sync
        draws = diffusion_draws(cfg.seed, sample_ids, batch.latent.shape[1], model_cfg.latent_dim,
                                model_cfg.cfg_dropout, self.info.device, self.generator)
        return batch, draws

    def note(self, item):
        """A measured micro-batch's real lengths, the shape it was padded to, the attention path each
        part takes."""
        batch, draws = item
        return ((batch.audio_len.tolist(), batch.text_len.tolist(), batch.ref_len.tolist()),
                (batch.latent.shape[1], batch.text_ids.shape[1], self.cfg.speaker_frames),
                self.echo.attention_paths(batch.padding, not draws.keep.all(), batch.text_ids.shape[1]))

    def to_device(self, item):
        batch, draws = item
        return batch.to(self.info.device), draws

    def profile_kernels(self, setup) -> dict[str, dict[str, int]]:
        return profile_variants(setup, self.echo, self.cfg, self.variants, self.tokenizer, self.info.device,
                                self.generator)

    def figures(self, setup, notes: list, dtype: torch.dtype) -> dict:
        cfg, model_cfg = self.cfg, self.model_cfg
        lengths, padded, took_paths = ([note[i] for note in notes] for i in range(3))
        counts = count_measured(model_cfg, setup.info.get("ac_mode", cfg.ac), lengths, padded,
                                skips_padded_keys(setup.info))
        paths: dict[str, Counter] = {}
        for took in took_paths:
            for part, path in took.items():
                paths.setdefault(part, Counter())[path] += 1
        return {
            **counts,  # samples, model / hardware / padded FLOPs, audio frames, tokens per stream
            "padded_audio_frames": [shape[0] for shape in padded],  # per measured micro-batch: its bucket
            "skipped_samples": getattr(self.loader, "skipped", 0),
            "attention_paths": {part: dict(c) for part, c in paths.items()},
            "attention_flops": attention_flops_by_path(model_cfg, took_paths, padded),
            "sdpa_backends_predicted": sdpa_choices(model_cfg, cfg.micro_batch, max(shape[0] for shape in padded),
                                                    cfg.text_tokens, cfg.speaker_frames, self.info.device,
                                                    setup.autocast_dtype or dtype, tp=cfg.tp,
                                                    paths={p for took in took_paths for p in took.items()},
                                                    te=bool(setup.info.get("te"))),
            "warmup_variants": [variant_label(v, self.echo.attention_paths(Padding(v.latent, v.text, v.speaker),
                                                                           v.dropped, cfg.text_tokens))
                                for v in self.variants],
        }

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
