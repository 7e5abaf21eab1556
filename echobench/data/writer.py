"""Writing shards: the tar file of sample triplets (echobench.data.format) and its index
(echobench.data.index), which the writer fills from the offsets it has just written, no walk needed."""
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Iterable

import numpy as np

from .format import LATENT_DIM
from .index import index_entry, write_index


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _latent(array, what: str, key: str) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 2 or array.shape[1] != LATENT_DIM:
        raise ValueError(f"sample {key!r}: {what} must be (T, {LATENT_DIM}), got {array.shape}")
    return array.astype(np.float16, copy=False)


def _padded(size: int) -> int:
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def write_shard(path, samples: Iterable[dict], index: bool = True) -> Path:
    """Write samples (dicts with key, latent, ref, text, target_duration) to one tar shard, and,
    with index, its index (echobench.data.index: the offsets are known here, no walk needed).

    Written to a temporary name and renamed, so a reader never sees a half-written shard.
    Member times are fixed, so the same samples give the same bytes.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    entries = []
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for s in samples:
            key = str(s["key"])
            if not key or "." in key or "/" in key:
                raise ValueError(f"sample key {key!r} must be non-empty, without '.' or '/'")
            if entries and entries[-1]["key"] == key:  # a reader would see one sample of both
                raise ValueError(f"sample key {key!r} repeats the previous sample's")
            meta = {"text": str(s["text"]), "target_duration": float(s["target_duration"])}
            latent, ref = _latent(s["latent"], "latent", key), _latent(s["ref"], "ref", key)
            members = {
                "npy": _npy_bytes(latent),
                "ref.npy": _npy_bytes(ref),
                "json": json.dumps(meta, ensure_ascii=False).encode(),
            }
            placed = []  # (name, data offset, size): the data ends at tar.offset, padded
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
                placed.append((info.name, tar.offset - _padded(len(data)), len(data)))
            entries.append(index_entry(key, placed, len(latent), len(meta["text"].encode()), len(ref)))
        end = tar.offset  # where close() writes the end-of-archive marker
    os.replace(tmp, path)
    if index:
        write_index(path, entries, end)
    return path
