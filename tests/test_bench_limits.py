"""The run's time limit covers warm-up and the measured steps only; --trace's steps, trace export
and breakdown after them have their own bound (trace_limit_s), and neither loses what was measured.
Each holds for every workload of the loop: Echo, and a model card's plain decoder.

The runs are in this process (as `echobench run` without --nproc), so that the export or the
breakdown can be made slow. Where the property is the limits' logic, their timer runs on a fake
clock (FakeAlarm) that only the slow part advances: nothing depends on how fast the machine is.
Two tests keep the real timer: a bound that interrupts a write sleeping far past it, and a limit
that ends a run of a million steps. The first run in a process pays the imports (seconds): a
module fixture pays them once, so that those real limits are reached in the steps they mean.
"""

import signal
import time
from types import SimpleNamespace

import pytest
import torch

from echobench.train import bench
from echobench.train import bench_profile
from echobench.train.breakdown import read_profiled_run
from echobench.records.config import RunConfig

SHAPES = dict(scale="tiny", audio_frames=50, text_tokens=16, speaker_frames=40, micro_batch=1, peak_tflops=1.0,
              device="cpu")


class Loop:
    """A workload's runs in this process: its settings and what run_benchmark is given for it."""

    def __init__(self, settings: dict, card=None):
        self.settings, self.card = settings, card

    def run(self, out, **settings):
        return bench.run_benchmark(RunConfig(**self.settings, **settings), out, self.card)


@pytest.fixture(scope="module", params=["echo", "card"])
def loop(request, tmp_path_factory) -> Loop:
    if request.param == "echo":
        return Loop(SHAPES)
    from echobench.predict.cards.run import run_card
    from test_card_runs import write_card

    path = write_card(tmp_path_factory.mktemp("card") / "tiny.yaml")
    return Loop(dict(card=str(path), micro_batch=2, peak_tflops=1.0, device="cpu"), run_card(str(path)))


@pytest.fixture(scope="module")
def warm(loop, tmp_path_factory):
    """One unlimited run first: the imports and first-step costs are not in the limited runs."""
    r = loop.run(tmp_path_factory.mktemp("warm"), steps=1, warmup_steps=1)
    assert r.status == "ok", r.error


def assert_measured(r, steps: int) -> None:
    assert r.status == "ok", r.error
    assert r.error == "" and len(r.step_times_s) == steps and r.measured_steps == steps
    assert r.mfu > 0 and r.samples_per_s > 0 and r.measured_samples == steps * r.global_batch


class FakeAlarm:
    """bench's SIGALRM timer on a fake clock: setitimer notes the deadline, advance() moves the clock
    and, where it passes the deadline, calls the SIGALRM handler there as the kernel's signal would
    (in the main thread, where the profiler's callbacks run). No real timer is armed."""

    def __init__(self):
        self.now, self.deadline = 0.0, None

    def setitimer(self, which, seconds, interval=0.0):
        self.deadline = self.now + seconds if seconds else None

    def advance(self, seconds: float) -> None:
        self.now += seconds
        if self.deadline is not None and self.deadline <= self.now:
            self.deadline = None
            signal.getsignal(signal.SIGALRM)(signal.SIGALRM, None)


@pytest.fixture
def alarm(monkeypatch) -> FakeAlarm:
    fake = FakeAlarm()
    monkeypatch.setattr(bench, "signal", SimpleNamespace(signal=signal.signal, SIGALRM=signal.SIGALRM,
                                                         ITIMER_REAL=signal.ITIMER_REAL, setitimer=fake.setitimer))
    return fake


