"""Per-shard indexes: where each sample's members lie in its tar shard, so that a reader seeks
straight to its own samples instead of walking every tar header of every shard.

    SHARD.tar.idx.jsonl   beside the shard; in echobench's cache (ECHOBENCH_CACHE/shard-index/)
                          when the shard's directory cannot be written

Line 1 is a header: format, version, the shard's name, size and mtime_ns (an index whose shard has
another size or mtime is stale), count (sample slots), end (offset of the end-of-archive marker)
and record_bytes. Then one record per slot, padded with spaces to record_bytes (newline included)
so that slot i lies at a fixed offset: a reader parses its own slots' records, not the others'.

    {"key": "s000000-000001", "members": [["s000000-000001.npy", 1536, 51328], ...],
     "frames": 200, "text_bytes": 120, "ref_frames": 250}

members: each member's name, data offset and size; frames / ref_frames: rows of the latent and
the reference (from their .npy headers); text_bytes: the text's UTF-8 length; null where the member
is missing or unreadable (reading that sample then raises the DataError the walk raises). Slots are
numbered as iter_shard numbers them; a damaged shard gets no index: its readers walk it.
"""
import errno
import hashlib
import io
import json
import os
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from echobench.records.atomic import write_text_atomic
from echobench.records.paths import cache_dir

from .format import LATENT_DIM, SKIP_HINT, SUFFIXES, DataError, decode_sample, ends_cleanly, sample_key

FORMAT, VERSION = "echobench-shard-index", 1
SUFFIX = ".idx.jsonl"
BLOCK = tarfile.BLOCKSIZE
_pread = os.pread  # every read of a shard or an index record goes through here (tests count them)


def index_path(shard) -> Path:
    """The index beside its shard."""
    shard = Path(shard)
    return shard.with_name(shard.name + SUFFIX)


def cache_path(shard) -> Path:
    """The index in the cache, for a shard whose directory cannot be written (keyed by its path)."""
    shard = Path(shard)
    digest = hashlib.sha256(str(shard.resolve()).encode()).hexdigest()[:16]
    return cache_dir() / "shard-index" / f"{digest}-{shard.name}{SUFFIX}"


CACHE_HINT = "set ECHOBENCH_CACHE to a writable folder"  # where an index goes when its shard's folder is read-only


def index_command(shard, rebuild: bool = False) -> str:
    """The `echobench data index` command that indexes this shard's directory."""
    return f"`echobench data index {'--rebuild ' if rebuild else ''}{Path(shard).parent}`"


def rebuild_hint(shard) -> str:
    return f"rebuild it with {index_command(shard, rebuild=True)}"


class UnreadableShard(DataError):
    """A shard the system will not let this process open (permissions, gone): it may be whole, so
    it is not called damaged."""


def unreadable(shard, e: OSError) -> UnreadableShard:
    hint = ": give this user read access to it" if e.errno in (errno.EACCES, errno.EPERM) else ""
    return UnreadableShard(f"{shard}: cannot be read ({e.strerror or e}){hint}")


@dataclass(frozen=True)
class ShardIndex:
    """A fresh index of one shard: what a reader needs to find a slot's record (the records stay
    on disk; read_slots reads those it is asked for)."""

    shard: str
    path: str  # the index file
    count: int  # sample slots
    size: int  # the shard's size in bytes
    mtime_ns: int
    end: int  # offset of the shard's end-of-archive marker
    header: bytes  # the index's first line: read_slots checks the file still starts with it
    record_bytes: int


def index_entry(key: str, members: Iterable[tuple[str, int, int]], frames: int | None,
                text_bytes: int | None, ref_frames: int | None) -> dict:
    """One slot's record: its key, members (name, data offset, size) and lengths."""
    return {"key": key, "members": [list(m) for m in members], "frames": frames,
            "text_bytes": text_bytes, "ref_frames": ref_frames}


# ---- building -------------------------------------------------------------------------------

def _npy_rows(f, offset: int, size: int) -> int | None:
    """Rows of a (T, 128) .npy member, from its header alone (None if it is not one)."""
    try:
        f.seek(offset)
        head = io.BytesIO(f.read(min(size, 4096)))  # np.save's headers are 128 bytes
        version = np.lib.format.read_magic(head)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, _ = read(head)
        return int(shape[0]) if len(shape) == 2 and shape[1] == LATENT_DIM else None
    except Exception:  # any unreadable header: no length; reading the sample reports why
        return None


def _text_bytes(f, offset: int, size: int) -> int | None:
    try:
        if size > 1 << 20:
            return None
        f.seek(offset)
        text = json.loads(f.read(size))["text"]
        return len(text.encode()) if isinstance(text, str) else None
    except Exception:
        return None


