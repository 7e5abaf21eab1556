"""predict's element-wise bytes counted (echobench.predict.elementwise): stepcount's count of the run's
configuration at 1 and 2 layers per stack, extrapolated per layer; cached in memory and on disk; priced
by device_seconds on a GPU profile (nothing is timed)."""

import dataclasses
from unittest import mock

import pytest

from echobench.predict import stepcount
from echobench.records.config import RunConfig
from echobench.hardware.profile import find_profile, load_profile
from echobench.predict import elementwise as ew
from echobench.predict import pricing as pr
from echobench.predict import predict
from echobench.predict.work import elementwise_bytes, ratios_saved

LENGTHS = {"audio_frames": 24, "text_tokens": 12, "speaker_frames": 18}


def tiny(**kw) -> RunConfig:
    return RunConfig(**{"scale": "tiny", "micro_batch": 2, "precision": "bf16", "compile": False, **LENGTHS, **kw})


def full_count(cfg: RunConfig, dit: int, speaker: int, encoder: int) -> tuple[int, int]:
    """stepcount's memory-bound bytes (forward, backward) of one step at these layers, counted whole."""
    m = cfg.model_config()
    model = dataclasses.replace(m, layers=dit, speaker_layers=speaker,
                                text_encoder=dataclasses.replace(m.text_encoder, layers=encoder))
    with mock.patch.object(RunConfig, "model_config", lambda self: model):
        count = stepcount.count_step(cfg)
    return count.total("forward", kind="memory").bytes, count.total("backward", kind="memory").bytes


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    ew._counted.cache_clear()
    ew._FAILED.clear()
    yield
    ew._counted.cache_clear()
    ew._FAILED.clear()


@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_extrapolation_per_layer_equals_a_full_count(ac):
    cfg = tiny(ac=ac)
    run = ew.count_config(cfg, 2)
    depth1, depth2 = ew.count_at_depth(run, False, 1), ew.count_at_depth(run, False, 2)
    for layers in ((4, 3, 2), (3, 1, 4)):
        m = run.model_config()
        model = dataclasses.replace(m, layers=layers[0], speaker_layers=layers[1],
                                    text_encoder=dataclasses.replace(m.text_encoder, layers=layers[2]))
        with mock.patch.object(RunConfig, "model_config", lambda self, model=model: model):
            extrapolated = ew.extrapolate(run, depth1, depth2)
        assert extrapolated == full_count(run, *layers)  # exactly: bytes are integers
    # the top level (embeddings, projections, DiT input and output, the loss) is the same at any depth
    assert all(depth1[k] == depth2[k] for k in depth1 if k.endswith("/top"))
    # the optimizer and clipping are not in it: predict prices them apart
    assert set(depth1) == {f"{ph}/{pa}" for ph in ("forward", "backward") for pa in ew.PARTS}


def test_the_counted_ratios_against_the_old_fixed_ones():
    """The fixed eager ratios were counted on fp32 CPU steps, summing every tensor argument's numel:
    3.0 .. 4.0 forward, 5.2 .. 7.7 backward against today's activation estimate (5.4 .. 7.2 and 9.4 ..
    14 against the one before issue 34, 1.82x smaller at tiny). stepcount counts an fp32 step a little
    lower (each distinct element read once: a broadcast input once, a lookup the rows it gathers; the
    GPU's attention path). Under bf16 autocast the residual stream, norms and activations stay fp32 and every
    matmul's operands are cast, while the saved bytes are priced at 2 bytes an element: the bf16 ratios
    are about twice the fp32 ones. The old ratios, priced at 2 bytes, under-counted bf16 steps."""
    fp32 = tiny(precision="fp32", micro_batch=3, audio_frames=150, text_tokens=24, speaker_frames=60)
    counted = ew.counted_bytes(fp32, 4)
    saved = ratios_saved(fp32, 4)
    assert 0.8 * 3.0 <= counted.forward / saved <= 4.0
    assert 0.9 * 5.2 <= counted.backward / saved <= 7.7
    bf16 = dataclasses.replace(fp32, precision="bf16")
    half = ew.counted_bytes(bf16, 2)
    assert half.forward / ratios_saved(bf16, 2) > 1.5 * counted.forward / saved
    assert half.backward / ratios_saved(bf16, 2) > 1.5 * counted.backward / saved


def test_the_cache_returns_the_same_bytes_without_counting_again(monkeypatch):
    calls = []
    real = ew.count_at_depth

    def counting(*args):
        calls.append(args[1:])
        return real(*args)

    monkeypatch.setattr(ew, "count_at_depth", counting)
    cfg = tiny()
    first = ew.counted_bytes(cfg, 2)
    assert calls == [(False, 1), (False, 2)]
    assert ew.counted_bytes(cfg, 2) == first and len(calls) == 2  # in memory
    ew._counted.cache_clear()
    assert ew.counted_bytes(cfg, 2) == first and len(calls) == 2  # from disk
    # another configuration (another micro-batch) is counted
    ew.counted_bytes(tiny(micro_batch=3), 2)
    assert len(calls) == 4


