"""The bucketed stream (echobench.data.buckets): a permutation of the global stream within each
window, cut into global batches each padded to the smallest boundary that holds its longest
sample; a function of the lengths and the seed alone, so every reader computes the same one."""

import random

import pytest

from echobench.data.buckets import WINDOW_BATCHES, boundaries, bucket_of, rank_slice, window
from echobench.records.config import parse_buckets


def lengths_2_to_20_s(n, seed=0):
    rng = random.Random(seed)
    return [rng.randint(50, 500) for _ in range(n)]  # 25 frames per second


def test_boundaries_are_quantiles_aligned_and_end_at_the_maximum():
    edges = boundaries(list(range(1, 401)), max_frames=500)
    assert edges == [104, 200, 304, 500]
    assert boundaries([10] * 100, max_frames=500) == [16, 500]  # one length: one bucket below the maximum
    assert boundaries([], max_frames=500) == [500]
    assert boundaries([1, 2], max_frames=500, given=[100, 250, 900]) == [100, 250, 500]


@pytest.mark.parametrize("text", ["", "a,b", "300,200", "0,100", "100,100"])
def test_bad_bucket_lists_are_refused(text):
    with pytest.raises(ValueError, match="ascending integers"):
        parse_buckets(text)


def test_a_window_is_a_permutation_padded_to_the_smallest_boundary_that_holds_each_batch():
    gb, lengths = 8, lengths_2_to_20_s(WINDOW_BATCHES * 8 * 3)
    edges = boundaries(lengths, max_frames=500)
    for w in range(3):
        batches = window(w, gb, lengths.__getitem__, edges, seed=1)
        seen = [g for b in batches for g in b.indices]
        assert sorted(seen) == list(range(w * WINDOW_BATCHES * gb, (w + 1) * WINDOW_BATCHES * gb))
        for b in batches:
            longest = max(lengths[g] for g in b.indices)
            assert b.frames == edges[bucket_of(longest, edges)] and b.frames >= longest
        assert len({b.frames for b in batches}) <= len(edges)


def test_the_stream_depends_on_the_seed_and_lengths_only_and_pads_less_than_one_shape():
    gb, lengths = 8, lengths_2_to_20_s(WINDOW_BATCHES * 8)
    edges = boundaries(lengths, max_frames=500)
    a = window(0, gb, lengths.__getitem__, edges, seed=3)
    assert a == window(0, gb, lengths.__getitem__, edges, seed=3)
    assert a != window(0, gb, lengths.__getitem__, edges, seed=4)  # another order of the same batches
    assert sorted(a, key=lambda b: b.indices) == sorted(window(0, gb, lengths.__getitem__, edges, seed=4),
                                                        key=lambda b: b.indices)
    real = sum(lengths)
    padded = sum(b.frames * len(b.indices) for b in a)
    assert real / padded > real / (500 * len(lengths)) + 0.2  # buckets waste far less than padding to 500


def test_ranks_split_each_global_batch_in_order():
    b = window(0, 4, lambda g: 100, [500], seed=0)[0]
    assert rank_slice(b, 0, 2) + rank_slice(b, 1, 2) == b.indices


# ---- the bucketed reader (LocalTarDataset, batching="bucket") on real shards ----

AUDIO_FRAMES = 12


def bucketed(data, rank, world_size, micro_batch, workers=1, worker=0, **kw):
    from echobench.data import LocalTarDataset

    ds = LocalTarDataset(data, rank=rank, world_size=world_size, micro_batch=micro_batch, shuffle_seed=5,
                         batching="bucket", audio_frames=AUDIO_FRAMES, **kw)
    seen = ((s["index"], s["key"], s["pad_frames"], len(s["latent"])) for s in ds.samples(workers, worker))
    return seen, ds


@pytest.fixture
def shards(tmp_path, monkeypatch):
    from test_data_index import tiny_shards

    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    return tiny_shards(tmp_path / "shards", [23, 40, 17])  # 80 samples of 2-10 frames


