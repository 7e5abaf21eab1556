"""Shard indexes: a reader seeks straight to its own samples and reads exactly what the walk reads."""
import io
import itertools
import json
import logging
import re
import tarfile
from pathlib import Path

import pytest

from conftest import run_cli
from echobench.data import DataError, LocalTarDataset, write_shard
from echobench.data import dataset as dataset_module
from echobench.data import index as index_module
from echobench.data.dataset import _is_mine, _own_indices
from echobench.data.index import build_index, cache_path, ensure_index, index_path, load_index, read_records
from test_data import rewrite_without, sample


def tiny_shards(root: Path, counts, index=True) -> list[Path]:
    """Shards of a few-frame samples of varied lengths: shard j holds counts[j] samples."""
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for j, n in enumerate(counts):
        samples = [sample(f"k{j}-{i:03d}", 2 + (7 * i + j) % 9, 1 + (5 * i) % 7, f"[S1] {'ab' * i} ü", seed=10 * j + i)
                   for i in range(n)]
        paths.append(write_shard(root / f"shard-{j:03d}.tar", samples, index=index))
    return paths


def as_read(samples) -> list[tuple]:
    """What a training step sees of each sample, comparable across readers."""
    return [(s["index"], s["key"], s["shard"], s["text"], s["target_duration"],
             s["latent"].tobytes(), s["latent"].shape, s["ref"].tobytes(), s["ref"].shape) for s in samples]


def forbid_walk(monkeypatch):
    """From here on, a reader that walks a shard fails the test: the indexed reader must not."""
    def walk(*a, **k):
        raise AssertionError("the reader walked a shard that has an index")
    monkeypatch.setattr(dataset_module, "iter_shard", walk)


def refuse_open(monkeypatch, *shards):
    """Opening these shards is refused, as for a file this user may not read (root reads a chmod
    000 file all the same), both where indexes are built and where shards are walked."""
    import builtins
    import errno

    from echobench.data import format as format_module

    def refusing(path, *a, **k):
        if str(path) in map(str, shards):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return builtins.open(path, *a, **k)

    for module in (index_module, format_module):
        monkeypatch.setattr(module, "open", refusing, raising=False)


@pytest.fixture
def no_walk(monkeypatch):
    forbid_walk(monkeypatch)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))


def reader(data, rank, world_size, workers, worker, n=None, **kw):
    ds = LocalTarDataset(data, rank=rank, world_size=world_size, **kw)
    it = ds.samples(workers, worker)
    return as_read(itertools.islice(it, n) if n is not None else it), ds


# --- the index itself -----------------------------------------------------------------------------

def test_written_index_is_what_a_rebuild_finds_and_holds_the_lengths(tmp_path):
    (shard,) = tiny_shards(tmp_path, [5])
    header, *lines = index_path(shard).read_text().splitlines()
    header = json.loads(header)
    records = [json.loads(line) for line in lines]
    assert len({len(line) for line in lines}) == 1  # fixed width: slot i at a known offset
    assert header["count"] == 5 and header["size"] == shard.stat().st_size
    assert header["mtime_ns"] == shard.stat().st_mtime_ns and header["shard"] == shard.name
    assert (records, header["end"]) == build_index(shard)  # synth's offsets are the walk's
    walked, _ = reader(tmp_path, 0, 1, 1, 0, loop=False, use_index=False)
    for rec, s in zip(records, walked):
        assert rec["key"] == s[1]
        assert (rec["frames"], rec["ref_frames"]) == (s[6][0], s[8][0])
        assert rec["text_bytes"] == len(s[3].encode())  # UTF-8 bytes, not characters
        assert [m[0] for m in rec["members"]] == [f"{s[1]}.{x}" for x in ("npy", "ref.npy", "json")]
    assert load_index(shard).count == 5 and read_records(load_index(shard)) == records


def test_lengths_are_null_for_a_missing_or_unreadable_member(tmp_path):
    (shard,) = tiny_shards(tmp_path, [3])
    rewrite_without(shard, drop=["k0-001.ref.npy"], replace={"k0-002.npy": b"not an npy file"})
    records, _ = build_index(shard)
    assert [r["ref_frames"] is None for r in records] == [False, True, False]
    assert [r["frames"] is None for r in records] == [False, False, True]
    assert len(records[1]["members"]) == 2