def _entry(f, key: str, members: dict) -> dict:
    def length(suffix, fn):
        return fn(f, *members[suffix][1:]) if suffix in members else None

    return index_entry(key, members.values(), length("npy", _npy_rows),
                       length("json", _text_bytes), length("ref.npy", _npy_rows))


def build_index(shard) -> tuple[list[dict], int]:
    """The records of a shard's slots and the offset of its end-of-archive marker, from one walk
    over its tar headers (slots numbered as iter_shard numbers them, member bytes unread but for
    the .npy headers and the json). DataError for a damaged shard: it is read by the walk;
    UnreadableShard (a DataError) for one that cannot be opened."""
    entries, key, members = [], None, {}

    def where():
        return "before its first sample" if key is None else f"after sample {key!r}"

    try:
        f = open(shard, "rb")
    except OSError as e:  # permissions, not damage: errors while reading it are damage (below)
        raise unreadable(shard, e) from e
    try:
        with f, tarfile.open(fileobj=f, mode="r:") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                if m.issparse():  # its data is not one run of bytes
                    raise DataError(f"{shard}: member {m.name!r} is a sparse file")
                k, suffix = sample_key(m.name)
                if k != key:
                    if key is not None:
                        entries.append(_entry(f, key, members))
                    key, members = k, {}
                members[suffix] = (m.name, m.offset_data, m.size)  # a repeated member: the last counts
            end = tar.offset
            if not ends_cleanly(f, end):
                raise DataError(f"{shard}: truncated or corrupt shard (no end-of-archive marker "
                                f"{where()})")
            if key is not None:
                entries.append(_entry(f, key, members))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"{shard}: truncated or corrupt shard {where()} "
                        f"({e or type(e).__name__})") from e
    return entries, end


def _text(shard: Path, entries: list[dict], end: int, st: os.stat_result | None = None) -> str:
    st = st or shard.stat()
    lines = [json.dumps(e) for e in entries]
    width = max(map(len, lines), default=0) + 1  # + the newline
    header = {"format": FORMAT, "version": VERSION, "shard": shard.name, "size": st.st_size,
              "mtime_ns": st.st_mtime_ns, "count": len(entries), "end": end, "record_bytes": width}
    return "".join([json.dumps(header) + "\n", *(line.ljust(width - 1) + "\n" for line in lines)])


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)


def _place(shard: Path) -> tuple[Path | None, str]:
    """Where this shard's index can be written: beside it, else in the cache; (None, why) if
    neither can be."""
    beside, cached = index_path(shard), cache_path(shard)
    if _writable(beside.parent):
        return beside, ""
    if _writable(cached.parent):
        return cached, ""
    return None, f"neither {beside.parent} nor the cache {cached.parent} can be written: {CACHE_HINT}"


def write_index(shard, entries: list[dict], end: int, st: os.stat_result | None = None) -> Path:
    """Write a shard's index (atomically) beside it, or in the cache when its directory cannot be
    written; OSError when neither can. st: the shard's stat when its entries were read (default:
    now), so that a shard that changed since is stale at once."""
    shard = Path(shard)
    text = _text(shard, entries, end, st)
    path, why = _place(shard)
    if path is None:
        raise OSError(why)
    try:
        write_text_atomic(path, text)
    except OSError:
        if path == cache_path(shard) or not _writable(cache_path(shard).parent):
            raise
        path = cache_path(shard)  # the directory said yes, then refused (a read-only mount)
        write_text_atomic(path, text)
    return path


# ---- loading ----------------------------------------------------------------------------------

def _open(shard: Path, path: Path, st: os.stat_result) -> ShardIndex | None:
    """The index at `path` if it is this shard's and fresh: format, version, name, size and
    mtime agree, and its file holds exactly `count` records (a count that lies is caught here)."""
    try:
        fd = os.open(path, os.O_RDONLY)  # os.open, not open(): a reader opens one per shard
        try:
            head, file_size = os.pread(fd, 4096, 0), os.fstat(fd).st_size
            if b"\n" not in head:  # a long shard name
                head = os.pread(fd, 1 << 16, 0)
        finally:
            os.close(fd)
        line = head[:head.index(b"\n") + 1]
        h = json.loads(line)
        count, width, end = h["count"], h["record_bytes"], h["end"]
        fresh = (h["format"] == FORMAT and h["version"] == VERSION and h["shard"] == shard.name
                 and h["size"] == st.st_size and h["mtime_ns"] == st.st_mtime_ns
                 and all(type(v) is int and v >= 0 for v in (count, width, end))
                 and file_size == len(line) + count * width and end <= st.st_size)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not fresh:
        return None
    return ShardIndex(str(shard), str(path), count, st.st_size, st.st_mtime_ns, end, line, width)


