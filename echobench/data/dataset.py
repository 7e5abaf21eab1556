"""From shards to padded batches: LocalTarDataset, SyntheticSource, collate and BatchLoader.

A sample is a dict: key, latent (T,128) float16 ndarray, ref (T',128) float16 ndarray, text,
target_duration (seconds), shard. Batches have static shapes (padded to the configured maxima) so
that torch.compile and tensor-parallel layouts see one shape; FLOPs are counted on the real lengths.
"""
import functools
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .format import FRAME_RATE, LATENT_DIM, DataError, read_shard
from .synth import WORDS
from .tokenizer import TextTokenizer

log = logging.getLogger(__name__)
SPEAKER_PATCH = 4  # the speaker encoder folds 4 reference frames into one token


@dataclass
class Batch:
    latent: torch.Tensor  # (B, Ta, 128) float32
    latent_mask: torch.Tensor  # (B, Ta) bool, True on real frames
    ref: torch.Tensor  # (B, Ts, 128) float32
    ref_mask: torch.Tensor  # (B, Ts) bool
    text_ids: torch.Tensor  # (B, Tt) int64
    text_mask: torch.Tensor  # (B, Tt) bool
    audio_len: torch.Tensor  # (B,) int64, real (unpadded) lengths: the FLOP count uses these
    ref_len: torch.Tensor
    text_len: torch.Tensor

    @property
    def size(self) -> int:
        return self.latent.shape[0]

    def _map(self, fn) -> "Batch":
        return Batch(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def to(self, device, non_blocking: bool = True) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        return self._map(lambda t: t.pin_memory())


def _lengths_mask(lengths: np.ndarray, padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.from_numpy(lengths)
    return lengths, torch.arange(padded) < lengths[:, None]


# float16 -> float32 goes through torch (vectorized, several times numpy's speed) in chunks well
# under ATen's parallel grain size (32768 elements): the copy then stays on the calling (prefetch)
# thread instead of starting an OpenMP team there that fights the training loop for cores.
_ROWS_PER_COPY = 16384 // LATENT_DIM


def _copy_rows(dst: torch.Tensor, src: np.ndarray):
    src = torch.from_numpy(src)
    for j in range(0, len(src), _ROWS_PER_COPY):
        k = min(j + _ROWS_PER_COPY, len(src))
        dst[j:k].copy_(src[j:k])


def collate(samples: list[dict], tokenizer: TextTokenizer, audio_frames: int, text_tokens: int,
            speaker_frames: int) -> Batch:
    """Crop each sample to the maximum lengths and pad to exactly those maxima (static shapes)."""
    B = len(samples)
    # The speaker encoder patches by 4, so its padded length is rounded up to a multiple of 4;
    # the reference itself is still cropped to speaker_frames (ref_len <= speaker_frames).
    ref_padded = -(-speaker_frames // SPEAKER_PATCH) * SPEAKER_PATCH
    # np.zeros is lazily zeroed memory (torch.zeros would fill it, on several threads).
    latent = torch.from_numpy(np.zeros((B, audio_frames, LATENT_DIM), np.float32))
    ref = torch.from_numpy(np.zeros((B, ref_padded, LATENT_DIM), np.float32))
    text_ids = np.full((B, text_tokens), tokenizer.pad_id, np.int64)
    audio_len, ref_len, text_len = (np.zeros(B, np.int64) for _ in range(3))
    for i, s in enumerate(samples):
        a = s["latent"][:audio_frames]
        r = s["ref"][:speaker_frames]
        t = tokenizer.encode(s["text"])[:text_tokens]
        _copy_rows(latent[i], a)
        _copy_rows(ref[i], r)
        text_ids[i, : len(t)] = t
        audio_len[i], ref_len[i], text_len[i] = len(a), len(r), len(t)
    audio_len, latent_mask = _lengths_mask(audio_len, audio_frames)
    ref_len, ref_mask = _lengths_mask(ref_len, ref_padded)
    text_len, text_mask = _lengths_mask(text_len, text_tokens)
    return Batch(latent, latent_mask, ref, ref_mask, torch.from_numpy(text_ids), text_mask,
                 audio_len, ref_len, text_len)


def find_shards(data) -> list[Path]:
    """A directory of *.tar shards, one shard file, or a list of shard paths."""
    if isinstance(data, (str, Path)):
        path = Path(data)
        if path.is_file():
            return [path]
        shards = sorted(path.glob("*.tar")) if path.is_dir() else []
        if not shards:
            state = "has no *.tar shards" if path.is_dir() else "does not exist"
            raise DataError(f"data directory {path} {state}; write some with "
                            f"`echobench data synth --out {path}`")
        return shards
    shards = [Path(p) for p in data]
    if not shards:
        raise DataError("empty shard list; write shards with `echobench data synth`")
    return shards


class LocalTarDataset(IterableDataset):
    """Streams samples from local tar shards, split across ranks and DataLoader workers.

    Each (rank, worker) pair is one consumer; all consumers see the same shard order (shuffled per
    epoch with shuffle_seed, else sorted). With at least as many shards as consumers, shards are
    dealt round-robin: each shard is read by one consumer only. With fewer shards, every consumer
    reads every shard and keeps the samples whose index (offset by the shard's position, to spread
    small shards) modulo the number of consumers is its own id; the others are skipped unread.
    Either way every sample goes to exactly one consumer per epoch.

    A bad sample or shard raises DataError, or with skip_bad_samples=True is counted in
    self.skipped (per process: each DataLoader worker counts its own) and skipped.
    """

    def __init__(self, data_dir_or_shard_list, rank: int = 0, world_size: int = 1,
                 shuffle_seed: int | None = None, skip_bad_samples: bool = False,
                 loop: bool = True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.shards = find_shards(data_dir_or_shard_list)
        self.rank, self.world_size = rank, world_size
        self.shuffle_seed, self.skip_bad_samples, self.loop = shuffle_seed, skip_bad_samples, loop
        self.skipped = 0

    def _skip(self, err: DataError):
        self.skipped += 1
        if self.skipped <= 10:
            log.warning("skipping bad sample (%d so far): %s", self.skipped, err)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        consumers, me = self.world_size * workers, self.rank * workers + worker
        on_error = self._skip if self.skip_bad_samples else None
        epoch = 0
        while True:
            shards = list(self.shards)
            if self.shuffle_seed is not None:  # same seed and epoch on every consumer: same order
                random.Random(f"{self.shuffle_seed}-{epoch}").shuffle(shards)
            if len(shards) >= consumers:
                plan = [(shard, None) for shard in shards[me::consumers]]
            else:
                plan = [(shard, functools.partial(_is_mine, pos, consumers, me))
                        for pos, shard in enumerate(shards)]
            count = 0
            for shard, keep in plan:
                for sample in read_shard(shard, keep, on_error):
                    count += 1
                    yield sample
            if not self.loop:
                return
            if count == 0:  # looping would spin forever
                raise DataError(f"consumer {me} of {consumers} (rank {self.rank}, worker {worker}) "
                                f"read no samples from {len(shards)} shard(s) in a full pass")
            epoch += 1


def _is_mine(pos: int, consumers: int, me: int, index: int) -> bool:
    return (pos + index) % consumers == me


def _random_latent(rng, frames: int) -> np.ndarray:
    return rng.standard_normal((frames, LATENT_DIM), np.float32).astype(np.float16)


class SyntheticSource:
    """Full-length random samples from memory, with no I/O: takes the data path out of a
    measurement on purpose. A few samples are made once and repeated (they are shared: read-only).

    The sample at global index g (step * world_size * micro_batch + rank * micro_batch + i) is
    samples[g % distinct], the same pool on every rank: 2 ranks x micro-batch B see exactly the
    samples of 1 rank x micro-batch 2B, so runs of different layouts can be compared step by step.
    """

    def __init__(self, audio_frames: int, text_tokens: int, speaker_frames: int, seed: int = 0,
                 distinct: int = 4, rank: int = 0, world_size: int = 1, micro_batch: int = 1):
        self.rank, self.world_size, self.micro_batch = rank, world_size, micro_batch
        rng = np.random.default_rng(seed)
        self.samples = []
        for i in range(distinct):
            # ~6 characters per token on average fills text_tokens for bytes and BPE tokenizers.
            words = rng.choice(WORDS, size=max(1, text_tokens * 6 // 4))
            self.samples.append({
                "key": f"synthetic-{i}",
                "latent": _random_latent(rng, audio_frames),
                "ref": _random_latent(rng, speaker_frames),
                "text": "[S1] " + " ".join(words),
                "target_duration": audio_frames / FRAME_RATE,
                "shard": "synthetic",
            })

    def __iter__(self):
        step = 0
        while True:
            first = (step * self.world_size + self.rank) * self.micro_batch
            for g in range(first, first + self.micro_batch):
                yield self.samples[g % len(self.samples)]
            step += 1


_END = object()  # the source is exhausted


class BatchLoader:
    """Collates batches from a sample source in a background thread, `prefetch` batches ahead.

    next() only takes a ready batch from the queue, so the time it blocks is the data wait
    (also kept in self.last_wait_s). An exception in the thread is re-raised at next().
    An incomplete last batch is dropped (shapes stay static).
    """

    def __init__(self, source, collate_fn, batch_size: int, prefetch: int = 4,
                 pin_memory: bool = False):
        self.source, self.collate_fn, self.batch_size = source, collate_fn, batch_size
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.last_wait_s = 0.0
        self._queue = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._fill, name="echobench-data", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():  # wake up now and then so close() can stop us
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _fill(self):
        try:
            samples = []
            for sample in self.source:
                if self._stop.is_set():
                    return
                samples.append(sample)
                if len(samples) == self.batch_size:
                    batch = self.collate_fn(samples)
                    samples = []
                    if self.pin_memory:
                        batch = batch.pin_memory()
                    if not self._put(batch):
                        return
            self._put(_END)
        except BaseException as e:  # handed to the consumer, raised at its next()
            self._put(e)

    @property
    def skipped(self) -> int:
        """Bad samples skipped by the source in this process (0 if it does not count them)."""
        return getattr(self.source, "skipped", 0)

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        item = self._queue.get()
        self.last_wait_s = time.perf_counter() - t0
        if item is _END or isinstance(item, BaseException):
            self._done = True
            if item is _END:
                raise StopIteration
            raise item
        return item

    def close(self):
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _as_is(sample):  # DataLoader collate_fn that keeps numpy arrays (module level: picklable)
    return sample


def make_loader(source: str, *, micro_batch: int, audio_frames: int, text_tokens: int,
                speaker_frames: int, tokenizer: TextTokenizer, rank: int = 0, world_size: int = 1,
                seed: int = 0, skip_bad_samples: bool = False, prefetch: int = 4,
                num_workers: int = 0) -> BatchLoader:
    """A BatchLoader over "synthetic" (SyntheticSource) or a directory of shards.

    num_workers > 0 reads shards in that many DataLoader processes (the prefetch thread still
    collates); then skipped-sample counts stay in the workers.
    """
    if source == "synthetic":
        samples = SyntheticSource(audio_frames, text_tokens, speaker_frames, seed=seed, rank=rank,
                                  world_size=world_size, micro_batch=micro_batch)
    else:
        samples = LocalTarDataset(source, rank=rank, world_size=world_size, shuffle_seed=seed,
                                  skip_bad_samples=skip_bad_samples, loop=True)
        if num_workers > 0:
            samples = torch.utils.data.DataLoader(samples, batch_size=None, collate_fn=_as_is,
                                                  num_workers=num_workers, prefetch_factor=8)
    collate_fn = functools.partial(collate, tokenizer=tokenizer, audio_frames=audio_frames,
                                   text_tokens=text_tokens, speaker_frames=speaker_frames)
    return BatchLoader(samples, collate_fn, micro_batch, prefetch=prefetch, pin_memory=True)
