"""Synthetic data of drawn lengths (synthetic_lengths drawn): its samples follow the stated
distribution, pad and bucket as shards of the same samples do, and a run's record states the
padding share and attention path mix that its micro-batches had, counted here on their own."""
import json
import math

import numpy as np
import pytest

from echobench.data import FRAME_RATE, LocalTarDataset, collate, make_source, synth_shards
from echobench.data.dataset import DRAWN_POOL, SyntheticSource
from echobench.data.synth import LENGTHS, MIN_SECONDS
from echobench.data.tokenizer import build_tokenizer

AUDIO_FRAMES = 500  # 20 s: the clip at the top matters as well as the one at the bottom


def clipped_lognormal_mean(median: float, sigma: float, low: float, high: float) -> float:
    """E[clip(X, low, high)] for X log-normal (ln X ~ N(ln median, sigma^2))."""
    mu = math.log(median)
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    a, b = (math.log(low) - mu) / sigma, (math.log(high) - mu) / sigma
    inside = math.exp(mu + sigma ** 2 / 2) * (cdf(b - sigma) - cdf(a - sigma))
    return inside + low * cdf(a) + high * (1 - cdf(b))


def test_drawn_lengths_pad_as_their_distribution_implies():
    """Padded to audio_frames (batching pad), the latent's padded share over the pool is 1 - E[frames]
    / audio_frames of the stated clipped log-normal, within the pool's sampling error."""
    source = SyntheticSource(AUDIO_FRAMES, 64, 100, seed=1, lengths="drawn", micro_batch=8)
    frames = np.array([len(s["latent"]) for s in source.samples], float)
    assert len(frames) == DRAWN_POOL and frames.min() >= MIN_SECONDS * FRAME_RATE and frames.max() <= AUDIO_FRAMES
    expected = clipped_lognormal_mean(LENGTHS.median_s, LENGTHS.sigma, MIN_SECONDS, AUDIO_FRAMES / FRAME_RATE)
    share = 1 - expected * FRAME_RATE / AUDIO_FRAMES
    tokenizer = build_tokenizer(512)
    samples = iter(source)
    real = computed = 0
    for _ in range(DRAWN_POOL // 8):  # the pool once, in micro-batches as the loader collates them
        batch = collate([next(samples) for _ in range(8)], tokenizer, AUDIO_FRAMES, 64, 100)
        real += int(batch.audio_len.sum())
        computed += batch.latent.shape[0] * batch.latent.shape[1]
    assert computed == DRAWN_POOL * AUDIO_FRAMES
    error = 4 * frames.std() / math.sqrt(len(frames)) / AUDIO_FRAMES  # 4 standard errors of the pool's mean
    assert abs((1 - real / computed) - share) < error
    assert 0.4 < share < 0.8  # the distribution pads a lot at 20 s: far from synthetic full length (0)


def test_drawn_lengths_bucket_as_shards_of_the_same_samples(tmp_path):
    """batching bucket: the drawn pool is shard 0 of `data synth` with the same seed, and the stream
    (samples, order, padded shapes) is the one a LocalTarDataset makes of that shard."""
    synth_shards(tmp_path, 1, DRAWN_POOL, seed=3, max_seconds=AUDIO_FRAMES / FRAME_RATE)
    kw = dict(micro_batch=4, rank=1, world_size=2, seed=3, audio_frames=AUDIO_FRAMES, text_tokens=64,
              speaker_frames=100, batching="bucket")
    drawn = make_source("synthetic", synthetic_lengths="drawn", **kw)
    shards = make_source(str(tmp_path), **kw)
    assert drawn.edges == shards.edges and len(drawn.edges) == 4
    n = 3 * DRAWN_POOL // 2  # past the pool's end: it repeats, as the shard's epochs do
    ours = [(s["key"], s["index"], s["pad_frames"], len(s["latent"]), s["text"]) for _, s in zip(range(n), drawn)]
    theirs = [(s["key"], s["index"], s["pad_frames"], len(s["latent"]), s["text"]) for _, s in zip(range(n), shards)]
    assert ours == theirs
    # Each sample is padded to the smallest boundary that holds its batch's longest: below audio_frames
    # for most, so a bucketed pass pads less than one shape does.
    assert sum(p for _, _, p, _, _ in ours) < n * AUDIO_FRAMES
    assert all(length <= pad for _, _, pad, length, _ in ours)


def test_full_lengths_cannot_bucket_and_drawn_needs_synthetic(tmp_path):
    from echobench.records.config import RunConfig

    with pytest.raises(ValueError, match="synthetic_lengths drawn"):
        RunConfig(batching="bucket")
    RunConfig(batching="bucket", synthetic_lengths="drawn")
    with pytest.raises(ValueError, match="drop synthetic_lengths"):
        RunConfig(data=str(tmp_path), synthetic_lengths="drawn")


def test_a_run_on_drawn_lengths_records_the_padding_share_and_path_mix_of_its_batches(cli, tmp_path):
    """The record's padded shares and attention path counts are those of the micro-batches the
    window trained on, counted here from the same source: frames, text tokens, and the DiT's path
    (dense where a stream is padded, split where a sample drops its conditioning, else none)."""
    import torch

    from echobench.model.echo import diffusion_draws
    from echobench.records.config import RunConfig

    steps, warmup, mb, seed = 4, 1, 4, 5
    settings = dict(audio_frames=100, text_tokens=24, speaker_frames=40)
    out = tmp_path / "run"
    proc = cli("run", "--scale", "tiny", "--steps", steps, "--warmup-steps", warmup, "--micro-batch", mb,
               "--audio-frames", settings["audio_frames"], "--text-tokens", settings["text_tokens"],
               "--speaker-frames", settings["speaker_frames"], "--seed", seed, "--peak-tflops", "1",
               "--synthetic-lengths", "drawn", "--batching", "bucket", "--out", out)
    assert proc.returncode == 0, proc.stderr
    r = json.loads((out / "result.json").read_text())
    assert r["config"]["synthetic_lengths"] == "drawn" and r["config"]["batching"] == "bucket"

    restarts = r.get("window_restarts") or []
    first = restarts[-1]["first_step"] + steps + 1 if restarts else warmup  # the measured window's first step
    model = RunConfig(scale="tiny").model_config()
    tokenizer = build_tokenizer(model.text_encoder.vocab)
    source = iter(make_source("synthetic", micro_batch=mb, seed=seed, batching="bucket",
                              synthetic_lengths="drawn", **settings))
    batches = [[next(source) for _ in range(mb)] for _ in range(first + steps)][first:]
    frames = [0, 0]  # real, computed
    text = [0, 0]
    paths = {}
    for samples in batches:
        pad = samples[0]["pad_frames"]
        lengths = [min(len(s["latent"]), pad) for s in samples]
        tokens = [min(len(tokenizer.encode(s["text"])), settings["text_tokens"]) for s in samples]
        frames[0] += sum(lengths)
        frames[1] += pad * mb
        text[0] += sum(tokens)
        text[1] += settings["text_tokens"] * mb
        refs = [min(len(s["ref"]), settings["speaker_frames"]) for s in samples]
        padded = (min(lengths) < pad or min(tokens) < settings["text_tokens"]
                  or min(refs) < settings["speaker_frames"])
        draws = diffusion_draws(seed, [s["index"] for s in samples], pad, model.latent_dim, model.cfg_dropout,
                                torch.device("cpu"))
        dropped = not draws.keep.all()
        path = "dense" if padded else "split" if dropped else "none"
        paths[path] = paths.get(path, 0) + 1
    shapes = [b[0]["pad_frames"] for b in batches]
    assert r["bucket_steps"] == {str(f): shapes.count(f) for f in sorted(set(shapes))}
    assert r["padded_frac_latent"] == pytest.approx(1 - frames[0] / frames[1], rel=1e-9)
    assert r["padded_frac_text"] == pytest.approx(1 - text[0] / text[1], rel=1e-9)
    assert r["padded_frac_latent"] > 0  # drawn lengths below the 4 s maximum are padded
    assert r["attention_paths"]["dit"] == paths
