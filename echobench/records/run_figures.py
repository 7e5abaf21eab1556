"""A run's figures from its measurements, as its record (echobench.records.results) holds them: throughput
and MFU over the measured window, step-time statistics, padding, peak memory. The MFU convention lives
here (mfu_of, peak_fraction, seconds_at_mfu): what a run measures, shows while it runs and predict
predicts all import it (tests/test_figures.py fails where the formula is written elsewhere)."""

from __future__ import annotations

import statistics


def mfu_of(flops: float, seconds: float, devices: int, peak_tflops: float) -> float:
    """FLOPs done in `seconds` by `devices` devices over what their peak (TFLOP/s per device) could do
    in that time: the MFU of model FLOPs, the HFU of hardware FLOPs."""
    return flops / (seconds * devices * peak_tflops * 1e12)


def peak_fraction(tflops_per_device: float, peak_tflops: float) -> float:
    """The MFU of a rate: TFLOP/s per device over the peak (or a ceiling) per device."""
    return tflops_per_device / peak_tflops


def seconds_at_mfu(flops: float, devices: int, peak_tflops: float, at_mfu: float) -> float:
    """How long `devices` devices take for `flops` at MFU at_mfu of their peak: mfu() solved for the time."""
    return flops / (devices * peak_tflops * 1e12 * at_mfu)


def window_figures(*, measured_time_s: float, samples: int, model_flops: int, hardware_flops: int,
                   audio_seconds: float, world_size: int, peak_tflops: float, ceiling_tflops: float | None = None,
                   peak_fp8_tflops: float | None = None) -> dict:
    """Throughput and MFU over the whole measured window.

    measured_time_s is the sum of the measured steps, each at its slowest rank; samples and
    FLOPs are those of the measured steps (data-parallel replicas, real lengths).
    """
    tflops_per_gpu = model_flops / measured_time_s / world_size / 1e12
    return {
        "samples_per_s": samples / measured_time_s,
        "audio_seconds_per_s": audio_seconds / measured_time_s,
        "model_flops_per_sample": model_flops / samples,
        "hardware_flops_per_sample": hardware_flops / samples,
        "tflops_per_gpu": tflops_per_gpu,
        "mfu": mfu_of(model_flops, measured_time_s, world_size, peak_tflops),
        "hfu": mfu_of(hardware_flops, measured_time_s, world_size, peak_tflops),
        "mfu_vs_ceiling": peak_fraction(tflops_per_gpu, ceiling_tflops) if ceiling_tflops else None,
        "mfu_fp8_peak": peak_fraction(tflops_per_gpu, peak_fp8_tflops) if peak_fp8_tflops else None,
    }


def padding_figures(*, padded_flops: int, hardware_flops: int, tokens: dict[str, list[int]]) -> dict:
    """What the padding cost over the measured window (docs/explanation/mfu.md), from the counts
    of bench_echo.count_measured: measured_padded_flops, the hardware FLOPs of every row at the padded
    lengths (flops.padded_flops); padded_flops_frac = (padded - hardware FLOPs) / padded FLOPs, the
    share of the matmul FLOPs executed that went to padded tokens; per stream, padded_frac_<stream>
    = (computed - real tokens) / computed tokens, speaker tokens being patches."""
    return {
        "measured_padded_flops": padded_flops,
        "padded_flops_frac": (padded_flops - hardware_flops) / padded_flops if padded_flops else None,
        **{f"padded_frac_{stream}": (computed - real) / computed if computed else None
           for stream, (real, computed) in tokens.items()},
    }


def step_figures(step_times_s: list[float]) -> dict:
    """Median, p10 / p90 and mean of the measured steps, and how far the mean sits above the median."""
    n = len(step_times_s)
    median = statistics.median(step_times_s)
    mean = sum(step_times_s) / n
    return {
        "step_time_s": median,
        "step_time_p10_s": percentile(step_times_s, 0.1),
        "step_time_p90_s": percentile(step_times_s, 0.9),
        "step_time_mean_s": mean,
        "step_time_mean_vs_median": mean / median - 1,
        "measured_steps": n,
        "measured_time_s": sum(step_times_s),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def peak_mem_gib(memory: dict) -> float:
    """A rank's peak memory from its memory stats (bench.memory_stats): reserved on GPU (the
    caching allocator's peak, its cache included: what the device had to give), RSS on CPU."""
    return memory.get("peak_reserved_gib", memory.get("peak_rss_gib", 0.0))


def max_of(memories: list[dict], key: str) -> float | None:
    values = [m[key] for m in memories if m.get(key) is not None]
    return max(values) if values else None


def peak_mem_figures(memories: list[dict]) -> dict:
    """The record's memory figures from the ranks' memory stats (bench.memory_stats), each the max
    over ranks: peak_mem_gib (peak_mem_gib above), and on GPU the allocator's peaks apart,
    peak_mem_allocated_gib (live tensors) and peak_mem_reserved_gib (with its cache); None on CPU."""
    return {"peak_mem_gib": max(peak_mem_gib(m) for m in memories),
            "peak_mem_allocated_gib": max_of(memories, "peak_allocated_gib"),
            "peak_mem_reserved_gib": max_of(memories, "peak_reserved_gib")}
