"""Data package: real tar shards written to tmp_path."""
import io
import json
import os
import tarfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from echobench.data import (
    CONDITIONING_TOKENS, FRAME_RATE, LATENT_DIM, BatchLoader, DataError, LocalTarDataset,
    SyntheticSource, build_tokenizer, collate, make_loader, make_source, read_shard, synth_shards,
    write_shard,
)
from echobench.data import dataset as dataset_module


def sample(key, frames, ref_frames, text="[S1] hello", seed=0):
    rng = np.random.default_rng(seed)
    return {"key": key, "text": text, "target_duration": frames / FRAME_RATE,
            "latent": rng.standard_normal((frames, LATENT_DIM)).astype(np.float16),
            "ref": rng.standard_normal((ref_frames, LATENT_DIM)).astype(np.float16)}


def keys_of(samples):
    return [s["key"] for s in samples]


# --- format and synth ---------------------------------------------------------------------------

def test_synth_draws_the_lengths_its_docs_state():
    """docs/explanation/data.md and `data synth --help` state the distribution: audio median 8 s,
    reference median 10 s (log-normal, clipped to [2 s, max]), about 14 characters per second."""
    from echobench.data.synth import synth_sample

    rng = np.random.default_rng(0)
    samples = [synth_sample(rng, str(i)) for i in range(400)]
    seconds = np.array([s["target_duration"] for s in samples])
    refs = np.array([len(s["ref"]) for s in samples]) / FRAME_RATE
    assert 7.0 < np.median(seconds) < 9.0 and 9.0 < np.median(refs) < 11.0
    assert seconds.min() >= 2.0 and max(seconds.max(), refs.max()) <= 30.0
    chars = np.array([len(s["text"]) for s in samples])
    assert 12 < np.median(chars / seconds) < 17


def test_synth_writes_triplets_with_a_spread_of_lengths(tmp_path):
    paths = synth_shards(tmp_path, num_shards=2, samples_per_shard=40, seed=3, max_seconds=20.0)
    assert [p.name for p in paths] == ["shard-000000.tar", "shard-000001.tar"]
    for p in paths:
        with tarfile.open(p) as tar:
            names = tar.getnames()
        keys = sorted({n.split(".")[0] for n in names})
        assert len(keys) == 40
        assert sorted(names) == sorted(f"{k}.{s}" for k in keys for s in ("npy", "ref.npy", "json"))

    samples = list(LocalTarDataset(tmp_path, loop=False))
    assert len(samples) == 80 and len(set(keys_of(samples))) == 80
    frames = np.array([len(s["latent"]) for s in samples])
    refs = np.array([len(s["ref"]) for s in samples])
    chars = np.array([len(s["text"]) for s in samples])
    assert 2 * FRAME_RATE <= frames.min() < frames.max() <= 20 * FRAME_RATE
    assert 2 * FRAME_RATE <= refs.min() < refs.max() <= 20 * FRAME_RATE
    assert (frames != refs).mean() > 0.9  # reference length is drawn independently
    assert np.corrcoef(frames, chars)[0, 1] > 0.8  # text grows with duration
    assert 8 < chars.sum() / (frames.sum() / FRAME_RATE) < 25  # roughly 14 chars per second
    for s in samples:
        assert s["latent"].dtype == np.float16 and s["latent"].shape[1] == LATENT_DIM
        assert s["target_duration"] == pytest.approx(len(s["latent"]) / FRAME_RATE)
        assert s["text"].startswith("[S1] ")

    again = synth_shards(tmp_path / "again", 2, 40, seed=3, max_seconds=20.0)
    other = synth_shards(tmp_path / "other", 1, 40, seed=4, max_seconds=20.0)
    assert again[1].read_bytes() == paths[1].read_bytes()  # deterministic for a seed
    assert other[0].read_bytes() != paths[0].read_bytes()


def test_round_trip_keeps_values(tmp_path):
    written = [sample("a", 30, 7, "[S1] héllo [S2] wörld", seed=1), sample("b", 1, 90, seed=2)]
    path = write_shard(tmp_path / "x.tar", written)
    read = list(read_shard(path))
    assert keys_of(read) == ["a", "b"]
    for w, r in zip(written, read):
        np.testing.assert_array_equal(r["latent"], w["latent"])
        np.testing.assert_array_equal(r["ref"], w["ref"])
        assert r["latent"].dtype == np.float16
        assert r["text"] == w["text"] and r["target_duration"] == w["target_duration"]
        assert r["shard"] == str(path)


# --- collate ------------------------------------------------------------------------------------