def test_members_the_walk_skips_are_skipped_alike(tmp_path, monkeypatch):
    """Directories, a sample's extra member, names in a subdirectory and a key seen again later:
    the index numbers the slots as the walk does, and the shard's trailing directory is no sample."""
    shard = tmp_path / "odd.tar"
    triplets = {k: {m.name.split(".", 1)[1]: data for m, data in members(tiny_shards(tmp_path / k, [1])[0])}
                for k in ("a", "b")}
    with tarfile.open(shard, "w") as tar:
        def add(name, data=None):
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
        add("top")
        for suffix, data in triplets["a"].items():
            add(f"top/x1.{suffix}", data)
        add("top/x1.txt", b"an extra member")
        add("sub")
        for suffix, data in triplets["b"].items():
            add(f"sub/x2.{suffix}", data)
        add("x1.npy", triplets["a"]["npy"])  # key x1 again: a slot of its own, missing members
        add("end")
    walked, _ = reader(shard, 0, 1, 1, 0, loop=False, skip_bad_samples=True, use_index=False)
    forbid_walk(monkeypatch)
    got, ds = reader(shard, 0, 1, 1, 0, loop=False, skip_bad_samples=True)
    assert ds.indexes[shard].count == 3 and ds.skipped == 1
    assert got == walked and [s[1] for s in got] == ["x1", "x2", None]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_long_and_non_ascii_names_in_every_tar_format(tmp_path, monkeypatch, fmt):
    """The header check accepts what each format writes before a member with such a name."""
    triplet = {m.name.split(".", 1)[1]: data for m, data in members(tiny_shards(tmp_path / "t", [1])[0])}
    shard = tmp_path / "names.tar"
    deep = "d" * 60 + "/" + "e" * 50  # over 100 bytes with the file name: a ustar prefix, or an extended header
    with tarfile.open(shard, "w", format=fmt) as tar:
        for key in ("kü-é", f"{deep}/long-{'x' * 40}"):
            for suffix, data in triplet.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    walked, _ = reader(shard, 0, 1, 1, 0, loop=False, use_index=False)
    forbid_walk(monkeypatch)
    got, ds = reader(shard, 0, 1, 1, 0, loop=False)
    assert got == walked and [s[1] for s in got] == ["kü-é", f"long-{'x' * 40}"] and ds.skipped == 0


def members(shard):
    with tarfile.open(shard) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def test_write_shard_refuses_a_key_twice_in_a_row(tmp_path):
    with pytest.raises(ValueError, match="'a' repeats the previous sample's"):
        write_shard(tmp_path / "x.tar", [sample("a", 2, 2), sample("a", 3, 3)])


@pytest.mark.parametrize("args", [(10, 0, 3, 1, 0), (12, 4, 4, 3, 2), (6, 0, 1, 2, 1), (8, 3, 2, 1, 0),
                                  (4, 0, 4, 4, 3), (30, 7, 5, 2, 0)])
def test_own_indices_are_what_is_mine_takes(args):
    for lo, hi in [(0, 0), (0, 1), (0, 97), (5, 6), (13, 64), (50, 51), (3, 200)]:
        assert _own_indices(*args, lo, hi) == [g for g in range(lo, hi) if _is_mine(*args, g)]


# --- the reader -----------------------------------------------------------------------------------

COMBOS = [(1, 1, 1), (2, 1, 2), (3, 2, 1), (4, 3, 2), (8, 2, 3), (24, 1, 1)]  # ranks, workers, micro-batch


