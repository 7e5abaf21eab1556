"""Synthetic samples in the training format, with a realistic spread of lengths: the shards of
`echobench data synth`, and the samples of `data: synthetic` with `synthetic_lengths: drawn`.

Latents are random (throughput does not depend on their values); what matters for a benchmark of
padded data is the shape of the data: clipped log-normal durations (LENGTHS), text length roughly
proportional to duration, and reference clips of their own length.
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .format import FRAME_RATE, LATENT_DIM
from .writer import write_shard

MIN_SECONDS = 2.0


@dataclass(frozen=True)
class Lengths:
    """The distribution of a synthetic sample's lengths: audio seconds log-normal (median, sigma),
    reference seconds log-normal, both clipped to [MIN_SECONDS, the maximum]; text characters at
    chars_per_second of the audio times a log-normal factor (median 1, text_sigma)."""

    median_s: float = 8.0
    sigma: float = 0.6
    ref_median_s: float = 10.0
    ref_sigma: float = 0.5
    chars_per_second: float = 14.0  # typical read-speech rate
    text_sigma: float = 0.15


LENGTHS = Lengths()
WORDS = (
    "the a and of to in is it that was for on are with as they be at one have this from or had by "
    "but some what there we can out other were all your when up use word how said an each she "
    "which do their time if will way about many then them would write like so these her long make "
    "thing see him two has look more day could go come did my sound no most number who over know "
    "water than call first people may down side been now find any new work part take get place "
    "made live where after back little only round man year came show every good me give our under "
    "name very through just form much great think say help low line before turn cause same mean "
    "differ move right boy old too does tell sentence set three want air well also play small end "
    "put home read hand port large spell add even land here must big high such follow act why ask "
    "men change went light kind off need house picture try us again animal point mother world near"
).split()


def _lognormal_seconds(rng, median: float, sigma: float, max_seconds: float) -> float:
    return float(np.clip(rng.lognormal(np.log(median), sigma), MIN_SECONDS, max_seconds))


def _text(rng, num_chars: int) -> str:
    """Random words up to about num_chars, as one or two speaker turns."""
    words, length = [], 0
    while length < num_chars:
        w = WORDS[rng.integers(len(WORDS))]
        words.append(w)
        length += len(w) + 1
    text = "[S1] " + " ".join(words)
    if len(words) > 8 and rng.random() < 0.25:  # some samples are a two-speaker exchange
        cut = int(rng.integers(4, len(words) - 3))
        text = "[S1] " + " ".join(words[:cut]) + " [S2] " + " ".join(words[cut:])
    return text


def synth_sample(rng, key: str, max_seconds: float = 30.0, lengths: Lengths = LENGTHS) -> dict:
    seconds = _lognormal_seconds(rng, lengths.median_s, lengths.sigma, max_seconds)
    frames = max(1, round(seconds * FRAME_RATE))
    ref_frames = max(1, round(_lognormal_seconds(rng, lengths.ref_median_s, lengths.ref_sigma, max_seconds)
                              * FRAME_RATE))
    num_chars = max(4, round(seconds * lengths.chars_per_second * rng.lognormal(0.0, lengths.text_sigma)))
    return {
        "key": key,
        "latent": rng.standard_normal((frames, LATENT_DIM), dtype=np.float32).astype(np.float16),
        "ref": rng.standard_normal((ref_frames, LATENT_DIM), dtype=np.float32).astype(np.float16),
        "text": _text(rng, num_chars),
        "target_duration": frames / FRAME_RATE,
    }


def shard_samples(seed: int, shard: int, count: int, max_seconds: float = 30.0):
    """The samples of shard `shard` of synth_shards(seed=seed, max_seconds=max_seconds), drawn in order."""
    rng = np.random.default_rng([seed, shard])  # per-shard stream: shards don't depend on count
    return (synth_sample(rng, f"s{shard:06d}-{i:06d}", max_seconds) for i in range(count))


def synth_shards(out_dir, num_shards: int, samples_per_shard: int, seed: int = 0,
                 max_seconds: float = 30.0) -> list[Path]:
    """Write shard-000000.tar ... into out_dir; the same seed gives the same shards."""
    if max_seconds < MIN_SECONDS:
        raise ValueError(f"max_seconds={max_seconds} is below the {MIN_SECONDS} s minimum")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        paths.append(write_shard(out_dir / f"shard-{shard:06d}.tar",
                                 shard_samples(seed, shard, samples_per_shard, max_seconds)))
    return paths