def test_collate_crops_pads_and_masks_real_lengths():
    tok = build_tokenizer(512)
    samples = [sample("long", 40, 15, "[S1] " + "x" * 50, seed=1), sample("short", 5, 3, "[S2] hi")]
    b = collate(samples, tok, audio_frames=20, text_tokens=16, speaker_frames=10)
    assert b.size == 2
    assert b.latent.shape == (2, 20, 128) and b.latent.dtype == torch.float32
    assert b.ref.shape == (2, 12, 128)  # 10 rounded up to the speaker patch (4)
    assert b.text_ids.shape == (2, 16) and b.text_ids.dtype == torch.int64
    assert b.audio_len.tolist() == [20, 5] and b.ref_len.tolist() == [10, 3]
    short_ids = tok.encode("[S2] hi")
    assert b.text_len.tolist() == [16, len(short_ids)]
    for mask, lengths in ((b.latent_mask, b.audio_len), (b.ref_mask, b.ref_len),
                          (b.text_mask, b.text_len)):
        assert mask.dtype == torch.bool
        assert mask.sum(1).tolist() == lengths.tolist()
        assert all(mask[i, :n].all() for i, n in enumerate(lengths.tolist()))  # prefix masks
    np.testing.assert_array_equal(b.latent[0].numpy(), samples[0]["latent"][:20].astype(np.float32))
    np.testing.assert_array_equal(b.ref[1, :3].numpy(), samples[1]["ref"].astype(np.float32))
    assert not b.latent[1, 5:].any() and not b.ref[0, 10:].any()
    assert b.text_ids[1].tolist() == short_ids + [tok.pad_id] * (16 - len(short_ids))
    assert b.text_ids[0].tolist() == tok.encode(samples[0]["text"])[:16]
    moved = b.to("cpu")
    assert moved.latent.shape == b.latent.shape and moved.text_len.tolist() == b.text_len.tolist()


# --- splitting across ranks and workers ---------------------------------------------------------

def read_as_consumers(monkeypatch, data, world_size, workers, **kw):
    """Samples each (rank, worker) consumer reads in one pass."""
    out = {}
    for rank in range(world_size):
        for worker in range(workers):
            info = SimpleNamespace(num_workers=workers, id=worker)
            monkeypatch.setattr(dataset_module, "get_worker_info", lambda: info)
            ds = LocalTarDataset(data, rank=rank, world_size=world_size, loop=False, **kw)
            out[rank, worker] = keys_of(ds)
    return out


@pytest.mark.parametrize("num_shards,per_shard", [(9, 3), (4, 5), (2, 7), (1, 3)])
@pytest.mark.parametrize("shuffle_seed", [None, 5])
def test_ranks_and_workers_read_every_sample_once(tmp_path, monkeypatch, num_shards, per_shard,
                                                  shuffle_seed):
    synth_shards(tmp_path, num_shards, per_shard, max_seconds=3.0)
    everything = keys_of(LocalTarDataset(tmp_path, loop=False))
    assert len(everything) == num_shards * per_shard
    parts = read_as_consumers(monkeypatch, tmp_path, 2, 2, shuffle_seed=shuffle_seed)
    flat = [k for keys in parts.values() for k in keys]
    assert sorted(flat) == sorted(everything)  # all covered, none twice
    if num_shards * per_shard >= 4 * 2:
        assert all(parts.values())  # everyone gets work


def steps_of(data, rank, world_size, micro_batch, steps, num_workers=0, **kw):
    """The samples a rank trains on, step by step (make_source: what make_loader batches)."""
    source = make_source(str(data), micro_batch=micro_batch, rank=rank, world_size=world_size, seed=5,
                         num_workers=num_workers, audio_frames=100, text_tokens=64, speaker_frames=100,
                         **kw)
    it = iter(source)
    out = [[next(it) for _ in range(micro_batch)] for _ in range(steps)]
    del it  # stops DataLoader workers
    return out


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_layout_reads_the_same_samples_per_step(tmp_path, num_workers):
    """1 rank x micro-batch 2B and 2 ranks x micro-batch B train on the same samples at every step:
    rank r takes slice r of each global batch of one global order, with or without workers."""
    synth_shards(tmp_path, 3, 5, max_seconds=3.0)  # 15 samples: steps straddle shards and epochs
    single = steps_of(tmp_path, 0, 1, 4, 6, num_workers)
    ranks = [steps_of(tmp_path, r, 2, 2, 6, num_workers) for r in range(2)]
    for k in range(6):
        assert keys_of(single[k]) == keys_of(ranks[0][k]) + keys_of(ranks[1][k])
        assert [s["index"] for s in single[k]] == list(range(4 * k, 4 * k + 4))
        assert [s["index"] for s in ranks[1][k]] == list(range(4 * k + 2, 4 * k + 4))
    # The global order: each epoch every sample once, shards whole and in sample order.
    stream = keys_of([s for batch in single for s in batch])
    for epoch in (stream[:15], stream[15:]):
        shards = [k.split("-")[0] for k in epoch]
        runs = [shards[i] for i in range(len(shards)) if i == 0 or shards[i] != shards[i - 1]]
        assert len(set(runs)) == len(runs)  # each shard read in one run
        assert [k for k in epoch if k.startswith(runs[0])] == sorted(k for k in epoch if k.startswith(runs[0]))
    assert sorted(stream[:15]) == sorted(keys_of(LocalTarDataset(tmp_path, loop=False)))


