"""Length buckets (`batching: bucket`): a few static audio shapes instead of one, so that a batch
of short clips is not padded to the longest clip the run allows.

The bucketed stream is a function of the global sample stream and the samples' lengths only (read
from the shards' index, never from a rank's own reads), so every layout trains on the same global
batches in the same order, as with `pad`: the stream is cut into windows of WINDOW_BATCHES global
batches; within a window the samples are stably sorted by bucket and cut into global batches
again, whose order is shuffled with the run's seed (a benchmark's few steps see every bucket, not
the short ones first). A global batch is padded to the smallest boundary that holds its longest
sample: every rank of every layout pads its part of batch k alike, so losses agree.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterator

WINDOW_BATCHES = 16  # global batches per window: enough to fill buckets, few enough to keep order local
DEFAULT_BUCKETS = 4
ALIGN = 8  # boundaries are multiples of 8 frames (tensor-core and vector friendly shapes)


def boundaries(lengths: list[int], max_frames: int, given: list[int] | None = None,
               count: int = DEFAULT_BUCKETS) -> list[int]:
    """The bucket boundaries of a run: the given ones (cut at max_frames), else `count` quantiles of
    the data's audio lengths, rounded up to ALIGN; the last is always max_frames (the `pad` shape)."""
    if given:
        edges = [b for b in given if b < max_frames]
    else:
        clipped = sorted(min(n, max_frames) for n in lengths)
        edges = []
        for q in range(1, count):
            if clipped:
                at = clipped[min(len(clipped) - 1, math.ceil(q * len(clipped) / count) - 1)]
                edges.append(min(max_frames, -(-at // ALIGN) * ALIGN))
    return sorted({b for b in edges if 0 < b < max_frames}) + [max_frames]


def bucket_of(length: int, edges: list[int]) -> int:
    """The index of the smallest boundary that holds `length` (cropped to the last)."""
    for i, edge in enumerate(edges):
        if length <= edge:
            return i
    return len(edges) - 1


@dataclass(frozen=True)
class GlobalBatch:
    indices: tuple[int, ...]  # global sample indices, in the order ranks take them (rank r: [r*mb, (r+1)*mb))
    frames: int  # the audio length every sample of the batch is padded to


def window(w: int, global_batch: int, length_of: Callable[[int], int], edges: list[int],
           seed: int, end: int | None = None) -> list[GlobalBatch]:
    """The global batches of window w: samples w*W .. (w+1)*W - 1 of the global stream (W =
    WINDOW_BATCHES x global_batch; a finite stream stops at `end`), grouped by bucket, in an order
    shuffled per (seed, w)."""
    size = WINDOW_BATCHES * global_batch
    first = w * size
    last = first + size if end is None else min(first + size, end)
    members = sorted(range(first, last), key=lambda g: bucket_of(length_of(g), edges))  # stable
    size = len(members)
    batches = []
    for k in range(0, size, global_batch):
        chunk = tuple(members[k:k + global_batch])
        batches.append(GlobalBatch(chunk, edges[max(bucket_of(length_of(g), edges) for g in chunk)]))
    random.Random(f"buckets-{seed}-{w}").shuffle(batches)
    return batches


def rank_slice(batch: GlobalBatch, rank: int, micro_batch: int) -> tuple[int, ...]:
    """The samples rank `rank` (of the data-parallel ranks) trains on in `batch`."""
    return batch.indices[rank * micro_batch:(rank + 1) * micro_batch]


def rank_stream(global_batch: int, rank: int, micro_batch: int, length_of: Callable[[int], int],
                edges: list[int], seed: int, end: int | None = None) -> Iterator[tuple[int, int]]:
    """This rank's samples of the bucketed stream, window by window, in order: (global index, the
    audio frames its batch is padded to). A finite stream (end) stops after its last window."""
    w = 0
    while batches := window(w, global_batch, length_of, edges, seed, end):
        for batch in batches:
            for g in rank_slice(batch, rank, micro_batch):
                yield g, batch.frames
        w += 1