def load_index(shard) -> ShardIndex | None:
    """The shard's fresh index, beside it or in the cache; None if neither is."""
    shard = Path(shard)
    st = shard.stat()
    found = _open(shard, index_path(shard), st)
    return found if found is not None else _open(shard, cache_path(shard), st)  # the cache: only if needed


def ensure_index(shard, rebuild: bool = False) -> tuple[ShardIndex | None, str, str]:
    """(index, status, detail) for one shard: status "fresh" (found), "built" (written to detail),
    "damaged" (a damaged shard: no index; detail is the DataError), "unreadable" (a shard this
    process may not open: detail says why) or "unwritable" (missing or stale, and nowhere to write
    one; detail says why). Without an index a reader walks the shard."""
    shard = Path(shard)
    try:
        st = shard.stat()
        found = None if rebuild else load_index(shard)
    except OSError as e:
        return None, "unreadable", str(unreadable(shard, e))
    if found is not None:
        return found, "fresh", str(found.path)
    path, why = _place(shard)
    if path is None:  # before the walk that building costs: it would be thrown away
        return None, "unwritable", why
    try:
        entries, end = build_index(shard)
    except UnreadableShard as e:
        return None, "unreadable", str(e)
    except DataError as e:
        return None, "damaged", str(e)
    try:
        path = write_index(shard, entries, end, st)
    except OSError as e:
        return None, "unwritable", f"cannot write {path} ({e.strerror or e}): {CACHE_HINT}"
    found = load_index(shard)
    if found is None:  # the index is stale already: walk the shard, which is being written?
        return None, "damaged", f"{shard}: changed while it was indexed"
    return found, "built", str(path)


def read_records(ix: ShardIndex) -> list[dict]:
    """Every slot's record (key, members, lengths) in slot order, for a tool that needs them all
    (the lengths, say); a reader reads only its own, with read_slots."""
    with open(ix.path, "rb") as f:
        f.seek(len(ix.header))
        data, w = f.read(ix.count * ix.record_bytes), ix.record_bytes
    return [json.loads(data[i * w:(i + 1) * w]) for i in range(ix.count)]


# ---- reading ------------------------------------------------------------------------------------

def _header_problem(block: bytes, name: str, size: int) -> str | None:
    """Why the tar header before a member's data is not that member's, or None: its name and size
    must be the index's (a cheap check: no checksum; a garbled header fails on name or size)."""
    if len(block) != BLOCK:
        return "is past the end of the shard"
    got = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0]  # ustar's; other fields there in GNU headers
    gots = (got, prefix + b"/" + got) if prefix else (got,)
    # A pax archive holds a non-ASCII name in an extended header before this one, and here its
    # ASCII form; a name over 100 bytes is there (or in a GNU one) in full, and here cut short.
    wants = (name.encode("utf-8", "surrogateescape"), name.encode("ascii", "replace"))
    if not any(g == w or (g and len(w) > 99 and w.startswith(g)) for g in gots for w in wants):
        return f"names {gots[-1].decode('utf-8', 'replace')!r}, not {name!r}"
    if block[156:157] not in tarfile.REGULAR_TYPES:
        return "is not a file's"
    try:
        if tarfile.nti(block[124:136]) != size:
            return f"gives {tarfile.nti(block[124:136])} bytes, not {size}"
    except tarfile.HeaderError:
        return "has no valid size"
    return None


def _record(fd: int, ix: ShardIndex, slot: int) -> dict:
    raw = _pread(fd, ix.record_bytes, len(ix.header) + slot * ix.record_bytes)
    rec = json.loads(raw)
    members = rec["members"]
    if not (isinstance(rec["key"], str) and isinstance(members, list) and all(
            isinstance(m, list) and len(m) == 3 and isinstance(m[0], str)
            and all(type(v) is int and v >= 0 for v in m[1:]) for m in members)):
        raise ValueError("not a record of key and members [name, offset, size]")
    return rec


def _mismatch(ix: ShardIndex, key, what: str) -> DataError:
    return DataError(f"{ix.shard}: sample {key!r}: its index {ix.path} does not match the shard "
                     f"({what}); {rebuild_hint(ix.shard)} ({SKIP_HINT})")


