"""The run's time limit covers warm-up and the measured steps only; --profile's steps, trace export
and breakdown after them have their own bound (profile_limit_s), and neither loses what was measured.

The runs are in this process (as `echobench run` without --nproc), so that the export or the
breakdown can be made slow. The first run in a process pays the imports (seconds): a module
fixture pays them once, so that the limits below can be a few seconds and still exceed the
measured steps (a tenth of a second on the tiny model) by a large factor. The slow parts sleep
far past the limits instead of racing them.
"""

import time

import pytest
import torch

from echobench.train import bench
from echobench.train import bench_profile
from echobench.train.breakdown import read_profiled_run
from echobench.records.config import RunConfig

SHAPES = dict(scale="tiny", audio_frames=50, text_tokens=16, speaker_frames=40, micro_batch=1, peak_tflops=1.0,
              device="cpu")


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """One unlimited run first: the imports and first-step costs are not in the limited runs."""
    r = bench.run_benchmark(RunConfig(**SHAPES, steps=1, warmup_steps=1), tmp_path_factory.mktemp("warm"))
    assert r.status == "ok", r.error


def assert_measured(r, steps: int) -> None:
    assert r.status == "ok", r.error
    assert r.error == "" and len(r.step_times_s) == steps and r.measured_steps == steps
    assert r.mfu > 0 and r.samples_per_s > 0 and r.measured_samples == steps


def test_a_time_limit_reached_while_profiling_keeps_the_measured_figures(warm, tmp_path, monkeypatch):
    """The breakdown sleeps until twice the run's limit after the run started: the limit's deadline
    falls inside that sleep or before it, and the sleep goes on as long again after it, so a limit
    still running would fire. The run is ok, with every measured step and a real breakdown.

    A run that reached its limit before the breakdown began (the machine so busy that start-up and
    the measured steps outran it) says nothing either way: it is run again with twice the limit."""
    real = bench_profile.rank_breakdown
    for attempt, limit in enumerate((2.0, 4.0, 8.0, 16.0, 32.0, 64.0)):  # 3 test workers on 2 cores: up to a minute
        out = tmp_path / str(attempt)
        started, entered = time.monotonic(), []

        def slow_breakdown(prof, rank, started=started, limit=limit, entered=entered):
            entered.append(time.monotonic())
            time.sleep(max(0.0, started + 2 * limit - time.monotonic()))
            return real(prof, rank)

        monkeypatch.setattr(bench_profile, "rank_breakdown", slow_breakdown)
        cfg = RunConfig(**SHAPES, steps=3, warmup_steps=1, profile=True, time_limit_s=limit)
        r = bench.run_benchmark(cfg, out)
        if entered:
            break
        assert r.status == "timeout", (r.status, r.error)  # the limit reached before the breakdown: too busy to tell
    else:
        pytest.fail("start-up and the measured steps outran every limit tried")
    assert_measured(r, 3)
    assert time.monotonic() - started >= 2 * limit  # the slow breakdown ran to its end
    assert "fractions" in r.breakdown and (out / "breakdown.json").is_file()
    assert r.profile_traces == [str(out / "trace-rank0.json")] and (out / "trace-rank0.json").is_file()


def test_the_profile_bound_stops_profiling_and_the_run_stays_ok(warm, tmp_path, monkeypatch):
    """A breakdown that would take a minute, a 1 s bound: profiling stops there, the measured steps
    stand, and the breakdown entry (and `explain`) say why there is none."""
    def stuck_breakdown(prof, rank):
        time.sleep(60)
        raise AssertionError("the profile bound did not stop the breakdown")

    monkeypatch.setattr(bench_profile, "rank_breakdown", stuck_breakdown)
    cfg = RunConfig(**SHAPES, steps=2, warmup_steps=1, profile=True, profile_limit_s=1.0)
    r = bench.run_benchmark(cfg, tmp_path)
    assert_measured(r, 2)
    assert "profiling stopped at its 1 s bound (profile_limit_s)" in r.breakdown["error"]
    assert r.breakdown["error"].startswith("rank 0: ")
    assert not (tmp_path / "breakdown.json").exists()
    assert all(p and (tmp_path / p).is_file() for p in r.profile_traces)  # only traces that are there
    with pytest.raises(ValueError, match=r"profiling stopped at its 1 s bound"):
        read_profiled_run(tmp_path)  # what `echobench explain` prints, in one line
    # the profiler is gone: a later profiler in this process starts and stops cleanly
    with torch.profiler.profile() as p:
        torch.ones(2) + 1
    assert len(p.events()) > 0


def test_a_trace_cut_by_the_profile_bound_is_removed(warm, tmp_path, monkeypatch):
    """The bound fires while the chrome trace is half written: the file is removed, no trace is listed."""
    def stuck_export(self, path, *args, **kwargs):
        with open(path, "w") as f:
            f.write('{"traceEvents": [')
        time.sleep(60)
        raise AssertionError("the profile bound did not stop the export")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", stuck_export)
    cfg = RunConfig(**SHAPES, steps=2, warmup_steps=1, profile=True, profile_limit_s=1.0)
    r = bench.run_benchmark(cfg, tmp_path)
    assert_measured(r, 2)
    assert "profiling stopped at its 1 s bound" in r.breakdown["error"]
    assert r.profile_traces == [] and not (tmp_path / "trace-rank0.json").exists()
    assert r.per_rank[0].peak_mem_gib > 0


def test_the_time_limit_still_fires_in_the_measured_steps_of_a_profiled_run(warm, tmp_path):
    cfg = RunConfig(**SHAPES, steps=10**6, warmup_steps=1, profile=True, time_limit_s=2.0, profile_limit_s=600.0)
    r = bench.run_benchmark(cfg, tmp_path)  # 10**6 steps: only the limit ends it
    assert r.status == "timeout" and "time limit of 2 s reached" in r.error
    assert r.step_times_s is None and r.mfu is None
