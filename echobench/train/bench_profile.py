"""--trace's torch.profiler for a run (echobench.train.bench): a few traced steps after the measured
ones, a chrome trace per rank, and this rank's time breakdown (echobench.train.breakdown)."""

from __future__ import annotations

from pathlib import Path

from torch.profiler import ProfilerActivity, profile, schedule

from echobench.train.breakdown import rank_breakdown
from echobench.records.config import RunConfig
from echobench.train.distributed import DistInfo

PROFILER_WARMUP, PROFILED_STEPS = 1, 3


def trace_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"trace-rank{rank}.json"


def profiled_steps(first: int) -> list[int]:
    """Steps traced by --trace (0 = the run's first step) when profiling starts at step `first`,
    after the measured window, so the profiler's overhead never reaches the timings: its warm-up
    step, then the traced ones."""
    return list(range(first + PROFILER_WARMUP, first + PROFILER_WARMUP + PROFILED_STEPS))


def make_profiler(cfg: RunConfig, info: DistInfo, out_dir: Path, profiled: dict):
    """With --trace, a torch.profiler started now, once the measured window is over: a warm-up
    step, then PROFILED_STEPS traced steps on every rank; it writes a chrome trace (OUT/trace-rankN.json)
    next to the result and puts this rank's time breakdown, from the profiler's events, in
    profiled["breakdown"]."""
    if not cfg.trace:
        return None
    active, warmup, wait = PROFILED_STEPS, PROFILER_WARMUP, 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    path = trace_path(out_dir, info.rank)

    def ready(p):
        profiled["phase"] = "the trace export"
        p.export_chrome_trace(str(path))
        profiled["trace"] = str(path)  # complete: kept even if the bound stops the breakdown
        profiled["phase"] = "the breakdown"
        profiled["breakdown"] = rank_breakdown(p, info.rank)

    prof = profile(activities=activities, schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
                   on_trace_ready=ready)
    prof.start()
    return prof


def profiling_stopped(profiled: dict, exc: BaseException, path: Path, rank: int) -> None:
    """Profiling met its bound (ProfileTimeout): a trace whose export did not complete is removed,
    and this rank's breakdown entry says where profiling stopped (unless it was computed by then)."""
    if profiled.get("trace") is None:
        Path(path).unlink(missing_ok=True)
    if not profiled.get("breakdown"):
        where = profiled.get("phase", "the profiled steps")
        profiled["breakdown"] = {"rank": rank, "error": f"{exc} during {where}; the measured figures stand "
                                                        "(a larger trace_limit_s gives the profiler more time)"}


def discard_profiler(prof) -> None:
    """Stops the profiler without exporting or breaking down again: after a completed profile it
    has nothing left to do; after a failure or a stop by the bound, what it holds is dropped."""
    prof.on_trace_ready = None
    try:
        prof.stop()
    except Exception:  # noqa: BLE001 - stopped mid-transition (its bound fired in step()): nothing to keep
        pass
