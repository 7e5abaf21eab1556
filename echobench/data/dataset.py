"""From shards to padded batches: LocalTarDataset, SyntheticSource, collate and BatchLoader.

A sample is a dict: key, latent (T,128) float16 ndarray, ref (T',128) float16 ndarray, text,
target_duration (seconds), shard. Batches have static shapes (padded to the configured maxima) so
that torch.compile and tensor-parallel layouts see one shape; FLOPs are counted on the real lengths.
"""
import bisect
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

from .format import FRAME_RATE, LATENT_DIM, DataError, iter_shard
from .buckets import boundaries, rank_stream
from .index import CACHE_HINT, ensure_index, index_command, read_records, read_slots
from .synth import MIN_SECONDS, WORDS, shard_samples
from .tokenizer import TextTokenizer

log = logging.getLogger(__name__)
SPEAKER_PATCH = 4  # the speaker encoder folds 4 reference frames into one token
DRAWN_POOL = 512  # synthetic samples of drawn lengths: enough for the distribution's spread and buckets


@dataclass(frozen=True)
class Padding:
    """Which streams of a batch have padded positions, the speaker stream counted in the speaker
    encoder's patches: known on the host when the batch is made (collate), so that the step picks
    an attention without a mask where none is needed, with no device sync."""

    latent: bool = True
    text: bool = True
    speaker: bool = True


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
    index: torch.Tensor  # (B,) int64: each sample's global index (the diffusion draws are keyed by it)
    padding: Padding = Padding()  # on the host

    @property
    def size(self) -> int:
        return self.latent.shape[0]

    def _map(self, fn) -> "Batch":
        return Batch(**{f.name: fn(v) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                        for f in fields(self)})

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
    """Crop each sample to the maximum lengths and pad to exactly those maxima (static shapes); a
    bucketed batch's audio to its bucket (the samples' pad_frames, one per batch)."""
    B = len(samples)
    audio_frames = min(audio_frames, samples[0].get("pad_frames", audio_frames)) if samples else audio_frames
    # The speaker encoder patches by 4, so its padded length is rounded up to a multiple of 4;
    # the reference itself is still cropped to speaker_frames (ref_len <= speaker_frames).
    ref_padded = -(-speaker_frames // SPEAKER_PATCH) * SPEAKER_PATCH
    # np.zeros is lazily zeroed memory (torch.zeros would fill it, on several threads).
    latent = torch.from_numpy(np.zeros((B, audio_frames, LATENT_DIM), np.float32))
    ref = torch.from_numpy(np.zeros((B, ref_padded, LATENT_DIM), np.float32))
    text_ids = np.full((B, text_tokens), tokenizer.pad_id, np.int64)
    audio_len, ref_len, text_len = (np.zeros(B, np.int64) for _ in range(3))
    index = np.array([s.get("index", -1) for s in samples], np.int64)  # -1: a sample from nowhere
    for i, s in enumerate(samples):
        a = s["latent"][:audio_frames]
        r = s["ref"][:speaker_frames]
        t = tokenizer.encode(s["text"])[:text_tokens]
        _copy_rows(latent[i], a)
        _copy_rows(ref[i], r)
        text_ids[i, : len(t)] = t
        audio_len[i], ref_len[i], text_len[i] = len(a), len(r), len(t)
    # A partial last patch still counts as the reference's (SpeakerEncoder): padding in patches.
    padding = Padding(latent=bool((audio_len < audio_frames).any()), text=bool((text_len < text_tokens).any()),
                      speaker=bool((-(-ref_len // SPEAKER_PATCH) < ref_padded // SPEAKER_PATCH).any()))
    audio_len, latent_mask = _lengths_mask(audio_len, audio_frames)
    ref_len, ref_mask = _lengths_mask(ref_len, ref_padded)
    text_len, text_mask = _lengths_mask(text_len, text_tokens)
    return Batch(latent, latent_mask, ref, ref_mask, torch.from_numpy(text_ids), text_mask,
                 audio_len, ref_len, text_len, torch.from_numpy(index), padding)


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
    """Streams samples from local tar shards in one global order; each rank takes its slice.

    The global order is the same for every layout: shards in an order shuffled per epoch with
    shuffle_seed (else sorted), samples in shard order, epoch after epoch; a sample's position in
    this stream is its global index (kept in sample["index"]: the diffusion draws are keyed by it).
    The stream is cut into global batches of micro_batch x world_size samples and rank r takes the
    r-th micro-batch of each, so 2 ranks x micro-batch B read exactly the samples of 1 rank x
    micro-batch 2B, step by step. DataLoader workers deal a rank's samples round-robin (its i-th
    to worker i mod workers), the order in which a DataLoader takes items from its workers: the
    rank gets its samples in global order with or without workers.

    Each shard's index (echobench.data.index; built here where missing or stale and it can be
    written) gives its sample count and each sample's member offsets: a reader numbers every sample
    without reading a shard and seeks straight to its own samples, so its CPU per own sample does
    not grow with the number of readers. A shard without an index (damaged, or nowhere to write
    one; said once in the log), or every shard with use_index=False, is read by walking its tar
    headers, numbering the samples alike but paying for every other reader's samples.

    With batching="bucket" (echobench.data.buckets) the same global stream is regrouped by audio
    length, window by window, into global batches of a few static shapes: the lengths come from the
    indexes (every shard needs one), so every reader computes the same bucketed order; each sample
    carries "pad_frames", the audio length its batch is padded to (collate).

    A bad sample or shard raises DataError, or with skip_bad_samples=True is counted in
    self.skipped (per process: each DataLoader worker counts its own) and replaced by a stand-in
    (STAND_IN, no audio frames), so that nothing after it moves: step k of every layout trains on
    global batch k less its bad samples, and the stand-in adds nothing to the loss or the FLOPs.
    """

    def __init__(self, data_dir_or_shard_list, rank: int = 0, world_size: int = 1,
                 micro_batch: int = 1, shuffle_seed: int | None = None,
                 skip_bad_samples: bool = False, loop: bool = True, use_index: bool = True,
                 batching: str = "pad", buckets: list[int] | None = None, audio_frames: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
        self.shards = find_shards(data_dir_or_shard_list)
        self.rank, self.world_size, self.micro_batch = rank, world_size, micro_batch
        self.shuffle_seed, self.skip_bad_samples, self.loop = shuffle_seed, skip_bad_samples, loop
        self.skipped = 0
        # Here, before DataLoader workers start: they inherit the indexes, and the log says it once.
        self.indexes, self.not_indexed = _open_indexes(self.shards) if use_index else ({}, {})
        self.edges = None  # bucket boundaries (audio frames), with batching="bucket"
        if batching == "bucket":
            self._bucket_lengths(buckets, audio_frames)
        elif batching != "pad":
            raise ValueError(f"batching={batching!r}: pad or bucket")

    def _bucket_lengths(self, buckets, audio_frames):
        """Every sample's audio frames, from the indexes (here, once: workers inherit them), and the
        bucket boundaries: the given ones, else quantiles of these lengths."""
        if audio_frames is None:
            raise ValueError("batching=bucket needs audio_frames (the last bucket)")
        missing = [s for s in self.shards if s not in self.indexes]
        if missing:
            raise DataError(self._no_lengths(missing))
        self.lengths = {s: np.array([r.get("frames") or 0 for r in read_records(self.indexes[s])], np.int64)
                        for s in self.shards}
        self.total = int(sum(len(v) for v in self.lengths.values()))
        if self.total == 0:
            raise DataError(f"{len(self.shards)} shard(s) hold no samples")
        self.edges = boundaries(np.concatenate(list(self.lengths.values())).tolist(), audio_frames, buckets)

    def _no_lengths(self, missing: list) -> str:
        """Why bucketing cannot start, and the fix: a damaged or unreadable shard gets no index, so
        `data index` cannot help there (such a shard is named first); another shard's can be written."""
        why = "batching=bucket reads the samples' lengths from the shards' indexes"
        of = f"{len(missing)} of {len(self.shards)} shards without one"
        status_of = {s: self.not_indexed.get(s, (None, ""))[0] for s in missing}
        if damaged := [s for s in missing if status_of[s] == "damaged"]:
            return (f"{why}, and a damaged shard has none ({of}): {self.not_indexed[damaged[0]][1]}: replace or "
                    f"remove that shard (or use batching=pad, where --skip-bad-samples skips its bad samples)")
        if unreadable := [s for s in missing if status_of[s] == "unreadable"]:
            return (f"{why}, and a shard cannot be read ({of}): {self.not_indexed[unreadable[0]][1]} (or remove "
                    f"it from {unreadable[0].parent})")
        return (f"{why}, and {missing[0]} has none ({of}): run {index_command(missing[0])} where it can write "
                f"(or {CACHE_HINT}), or use batching=pad")

    def _skip(self, err: DataError):
        self.skipped += 1
        if self.skipped <= 10:
            log.warning("skipping bad sample (%d so far): %s", self.skipped, err)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.samples(workers, worker)

    def samples(self, workers: int = 1, worker: int = 0):
        """This reader's samples as DataLoader worker `worker` of `workers` reads them."""
        if self.edges is not None:
            yield from self._bucketed(workers, worker)
            return
        slice_of = (self.micro_batch * self.world_size, self.rank * self.micro_batch, self.micro_batch,
                    workers, worker)
        mine = functools.partial(_is_mine, *slice_of)
        counts = {s: ix.count for s, ix in self.indexes.items()}  # shard -> samples; walked: once walked
        offset, epoch = 0, 0  # global index of the next shard's first sample
        while True:
            shards = self._shard_order(epoch)
            epoch_start = offset
            for shard in shards:
                count = counts.get(shard)
                own = None if count is None else _own_indices(*slice_of, offset, offset + count)
                if own is None or own:
                    yield from self._read(shard, offset, mine, own, counts)
                offset += counts[shard]
            if not self.loop:
                return
            if offset == epoch_start:  # looping would spin forever
                raise DataError(f"{len(shards)} shard(s) hold no samples in a full pass")
            epoch += 1

    def _shard_order(self, epoch: int) -> list:
        """The shards of an epoch in the global order: shuffled with the seed (the same seed and
        epoch on every reader: the same order), else sorted."""
        shards = list(self.shards)
        if self.shuffle_seed is not None:
            random.Random(f"{self.shuffle_seed}-{epoch}").shuffle(shards)
        return shards

    def _epoch_order(self, epoch: int) -> tuple[list, list[int]]:
        """The shards of an epoch in the global order and the global offset of each within it."""
        shards = self._shard_order(epoch)
        starts, at = [], 0
        for shard in shards:
            starts.append(at)
            at += len(self.lengths[shard])
        return shards, starts

    def _locate(self, g: int, cache: dict) -> tuple[Path, int]:
        """(shard, slot) of global sample g."""
        epoch, within = divmod(g, self.total)
        if epoch not in cache:
            for old in [e for e in cache if e < epoch - 1]:  # windows move forward: a window spans two at most
                del cache[old]
            cache[epoch] = self._epoch_order(epoch)
        shards, starts = cache[epoch]
        j = bisect.bisect_right(starts, within) - 1
        return shards[j], within - starts[j]

    def _bucketed(self, workers: int, worker: int):
        """batching=bucket: this reader's samples of the bucketed stream, window by window."""
        global_batch = self.micro_batch * self.world_size
        orders = {}  # epoch -> its shard order (_locate)

        def length_of(g):
            shard, slot = self._locate(g, orders)
            return int(self.lengths[shard][slot])

        seed = 0 if self.shuffle_seed is None else self.shuffle_seed
        stream = rank_stream(global_batch, self.rank, self.micro_batch, length_of, self.edges, seed,
                             end=None if self.loop else self.total)
        for local, (g, frames) in enumerate(stream):  # the rank's samples, dealt round-robin to workers
            if local % workers == worker:
                shard, slot = self._locate(g, orders)
                yield from self._read_one(shard, slot, g, frames)

    def _read_one(self, shard, slot: int, g: int, pad_frames: int):
        """One sample of the bucketed stream (a stand-in for a bad one, as in _read)."""
        given = False
        for _, item in read_slots(self.indexes[shard], [slot]):
            if isinstance(item, DataError):
                if not self.skip_bad_samples:
                    raise item
                self._skip(item)
                if given:  # damage after the whole sample: it keeps its slot
                    continue
                item = STAND_IN
            given = True
            yield {**item, "index": g, "shard": str(shard), "pad_frames": pad_frames}

    def _read(self, shard, first: int, mine, own: list[int] | None, counts: dict):
        """This reader's samples of one shard, whose first sample has global index `first`: those
        at global indices `own`, from the index, or found by walking the shard (own None: its
        count is not known yet)."""
        last = -1  # the last slot handed out
        index = self.indexes.get(shard)
        if index is not None:
            items = read_slots(index, [g - first for g in own])
        else:
            counts[shard] = 0
            items = iter_shard(shard, lambda i: mine(first + i))
        for i, item in items:
            if index is None:
                counts[shard] = i + 1
            if item is None:
                continue
            if isinstance(item, DataError):
                if not self.skip_bad_samples:
                    raise item
                self._skip(item)
                if i == last:  # damage after a whole sample: that sample keeps its slot
                    continue
                item = STAND_IN
            last = i
            yield {**item, "index": first + i, "shard": str(shard)}


def _open_indexes(shards) -> tuple[dict, dict]:
    """(shard -> its index, for the shards that have one or get one here; shard -> (status, detail)
    of the others, which are walked: ensure_index's words). Says once what it built and what it walks."""
    indexes, not_indexed, done = {}, {}, {"built": [], "unwritable": [], "damaged": [], "unreadable": []}
    for shard in shards:
        index, status, detail = ensure_index(shard)
        if index is not None:
            indexes[shard] = index
        else:
            not_indexed[shard] = status, detail
        if status != "fresh":
            done[status].append(detail)

    def some(items):
        return items[0] + (f" (and {len(items) - 1} more)" if len(items) > 1 else "")

    walk = "read by walking their tar headers (each reader then pays for every other reader's samples)"
    if done["built"]:
        log.warning("indexed %d of %d shard(s) whose index was missing or out of date: %s; "
                    "%s does this once ahead of a run", len(done["built"]), len(shards), some(done["built"]),
                    index_command(shards[0]))
    if done["unwritable"]:  # the detail says to set ECHOBENCH_CACHE
        first = next(s for s, (status, _) in not_indexed.items() if status == "unwritable")
        log.warning("%d of %d shard(s) have no fresh index and none can be written, %s: %s; or run "
                    "%s where it can write", len(done["unwritable"]), len(shards), walk,
                    some(done["unwritable"]), index_command(first))
    if done["damaged"]:
        log.warning("%d of %d shard(s) are damaged and %s: %s", len(done["damaged"]), len(shards),
                    walk, some(done["damaged"]))
    if done["unreadable"]:
        log.warning("%d of %d shard(s) cannot be read: %s", len(done["unreadable"]), len(shards),
                    some(done["unreadable"]))
    return indexes, not_indexed


def _own_indices(global_batch: int, start: int, micro_batch: int, workers: int, worker: int,
                 lo: int, hi: int) -> list[int]:
    """The global indices in [lo, hi) that _is_mine takes, in order, computed rather than tested
    one by one: the cost follows this reader's samples, not all of them."""
    def before(g):  # how many of the rank's samples have a global index below g
        return g // global_batch * micro_batch + min(max(g % global_batch - start, 0), micro_batch)

    first, end = before(lo), before(hi)  # the rank's local indices [first, end)
    first += (worker - first) % workers  # the worker's first: local index = worker mod workers
    return [k // micro_batch * global_batch + start + k % micro_batch for k in range(first, end, workers)]


def _is_mine(global_batch: int, start: int, micro_batch: int, workers: int, worker: int,
             g: int) -> bool:
    """Whether global sample g is in this rank's slice [start, start + micro_batch) of its global
    batch, and, among the rank's samples, dealt to this worker."""
    pos = g % global_batch - start
    if not 0 <= pos < micro_batch:
        return False
    return (g // global_batch * micro_batch + pos) % workers == worker


# Takes a skipped sample's place in its batch (static shapes): no audio frames, so it adds nothing
# to the loss or the FLOP count; one reference frame and a speaker tag, so that its attention has
# keys. Shared by every stand-in: read-only by convention, like SyntheticSource's samples.
STAND_IN = {"key": None, "latent": np.zeros((0, LATENT_DIM), np.float16),
            "ref": np.zeros((1, LATENT_DIM), np.float16), "text": "[S1]", "target_duration": 0.0}


def _random_latent(rng, frames: int) -> np.ndarray:
    return rng.standard_normal((frames, LATENT_DIM), np.float32).astype(np.float16)


class SyntheticSource:
    """Random samples from memory, with no I/O: takes the data path out of a measurement on purpose.
    A pool of samples is made once and repeated (they are shared: read-only).

    lengths "full": `distinct` samples at the maximum lengths, nothing padded (a synthetic run's MFU
    is the upper bound of padded data's). lengths "drawn": DRAWN_POOL samples whose lengths follow
    synth.LENGTHS (audio clipped to audio_frames), the samples of shard 0 of `echobench data synth`
    with the same seed, padded as collate pads shards, or with batching "bucket" regrouped into the
    buckets a LocalTarDataset makes of them (boundaries from the pool's lengths, as from shards').

    The same global order as LocalTarDataset: the sample at global index g (step * world_size *
    micro_batch + rank * micro_batch + i) is samples[g % len(samples)], the same pool on every rank,
    so 2 ranks x micro-batch B see exactly the samples of 1 rank x micro-batch 2B.
    """

    def __init__(self, audio_frames: int, text_tokens: int, speaker_frames: int, seed: int = 0,
                 distinct: int = 4, rank: int = 0, world_size: int = 1, micro_batch: int = 1,
                 lengths: str = "full", batching: str = "pad", buckets: list[int] | None = None):
        self.rank, self.world_size, self.micro_batch, self.seed = rank, world_size, micro_batch, seed
        self.edges = None  # bucket boundaries (audio frames), with batching="bucket"
        if lengths == "drawn":
            max_seconds = max(MIN_SECONDS, audio_frames / FRAME_RATE)  # collate crops what is longer
            self.samples = [{**s, "shard": "synthetic"} for s in shard_samples(seed, 0, DRAWN_POOL, max_seconds)]
            if batching == "bucket":
                self.edges = boundaries([len(s["latent"]) for s in self.samples], audio_frames, buckets)
            return
        if lengths != "full":
            raise ValueError(f"lengths={lengths!r}: full or drawn")
        if batching != "pad":
            raise ValueError("batching=bucket needs samples of different lengths: synthetic lengths drawn, or shards")
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
        if self.edges is not None:
            stream = rank_stream(self.micro_batch * self.world_size, self.rank, self.micro_batch,
                                 lambda g: len(self.samples[g % len(self.samples)]["latent"]), self.edges, self.seed)
            for g, frames in stream:
                yield {**self.samples[g % len(self.samples)], "index": g, "pad_frames": frames}
            return
        step = 0
        while True:
            first = (step * self.world_size + self.rank) * self.micro_batch
            for g in range(first, first + self.micro_batch):
                yield {**self.samples[g % len(self.samples)], "index": g}
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
    def bucket_frames(self) -> list[int] | None:
        """The audio shapes batches come in with batching=bucket (the source's boundaries), else None."""
        return getattr(getattr(self.source, "dataset", self.source), "edges", None)

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


def make_source(source: str, *, micro_batch: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                skip_bad_samples: bool = False, num_workers: int = 0, audio_frames: int,
                text_tokens: int, speaker_frames: int, batching: str = "pad", buckets: list[int] | None = None,
                synthetic_lengths: str = "full"):
    """This rank's samples in global order: SyntheticSource for "synthetic" (its lengths
    synthetic_lengths), else a LocalTarDataset over a directory of shards, read in num_workers
    DataLoader processes when > 0 (skipped-sample counts then stay in the workers)."""
    if source == "synthetic":
        return SyntheticSource(audio_frames, text_tokens, speaker_frames, seed=seed, rank=rank,
                               world_size=world_size, micro_batch=micro_batch, lengths=synthetic_lengths,
                               batching=batching, buckets=buckets)
    samples = LocalTarDataset(source, rank=rank, world_size=world_size, micro_batch=micro_batch,
                              shuffle_seed=seed, skip_bad_samples=skip_bad_samples, loop=True,
                              batching=batching, buckets=buckets, audio_frames=audio_frames)
    if num_workers > 0:  # in_order (the default): items come from the workers round-robin
        samples = torch.utils.data.DataLoader(samples, batch_size=None, collate_fn=_as_is,
                                              num_workers=num_workers, prefetch_factor=8)
    return samples


def make_loader(source: str, *, micro_batch: int, audio_frames: int, text_tokens: int,
                speaker_frames: int, tokenizer: TextTokenizer, rank: int = 0, world_size: int = 1,
                seed: int = 0, skip_bad_samples: bool = False, prefetch: int = 4,
                num_workers: int = 0, batching: str = "pad", buckets: list[int] | None = None,
                synthetic_lengths: str = "full") -> BatchLoader:
    """A BatchLoader over make_source: this rank's micro-batches of the global batches."""
    samples = make_source(source, micro_batch=micro_batch, rank=rank, world_size=world_size, seed=seed,
                          skip_bad_samples=skip_bad_samples, num_workers=num_workers,
                          audio_frames=audio_frames, text_tokens=text_tokens,
                          speaker_frames=speaker_frames, batching=batching, buckets=buckets,
                          synthetic_lengths=synthetic_lengths)
    collate_fn = functools.partial(collate, tokenizer=tokenizer, audio_frames=audio_frames,
                                   text_tokens=text_tokens, speaker_frames=speaker_frames)
    return BatchLoader(samples, collate_fn, micro_batch, prefetch=prefetch, pin_memory=True)