def _sample(fd: int, ix: ShardIndex, rec: dict) -> dict:
    """The slot's sample, read from the member offsets (one read when they lie together, as they
    do); DataError when the index does not match the shard or the sample cannot be decoded."""
    key, wanted = rec["key"], []
    for name, offset, size in rec["members"]:
        k, suffix = sample_key(name)
        if k != key:
            raise _mismatch(ix, key, f"member {name!r} is not of this sample")
        if offset < BLOCK:
            raise _mismatch(ix, key, f"member {name!r} at byte {offset}, before any header")
        if offset + size > ix.size:
            raise _mismatch(ix, key, f"member {name!r} ends at byte {offset + size}, past the end "
                                     f"of the shard ({ix.size} bytes)")
        if suffix in SUFFIXES:  # others (a sample's extras) are not read
            wanted.append((suffix, name, offset, size))
    parts = {}
    if wanted:
        lo = min(w[2] for w in wanted) - BLOCK
        hi = max(w[2] + w[3] for w in wanted)
        together = hi - lo <= 2 * sum(BLOCK + w[3] for w in wanted) + (1 << 16)
        span = _pread(fd, hi - lo, lo) if together else b""
        for suffix, name, offset, size in wanted:
            if together:
                block, data = span[offset - BLOCK - lo:offset - lo], span[offset - lo:offset - lo + size]
            else:  # members far apart: read each, not what lies between
                buf = _pread(fd, BLOCK + size, offset - BLOCK)
                block, data = buf[:BLOCK], buf[BLOCK:]
            problem = _header_problem(block, name, size)
            if problem is None and len(data) != size:
                problem = "is followed by fewer bytes than its size"
            if problem:
                raise _mismatch(ix, key, f"the tar header before byte {offset} {problem}")
            parts[suffix] = data
    return decode_sample(ix.shard, key, parts)


def _end_problem(fd: int, ix: ShardIndex, rec: dict) -> str | None:
    """Why the shard does not end after the index's last sample, or None: a count that drops
    slots at the end must not hide them."""
    block = _pread(fd, BLOCK, ix.end)
    if len(block) != BLOCK or block.count(0) != BLOCK:
        return f"no end-of-archive marker at byte {ix.end}"
    last = max((o + -(-s // BLOCK) * BLOCK for _, o, s in rec["members"]), default=0)
    if last > ix.end:
        return f"a member ends at byte {last}, after the end-of-archive marker at {ix.end}"
    if last < ix.end:  # non-file members (directories) may follow; a file may not
        block = _pread(fd, BLOCK, last)
        if block[156:157] in tarfile.REGULAR_TYPES and block.count(0) != BLOCK:
            name = block[:100].split(b"\0", 1)[0].decode("utf-8", "replace")
            return f"the index ends at this sample ({ix.count} samples) but member {name!r} follows"
    return None


def read_slots(ix: ShardIndex, slots: Iterable[int]) -> Iterator[tuple[int, dict | DataError]]:
    """(slot, sample or DataError) for the given slots of an indexed shard, in the order given,
    reading only their records and members: what iter_shard yields for kept slots, without the
    walk. After the last slot's sample, a DataError for the same slot if the shard goes on."""
    slots, fds = list(slots), []
    try:
        for path in (ix.shard, ix.path):  # os.open: a reader may open a shard per own sample
            fds.append(os.open(path, os.O_RDONLY))
    except OSError as e:
        for fd in fds:
            os.close(fd)
        for i in slots:
            yield i, DataError(f"{ix.shard}: sample slot {i}: cannot open the shard or its index "
                               f"({e.strerror or e}); {rebuild_hint(ix.shard)} ({SKIP_HINT})")
        return
    fd, idx = fds
    try:
        st = os.fstat(fd)
        changed = None  # the shard or the index replaced since the index was loaded
        if (st.st_size, st.st_mtime_ns) != (ix.size, ix.mtime_ns):
            changed = f"the shard changed since its index was read ({st.st_size} bytes now)"
        elif _pread(idx, len(ix.header), 0) != ix.header:
            changed = f"its index {ix.path} changed since it was read"
        for i in slots:
            if changed or not 0 <= i < ix.count:
                why = changed or f"slot {i} is not among the index's {ix.count}"
                yield i, DataError(f"{ix.shard}: sample slot {i}: {why}; {rebuild_hint(ix.shard)} "
                                   f"({SKIP_HINT})")
                continue
            try:
                rec = _record(idx, ix, i)
            except (ValueError, KeyError, TypeError) as e:
                yield i, DataError(f"{ix.shard}: sample slot {i}: its record in {ix.path} is "
                                   f"unreadable ({e}); {rebuild_hint(ix.shard)} ({SKIP_HINT})")
                continue
            try:
                sample = _sample(fd, ix, rec)
            except DataError as e:
                sample = e
            yield i, sample
            if i == ix.count - 1:
                problem = _end_problem(fd, ix, rec)
                if problem:
                    yield i, _mismatch(ix, rec["key"], problem)
    finally:  # also when the consumer stops early (a generator closed)
        os.close(fd)
        os.close(idx)
