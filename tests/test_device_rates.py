"""echobench.hardware.devicerates: each device rate a plain function of a profile, with its source; the
GEMM model's shape and clock terms and the float8 rate behave as the physics says."""

import pytest

from echobench.hardware import devicerates as dr
from echobench.hardware.profile import GemmPoint, KernelGap, SustainedClock, find_profile, load_profile

NONE = dr.InStepFit()  # no fitted in-step clock: the profile's own figures


def shipped(name: str):
    return load_profile(find_profile(name))


def test_a_gemm_at_the_best_points_shape_is_that_point_and_a_one_wave_shape_is_slower():
    h100 = shipped("h100-hgx-ib")
    best = max(dr.gemm_points(h100), key=lambda p: p.tflops)
    at_best = dr.gemm(h100, best.m, best.n, best.k, fit=NONE)
    assert at_best.value == best.tflops and best.source in at_best.source
    small = dr.gemm(h100, 256, 256, 4096, fit=NONE)  # 2 to 4 output tiles on 132 SMs: split-K cannot fill them
    assert small.value < 0.5 * at_best.value and "shape model" in small.source


def test_float8_gemms_run_at_the_devices_float8_rate_and_a_device_without_one_says_so():
    h100 = shipped("h100-hgx-ib")
    bf16, fp8 = dr.gemm(h100, 8192, 8192, 8192), dr.gemm(h100, 8192, 8192, 8192, "fp8")
    assert 1.4 * bf16.value < fp8.value <= dr.peak(h100, "fp8").value and "float8" in fp8.source
    a100 = shipped("a100-sxm-80gb")
    with pytest.raises(KeyError, match="fp8"):
        dr.gemm(a100, 8192, 8192, 8192, "fp8")


def test_the_sustained_clock_scales_gemm_and_attention_and_its_range_gives_the_bounds():
    h100 = shipped("h100-hgx-ib")
    slow = h100.model_copy(update={"clock": SustainedClock(ratio=0.9, low=0.8, high=1.0, source="test: 500 W")})
    for f in (lambda p: dr.gemm(p, 4096, 4096, 4096, fit=NONE), lambda p: dr.attention(p, 4096, 4096, 128, True, "flash2", NONE)):
        full, throttled = f(h100), f(slow)
        assert throttled.value == pytest.approx(0.9 * full.value) and "500 W" in throttled.source
        assert throttled.range == pytest.approx((0.8 * full.value, full.value))
    assert dr.sustained_clock(h100, NONE).value == 1.0  # its points are the device's own sustained figures


def test_the_fitted_in_step_clock_is_its_familys_and_a_measured_profile_takes_none():
    fit = dr.InStepFit({"hopper": 0.7, "ampere": 0.8}, ("row",), "test fit")
    for name, want in (("h100-hgx-ib", 0.7), ("h200-hgx-ib", 0.7), ("gh200-quad-ib", 0.7), ("a100-sxm-80gb", 0.8)):
        p = shipped(name)
        assert dr.in_step_clock(p, fit).value == want and "FITTED" in dr.in_step_clock(p, fit).source
        assert dr.gemm(p, 4096, 4096, 4096, fit=fit).value == pytest.approx(want * dr.gemm(p, 4096, 4096, 4096, fit=NONE).value)
    measured = shipped("h100-hgx-ib").model_copy(update={"measured": True})
    assert dr.in_step_clock(measured, fit).value == 1.0
    assert dr.gpu_family("NVIDIA GH200 120GB") == "hopper" and dr.gpu_family("CPU AMD EPYC") is None
    committed = dr.committed_fit()
    assert set(committed.clock) == {"hopper", "ampere"} and all(0.6 <= c <= 1 for c in committed.clock.values())


def test_a_run_on_one_gpu_is_outside_the_fits_rows_and_priced_at_the_isolated_rate():
    fit = dr.InStepFit({"hopper": 0.7}, ("row",), "test fit")
    h200 = shipped("h200-hgx-ib")
    assert dr.run_fit(8, fit) is fit and dr.in_step_clock(h200, dr.run_fit(2, fit)).value == 0.7
    one = dr.in_step_clock(h200, dr.run_fit(1, fit))
    assert one.value == 1.0 and "one GPU" in one.source


def test_a_one_gpu_prediction_prices_gemms_at_the_isolated_rate_and_says_so():
    """The same per-GPU step on 1 and on 8 H200s: the 8-GPU run's GEMM and attention seconds are the
    one-GPU run's over the committed hopper clock, and each run's notes say which it took."""
    from echobench.predict import predict
    from echobench.records.config import RunConfig

    h200, clock = shipped("h200-hgx-ib"), dr.committed_fit().clock["hopper"]
    one, eight = (predict(RunConfig(scale="800M", micro_batch=8, gpus_per_node=g, parallelism="single" if g == 1 else "ddp",
                                    device="cuda"), h200) for g in (1, 8))
    for part in ("gemm", "attention"):
        assert eight.parts[part] == pytest.approx(one.parts[part] / clock, rel=1e-9)
    assert any("isolated kernels' rate: no in-step clock (one GPU" in n for n in one.notes)
    assert any(f"at {clock:.3g} x the isolated kernels' rate" in n for n in eight.notes)


def test_memory_bound_work_eager_and_compiled_and_the_kernel_gap_name_their_sources():
    h200 = shipped("h200-hgx-ib")
    eager, compiled = dr.memory_bandwidth(h200), dr.memory_bandwidth(h200, compiled=True)
    assert eager.value == 4150.0 and "BabelStream Add" in eager.source
    # the H200 has a Triton point (assumed: 69% of its datasheet peak); a profile without one prices
    # compiled work at its add figure, and says so
    assert compiled.value < eager.value and "Triton" in compiled.source and compiled.assumed
    bare = h200.model_copy(update={"memory": [m for m in h200.memory if m.op != "triton"]})
    fallback = dr.memory_bandwidth(bare, compiled=True)
    assert fallback.value == eager.value and "add kernel's bandwidth" in fallback.source and fallback.assumed
    gap = dr.kernel_gap(h200)
    assert 0 < gap.value < 1e-5 and gap.assumed
    none = h200.model_copy(update={"kernel_gap": None})
    assert dr.kernel_gap(none).value == 0.0
    one = h200.model_copy(update={"kernel_gap": KernelGap(seconds=2e-6, source="measured: test")})
    assert dr.kernel_gap(one).value == 2e-6 and not dr.kernel_gap(one).assumed


def test_a_calibrated_cpu_profile_has_its_peak_from_its_own_gemm():
    cpu = shipped("h100-hgx-ib").model_copy(update={"device": "CPU test", "dtype": "float32", "gemm": [
        GemmPoint(m=64, n=64, k=64, tflops=0.2, source="measured: test")]})
    assert dr.peak(cpu).value == 0.2 and "calibrated" in dr.peak(cpu).source