@pytest.mark.parametrize("world_size,workers,micro_batch", COMBOS)
@pytest.mark.parametrize("shuffle_seed", [None, 7])
def test_indexed_reader_reads_what_the_walk_reads(tmp_path, monkeypatch, world_size, workers, micro_batch,
                                                  shuffle_seed):
    """The same samples with the same global indices, on every (rank, worker), over two epochs."""
    tiny_shards(tmp_path, [6, 1, 7, 0, 3])  # 17 samples, an empty shard among them
    n = 2 * 17 // (world_size * workers) + 1  # into the second epoch
    kw = dict(micro_batch=micro_batch, shuffle_seed=shuffle_seed, loop=True)
    walked = {(r, w): reader(tmp_path, r, world_size, workers, w, n, use_index=False, **kw)[0]
              for r in range(world_size) for w in range(workers)}
    forbid_walk(monkeypatch)
    for (rank, worker), expected in walked.items():
        got, ds = reader(tmp_path, rank, world_size, workers, worker, n, **kw)
        assert got == expected
        assert len(ds.indexes) == 5
    one_pass = [s for (r, w) in walked for s in reader(tmp_path, r, world_size, workers, w, loop=False,
                                                        micro_batch=micro_batch, shuffle_seed=shuffle_seed)[0]]
    assert sorted(s[0] for s in one_pass) == list(range(17))  # every sample once


def test_reads_per_own_sample_do_not_depend_on_the_number_of_readers(tmp_path, monkeypatch, no_walk):
    """A reader reads its own samples' records and bytes, and per shard it touches its index's first
    line: the same bytes for a sample whichever of 1 .. 24 readers owns it, nothing for the others'."""
    shards = tiny_shards(tmp_path, [6, 5, 7])
    first, cost = {}, {}  # a shard's first global index; (shard, slot) -> bytes its reader reads
    for j, shard in enumerate(shards):
        ix = load_index(shard)
        first[str(shard)] = sum(c for c in (6, 5, 7)[:j])
        records, _ = build_index(shard)
        for i, rec in enumerate(records):
            lo = min(m[1] for m in rec["members"]) - 512
            hi = max(m[1] + m[2] for m in rec["members"])
            cost[str(shard), i] = ix.record_bytes + hi - lo + (512 if i == len(records) - 1 else 0)
    header = {str(s): len(load_index(s).header) for s in shards}
    reads = []
    pread = index_module._pread
    monkeypatch.setattr(index_module, "_pread", lambda fd, n, off: reads.append(n) or pread(fd, n, off))
    for world_size, workers in [(1, 1), (2, 1), (3, 2), (4, 3), (18, 1)]:
        total = 0
        for rank, worker in itertools.product(range(world_size), range(workers)):
            reads.clear()
            got, _ = reader(tmp_path, rank, world_size, workers, worker, loop=False, micro_batch=2)
            touched = {s[2] for s in got}
            assert sum(reads) == sum(cost[s[2], s[0] - first[s[2]]] for s in got) + sum(header[t] for t in touched)
            last_slots = sum(s[0] - first[s[2]] == (6, 5, 7)[shards.index(Path(s[2]))] - 1 for s in got)
            assert len(reads) == 2 * len(got) + len(touched) + last_slots  # one read per record, one per sample
            total += len(got)
        assert total == 18


def test_shards_of_another_directory_index_in_the_cache(tmp_path, monkeypatch, caplog):
    """A read-only data directory: the index goes to echobench's cache, said once."""
    data = tmp_path / "ro"
    tiny_shards(data, [4, 3], index=False)
    expected, _ = reader(data, 1, 2, 1, 0, loop=False, use_index=False)
    forbid_walk(monkeypatch)
    monkeypatch.setattr(index_module, "_writable", lambda d: data not in (d, *d.parents))
    with caplog.at_level(logging.WARNING, logger="echobench.data.dataset"):
        got, ds = reader(data, 1, 2, 1, 0, loop=False)
        again, _ = reader(data, 1, 2, 1, 0, loop=False)  # finds them in the cache
    assert got == expected == again
    assert [r.getMessage().startswith("indexed 2 of 2 shard(s)") for r in caplog.records] == [True]
    assert all(cache_path(s).is_file() and not index_path(s).exists() for s in ds.shards)
    assert str(tmp_path / "cache") in str(cache_path(ds.shards[0]))