def test_a_time_limit_that_passes_while_profiling_keeps_the_measured_figures(loop, tmp_path, monkeypatch, alarm):
    """The run's limit covers warm-up and the measured steps (no time passes in them on the fake
    clock); the breakdown after them takes twice the limit, with no profile bound to replace the
    limit's timer: a limit left running past the measured steps would fire there. The run is ok,
    with every measured step and a real breakdown."""
    real, entered = bench_profile.rank_breakdown, []

    def slow_breakdown(prof, rank):
        entered.append(alarm.now)
        alarm.advance(2 * 2.0)
        return real(prof, rank)

    monkeypatch.setattr(bench_profile, "rank_breakdown", slow_breakdown)
    r = loop.run(tmp_path, steps=3, warmup_steps=1, trace=True, time_limit_s=2.0, trace_limit_s=None)
    assert entered == [0.0] and alarm.now == 4.0  # the breakdown ran, past the limit's deadline
    assert_measured(r, 3)
    assert "fractions" in r.breakdown and (tmp_path / "breakdown.json").is_file()
    assert r.profile_traces == [str(tmp_path / "trace-rank0.json")] and (tmp_path / "trace-rank0.json").is_file()


def test_the_profile_bound_stops_profiling_and_the_run_stays_ok(loop, tmp_path, monkeypatch, alarm):
    """A breakdown that takes a minute on the fake clock, a 1 s bound: profiling stops there, the
    measured steps stand, and the breakdown entry (and `explain`) say why there is none."""
    def stuck_breakdown(prof, rank):
        alarm.advance(60)
        raise AssertionError("the profile bound did not stop the breakdown")

    monkeypatch.setattr(bench_profile, "rank_breakdown", stuck_breakdown)
    r = loop.run(tmp_path, steps=2, warmup_steps=1, trace=True, trace_limit_s=1.0)
    assert_measured(r, 2)
    assert "profiling stopped at its 1 s bound (trace_limit_s)" in r.breakdown["error"]
    assert r.breakdown["error"].startswith("rank 0: ")
    assert not (tmp_path / "breakdown.json").exists()
    assert all(p and (tmp_path / p).is_file() for p in r.profile_traces)  # only traces that are there
    with pytest.raises(ValueError, match=r"profiling stopped at its 1 s bound"):
        read_profiled_run(tmp_path)  # what `echobench explain` prints, in one line
    # the profiler is gone: a later profiler in this process starts and stops cleanly
    with torch.profiler.profile() as p:
        torch.ones(2) + 1
    assert len(p.events()) > 0


def test_a_trace_cut_by_the_profile_bound_is_removed(loop, warm, tmp_path, monkeypatch):
    """The bound fires while the chrome trace is half written: the file is removed, no trace is listed."""
    def stuck_export(self, path, *args, **kwargs):
        with open(path, "w") as f:
            f.write('{"traceEvents": [')
        time.sleep(60)
        raise AssertionError("the profile bound did not stop the export")

    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace", stuck_export)
    r = loop.run(tmp_path, steps=2, warmup_steps=1, trace=True, trace_limit_s=1.0)
    assert_measured(r, 2)
    assert "profiling stopped at its 1 s bound" in r.breakdown["error"]
    assert r.profile_traces == [] and not (tmp_path / "trace-rank0.json").exists()
    assert r.per_rank[0].peak_mem_gib > 0


def test_the_time_limit_still_fires_in_the_measured_steps_of_a_profiled_run(loop, warm, tmp_path):
    # 10**6 steps: only the limit ends it
    r = loop.run(tmp_path, steps=10**6, warmup_steps=1, trace=True, time_limit_s=2.0, trace_limit_s=600.0)
    assert r.status == "timeout" and "time limit of 2 s reached" in r.error
    assert r.step_times_s is None and r.mfu is None


@pytest.mark.parametrize("kind,status,said", [("error", "error", "injected failure"),
                                              ("oom", "oom", "injected out-of-memory")])
def test_a_failure_injected_in_the_measured_steps_is_the_record_s_status(loop, warm, tmp_path, kind, status, said):
    r = loop.run(tmp_path, steps=3, warmup_steps=1, fail_at_step=2, fail_kind=kind)
    assert r.status == status and r.error.endswith(f"{said} at step 2 on rank 0"), r.error
    assert r.mfu is None and (tmp_path / "ranks" / "rank-0.json").is_file() and (tmp_path / "result.json").is_file()
