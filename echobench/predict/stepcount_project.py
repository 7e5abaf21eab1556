"""A counted step (echobench.predict.stepcount) priced on one device of a hardware profile: the projection a
first GPU record is held against. Every rate comes from echobench.hardware.devicerates, the functions
`echobench predict` prices with, and names its source:

- GEMMs: each shape at devicerates.gemm (the profile's best GEMM point x the shape model's tile and
  wave quantization over the SMs x the sustained clock), not one best rate for every shape;
- attention: each call at devicerates.attention of the kernel that runs it, at its lengths;
- memory-bound kernels: their bytes at devicerates.memory_bandwidth (eager ATen kernels, or the
  Triton kernels inductor generates where the step is compiled);
- every kernel launch: devicerates.kernel_gap of idle device time between kernels (the host keeps
  up; its own cost is not here);
- the optimizer: its bytes at devicerates.optimizer_bandwidth, its launches' gaps;
- the path mix: a micro-batch is unmasked, or masked where a sample drops its conditioning (the
  DiT's attention over a key mask); each is counted and priced, and weighted by the run's expected
  share of masked micro-batches (model.config.masked_share).

Nothing overlaps (one stream); grad_accum micro-batches per optimizer step repeat the forward and
backward. MFU = model FLOPs (echobench.model.flops, x micro-batch x grad_accum) / (step time x peak).
"""

from __future__ import annotations

from echobench.hardware import devicerates
from echobench.hardware.profile import HardwareProfile
from echobench.predict.stepcount import StepCount
from echobench.records.run_figures import mfu_of

# stepcount's attention kernels -> the profiles' (hwprofile.ATTENTION_KERNELS): SDPA's flash backend is
# FlashAttention-2; an attention call that escaped the GPU emulation is priced as it.
KERNELS = {"flash": "flash2", "efficient": "efficient", "cudnn": "cudnn", "flex": "flex", "cpu-flash": "flash2"}
PASSES = ("forward", "backward")


def price(count: StepCount, profile: HardwareProfile, fit=None) -> dict:
    """Seconds of one counted micro-batch's forward and backward by term, and of the optimizer's step
    (`fit`: the in-step clock's fit, devicerates.InStepFit; None: the committed one)."""
    compiled = bool(count.settings.get("compiled"))
    gemm_s = sum(t.flops / (devicerates.gemm(profile, m, n, k, precision, fit=fit).value * 1e12)
                 for (phase, m, n, k, precision), t in count.gemms.items() if phase in PASSES)
    attention_s: dict[str, float] = {}
    for (kernel, q, kv, d), t in count.attention_calls.items():
        rate = devicerates.attention(profile, q, kv, d, kernel=KERNELS[kernel], fit=fit).value
        attention_s[kernel] = attention_s.get(kernel, 0.0) + t.flops / (rate * 1e12)
    memory = sum(count.total(ph, kind="memory").bytes for ph in PASSES)
    memory_s = memory / (devicerates.memory_bandwidth(profile, compiled).value * 1e9)
    gap = devicerates.kernel_gap(profile).value
    kernels = sum(count.total(ph).kernels for ph in PASSES)
    optimizer = count.total("optimizer")
    return {"gemm_s": gemm_s, "attention_s": attention_s, "memory_s": memory_s, "gaps_s": kernels * gap,
            "kernels": kernels, "optimizer_s": optimizer.bytes / (devicerates.optimizer_bandwidth(profile).value * 1e9)
            + optimizer.kernels * gap}


def project(variants: list[tuple[StepCount, float]], profile: HardwareProfile, peak_tflops: float | None = None,
            grad_accum: int = 1, fit=None) -> dict:
    """Step time and MFU on one device of `profile`: the counted micro-batch variants (unmasked,
    masked) weighted by their shares of the run's micro-batches (summing to 1), grad_accum of them,
    and one optimizer step; by term (ms) with every rate's source."""
    shares = [share for _, share in variants]
    if abs(sum(shares) - 1) > 1e-9 or min(shares) < 0:
        raise ValueError(f"variant shares {shares} must be >= 0 and sum to 1")
    count = variants[0][0]
    peak = devicerates.peak(profile) if peak_tflops is None else devicerates.Rate(peak_tflops, "TFLOP/s", "given")
    priced = [(price(c, profile, fit), share) for c, share in variants]

    def mix(key: str) -> float:
        return sum(share * p[key] for p, share in priced)

    attention = {}
    for p, share in priced:
        for kernel, seconds in p["attention_s"].items():
            attention[kernel] = attention.get(kernel, 0.0) + share * seconds
    micro = mix("gemm_s") + sum(attention.values()) + mix("memory_s") + mix("gaps_s")
    optimizer_s = priced[0][0]["optimizer_s"]  # one step's: the same for every variant
    step_s = grad_accum * micro + optimizer_s
    samples = count.settings["micro_batch"] * grad_accum
    model_flops = count.settings["model_flops_per_sample"] * samples
    return {"gemm_ms": grad_accum * mix("gemm_s") * 1e3,
            "attention_ms": {k: grad_accum * v * 1e3 for k, v in attention.items()},
            "memory_ms": grad_accum * mix("memory_s") * 1e3, "gaps_ms": grad_accum * mix("gaps_s") * 1e3,
            "kernels": grad_accum * mix("kernels"),
            "optimizer_ms": optimizer_s * 1e3, "step_ms": step_s * 1e3, "model_tflop": model_flops / 1e12,
            "mfu": mfu_of(model_flops, step_s, 1, peak.value), "peak_tflops": peak.value, "peak_source": peak.source,
            "masked_share": sum(share for c, share in variants if c.settings.get("masked")),
            "rates": rate_sources(variants, profile, fit)}


def rate_sources(variants: list[tuple[StepCount, float]], profile: HardwareProfile, fit=None) -> dict:
    """What each term was priced at, and where that comes from: the GEMM rate of the shape with the
    most FLOPs and the FLOP-weighted mean over every shape, each attention kernel's rate at its
    longest call, the memory-bound bandwidth, the kernel gap, the optimizer's bandwidth, the clock."""
    count = variants[0][0]
    gemms = [(m, n, k, pr, t.flops) for (ph, m, n, k, pr), t in count.gemms.items() if ph in PASSES]
    m, n, k, pr, _ = max(gemms, key=lambda g: g[4])
    top = devicerates.gemm(profile, m, n, k, pr, fit=fit)
    seconds = sum(f / devicerates.gemm(profile, a, b, c, p, fit=fit).value for a, b, c, p, f in gemms)
    out = {"gemm": {"largest_shape": [m, n, k], "precision": pr, "tflops": top.value, "source": top.source,
                    "flop_weighted_tflops": sum(g[4] for g in gemms) / seconds},
           "attention": {}}
    for c, _ in variants:
        for (kernel, q, kv, d), _t in sorted(c.attention_calls.items(), key=lambda x: -x[0][1] * x[0][2]):
            if kernel not in out["attention"]:
                r = devicerates.attention(profile, q, kv, d, kernel=KERNELS[kernel], fit=fit)
                out["attention"][kernel] = {"at": [q, kv, d], "tflops": r.value, "source": r.source,
                                            "assumed": r.assumed}
    for name, rate in (("memory", devicerates.memory_bandwidth(profile, bool(count.settings.get("compiled")))),
                       ("kernel_gap", devicerates.kernel_gap(profile)),
                       ("optimizer", devicerates.optimizer_bandwidth(profile)),
                       ("clock", devicerates.sustained_clock(profile, fit))):
        out[name] = {"value": rate.value, "unit": rate.unit, "source": rate.source, "assumed": rate.assumed}
    return out