def test_nowhere_to_write_an_index_walks_and_says_so_once(tmp_path, monkeypatch, caplog):
    tiny_shards(tmp_path, [5, 4], index=False)
    expected, _ = reader(tmp_path, 0, 3, 2, 1, loop=False, use_index=False)
    monkeypatch.setattr(index_module, "_writable", lambda d: False)
    monkeypatch.setattr(index_module, "build_index", None)  # no walk to build what cannot be kept
    with caplog.at_level(logging.WARNING, logger="echobench.data.dataset"):
        got, ds = reader(tmp_path, 0, 3, 2, 1, loop=False)
    assert got == expected and ds.indexes == {}
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "2 of 2 shard(s) have no fresh index" in msg and "walking their tar headers" in msg
    assert "ECHOBENCH_CACHE" in msg and "echobench data index" in msg


def test_a_stale_index_is_rebuilt_once(tmp_path, caplog, no_walk):
    shards = tiny_shards(tmp_path, [4, 4])
    rewrite_without(shards[1], drop=["k1-002.json"])  # the shard changes: its index is stale
    with caplog.at_level(logging.WARNING, logger="echobench.data.dataset"):
        ds = LocalTarDataset(tmp_path, loop=False, skip_bad_samples=True)
        keys = [s["key"] for s in ds]
        LocalTarDataset(tmp_path, loop=False)  # fresh now: nothing to say
    (msg,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("indexed")]
    assert msg.startswith("indexed 1 of 2 shard(s)") and str(index_path(shards[1])) in msg
    assert keys == [f"k0-{i:03d}" for i in range(4)] + ["k1-000", "k1-001", None, "k1-003"]
    assert ds.skipped == 1


# --- bad data and indexes that lie ----------------------------------------------------------------

def lie(shard: Path, edit):
    """Rewrite a shard's index with edited records, fresh for the shard as it stands."""
    entries, end = build_index(shard)
    edit(entries)
    index_path(shard).write_text(index_module._text(shard, entries, end))


def member(entries, slot, suffix):
    return next(m for m in entries[slot]["members"] if m[0].endswith("." + suffix))


LIES = {
    "offset past the end": (lambda e, size: member(e, 2, "npy").__setitem__(1, size + 4096), "past the end of the shard"),
    "another member at the offset": (lambda e, size: member(e, 2, "ref.npy").__setitem__(1, member(e, 3, "ref.npy")[1]),
                                     "names 'k0-003.ref.npy', not 'k0-002.ref.npy'"),
    "wrong size": (lambda e, size: member(e, 2, "json").__setitem__(2, member(e, 2, "json")[2] + 1), "bytes, not"),
    "member of another sample": (lambda e, size: e[2]["members"].__setitem__(0, member(e, 1, "npy")),
                                 "'k0-001.npy' is not of this sample"),
}


@pytest.mark.parametrize("lie_name", LIES)
def test_an_index_that_lies_is_an_error_or_a_counted_skip(tmp_path, monkeypatch, lie_name):
    (shard,) = tiny_shards(tmp_path, [5])
    walked, _ = reader(tmp_path, 0, 1, 1, 0, loop=False, use_index=False)
    forbid_walk(monkeypatch)
    edit, expect = LIES[lie_name]
    lie(shard, lambda e: edit(e, shard.stat().st_size))
    with pytest.raises(DataError) as e:
        list(LocalTarDataset(tmp_path, loop=False))
    msg = str(e.value)
    assert str(shard) in msg and "'k0-002'" in msg and expect in msg and "\n" not in msg
    assert f"echobench data index --rebuild {tmp_path}" in msg and "--skip-bad-samples" in msg
    got, ds = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True)
    assert ds.skipped == 1
    assert [s[1] for s in got] == ["k0-000", "k0-001", None, "k0-003", "k0-004"]  # a stand-in keeps the slot
    assert got[:2] + got[3:] == walked[:2] + walked[3:]