@pytest.mark.parametrize("world_size,workers,micro_batch", [(1, 2, 4), (2, 1, 2), (4, 1, 1), (2, 3, 2)])
def test_every_reader_takes_its_part_of_one_bucketed_stream(shards, world_size, workers, micro_batch):
    """Readers of any layout (ranks x DataLoader workers) together read the single reader's stream,
    global batch by global batch, over several epochs; each global batch has one shape, the smallest
    boundary that holds its longest sample."""
    import itertools

    gb, steps = micro_batch * world_size, 60
    stream, ds = bucketed(shards, 0, 1, gb, buckets=[4, 6, 8])  # (quantiles round to 8 frames: 2 buckets here)
    one = list(itertools.islice(stream, steps * gb))
    assert ds.edges == [4, 6, 8, AUDIO_FRAMES]
    for rank in range(world_size):
        workers_of = [bucketed(shards, rank, world_size, micro_batch, workers, w, buckets=[4, 6, 8])[0]
                      for w in range(workers)]
        mine = [next(workers_of[i % workers]) for i in range(steps * micro_batch)]  # a DataLoader's order
        for k in range(steps):
            assert mine[k * micro_batch:(k + 1) * micro_batch] == \
                one[k * gb + rank * micro_batch:k * gb + (rank + 1) * micro_batch]
    for k in range(steps):
        batch = one[k * gb:(k + 1) * gb]
        assert len({pad for _, _, pad, _ in batch}) == 1
        assert batch[0][2] == ds.edges[bucket_of(max(n for *_, n in batch), ds.edges)]
    window_size = WINDOW_BATCHES * gb  # the first window holds the first window_size samples, regrouped
    assert sorted(g for g, *_ in one[:window_size]) == list(range(window_size))
    assert [g for g, *_ in one[:window_size]] != list(range(window_size))


def test_collate_pads_a_bucketed_batch_to_its_bucket(shards):
    import itertools

    from echobench.data import build_tokenizer, collate
    from echobench.data import LocalTarDataset
    from echobench.model.config import PRESETS

    ds = LocalTarDataset(shards, micro_batch=4, batching="bucket", audio_frames=AUDIO_FRAMES)
    samples = list(itertools.islice(ds.samples(), 4))
    batch = collate(samples, build_tokenizer(PRESETS["tiny"].text_encoder.vocab), AUDIO_FRAMES, 16, 8)
    assert batch.latent.shape[1] == samples[0]["pad_frames"] <= AUDIO_FRAMES
    assert batch.audio_len.tolist() == [len(s["latent"]) for s in samples]


def test_bucketing_needs_every_index_and_shards(tmp_path, monkeypatch):
    from echobench.records.config import RunConfig
    from echobench.data import DataError, LocalTarDataset
    from test_data_index import tiny_shards

    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    paths = tiny_shards(tmp_path / "s", [5, 5])
    with pytest.raises(DataError, match="batching=bucket reads the samples' lengths from the shards' indexes"):
        LocalTarDataset(paths, batching="bucket", audio_frames=12, use_index=False)
    with pytest.raises(ValueError, match="needs shards"):
        RunConfig(batching="bucket")
    with pytest.raises(ValueError, match="ascending integers"):
        RunConfig(batching="bucket", data=str(tmp_path / "s"), buckets="8,4")
    with pytest.raises(ValueError, match="set batching=bucket"):
        RunConfig(data=str(tmp_path / "s"), buckets="4,8")


def test_given_boundaries_are_used_and_a_bad_sample_keeps_its_place(shards, tmp_path):
    import itertools

    from echobench.data import DataError
    from test_data import rewrite_without

    stream, ds = bucketed(shards, 0, 1, 4, buckets=[4, 8])
    assert ds.edges == [4, 8, AUDIO_FRAMES]
    before = list(itertools.islice(stream, 40))
    victim = before[5]
    rewrite_without(shards[int(victim[1][1])], (f"{victim[1]}.json",))  # keys are k{shard}-{i}: drop a member
    from echobench.data.index import ensure_index

    ensure_index(shards[int(victim[1][1])])
    stream, ds = bucketed(shards, 0, 1, 4, buckets=[4, 8])
    with pytest.raises(DataError, match=victim[1]):
        list(itertools.islice(stream, 40))
    stream, ds = bucketed(shards, 0, 1, 4, buckets=[4, 8], skip_bad_samples=True)
    after = list(itertools.islice(stream, 40))
    assert ds.skipped == 1
    assert [a for a in after if a[0] != victim[0]] == [b for b in before if b[0] != victim[0]]


def test_warming_the_variants_moves_no_weight_and_leaves_no_gradient(shards):
    """bench_warmup.warm_variants runs each bucket's shape forward and backward, masked and not, before
    the warm-up steps: the weights, the optimizer state and the gradients are as they were (the run
    trains as without it)."""
    import torch

    from echobench.backends import build_training
    from echobench.train.bench_warmup import warm_variants, warmup_variants
    from echobench.records.config import RunConfig
    from echobench.data import build_tokenizer
    from echobench.train.distributed import DistInfo

    cfg = RunConfig(scale="tiny", data=str(shards[0].parent), batching="bucket", micro_batch=2, audio_frames=12,
                    text_tokens=16, speaker_frames=8, precision="fp32", device="cpu")
    setup = build_training(cfg, DistInfo(), torch.float32)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    tokenizer = build_tokenizer(cfg.model_config().text_encoder.vocab)
    variants = warmup_variants(cfg, [4, 8, 12], tokenizer)
    assert [v.frames for v in variants] == [4, 4, 8, 8, 12, 12]
    warm_variants(setup, cfg, variants, tokenizer, torch.device("cpu"), torch.Generator())
    for n, p in setup.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n
    assert not setup.optimizer.state  # no step taken


