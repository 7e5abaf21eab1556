"""Compute pricing (issue 34, defects 2, 3 and 5): attention priced by the kernel a run takes and
at its own causality, the GEMM shape model (tile and wave quantization over the SM count) held
against the published best shapes, and the shipped profiles' achievable bandwidth and assumed
host cost per op where they have no measured figure. Nothing here times anything."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest

from echobench import predict as pr
from echobench.records.config import RunConfig
from echobench.hardware.devicerates import (
    GEMM_FIT,
    InStepFit,
    attention_points,
    attention_tflops,
    gemm_efficiency,
    gemm_model_tflops,
    gemm_rate,
    gemm_tflops,
)
from echobench.hardware.profile import (
    ATTENTION_KERNELS,
    AttentionPoint,
    GemmPoint,
    HardwareProfile,
    HostOpCost,
    MemoryPoint,
    find_profile,
    load_profile,
)
from echobench.predict.pricing import attention_kernel, device_seconds


def shipped(name: str) -> HardwareProfile:
    return load_profile(find_profile(name))


def cfg(**settings) -> RunConfig:
    base = dict(scale="800M", device="cuda", precision="bf16", micro_batch=4, audio_frames=300, text_tokens=64,
                speaker_frames=200, parallelism="single", gpus_per_node=1)
    return RunConfig(**{**base, **settings})


# ---- attention by kernel ----

def test_each_shipped_gpu_profile_has_every_kernel_at_head_dim_128_from_512_to_8k():
    for name in ("h100-hgx-ib", "h200-hgx-ib", "gh200-quad-slingshot"):
        p = shipped(name)
        for kernel in ATTENTION_KERNELS:
            seqs = {a.seq_q for a in p.attention if a.kernel == kernel and a.head_dim == 128 and not a.causal}
            assert {2048, 4096, 8192} <= seqs, (name, kernel)
        for kernel in ("flash2", "flash3", "cudnn", "efficient", "flex"):  # causal too (math: non-causal only)
            assert {512, 1024, 2048, 4096, 8192} <= {a.seq_q for a in p.attention if a.kernel == kernel and a.causal}


def test_flash3_is_faster_than_flash2_at_8k_on_h100_and_cudnn_between():
    p = shipped("h100-hgx-ib")
    rate = {k: attention_tflops(p, 8192, 8192, 128, False, k) for k in ("flash2", "flash3", "cudnn", "efficient")}
    # FA3 paper Fig. 5c / 6b: FA3 646 / 559, cuDNN 600 / 518, FA2 370 / 318 TFLOP/s forward / backward at 8k
    assert rate["flash3"] > rate["cudnn"] > rate["flash2"] > rate["efficient"]
    assert rate["flash3"] == pytest.approx(3 / (1 / 646 + 2.5 / 559), rel=1e-3)
    # every point is below the dense bf16 peak once counted as echobench counts (all scores, bwd 2x fwd)
    assert all(a.tflops < 989 for a in p.attention)


def test_causal_is_priced_at_its_own_points_counted_with_every_score():
    p = shipped("h100-hgx-ib")
    rates = pr.Rates(p, terms=InStepFit())  # the points as published, no in-step clock
    causal = rates.attention_tflops(8192, 8192, 128, True, "flash2")
    plain = rates.attention_tflops(8192, 8192, 128, False, "flash2")
    # FlashAttention-2 README, H100: 308 TFLOP/s causal fwd+bwd at 8k, flash-attention's count (3.5x the
    # forward, half the scores): echobench counts every score, backward 2x: x 3/3.5 x 2
    assert causal == pytest.approx(308 * 3 / 3.5 * 2, rel=1e-3)
    assert causal != pytest.approx(2 * plain, rel=0.02)  # its own points, not the non-causal ones doubled
    # the H200's one measured point (azure) carries the same conversion
    h200 = shipped("h200-hgx-ib")
    point = next(a for a in h200.attention if a.kernel == "flash2" and a.causal and a.seq_q == 8192)
    assert point.tflops == pytest.approx(329.3 * 3 / 3.5 * 2, abs=0.1)


def test_a_kernel_the_profile_lacks_falls_back_in_order_and_says_so():
    only = HardwareProfile(name="p", device="NVIDIA H100 80GB HBM3", dtype="bfloat16", measured=False, date="x",
                           attention=[AttentionPoint(batch=1, heads=16, head_dim=128, seq_q=4096, seq_k=4096,
                                                     kernel="flash2", tflops=280.0, source="set")])
    points, factor, why = attention_points(only, 128, False, "flash3")
    assert factor == 1 and points[0].kernel == "flash2" and "flash2" in why
    points, factor, why = attention_points(only, 128, True, "flash2")  # causal from non-causal: x2, said
    assert factor == 2 and "x2" in why
    assert attention_points(only, 128, False, "flash2")[2] is None  # its own points: no note
    assert "at head_dim 128" in attention_points(only, 256, False, "flash2")[2]  # another head_dim's: said
    calibrated = only.model_copy(update={"attention": [a.model_copy(update={"kernel": None}) for a in only.attention]})
    assert attention_points(calibrated, 128, False, None)[2] is None  # a calibration's own path, asked for none
    with pytest.raises(ValueError, match="unknown attention kernel"):
        attention_points(only, 128, False, "flash9")


def test_every_published_attention_point_is_its_cited_figures_in_echobenchs_count():
    """Each H100 point re-derived from the TFLOP/s its source quotes: flash-attention's benchmarks count
    backward as 2.5x the forward and half the scores of a causal run (fa-bench-flops); echobench counts
    every score and backward 2x. Separate forward / backward figures: 3 / (1/fwd + 2.5/bwd) (x2 causal, the
    causal backward from the non-causal one x the forward's causal ratio); a forward + backward figure
    (3.5x the forward): x 3/3.5 (x2 causal)."""
    separate = re.compile(r"forward (\d+) \(Fig\. 5c\) and backward (\d+) \(Fig\. 6b\)")
    points = shipped("h100-hgx-ib").attention
    assert sum(a.source.startswith("fa3-paper:") and a.causal for a in points) == 12  # flash3, cudnn x 6 lengths
    for a in points:
        if a.source.startswith("fa2-h100:"):
            figure = float(re.search(r"forward \+ backward (\d+) TFLOP/s", a.source).group(1))
            assert a.tflops == pytest.approx(figure * 3 / 3.5 * (2 if a.causal else 1), abs=0.06), a.name
        elif a.source.startswith("fa3-paper:") and not a.causal:
            fwd, bwd = map(float, separate.search(a.source).groups())
            assert a.tflops == pytest.approx(3 / (1 / fwd + 2.5 / bwd), abs=0.06), a.name
        elif a.source.startswith("fa3-paper:"):
            fwd = float(re.search(r"causal forward (\d+) TFLOP/s", a.source).group(1))
            bwd, plain = map(float, re.search(r"non-causal backward (\d+) .* ratio (\d+)/(\d+)", a.source).group(1, 3))
            assert a.tflops == pytest.approx(2 * 3 / (1 / fwd + 2.5 / (bwd * fwd / plain)), abs=0.06), a.name
        elif a.kernel == "triton":  # FA2's point here x the A100 figure's Triton / FA2 ratio it names
            fa2 = next(b for b in points if b.kernel == "flash2" and (b.seq_q, b.causal) == (a.seq_q, a.causal))
            ratio = float(re.search(r"on A100 \((0\.\d+)", a.source).group(1))
            assert a.source.startswith("assumed:") and a.tflops == pytest.approx(fa2.tflops * ratio, rel=2e-3), a.name
        else:
            assert a.source.startswith("assumed:") and a.kernel in ("efficient", "flex"), a.name


@pytest.mark.parametrize("settings, kernel", [
    (dict(), "flash2"), (dict(sdpa_backend="flash"), "flash2"), (dict(sdpa_backend="efficient"), "efficient"),
    (dict(sdpa_backend="cudnn"), "cudnn"), (dict(sdpa_backend="math"), "math"),
    (dict(data="/shards"), "flex"), (dict(data="/shards", key_masking="dense"), "efficient"),
    (dict(data="/shards", key_masking="dense", sdpa_backend="cudnn"), "cudnn")])
def test_the_kernel_an_echo_run_takes_follows_its_settings(settings, kernel):
    assert attention_kernel(cfg(**settings)) == kernel


def scaled_points(p: HardwareProfile, field: str, factor: float, **match) -> HardwareProfile:
    """`p` with the `field` points that match (attribute = value) `factor` times as fast."""
    points = [x.model_copy(update={"tflops" if field != "memory" else "gbps":
                                   (x.tflops if field != "memory" else x.gbps) * factor})
              if all(getattr(x, k) == v for k, v in match.items()) else x for x in getattr(p, field)]
    return p.model_copy(update={field: points})


def test_an_echo_run_with_sdpa_efficient_is_priced_at_the_efficient_kernels_points():
    """Only the efficient kernel's points price its attention: twice as fast points, half the time;
    FlashAttention-2's twice as fast, no change."""
    p = shipped("h100-hgx-ib")
    run = cfg(sdpa_backend="efficient", cfg_drop="null")  # no micro-batch masked: every call the efficient kernel
    dev = device_seconds(run, pr.Rates(p), 2)
    faster = device_seconds(run, pr.Rates(scaled_points(p, "attention", 2.0, kernel="efficient")), 2)
    other = device_seconds(run, pr.Rates(scaled_points(p, "attention", 2.0, kernel="flash2")), 2)
    assert faster["attention_forward"] == pytest.approx(dev["attention_forward"] / 2, rel=1e-9)
    assert other["attention_forward"] == dev["attention_forward"]
    flash = device_seconds(cfg(cfg_drop="null"), pr.Rates(p), 2)
    assert dev["attention_forward"] > 1.5 * flash["attention_forward"]  # the efficient kernel is the slower


# ---- GEMM shapes ----

def test_a_shape_one_tile_row_past_a_full_wave_is_slower_per_flop():
    sms = 132
    full = gemm_efficiency(128 * sms, 256, 4096, sms)  # 132 tiles of 128 x 256: one full wave
    past = gemm_efficiency(128 * sms + 128, 256, 4096, sms)
    assert full == pytest.approx(1.0) and past < 0.75 * full
    p = shipped("h100-hgx-ib")
    assert gemm_tflops(p, 128 * sms + 128, 256, 4096) < gemm_tflops(p, 128 * sms, 256, 4096)


def test_the_published_best_shapes_sit_on_a_crest_of_the_model():
    """ml-engineering's MAMF table: the best shape an exhaustive search found on H100 SXM (794.5 TFLOP/s
    at 2048x2048x13312, MxNxK) and on GH200 (828.6 at 1024x15360x4096). A shape model that put either
    below 90% of its own ceiling would contradict the search (tolerance 10%); the best shape is priced at
    its published rate exactly."""
    for m, n, k in ((2048, 2048, 13312), (1024, 15360, 4096)):
        assert gemm_efficiency(m, n, k, 132) >= 0.90
    h100 = shipped("h100-hgx-ib")
    assert gemm_tflops(h100, 2048, 2048, 13312) == 794.5
    assert gemm_tflops(h100, 8192, 8192, 8192) <= 794.5  # never above the best the device was seen to reach
    assert gemm_tflops(h100, 1536, 1536, 3000) < 0.7 * 794.5  # 144 tiles of 128x128: two waves, one nearly empty


# OpenXLA's measured H100 (sm_90) bf16 matmul rates, TFLOP/s, batch 1, (m, n, k): github.com/tensorflow/
# tensorflow third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h at 372d578bb861cc5804e56d37d93aec931a59762c
# (kDefaultMatmulPTable, "bf16xbf16->bf16" values / 1e12, rounded to 0.1): all 125 rows of b = 1, m, n, k in 256 .. 4096.
XLA_H100 = {
    (256, 256, 256): 6.5, (256, 256, 512): 11.5, (256, 256, 1024): 19.5, (256, 256, 2048): 31.1,
    (256, 256, 4096): 84.3, (256, 512, 256): 11.5, (256, 512, 512): 22.0, (256, 512, 1024): 39.1,
    (256, 512, 2048): 62.4, (256, 512, 4096): 91.7, (256, 1024, 256): 22.7, (256, 1024, 512): 41.8,
    (256, 1024, 1024): 72.5, (256, 1024, 2048): 119.0, (256, 1024, 4096): 172.3, (256, 2048, 256): 41.8,
    (256, 2048, 512): 78.2, (256, 2048, 1024): 138.1, (256, 2048, 2048): 215.8, (256, 2048, 4096): 285.9,
    (256, 4096, 256): 78.0, (256, 4096, 512): 138.1, (256, 4096, 1024): 225.2, (256, 4096, 2048): 324.6,
    (256, 4096, 4096): 412.0, (512, 256, 256): 11.5, (512, 256, 512): 21.8, (512, 256, 1024): 39.3,
    (512, 256, 2048): 60.1, (512, 256, 4096): 91.1, (512, 512, 256): 21.6, (512, 512, 512): 40.7,
    (512, 512, 1024): 71.2, (512, 512, 2048): 114.7, (512, 512, 4096): 174.5, (512, 1024, 256): 43.5,
    (512, 1024, 512): 80.5, (512, 1024, 1024): 138.7, (512, 1024, 2048): 216.5, (512, 1024, 4096): 309.6,
    (512, 2048, 256): 79.3, (512, 2048, 512): 143.4, (512, 2048, 1024): 232.6, (512, 2048, 2048): 342.4,
    (512, 2048, 4096): 430.5, (512, 4096, 256): 134.2, (512, 4096, 512): 236.3, (512, 4096, 1024): 373.3,
    (512, 4096, 2048): 522.2, (512, 4096, 4096): 644.1, (1024, 256, 256): 22.0, (1024, 256, 512): 40.9,
    (1024, 256, 1024): 68.3, (1024, 256, 2048): 113.2, (1024, 256, 4096): 169.7, (1024, 512, 256): 42.9,
    (1024, 512, 512): 82.2, (1024, 512, 1024): 141.3, (1024, 512, 2048): 220.0, (1024, 512, 4096): 298.9,
    (1024, 1024, 256): 82.0, (1024, 1024, 512): 145.6, (1024, 1024, 1024): 236.3, (1024, 1024, 2048): 350.0,
    (1024, 1024, 4096): 470.1, (1024, 2048, 256): 139.5, (1024, 2048, 512): 237.6, (1024, 2048, 1024): 373.3,
    (1024, 2048, 2048): 524.3, (1024, 2048, 4096): 653.5, (1024, 4096, 256): 209.7, (1024, 4096, 512): 338.9,
    (1024, 4096, 1024): 490.3, (1024, 4096, 2048): 634.2, (1024, 4096, 4096): 738.5, (2048, 256, 256): 43.6,
    (2048, 256, 512): 77.3, (2048, 256, 1024): 135.8, (2048, 256, 2048): 216.1, (2048, 256, 4096): 307.5,
    (2048, 512, 256): 83.9, (2048, 512, 512): 142.8, (2048, 512, 1024): 235.9, (2048, 512, 2048): 347.7,
    (2048, 512, 4096): 451.2, (2048, 1024, 256): 141.6, (2048, 1024, 512): 238.4, (2048, 1024, 1024): 373.3,
    (2048, 1024, 2048): 523.3, (2048, 1024, 4096): 653.1, (2048, 2048, 256): 213.0, (2048, 2048, 512): 345.5,
    (2048, 2048, 1024): 493.9, (2048, 2048, 2048): 632.0, (2048, 2048, 4096): 738.0, (2048, 4096, 256): 299.3,
    (2048, 4096, 512): 450.4, (2048, 4096, 1024): 594.2, (2048, 4096, 2048): 715.4, (2048, 4096, 4096): 753.6,
    (4096, 256, 256): 82.2, (4096, 256, 512): 137.2, (4096, 256, 1024): 217.2, (4096, 256, 2048): 304.7,
    (4096, 256, 4096): 376.2, (4096, 512, 256): 142.5, (4096, 512, 512): 238.8, (4096, 512, 1024): 370.8,
    (4096, 512, 2048): 521.7, (4096, 512, 4096): 650.0, (4096, 1024, 256): 216.5, (4096, 1024, 512): 343.7,
    (4096, 1024, 1024): 488.1, (4096, 1024, 2048): 632.0, (4096, 1024, 4096): 738.5, (4096, 2048, 256): 304.0,
    (4096, 2048, 512): 447.0, (4096, 2048, 1024): 593.2, (4096, 2048, 2048): 716.1, (4096, 2048, 4096): 758.4,
    (4096, 4096, 256): 392.2, (4096, 4096, 512): 543.1, (4096, 4096, 1024): 677.4, (4096, 4096, 2048): 738.7,
    (4096, 4096, 4096): 783.3,
}


def _log_errors(rate) -> tuple[list[float], list[float], list[float]]:
    """|log(model / published)| on the rows of at least 2^31 FLOPs GEMM_FIT was fitted to (every second in
    sorted order), on the rest of them, and on the smaller (launch-bound) rows outside the fit."""
    rows = sorted(s for s in XLA_H100 if 2 * s[0] * s[1] * s[2] >= 2**31)
    errors = [abs(math.log(rate(*s) / XLA_H100[s])) for s in rows]
    small = [abs(math.log(rate(*s) / XLA_H100[s])) for s in XLA_H100 if 2 * s[0] * s[1] * s[2] < 2**31]
    return errors[0::2], errors[1::2], small


def test_the_fitted_shape_model_holds_on_the_published_rows_it_was_not_fitted_to():
    """GEMM_FIT's three constants are fitted to every second row of OpenXLA's H100 table of at least 2^31
    FLOPs; on the other 36 the model is within a mean 8% and a max 25% (log error; it reaches 5.9% / 18%).
    The shipped H100 profile (the model scaled to MAMF's best shape, from another machine) is within a
    mean 10% and a max 30% of all 72. The launch-bound GEMMs under 2^31 FLOPs are outside the fit (31%)."""
    fitted, held_out, small = _log_errors(lambda m, n, k: gemm_model_tflops(m, n, k, 132))
    assert len(fitted) + len(held_out) == 72 and len(small) == 53
    assert sum(fitted) / len(fitted) < 0.10 and sum(held_out) / len(held_out) < 0.08 and max(held_out) < 0.25
    assert GEMM_FIT["tflops"] < 989  # the rate scale stays below the dense bf16 peak
    h100 = shipped("h100-hgx-ib")
    fitted, held_out, _ = _log_errors(lambda m, n, k: gemm_tflops(h100, m, n, k))
    every = fitted + held_out
    assert sum(every) / len(every) < 0.10 and max(every) < 0.30


def test_measured_shapes_keep_the_nearest_point_and_the_model_needs_an_sm_count():
    points = [GemmPoint(m=4096, n=4096, k=4096, tflops=700.0, source="set"),
              GemmPoint(m=1536, n=1536, k=3000, tflops=600.0, source="set")]
    calibrated = HardwareProfile(name="c", device="NVIDIA H100 80GB HBM3", dtype="bfloat16", measured=True, date="x",
                                 gemm=points)
    assert gemm_tflops(calibrated, 1500, 1540, 3000) == 600.0  # no sm_count: the nearest point
    modelled = calibrated.model_copy(update={"sm_count": 132})
    assert gemm_rate(modelled, 1536, 1536, 3000) == (points[1], 1.0)  # a measured shape stands for itself
    point, factor = gemm_rate(modelled, 3000, 1536, 1536)  # no point near: the best point, scaled
    assert point is points[0] and factor == pytest.approx(
        gemm_model_tflops(3000, 1536, 1536, 132) / gemm_model_tflops(4096, 4096, 4096, 132))


# ---- memory and host ----

def test_shipped_gpu_profiles_price_elementwise_at_the_achievable_add_bandwidth():
    for name, datasheet in (("h100-hgx-ib", 3350.0), ("h200-hgx-ib", 4800.0), ("gh200-quad-slingshot", 4000.0)):
        p = shipped(name)
        assert pr.Rates(p).memory_gbps() == pytest.approx(0.86 * datasheet, rel=0.01), name  # H200: measured 4.15 TB/s, 86.5%
    # the element-wise time follows the add points alone: twice their bandwidth, half the time
    p, run = shipped("h100-hgx-ib"), cfg()
    dev = device_seconds(run, pr.Rates(p), 2)
    faster = device_seconds(run, pr.Rates(scaled_points(p, "memory", 2.0, op="add")), 2)
    assert faster["elementwise_forward"] == pytest.approx(dev["elementwise_forward"] / 2, rel=1e-9)


def test_eager_elementwise_on_the_h200_takes_the_add_measured_nearest_its_tensors():
    """The H200 profile's eager add measured at Echo 3B's activation (30.7 MB tensors, 2.66 TB/s)
    prices eager element-wise work of tensors near that size; BabelStream's 268 MB point prices larger
    ones, compiled work its Triton figure, whatever the size."""
    rates = pr.Rates(shipped("h200-hgx-ib"))
    near = next(m for m in rates.profile.memory if m.op == "add" and "echobench-h200" in m.source)
    assert near.nbytes == 8 * 750 * 2560 * 2 and near.gbps < 4150.0
    assert rates.memory_gbps("add", 8 * 750 * 2560 * 2) == near.gbps
    assert rates.memory_gbps("add", 16 * 750 * 1536 * 2) == near.gbps  # 800M at micro-batch 16
    assert rates.memory_gbps("add", 500e6) == 4150.0 and rates.memory_gbps("add") == 4150.0
    assert rates.memory_gbps("triton", 8 * 750 * 2560 * 2) == rates.memory_gbps("triton", 500e6) < 4150.0
    eager, compiled = cfg(compile=False), cfg(compile=True)
    slower = rates.profile.model_copy(update={"memory": [m.model_copy(update={"gbps": m.gbps / 2}) if m is near else m
                                                         for m in rates.profile.memory]})
    tensor = eager.micro_batch * eager.audio_frames * eager.model_config().width * 2
    assert rates.memory_gbps("add", tensor) == near.gbps  # cfg()'s tensors are near the measured size
    assert pr.predict(eager, slower).parts["elementwise"] > pr.predict(eager, rates.profile).parts["elementwise"]
    assert pr.predict(compiled, slower).parts["elementwise"] == pr.predict(compiled, rates.profile).parts["elementwise"]


def test_the_assumed_host_cost_prices_the_host_where_no_host_step_was_measured():
    p = shipped("h100-hgx-ib")
    assert p.host_op is not None and "assumed" in p.host_op.source and not p.host_steps
    run = cfg(compile=False)
    pred = pr.predict(run, p)
    doubled = p.host_op.model_copy(update={"seconds": 2 * p.host_op.seconds})
    twice = pr.predict(run, p.model_copy(update={"host_op": doubled}))
    assert pred.host_s > 0 and twice.host_s == pytest.approx(2 * pred.host_s)  # a cost per op: twice it, twice the host
    assert any("host_op" in n and "per op" in n for n in pred.notes)
    assert any(n.startswith("attention priced as the flash2 kernel the run takes (pricing.attention_kernel); the "
                            "DiT's 34% micro-batches in which a sample drops its conditioning as two unmasked")
               for n in pred.notes)  # micro-batch 4: 1 - 0.9^4 drop a sample's conditioning (split, the default)
    masked = pr.predict(replace(run, cfg_drop_attention="masked"), p)
    assert any(n.startswith("attention priced as the flash2 kernel the run takes (pricing.attention_kernel); the "
                            "DiT's 66% flash2, 34% flex") for n in masked.notes)
    # a GPU: no host cost leaves the device's time, a host far slower is the step
    bare = pr.predict(run, p.model_copy(update={"host_op": None}))
    assert bare.host_s == 0.0 and bare.step_time_s == pytest.approx(bare.device_s)
    with_cost = p.model_copy(update={"host_op": HostOpCost(seconds=1e-3, source="set")})
    slow = pr.predict(run, with_cost)
    assert slow.step_time_s == pytest.approx(slow.host_s) and slow.host_s > slow.device_s


def test_the_memory_point_without_add_falls_back_to_the_datasheet():
    p = HardwareProfile(name="d", device="X", dtype="bfloat16", measured=False, date="x",
                        memory=[MemoryPoint(op="datasheet", gbps=1000.0, source="set")])
    assert pr.Rates(p).memory_gbps() == 1000.0
    assert pr.Rates(p).memory_gbps("adamw") == 1000.0  # no AdamW figure: the add, else the datasheet