def test_a_skipped_sample_moves_nothing(tmp_path):
    """A bad sample's place holds a stand-in on whichever rank reads it: the layouts stay aligned."""
    synth_shards(tmp_path, 2, 5, max_seconds=3.0)
    rewrite_without(tmp_path / "shard-000001.tar", drop=["s000001-000002.json"])
    single = steps_of(tmp_path, 0, 1, 4, 5, skip_bad_samples=True)
    ranks = [steps_of(tmp_path, r, 2, 2, 5, skip_bad_samples=True) for r in range(2)]
    for k in range(5):
        assert keys_of(single[k]) == keys_of(ranks[0][k]) + keys_of(ranks[1][k])
    stream = [s for batch in single for s in batch]
    assert [s["index"] for s in stream] == list(range(20))
    stand_ins = [s["index"] for s in stream if s["key"] is None]
    assert len(stand_ins) == 2 and stand_ins[0] < 10 <= stand_ins[1]  # once per epoch of 10
    assert all(len(s["latent"]) == 0 for s in stream if s["key"] is None)


def test_loop_repeats_epochs_with_reshuffled_shards(tmp_path):
    synth_shards(tmp_path, 4, 2, max_seconds=3.0)
    ds = LocalTarDataset(tmp_path, shuffle_seed=1, loop=True)
    it = iter(ds)
    first, second = [next(it)["key"] for _ in range(8)], [next(it)["key"] for _ in range(8)]
    assert sorted(first) == sorted(second) and len(set(first)) == 8


# --- bad data -----------------------------------------------------------------------------------

def member_at(path, offset):
    """Name of the tar member whose header or data contains byte `offset`."""
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            if m.offset <= offset < m.offset_data + m.size:
                return m.name


@pytest.mark.parametrize("where", ["mid-data", "at-a-header"])
def test_truncated_shard_names_shard_and_key(tmp_path, where):
    paths = synth_shards(tmp_path, 3, 4, max_seconds=4.0)
    bad = paths[1]
    if where == "mid-data":
        cut = int(bad.stat().st_size * 0.6)
    else:  # cut between two samples: tarfile itself just stops there; the reader must notice
        with tarfile.open(bad) as tar:
            cut = tar.getmember("s000001-000002.npy").offset
    key = member_at(bad, cut).split(".")[0]
    if where == "at-a-header":
        key = "s000001-000001"  # the header is gone: the error names the last sample read
    bad.write_bytes(bad.read_bytes()[:cut])
    with pytest.raises(DataError) as e:
        list(LocalTarDataset(tmp_path, loop=False))
    msg = str(e.value)
    assert str(bad) in msg and repr(key) in msg and "--skip-bad-samples" in msg
    assert "\n" not in msg

    ds = LocalTarDataset(tmp_path, loop=False, skip_bad_samples=True)
    keys = keys_of(ds)
    assert ds.skipped == 1
    assert {f"s00000{s}-{i:06d}" for s in (0, 2) for i in range(4)} <= set(keys)  # other shards
    assert "s000001-000000" in keys  # samples before the damage survive
    assert "s000001-000003" not in keys
    assert (key in keys) == (where == "at-a-header")  # a whole sample before the cut survives
    assert (None in keys) == (where == "mid-data")  # a cut sample's slot holds a stand-in


def rewrite_without(path, drop=(), replace=None):
    """Rewrite a shard dropping some members and replacing others' bytes."""
    replace = replace or {}
    before = path.stat()
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w") as tar:
        for m, data in members:
            if m.name in drop:
                continue
            data = replace.get(m.name, data)
            m.size = len(data)
            tar.addfile(m, io.BytesIO(data))
    # Its index goes stale by size or mtime; on a filesystem with coarse timestamps a rewrite in the
    # same tick, padded to the same size, would look unchanged: make it a rewrite seen later.
    if path.stat().st_mtime_ns == before.st_mtime_ns:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


