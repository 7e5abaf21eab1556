"""The measured window holds training steps only: warm-up runs every micro-batch variant the window
can meet (bench_warmup), and a window in which torch compiled anything is measured again, or makes
the run an error (bench.MAX_WINDOWS)."""

import functools

import pytest
import torch

from echobench.train.bench_warmup import STREAMS, Variant, variant_micro_batch, warmup_variants
from echobench.records.config import RunConfig
from echobench.data import build_tokenizer
from echobench.model.config import PRESETS
from echobench.model.echo import diffusion_draws

TINY = dict(scale="tiny", audio_frames=50, text_tokens=16, speaker_frames=40, peak_tflops=1, micro_batch=2,
            device="cpu")


def first_masked_after_warmup(warmup_steps: int, micro_batch: int, cfg_dropout: float) -> int:
    """A seed whose warm-up micro-batches (synthetic, one process) all keep their conditioning and whose
    first measured one drops it: where a compiled run used to meet the DiT's masked graph first inside
    the measured window."""
    def dropped(seed, step):
        ids = range(step * micro_batch, (step + 1) * micro_batch)
        return not diffusion_draws(seed, ids, 1, 1, cfg_dropout, torch.device("cpu")).keep.all()

    return next(seed for seed in range(1000)
                if not any(dropped(seed, s) for s in range(warmup_steps)) and dropped(seed, warmup_steps))


def tokenizer():
    return build_tokenizer(PRESETS["tiny"].text_encoder.vocab)


def test_synthetic_runs_warm_the_dits_two_paths_and_nothing_more():
    """Synthetic samples fill every stream: the only variants are a micro-batch that keeps its
    conditioning and one that drops it (masked), per shape; none dropped by null conditioning or
    without dropout."""
    variants = warmup_variants(RunConfig(**TINY), None, tokenizer())
    assert variants == [Variant(50, False, False, False, False), Variant(50, False, False, False, True)]
    assert warmup_variants(RunConfig(**TINY, cfg_drop="null"), None, tokenizer()) == variants[:1]


def test_shard_runs_warm_each_shape_unpadded_and_padded(tmp_path):
    variants = warmup_variants(RunConfig(**TINY, data=str(tmp_path)), [20, 50], tokenizer())
    assert variants == [Variant(f, *(pad,) * 3, pad) for f in (20, 50) for pad in (False, True)]


@pytest.mark.parametrize("variant", [Variant(50, False, False, False, False), Variant(50, True, True, True, True),
                                     Variant(20, False, True, False, True)])
def test_a_variants_micro_batch_has_the_padding_and_drops_it_names(variant):
    cfg = RunConfig(**TINY)
    batch, draws = variant_micro_batch(cfg, variant, tokenizer(), torch.device("cpu"), torch.Generator())
    assert batch.latent.shape[:2] == (2, variant.frames)
    assert {s: getattr(batch.padding, s) for s in STREAMS} == {s: getattr(variant, s) for s in STREAMS}
    assert (not draws.keep.all()) == variant.dropped and (not draws.keep.any()) == variant.dropped


def run_without_warming_variants(tmp_path, monkeypatch, windows: int):
    """A compiled tiny run (dynamo with the aot_eager backend: the compiles are dynamo's, whatever
    compiles the graphs) whose first measured micro-batch is its first masked one, warm-up's variants
    left out: the DiT's masked graph compiles in the first measured step."""
    import torch._dynamo

    import echobench.train.bench as bench
    import echobench.train.bench_echo as bench_echo

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(bench_echo, "warmup_variants", lambda cfg, shapes, tok: [])
    monkeypatch.setattr(bench, "MAX_WINDOWS", windows)
    seed = first_masked_after_warmup(1, 2, PRESETS["tiny"].cfg_dropout)
    cfg = RunConfig(**TINY, steps=3, warmup_steps=1, compile=True, seed=seed)
    torch._dynamo.reset()
    try:
        return bench.run_benchmark(cfg, tmp_path / "run")
    finally:
        torch._dynamo.reset()


def test_a_window_in_which_torch_compiled_is_measured_again(tmp_path, monkeypatch):
    r = run_without_warming_variants(tmp_path, monkeypatch, windows=3)
    assert r.status == "ok", r.error
    (restart,) = r.window_restarts
    assert restart["window"] == 1 and restart["first_step"] == 1
    assert {c["rank"] for c in restart["compiles"]} == {0} and min(c["step"] for c in restart["compiles"]) == 0
    assert r.compiles_in_window == 0 and r.measured_steps == 3
    # the record's window is the second one: 1 warm-up + 3 discarded + 1 refill step before it
    assert len(r.losses) == 1 + 3 + 1 + 3


def test_a_run_that_compiles_in_every_window_is_an_error_that_keeps_its_figures(tmp_path, monkeypatch):
    r = run_without_warming_variants(tmp_path, monkeypatch, windows=1)
    assert r.status == "error" and r.compiles_in_window >= 1
    assert r.error.startswith(f"torch compiled {r.compiles_in_window} time(s) inside the measured window")
    assert "\n" not in r.error and "window_restarts" in r.error
    assert r.measured_steps == 3 and r.mfu > 0  # measured, and kept
    saved = (tmp_path / "run" / "result.json").read_text()
    assert '"status": "error"' in saved