def test_an_index_that_drops_the_last_samples_is_caught(tmp_path, no_walk):
    """count and records agree, but the shard goes on after the index's last sample."""
    shard, _ = tiny_shards(tmp_path, [4, 2])
    lie(shard, lambda e: e.pop())
    with pytest.raises(DataError, match=r"'k0-002'.*index ends at this sample \(3 samples\) but member 'k0-003.npy'"):
        list(LocalTarDataset(tmp_path, loop=False))
    got, ds = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True)
    assert ds.skipped == 1  # counted once, by the reader of the last slot; the sample itself is whole
    assert [s[1] for s in got] == ["k0-000", "k0-001", "k0-002", "k1-000", "k1-001"]


def test_a_count_that_disagrees_with_the_records_makes_the_index_stale(tmp_path, caplog, no_walk):
    shard, _ = tiny_shards(tmp_path, [4, 2])
    path = index_path(shard)
    header, rest = path.read_text().split("\n", 1)
    path.write_text(header.replace('"count": 4', '"count": 3') + "\n" + rest)
    assert load_index(shard) is None
    with caplog.at_level(logging.WARNING, logger="echobench.data.dataset"):
        got, _ = reader(tmp_path, 0, 1, 1, 0, loop=False)
    assert [s[1] for s in got] == ["k0-000", "k0-001", "k0-002", "k0-003", "k1-000", "k1-001"]
    assert any(r.getMessage().startswith("indexed 1 of 2") for r in caplog.records)


def test_an_unreadable_record_names_shard_and_slot(tmp_path, no_walk):
    (shard,) = tiny_shards(tmp_path, [3])
    ix = load_index(shard)
    with open(index_path(shard), "r+b") as f:
        f.seek(len(ix.header) + ix.record_bytes)
        f.write(b"#" * (ix.record_bytes - 1))
    with pytest.raises(DataError, match=rf"{shard}: sample slot 1: its record in .* is unreadable.*echobench data index"):
        list(LocalTarDataset(tmp_path, loop=False))
    got, ds = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True)
    assert [s[1] for s in got] == ["k0-000", None, "k0-002"] and ds.skipped == 1


def test_a_shard_replaced_after_its_index_was_read_is_not_read_through_it(tmp_path, no_walk):
    (shard,) = tiny_shards(tmp_path, [4])
    strict = LocalTarDataset(tmp_path, loop=False)
    lenient = LocalTarDataset(tmp_path, loop=False, skip_bad_samples=True)
    rewrite_without(shard, drop=["k0-000.npy"])  # every later member moves
    with pytest.raises(DataError, match=re.escape(f"{shard}: sample slot 0: the shard changed since its "
                                                  f"index was read")):
        list(strict)
    assert [s["key"] for s in lenient] == [None] * 4 and lenient.skipped == 4  # stand-ins, no wrong sample


def error_of(ds) -> str:
    with pytest.raises(DataError) as e:
        list(ds)
    return str(e.value)


@pytest.mark.parametrize("damage", [
    {"drop": ["k0-001.ref.npy"]},
    {"drop": ["k0-003.json"]},  # the last sample
    {"replace": {"k0-002.npy": b"not an npy file"}},
    {"replace": {"k0-002.json": json.dumps({"txt": 1}).encode()}},
])
def test_a_bad_sample_is_the_walks_error(tmp_path, damage):
    """A missing or undecodable member: the same one-line DataError, or the same counted skip."""
    (shard,) = tiny_shards(tmp_path, [4])
    rewrite_without(shard, **damage)
    walk = error_of(LocalTarDataset(tmp_path, loop=False, use_index=False))
    ds = LocalTarDataset(tmp_path, loop=False)
    assert shard in ds.indexes  # rebuilt: the error below is the indexed reader's
    assert error_of(ds) == walk and str(shard) in walk and "--skip-bad-samples" in walk
    got, ds = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True)
    expected, walker = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True, use_index=False)
    assert got == expected and ds.skipped == walker.skipped == 1