def bucketing_error(paths) -> str:
    from echobench.data import DataError, LocalTarDataset

    with pytest.raises(DataError) as e:
        LocalTarDataset(paths, batching="bucket", audio_frames=12)
    return str(e.value)


def test_bucketing_says_what_to_do_about_each_shard_without_an_index(tmp_path, monkeypatch):
    """A damaged shard: replace or remove it (`data index` refuses it); an unreadable one: its
    permissions; one merely unindexed: `data index` of its real directory, or ECHOBENCH_CACHE."""
    from echobench.data import index as index_module
    from test_data_index import refuse_open, tiny_shards

    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    paths = tiny_shards(tmp_path / "s", [5, 5], index=False)
    monkeypatch.setattr(index_module, "_writable", lambda d: False)  # a read-only data dir and cache
    msg = bucketing_error(paths)
    assert f"and {paths[0]} has none (2 of 2 shards without one): run `echobench data index {tmp_path / 's'}` " \
           f"where it can write (or set ECHOBENCH_CACHE to a writable folder), or use batching=pad" in msg
    monkeypatch.undo()
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    refuse_open(monkeypatch, paths[1])
    msg = bucketing_error(paths)
    assert msg.endswith(f"and a shard cannot be read (1 of 2 shards without one): {paths[1]}: cannot be read "
                        f"(Permission denied): give this user read access to it (or remove it from {paths[1].parent})")
    paths[0].write_bytes(paths[0].read_bytes()[:1500])  # truncated: damaged, named before the unreadable one
    msg = bucketing_error(paths)
    assert f"and a damaged shard has none (2 of 2 shards without one): {paths[0]}: truncated or corrupt" in msg
    assert msg.endswith("replace or remove that shard (or use batching=pad, where --skip-bad-samples skips its "
                        "bad samples)") and "DIR" not in msg and "data index" not in msg


def test_a_boundary_over_audio_frames_is_refused_before_anything_runs(tmp_path, cli):
    from echobench.records.config import RunConfig

    with pytest.raises(ValueError, match=r"buckets='32,100,1000': 100, 1000 are over audio_frames=64, the longest audio and "
                                         r"always the last bucket: give boundaries up to 64, or raise audio_frames"):
        RunConfig(batching="bucket", data=str(tmp_path), audio_frames=64, buckets="32,100,1000")
    assert RunConfig(batching="bucket", data=str(tmp_path), audio_frames=64, buckets="32,64").buckets == "32,64"
    proc = cli("run", "--scale", "tiny", "--batching", "bucket", "--data", tmp_path, "--audio-frames", "64",
               "--buckets", "1000", "--out", tmp_path / "out")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "1000 is over audio_frames=64" in proc.stderr and not (tmp_path / "out").exists()


def test_nine_buckets_with_checkpointing_compile_without_hitting_dynamo_s_recompile_limit(shards, tmp_path,
                                                                                          monkeypatch):
    """9 bucket shapes, full AC and compile, as `echobench run` runs them (in this process): every
    compiled block enters through one code object (nn.Module's call, the checkpoint wrapper's
    too), so the shapes would pass dynamo's default limit of 8 graphs (FailOnRecompileLimitHit);
    the run sizes the limit to its shapes. torch.compile's backend is eager here: the limit, the
    graphs and the breaks are dynamo's, whatever compiles the graphs (aot_eager's traced backward
    adds CPU, not a recompile), and inductor on 9 shapes would take minutes."""
    import functools

    import torch
    import torch._dynamo

    from echobench.train.bench import run_benchmark
    from echobench.records.config import RunConfig

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = RunConfig(scale="tiny", data=str(shards[0].parent), batching="bucket", buckets="2,3,4,5,6,7,8,9",
                    audio_frames=10, micro_batch=2, text_tokens=16, speaker_frames=8, ac="full", compile=True,
                    steps=2, warmup_steps=1, peak_tflops=1, device="cpu")
    torch._dynamo.reset()
    try:  # dynamo's defaults, put back afterwards (the run raises them)
        with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
            r = run_benchmark(cfg, tmp_path / "run")
    finally:
        torch._dynamo.reset()
    assert r.status == "ok", r.error
    assert r.compile is True and r.compile_graph_breaks == 0 and r.compile_graphs > 8


def test_more_bucket_shapes_than_a_run_compiles_are_refused_in_one_line(tmp_path):
    from echobench.records.config import RunConfig

    edges = ",".join(str(8 * k) for k in range(1, 17))  # 16 boundaries + audio_frames: 17 shapes
    with pytest.raises(ValueError, match=r"17 shapes, at most 16: each shape is warmed up \(and compiled\)"):
        RunConfig(batching="bucket", data=str(tmp_path), audio_frames=200, buckets=edges)
