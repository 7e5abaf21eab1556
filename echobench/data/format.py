"""The training shard format: plain (uncompressed) tar files of sample triplets.

    KEY.npy       (T, 128) float16  audio latent (DAC-VAE frames, 25 per second)
    KEY.ref.npy   (T', 128) float16 speaker reference latent (its own length)
    KEY.json      {"text": str, "target_duration": seconds}

Members of one sample are stored next to each other (the webdataset convention): the key is the
file name up to its first dot, and a sample ends where the next key begins. iter_shard walks a
shard's tar headers; readers use its index instead (index.py); writer.py writes both.
"""
import io
import json
import tarfile
from typing import Callable, Iterator

import numpy as np

LATENT_DIM = 128  # DAC-VAE latent channels
FRAME_RATE = 25  # DAC-VAE latent frames per second (750 frames = 30 s)
SUFFIXES = ("npy", "ref.npy", "json")  # the members every sample must have
SKIP_HINT = "pass --skip-bad-samples to skip bad samples"


class DataError(Exception):
    """A shard or sample that cannot be read; the message is one line naming shard and key."""


def sample_key(name: str) -> tuple[str, str]:
    """(key, suffix) of a member name: the file name up to its first dot, and the rest."""
    key, _, suffix = name.rsplit("/", 1)[-1].partition(".")
    return key, suffix


def ends_cleanly(f, offset: int) -> bool:
    """Whether an end-of-archive marker (a zero block) is at `offset`: tarfile stops silently at a
    truncated or garbled header, so a walk that ends must check where it ended."""
    f.seek(offset)
    end = f.read(tarfile.BLOCKSIZE)
    return len(end) == tarfile.BLOCKSIZE and end.count(0) == tarfile.BLOCKSIZE


def decode_sample(shard, key: str, members: dict[str, bytes]) -> dict:
    """Turn one key's raw members into a sample dict; raise DataError if one is missing or bad."""
    missing = [f"{key}.{s}" for s in SUFFIXES if s not in members]
    if missing:
        missing = ", ".join(missing)
        raise DataError(f"{shard}: sample {key!r}: missing member {missing} ({SKIP_HINT})")
    try:
        latent = np.load(io.BytesIO(members["npy"]), allow_pickle=False)
        ref = np.load(io.BytesIO(members["ref.npy"]), allow_pickle=False)
        meta = json.loads(members["json"])
        for name, a in (("latent", latent), ("ref", ref)):
            if a.ndim != 2 or a.shape[1] != LATENT_DIM:
                raise ValueError(f"{name} has shape {a.shape}, expected (T, {LATENT_DIM})")
            if len(a) == 0:  # only a stand-in for a skipped sample has no frames (dataset.py)
                raise ValueError(f"{name} has no frames")
        text, duration = meta["text"], float(meta["target_duration"])
        if not isinstance(text, str):
            raise ValueError("'text' is not a string")
    except Exception as e:  # any decode failure becomes a one-line DataError
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{shard}: sample {key!r}: cannot decode ({msg}) ({SKIP_HINT})") from e
    return {"key": key, "latent": latent, "ref": ref, "text": text,
            "target_duration": duration, "shard": str(shard)}


def iter_shard(path, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[int, dict | DataError | None]]:
    """Every sample slot of one shard, in order, as (index in the shard, item).

    item is the sample when keep(index) (None: keep all), a DataError when that sample cannot be
    read, and None for a slot not kept: its members are skipped without reading them, but the slot
    is still counted, so every reader numbers the shard's samples alike. A truncated or corrupt
    shard ends at the damage; the error names the last key read and belongs to that slot (a whole
    sample before the damage is yielded first, then the error for the same index).
    """
    keep = keep or (lambda i: True)
    index, key, members = -1, None, {}  # the sample being gathered

    def finish():  # the current sample is complete: decode it if it is kept
        if not keep(index):
            return None
        try:
            return decode_sample(path, key, members)
        except DataError as e:
            return e

    damage = None  # why the shard ends early, if it does
    try:
        f = open(path, "rb")
    except OSError as e:  # permissions, not damage: errors while reading it are damage (below)
        f, damage = None, f"the shard cannot be read ({e.strerror or e})"
    try:
        if f is not None:
            with f, tarfile.open(fileobj=f, mode="r:") as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    k, suffix = sample_key(member.name)
                    if k != key:
                        if key is not None:
                            yield index, finish()
                        index, key, members = index + 1, k, {}
                    if keep(index):
                        members[suffix] = tar.extractfile(member).read()
                if not ends_cleanly(f, tar.offset):
                    damage = "truncated or corrupt shard (no end-of-archive marker after this sample)"
    except (tarfile.TarError, OSError, EOFError) as e:
        damage = f"truncated or corrupt shard ({e or type(e).__name__})"
    if damage is None:
        if key is not None:
            yield index, finish()
        return
    if key is None:  # damaged before the first sample: one slot, so that readers agree
        index, key = 0, "<first sample>"
    if not keep(index):
        yield index, None
        return
    if all(s in members for s in SUFFIXES):  # the last sample is whole, even if damage follows it
        yield index, finish()
    yield index, DataError(f"{path}: sample {key!r}: {damage} ({SKIP_HINT})")


def read_shard(path, keep: Callable[[int], bool] | None = None,
               on_error: Callable[[DataError], None] | None = None) -> Iterator[dict]:
    """Yield the kept samples of one shard in order (iter_shard without the slots).

    A bad sample raises DataError, or, when on_error is given, is handed to it and skipped.
    """
    for _, item in iter_shard(path, keep):
        if isinstance(item, DataError):
            if on_error is None:
                raise item
            on_error(item)
        elif item is not None:
            yield item