def gpu_profile():
    return load_profile(find_profile("h100-hgx-ib"))


def test_predicts_elementwise_part_follows_the_counted_bytes_and_tp_splits_part_of_them(monkeypatch):
    """The prediction's element-wise part is priced from the count: twice the counted bytes, twice
    the part. TP divides part of the element-wise work over its ranks (the blocks', as
    memory.estimate_memory assumes), not the rest: a rank's share lies between 1/tp and all of it,
    smaller at tp4 than at tp2."""
    profile = gpu_profile()
    cfg = tiny(cfg_drop_attention="masked")  # the counted bytes alone: no split merge's (pricing.merge_bytes)
    p = predict(cfg, profile)
    assert any("element-wise bytes COUNTED" in n for n in p.notes)
    real = ew.counted_bytes
    monkeypatch.setattr(ew, "counted_bytes", lambda *args: dataclasses.replace(c := real(*args), forward=2 * c.forward,
                                                                                backward=2 * c.backward))
    assert predict(cfg, profile).parts["elementwise"] == pytest.approx(2 * p.parts["elementwise"], rel=1e-12)
    monkeypatch.setattr(ew, "counted_bytes", real)
    rates = pr.Rates(profile)
    one = pr.device_seconds(pr.priced(cfg, profile.device), rates, 2)["elementwise_forward"]
    tp2, tp4 = (pr.device_seconds(pr.priced(tiny(framework="megatron", parallelism=f"tp{n}", gpus_per_node=n),
                                            profile.device), rates, 2)["elementwise_forward"] for n in (2, 4))
    assert one / 2 < tp2 < one and one / 4 < tp4 < tp2


def test_compiled_runs_and_failed_counts_keep_the_ratios_with_a_note(monkeypatch):
    profile = gpu_profile()
    compiled = predict(tiny(compile="auto"), profile)  # auto: compiled on a GPU
    assert any("ASSUMED" in n and ew.COMPILED_ENV in n for n in compiled.notes)
    run = pr.priced(tiny(compile="auto"), profile.device)
    assert ew.echo_elementwise(run, 2)[0] == elementwise_bytes(run, 2)

    def fails(*args):
        raise ImportError("no torch")

    monkeypatch.setattr(ew, "count_at_depth", fails)
    p = predict(tiny(micro_batch=5), profile)
    assert any("counting the step failed: ImportError" in n for n in p.notes)
    eager = pr.priced(tiny(micro_batch=5), profile.device)
    assert ew.echo_elementwise(eager, 2)[0] == elementwise_bytes(eager, 2)


def test_a_cpu_run_is_counted_as_a_gpu_run_is():
    cfg = tiny(precision="fp32", device="cpu")
    (fwd, bwd), how = ew.echo_elementwise(cfg, 4)
    assert (fwd, bwd) == full_count(cfg, 2, 2, 2) and "COUNTED" in how


@pytest.mark.slow
def test_the_compiled_count_extrapolates_per_layer_too(monkeypatch):
    """ECHOBENCH_COUNT_COMPILED=1: inductor's kernels of each compiled unit times its calls, so the
    compiled count is as linear in the layers as the eager one."""
    cfg = tiny()
    with mock.patch.object(stepcount, "count_step", wraps=stepcount.count_step) as counted:
        depth1, depth2 = ew.count_at_depth(cfg, True, 1), ew.count_at_depth(cfg, True, 2)
        assert all(call.kwargs["compiled"] for call in counted.call_args_list)
    # Held at 3 DiT layers (tiny's own 2 everywhere would be the depth-2 count itself): counted whole.
    m = cfg.model_config()
    model = dataclasses.replace(m, layers=3, speaker_layers=1, text_encoder=dataclasses.replace(m.text_encoder, layers=2))
    with mock.patch.object(RunConfig, "model_config", lambda self: model):
        whole = stepcount.count_step(cfg, compiled=True)
        extrapolated = ew.extrapolate(cfg, depth1, depth2)
    assert extrapolated == (whole.total("forward", kind="memory").bytes, whole.total("backward", kind="memory").bytes)
    monkeypatch.setenv(ew.COMPILED_ENV, "1")  # the opt-in prices these counts (not counted again here)
    monkeypatch.setattr(ew, "count_at_depth", lambda run, compiled, depth: (depth1, depth2)[depth - 1] if compiled
                        else pytest.fail("counted eager"))
    run = pr.priced(tiny(compile="auto"), gpu_profile().device)
    fwd, bwd = ew.echo_elementwise(run, 2)[0]
    assert (fwd, bwd) == ew.extrapolate(cfg, depth1, depth2)