def test_a_truncated_shard_is_walked_and_names_shard_and_key(tmp_path, caplog):
    shards = tiny_shards(tmp_path, [3, 4, 3])
    bad = shards[1]
    bad.write_bytes(bad.read_bytes()[:int(bad.stat().st_size * 0.6)])
    with caplog.at_level(logging.WARNING, logger="echobench.data.dataset"):
        ds = LocalTarDataset(tmp_path, loop=False)
    assert set(ds.indexes) == {shards[0], shards[2]}
    (msg,) = [r.getMessage() for r in caplog.records]
    assert msg.startswith("1 of 3 shard(s) are damaged") and str(bad) in msg
    with pytest.raises(DataError) as e:
        list(ds)
    assert str(bad) in str(e.value) and "'k1-" in str(e.value) and "--skip-bad-samples" in str(e.value)
    got, ds = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True)
    expected, walk = reader(tmp_path, 0, 1, 1, 0, loop=False, skip_bad_samples=True, use_index=False)
    assert got == expected and ds.skipped == walk.skipped == 1


def test_a_shard_that_cannot_be_read_is_said_so_not_called_corrupt(tmp_path, monkeypatch):
    shards = tiny_shards(tmp_path, [3, 2], index=False)
    refuse_open(monkeypatch, shards[1])
    assert ensure_index(shards[1]) == (None, "unreadable", f"{shards[1]}: cannot be read (Permission denied): give "
                                                            f"this user read access to it")
    assert ensure_index(tmp_path / "gone.tar")[:2] == (None, "unreadable")  # stat fails: not damage either
    ds = LocalTarDataset(tmp_path, loop=False)
    assert set(ds.indexes) == {shards[0]} and ds.not_indexed[shards[1]][0] == "unreadable"
    err = error_of(ds)  # its walk says the same
    assert err.startswith(f"{shards[1]}: sample '<first sample>': the shard cannot be read (Permission denied)")
    assert "corrupt" not in err


def test_nowhere_to_write_an_index_suggests_echobench_cache(tmp_path, monkeypatch):
    (shard,) = tiny_shards(tmp_path, [3], index=False)
    monkeypatch.setattr(index_module, "_writable", lambda d: False)
    index, status, detail = ensure_index(shard)
    assert (index, status) == (None, "unwritable")
    assert detail == f"neither {tmp_path} nor the cache {cache_path(shard).parent} can be written: set " \
                     f"ECHOBENCH_CACHE to a writable folder"
    monkeypatch.undo()
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))

    def refused(*a, **k):  # the directories said yes, then the writes failed (a read-only mount)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(index_module, "write_index", refused)
    index, status, detail = ensure_index(shard)
    assert status == "unwritable" and detail.endswith("(Permission denied): set ECHOBENCH_CACHE to a writable folder")


# --- the command ----------------------------------------------------------------------------------

def test_data_index_command_indexes_shards_from_elsewhere(tmp_path):
    data = tmp_path / "data"
    shards = tiny_shards(data, [3, 2], index=False)
    proc = run_cli("data", "index", data, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == f"shard-000.tar: 3 samples, written to {index_path(shards[0])}"
    assert lines[-1] == "2 shards, 5 samples indexed: 2 written, 0 up to date, 0 damaged, 0 unreadable, 0 with " \
                        "nowhere to write"
    assert all(load_index(s) is not None for s in shards)
    shards[1].write_bytes(shards[1].read_bytes()[:1500])  # truncated: damaged
    proc = run_cli("data", "index", data, tmp_path=tmp_path)
    assert proc.returncode == 1
    assert "shard-001.tar: damaged, not indexed" in proc.stdout and "1 up to date, 1 damaged" in proc.stdout


def test_data_index_command_says_a_shard_cannot_be_read(tmp_path, monkeypatch):
    """In process (the refusal is simulated: root reads a chmod 000 file): not "damaged"; exit 1."""
    from typer.testing import CliRunner

    from echobench.cli import app

    shards = tiny_shards(tmp_path / "data", [3, 2], index=False)
    refuse_open(monkeypatch, shards[1])
    result = CliRunner().invoke(app, ["data", "index", str(tmp_path / "data")])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert f"shard-001.tar: cannot be read, not indexed: {shards[1]}: cannot be read (Permission denied): give this " \
           f"user read access to it" in out
    assert "corrupt" not in out and "damaged, not indexed" not in out
    assert out.endswith("2 shards, 3 samples indexed: 1 written, 0 up to date, 0 damaged, 1 unreadable, 0 with "
                        "nowhere to write")
