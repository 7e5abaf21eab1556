"""A run's progress lines (echobench.train.progress): rate-limited, one line each, the loss only where
reading it costs no device sync, and in a real run's output."""

import re

import pytest
import torch

from echobench.train.progress import Progress


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def progress(every_s, **kw):
    clock, lines = Clock(), []
    p = Progress(every_s, total_steps=10, samples_per_step=8, flops_per_step=2e12, peak_tflops=4.0,
                 device=torch.device("cpu"), clock=clock, out=lines.append, **kw)
    p.start()
    return p, clock, lines


def test_at_most_one_line_per_interval_with_the_rate_over_the_steps_since_the_last():
    p, clock, lines = progress(10.0)
    for step in range(1, 11):
        clock.now += 4.0  # a step every 4 s: a line at 12 s (3 steps), 24 s (3 more), 36 s (3 more)
        p.step(step, "warm-up", torch.tensor(1.5))
    assert [line.split(",")[0] for line in lines] == ["step 3/10 warm-up", "step 6/10 warm-up", "step 9/10 warm-up"]
    assert lines[0] == "step 3/10 warm-up, loss 1.5000, 4 s/step, 2 samples/s, 0.5 TFLOP/s, MFU 12.5%, " + \
        re.search(r"mem \S+ GiB", lines[0]).group(0)


def test_every_step_at_zero_none_at_none_and_rank_0_only():
    p, clock, lines = progress(0.0)
    for step in (1, 2, 3):
        clock.now += 1.0
        p.step(step, "warm-up", None)
    assert len(lines) == 3
    for p, clock, lines in (progress(None), progress(0.0, enabled=False)):
        p.phase("building")
        clock.now += 100.0
        assert not p.step(1, "warm-up", None) and lines == []


def test_a_measured_line_without_the_loss_says_its_clock_is_the_host_s():
    p, clock, lines = progress(0.0)
    clock.now += 2.0
    p.step(1, "measured", None)
    assert "loss -" in lines[0] and lines[0].endswith("(host clock)")


@pytest.mark.parametrize("workload", ["echo", "card"])
def test_a_run_prints_its_phases_and_its_steps_at_the_rate_asked(cli, tmp_path, workload):
    """Echo's run and a model card's decoder alike."""
    from test_card_runs import write_card

    steps = ["--steps", "3", "--warmup-steps", "2", "--micro-batch", "1", "--peak-tflops", "0.5"]
    tiny = {"echo": ["--scale", "tiny", "--audio-frames", "30", "--text-tokens", "8", "--speaker-frames", "30"],
            "card": ["--card", write_card(tmp_path / "tiny.yaml")]}[workload] + steps
    building = {"echo": "[echobench] building tiny torchtitan single on 1 rank(s), cpu",
                "card": "[echobench] building card tiny (2 layers, hidden 64, seq 32) torchtitan single on 1 rank(s), cpu"}
    every = cli("run", *tiny, "--progress-every-s", "0", "--out", tmp_path / "every")
    assert every.returncode == 0, every.stderr
    steps = [line for line in every.stdout.splitlines() if line.startswith("[echobench] step ")]
    assert [line.split(",")[0] for line in steps] == [
        "[echobench] step 1/5 warm-up", "[echobench] step 2/5 warm-up", "[echobench] step 3/5 measured",
        "[echobench] step 4/5 measured", "[echobench] step 5/5 measured"]
    assert all(re.search(r"loss \d+\.\d{4}, .* MFU \d", line) for line in steps), steps  # on the CPU: the loss too
    for phase in (building[workload], "[echobench] warm-up: ",
                  "[echobench] measuring 3 step(s)"):
        assert phase in every.stdout, phase
    rare = cli("run", *tiny, "--progress-every-s", "100000", "--out", tmp_path / "rare")
    assert rare.returncode == 0 and "[echobench] measuring 3 step(s)" in rare.stdout, rare.stderr
    assert "[echobench] step " not in rare.stdout