@pytest.mark.parametrize("damage,expect", [
    ({"drop": ["s000000-000001.ref.npy"]}, "s000000-000001.ref.npy"),
    ({"drop": ["s000000-000003.json"]}, "s000000-000003.json"),  # the last sample in the shard
    ({"replace": {"s000000-000002.npy": b"not an npy file"}}, "cannot decode"),
    ({"replace": {"s000000-000002.json": json.dumps({"txt": 1}).encode()}}, "cannot decode"),
])
def test_bad_member_raises_or_is_skipped(tmp_path, damage, expect):
    (path,) = synth_shards(tmp_path, 1, 4, max_seconds=3.0)
    rewrite_without(path, **damage)
    bad_key = expect.split(".")[0] if expect.startswith("s0") else "s000000-000002"
    with pytest.raises(DataError) as e:
        list(LocalTarDataset(tmp_path, loop=False))
    msg = str(e.value)
    assert str(path) in msg and repr(bad_key) in msg and expect in msg
    assert "--skip-bad-samples" in msg

    ds = LocalTarDataset(tmp_path, loop=False, skip_bad_samples=True)
    samples = list(ds)
    # A stand-in (no key, no audio) keeps the bad sample's place: nothing after it moves.
    assert ds.skipped == 1
    assert keys_of(samples) == [None if i == int(bad_key[-1]) else f"s000000-{i:06d}" for i in range(4)]
    assert [s["index"] for s in samples] == [0, 1, 2, 3]
    assert len(samples[int(bad_key[-1])]["latent"]) == 0


def test_bad_sample_is_reported_by_one_consumer(tmp_path, monkeypatch):
    synth_shards(tmp_path, 1, 8, max_seconds=3.0)  # fewer shards than consumers: index split
    rewrite_without(tmp_path / "shard-000000.tar", drop=["s000000-000005.ref.npy"])
    counts = []
    for worker in range(4):
        info = SimpleNamespace(num_workers=4, id=worker)
        monkeypatch.setattr(dataset_module, "get_worker_info", lambda: info)
        ds = LocalTarDataset(tmp_path, loop=False, skip_bad_samples=True)
        list(ds)
        counts.append(ds.skipped)
    assert sorted(counts) == [0, 0, 0, 1]


