"""Per-run time limits from the plan's estimate (issue 23, item 11): a short run asks the scheduler
for about what it needs (so that it can be backfilled), never less than the floor nor more than
slurm.time; an include's own limit wins and a run the plan cannot estimate keeps slurm.time."""

import dataclasses
import json
import math

import pytest

from conftest import run_cli
from echobench.sweep.estimate import estimated_seconds, format_time, time_limit, time_limit_s
from echobench.sweep.cluster import parse_time
from echobench.sweep.matrix import expand, parse_matrix

MATRIX = """
name: t
executor: slurm
slurm: {time: "04:00:00", time_from_estimate: {factor: 3, floor: "00:20:00"}}
hardware: {peak_tflops: %s, assumed_mfu: 0.4}
defaults: {scale: 800M, parallelism: single, micro_batch: 8, compile: false}  # no compile allowance
axes: {steps: [10, 2000, 3000000]}
include: [{steps: 7, time_limit: "00:45:00"}]
"""


def plan(peak="100"):
    m = parse_matrix(MATRIX % peak, "m.yaml")
    return m, {r.cfg.steps: r for r in expand(m).runs}


def test_limits_follow_the_estimate_between_the_floor_and_slurm_time():
    m, runs = plan()
    short, middle, huge, own = runs[10], runs[2000], runs[3000000], runs[7]
    assert time_limit(m, "slurm", short) == "00:20:00"  # 3 x the estimate is under the floor
    est = estimated_seconds(middle, m)
    assert 20 * 60 < 3 * est < 4 * 3600  # the case this run is meant to be
    assert time_limit_s(m, "slurm", middle) == math.ceil(3 * est / 60) * 60
    assert time_limit(m, "slurm", huge) == "04:00:00"  # capped at slurm.time
    assert time_limit(m, "slurm", own) == "00:45:00"  # an include's own limit wins
    assert time_limit(m, "slurm") == "04:00:00"


def test_a_run_the_plan_cannot_estimate_keeps_slurm_time():
    m = parse_matrix((MATRIX % "null").replace("hardware: {peak_tflops: null, ", "hardware: {"), "m.yaml")
    run = next(r for r in expand(m).runs if r.cfg.steps == 10)
    assert estimated_seconds(run, m) is None and time_limit(m, "slurm", run) == "04:00:00"


def test_without_the_rule_every_run_has_slurm_time():
    m = parse_matrix((MATRIX % "100").replace(', time_from_estimate: {factor: 3, floor: "00:20:00"}', ""), "m.yaml")
    assert {time_limit(m, "slurm", r) for r in expand(m).runs if r.cfg.steps != 7} == {"04:00:00"}


@pytest.mark.parametrize("seconds, text", [(1, "00:01:00"), (3600, "01:00:00"), (3601, "01:01:00"),
                                           (86400 + 90, "1-00:02:00")])
def test_format_time_rounds_up_to_minutes_and_reads_back(seconds, text):
    assert format_time(seconds) == text and parse_time(text) >= seconds


def test_job_scripts_and_the_plan_ask_for_the_per_run_limit(tmp_path):
    m, runs = plan()
    path = tmp_path / "m.yaml"
    path.write_text(MATRIX % "100")
    out = json.loads(run_cli("plan", path, "--json", tmp_path=tmp_path, check=True).stdout)
    by_steps = {r["settings"]["steps"]: r for r in out["runs"]}
    for steps, run in runs.items():
        assert by_steps[steps]["time_limit"] == time_limit(m, "slurm", run)
        script = run_cli("plan", path, "--script", run.id, "--out", tmp_path / "sw", tmp_path=tmp_path, check=True).stdout
        assert f"#SBATCH --time={time_limit(m, 'slurm', run)}" in script.splitlines()
    table = run_cli("plan", path, tmp_path=tmp_path, check=True).stdout
    assert "3 x the estimate, 00:20:00 .. 04:00:00" in table


@pytest.mark.parametrize("rule", ['{factor: 0.5}', '{floor: "soon"}', '{factr: 3}'])
def test_a_bad_rule_is_refused(rule):
    from echobench.sweep.matrix import MatrixError

    with pytest.raises(MatrixError, match="time_from_estimate"):
        parse_matrix(f"name: t\nslurm: {{time_from_estimate: {rule}}}\n", "m.yaml")


@pytest.mark.parametrize("settings, compiles", [({}, True), ({"device": "cuda"}, True), ({"device": "cpu"}, False),
                                                ({"device": "cpu", "compile": True}, True), ({"compile": False}, False)])
def test_compile_auto_gets_the_compile_allowance_unless_the_run_is_on_a_cpu(settings, compiles):
    """compile: auto compiles on a GPU; with device auto the plan cannot tell, so the limit errs long."""
    from echobench.sweep.estimate import COMPILE_S

    m = parse_matrix(MATRIX % "100", "m.yaml")
    base = next(r for r in expand(m).runs if r.cfg.steps == 10)
    run = dataclasses.replace(base, cfg=dataclasses.replace(base.cfg, **{"compile": "auto", "device": "auto", **settings}))
    assert run.cfg.may_compile() is compiles
    assert estimated_seconds(run, m) - estimated_seconds(base, m) == pytest.approx(COMPILE_S if compiles else 0)