def test_directory_without_shards(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path}.*echobench data synth"):
        LocalTarDataset(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        LocalTarDataset(tmp_path / "nope")


# --- tokenizer ----------------------------------------------------------------------------------

def test_byte_tokenizer_ids_fit_and_tags_are_single_ids():
    tok = build_tokenizer(263)
    ids = tok.encode("[S1] héllo [S2]ok[S4]")
    assert all(0 <= i < 263 for i in ids) and tok.vocab_size == 263
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.pad_id == 0
    tag_ids = {tok.encode(t)[1] for t in CONDITIONING_TOKENS}
    assert len(tag_ids) == 4 and all(len(tok.encode(t)) == 3 for t in CONDITIONING_TOKENS)
    assert ids.count(tok.encode("[S2]")[1]) == 1 and tok.encode("[S1]")[1] in ids
    assert len(tok.encode("é")) == 4  # two UTF-8 bytes
    with pytest.raises(ValueError, match="263.*100"):
        build_tokenizer(100)


def make_hf_tokenizer(path, with_unused):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<bos>", "<eos>", "<unk>", "hello", "world", "[", "]", "S1"]
    if with_unused:
        words += [f"<unused{i}>" for i in range(6)]
    vocab = {w: i for i, w in enumerate(words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                  eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(path)
    return vocab


@pytest.mark.parametrize("with_unused", [True, False])
def test_hf_tokenizer_maps_tags(tmp_path, with_unused):
    vocab = make_hf_tokenizer(tmp_path, with_unused)
    tok = build_tokenizer(64, str(tmp_path))
    ids = tok.encode("[S1] hello [S3] world")
    s1, s3 = tok.tag_ids["[S1]"], tok.tag_ids["[S3]"]
    assert ids == [vocab["<bos>"], s1, vocab["hello"], s3, vocab["world"], vocab["<eos>"]]
    assert len(set(tok.tag_ids.values())) == 4 and all(i < tok.vocab_size for i in ids)
    if with_unused:  # spare entries reused: the vocabulary does not grow
        assert s1 == vocab["<unused0>"] and tok.vocab_size == len(vocab)
    else:
        assert min(tok.tag_ids.values()) >= len(vocab) and tok.vocab_size == len(vocab) + 4
    with pytest.raises(ValueError, match=f"{tok.vocab_size}.*only 8"):
        build_tokenizer(8, str(tmp_path))


# --- loaders ------------------------------------------------------------------------------------

def test_batch_loader_reraises_source_error():
    def source():
        yield from (sample(str(i), 4, 4) for i in range(3))
        raise RuntimeError("disk on fire")

    tok = build_tokenizer(512)
    loader = BatchLoader(source(), lambda s: collate(s, tok, 4, 8, 4), batch_size=2)
    assert next(loader).size == 2
    with pytest.raises(RuntimeError, match="disk on fire"):
        next(loader)
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()


def test_make_loader_skips_and_counts_bad_samples(tmp_path):
    synth_shards(tmp_path, 1, 4, max_seconds=3.0)
    rewrite_without(tmp_path / "shard-000000.tar", drop=["s000000-000001.ref.npy"])
    kw = dict(micro_batch=3, audio_frames=80, text_tokens=64, speaker_frames=80,
              tokenizer=build_tokenizer(512))
    with make_loader(str(tmp_path), **kw) as loader:
        with pytest.raises(DataError, match="s000000-000001"):
            next(loader)
    with make_loader(str(tmp_path), skip_bad_samples=True, **kw) as loader:
        assert next(loader).size == 3
        assert loader.skipped >= 1  # once per pass; the thread may already be on the next pass


def test_batch_loader_prefetches_in_background_and_closes():
    """Batches are made ahead in the thread: with the producer held back, the prefetched ones still
    come; once the queue is empty, next() waits for the thread, and last_wait_s is that wait.
    Handshakes, not sleeps: nothing here depends on how fast a loaded machine runs the thread."""
    made, gate = [], threading.Event()

    def collate(samples):
        made.append(len(samples))
        if len(made) > 5:  # from the 6th batch on, the producer waits for the test
            gate.wait(timeout=60)
        return len(made)

    def forever():
        while True:
            yield {}

    loader = BatchLoader(forever(), collate, batch_size=2, prefetch=4)
    deadline = time.monotonic() + 60
    while not (loader._queue.full() and len(made) >= 5) and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread fills the queue (4) and holds the 5th while it is full
    assert loader._queue.full() and len(made) == 5
    assert [next(loader) for _ in range(4)] == [1, 2, 3, 4]  # ready ones: the 6th cannot be made yet
    assert next(loader) == 5  # the batch the thread held while the queue was full
    opened = []
    timer = threading.Timer(0.2, lambda: (opened.append(time.perf_counter()), gate.set()))
    timer.start()
    called = time.perf_counter()
    assert next(loader) == 6  # the queue is empty: next() waits on the thread
    assert loader.last_wait_s >= opened[0] - called - 1e-3  # it blocked until the gate opened
    loader.close()
    timer.join()
    assert not loader._thread.is_alive()
    # this loader's thread is gone (another test's loader in this worker may still be winding down)
    assert loader._thread not in threading.enumerate()


def test_synthetic_source_is_full_length():
    tok = build_tokenizer(512)
    loader = make_loader("synthetic", micro_batch=3, audio_frames=50, text_tokens=32,
                         speaker_frames=30, tokenizer=tok)
    with loader:
        b = next(loader)
    assert b.latent.shape == (3, 50, 128) and b.ref.shape == (3, 32, 128)
    assert b.audio_len.tolist() == [50] * 3 and b.ref_len.tolist() == [30] * 3
    assert b.text_len.tolist() == [32] * 3 and b.text_mask.all() and b.latent_mask.all()
    assert b.ref_mask.sum().item() == 90
    raw = next(iter(SyntheticSource(50, 32, 30)))
    assert raw["latent"].shape == (50, 128) and raw["ref"].shape == (30, 128)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_make_loader_over_shards_loops(tmp_path, num_workers):
    synth_shards(tmp_path, 2, 3, max_seconds=6.0)
    tok = build_tokenizer(512)
    loader = make_loader(str(tmp_path), micro_batch=4, audio_frames=100, text_tokens=64,
                         speaker_frames=99, tokenizer=tok, num_workers=num_workers)
    with loader:
        batches = [next(loader) for _ in range(3)]  # 12 samples from 6: it loops
    for b in batches:
        assert b.latent.shape == (4, 100, 128) and b.ref.shape == (4, 100, 128)
        assert (b.audio_len <= 100).all() and (b.audio_len >= 50).all()
