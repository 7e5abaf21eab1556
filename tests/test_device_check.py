"""The device check (tools/device/check.py) fits its call, skips what cannot run at once with the
reason, and leaves a summary after every step; its bookkeeping (tools/device/summary.py) counts
honestly and brings every measured file back."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tools.device import check as device_check
from tools.device import summary as device_summary

ROOT = Path(__file__).resolve().parents[1]


def test_the_always_attempted_steps_fit_the_call_with_a_margin():
    setup = device_check.WHEELS_S + device_check.PROBE_S + device_check.SHARDS_S  # the launcher check takes no time
    need = setup + device_check.always_minimum_s() + device_check.RESERVE_S
    assert device_check.DEADLINE_S <= device_check.CALL_S - 45
    assert need <= device_check.DEADLINE_S - 45, need  # at worst 45 s to spare inside the deadline


def test_the_speed_steps_come_first_and_wait_on_no_step():
    order = device_check.steps(dry=False)
    always = [s.name for s in order if s.always]
    assert [s.name for s in order[:len(always)]] == always  # nothing optional before an always step
    assert always[0] == "calibrate"
    speed = [s.name for s in order[1:8]]
    assert speed == ["3b-compile-mb16-accum4", "3b-compile-mb16-accum4-masked", "3b-compile-mb8-baseline",
                     "3b-fp8-rowwise-compile-mb16-accum4", "800m-compile-mb16-accum4", "3b-compile-mb8-padded",
                     "3b-compile-mb16-accum4-drawn"]
    by = {s.name: s for s in order}
    lean, masked, baseline = (by[n].args for n in speed[:3])
    assert "--master-weights" not in lean and "--cfg-drop-attention" not in lean  # the defaults: the lean recipe
    assert [a for a in masked if a not in lean] == ["--cfg-drop-attention", "masked"]
    assert baseline[baseline.index("--master-weights") + 1] == "fp32-autocast" and "--trace" in baseline
    fp8 = by[speed[3]].args
    assert fp8[fp8.index("--float8-recipe") + 1] == "rowwise"
    assert device_check.SHARDS in by[speed[5]].args
    # the padded twin of the headline: its arguments and nothing else
    assert [a for a in by[speed[6]].args if a not in lean] == ["--synthetic-lengths", "drawn"]
    # No step waits on another step, only on the set-up, which is never skipped.
    assert all(set(s.needs) <= set(device_check.SETUP_STEPS) for s in order), \
        [(s.name, s.needs) for s in order if not set(s.needs) <= set(device_check.SETUP_STEPS)]
    assert all("launcher" in s.needs for s in order if s.compiles)
    cards = [s for s in order if "--card" in s.args]  # published rows' 1-GPU slices
    rows = {r["id"] for r in yaml.safe_load((ROOT / "validation/published-runs.yaml").read_text())}
    named = [s.args[s.args.index("--card") + 1].split("#")[1] for s in cards]
    assert named and set(named) <= rows, set(named) - rows
    # The gpu tests' per-test limit fits a compiled tiny model's graphs, inside the step's own.
    pytest_step = by["pytest-gpu"]
    assert 100 <= device_check.PYTEST_TEST_S <= pytest_step.limit_s


def test_the_dry_plan_walks_the_steps_in_order_within_the_budget(tmp_path, monkeypatch):
    """DEVICE_CHECK_DRY's pass, its commands faked to take each step's least time: the steps run in
    steps()' order, every always step runs, the padded run reads the set-up's shards, and the pass
    ends inside the deadline (skipping, for time, what does not fit)."""
    check = make_check(tmp_path, deadline=device_check.DEADLINE_S)
    clock = {"t": 0.0}
    monkeypatch.setattr(device_check.time, "monotonic", lambda: clock["t"])
    check.start = 0.0
    ran = []

    def fake(cmd, log, limit, stdout=None):
        step = next(s for s in device_check.steps(dry=True) if s.name == log.stem)
        clock["t"] += step.min_s
        ran.append((step.name, cmd))
        return 1, step.min_s

    monkeypatch.setattr(check, "execute", fake)
    check.note(kind="setup", name="shards", rc=0)
    order = device_check.steps(dry=True)
    for step in order:
        check.run_step(step)
    names = [n for n, _ in ran]
    assert names == [s.name for s in order if s.name in names]  # in order
    assert {s.name for s in order if s.always} <= set(names)
    assert clock["t"] <= device_check.DEADLINE_S - check.reserve
    skipped = [ln for ln in device_summary.read_lines(check.records) if ln["kind"] == "skipped"]
    assert all(ln["note"].startswith("time:") for ln in skipped)
    # Alone (DEVICE_CHECK_ONLY), the padded run reads the set-up's shards.
    ran.clear()
    check.deadline = clock["t"] + 500
    check.run_step(next(s for s in order if s.name == "tiny-compile-mb2-padded"))
    (_, padded), = ran
    assert padded[padded.index("--data") + 1] == str(check.work / "shards")


def test_dry_steps_are_the_same_steps():
    gpu, dry = device_check.steps(dry=False), device_check.steps(dry=True)
    assert [(s.kind, s.always, s.compiles, len(s.needs)) for s in gpu] == \
        [(s.kind, s.always, s.compiles, len(s.needs)) for s in dry]


def make_check(tmp_path, deadline=500.0, **kw) -> device_check.Check:
    out, work = tmp_path / "out", tmp_path / "work"
    for d in (out, work / "logs", work / "runs", work / "bare"):
        d.mkdir(parents=True, exist_ok=True)
    return device_check.Check(out=out, work=work, dry=True, scale=1.0, deadline=deadline, reserve=30.0,
                              only=set(), **kw)


def test_a_step_that_cannot_run_is_skipped_at_once_with_its_reason(tmp_path, monkeypatch):
    check = make_check(tmp_path, deadline=200.0, launcher_reason="no C compiler (cc, gcc or clang; or $CC)")
    ran = []
    monkeypatch.setattr(check, "execute", lambda cmd, log, limit, stdout=None: ran.append(cmd) or (0, 0.1))
    by = {s.name: s for s in device_check.steps(dry=True)}
    check.run_step(by["tiny-compile-mb2-baseline"])  # no launcher
    check.launcher_reason = ""
    check.note(kind="setup", name="shards", rc=1)
    check.run_step(by["tiny-compile-mb2-padded"])  # no shards
    check.run_step(by["tiny-compile-sac-mb2"])  # 170 s left, 100 needed: runs
    check.deadline = 50.0
    check.run_step(by["tiny-eager-mb4"])  # 20 s left, 35 needed
    assert len(ran) == 1 and "--compile" in ran[0] and "selective" in ran[0]
    lines = device_summary.read_lines(check.records)
    notes = {ln["name"]: ln.get("note", "") for ln in lines if ln["kind"] == "skipped"}
    assert notes == {"tiny-compile-mb2-baseline": "no C compiler (cc, gcc or clang; or $CC)",
                     "tiny-compile-mb2-padded": "shards failed",
                     "tiny-eager-mb4": "time: 20 s left for it, it needs 35 s"}
    assert check.outcome["tiny-compile-sac-mb2"] == "failed"  # it ran (a fake) and left no record


def test_the_run_limit_leaves_room_for_profiling_and_the_record(tmp_path, monkeypatch):
    check = make_check(tmp_path)
    seen = {}
    monkeypatch.setattr(check, "execute", lambda cmd, log, limit, stdout=None: seen.update(cmd=cmd, limit=limit) or (1, 1.0))
    step = next(s for s in device_check.steps(dry=True) if "--trace" in s.args)
    check.run_step(step)
    cmd = seen["cmd"]
    time_limit = float(cmd[cmd.index("--time-limit-s") + 1])
    profile_limit = float(cmd[cmd.index("--trace-limit-s") + 1])
    assert time_limit + profile_limit + device_check.END_S <= seen["limit"] + 1


def test_summary_and_archive_are_written_after_every_step(tmp_path):
    check = make_check(tmp_path)
    (check.work / "logs" / "a.log").write_text("hello\n")
    check.note(kind="setup", name="wheels", rc=0, note="8 of 8 carried wheels installed")
    text = (check.out / "summary.md").read_text()
    assert "1 steps: 1 passed, 0 skipped, 0 failed" in text
    check.note(kind="skipped", name="tiny-eager-mb4", note="time: 3 s left for it, it needs 35 s")
    text = (check.out / "summary.md").read_text()
    assert "2 steps: 1 passed, 1 skipped, 0 failed" in text and "tiny-eager-mb4: skipped: time: 3 s left" in text
    with tarfile.open(check.out / "logs.tar.gz") as tar:
        assert "logs/a.log" in tar.getnames()


@pytest.mark.parametrize("last_line, rc, want", [
    ("6 skipped, 383 deselected in 9.20s", 0, "skipped"),
    ("no tests ran in 0.01s", 5, "skipped"),
    ("3 passed, 3 skipped, 383 deselected in 20.1s", 0, "passed"),
    ("1 failed, 2 passed in 3.0s", 1, "failed"),
    ("1 error in 2.0s", 2, "failed"),
    ("", 124, "failed"),
])
def test_tests_that_all_skipped_did_not_pass(tmp_path, last_line, rc, want):
    log = tmp_path / "pytest.log"
    log.write_text(f"$ python3 -m pytest\n{last_line}\n")
    line = device_summary.add_line(tmp_path / "r.jsonl", kind="pytest", name="pytest-gpu", rc=rc, log=log)
    assert line["outcome"] == want
    if want == "skipped":
        assert line["note"].startswith("none ran")


def test_unpack_restores_the_breakdown_for_explain(tmp_path, profiled_runs):
    tiny_profiled_run = profiled_runs["single"]  # the suite's traced tiny run (conftest)
    records = tmp_path / "records.jsonl"
    line = device_summary.add_line(records, kind="run", name="tiny-compile-mb2", rc=0, run_dir=tiny_profiled_run)
    assert line["outcome"] == "passed" and line["breakdown"]
    device_summary.main(["unpack", str(records), str(tmp_path / "back")])
    back = tmp_path / "back" / "tiny-compile-mb2"
    assert json.loads((back / "breakdown.json").read_text()) == json.loads((tiny_profiled_run / "breakdown.json").read_text())
    out = subprocess.run([sys.executable, "-m", "echobench", "explain", str(back)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "not profiled" not in out.stdout


def test_verify_names_what_makes_a_pass_unsound(tmp_path):
    records = tmp_path / "r.jsonl"
    log = tmp_path / "pytest.log"
    log.write_text("ERROR tests/test_x.py\n1 error in 1.0s\n")
    device_summary.add_line(records, kind="setup", name="wheels", rc=1, note="7 of 8 carried wheels installed")
    device_summary.add_line(records, kind="pytest", name="pytest-gpu", rc=2, log=log)
    device_summary.add_line(records, kind="report", name="report", rc=0)
    run = tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"status": "ok", "compiles_in_window": 0, "config": {},
                                                 "window_restarts": [{"window": 1, "first_step": 5}]}))
    device_summary.add_line(records, kind="run", name="3b-compile-mb8", rc=0, run_dir=run)
    problems = device_summary.verify_problems(device_summary.read_lines(records), expect_skip=True)
    assert [p.split(":")[0] for p in problems] == ["carried wheels", "pytest-gpu", "3b-compile-mb8",
                                                   "no step was skipped for time"]
    assert "1 window(s) measured again" in problems[2]


@pytest.mark.slow
def test_the_dry_pass_end_to_end(tmp_path):
    """The real script on this machine's packages: one calibration and one eager run, then the report."""
    env = dict(os.environ, DEVICE_CHECK_DRY="1", DEVICE_CHECK_ONLY="calibrate tiny-eager-mb2",
               DEVICE_CHECK_WORK=str(tmp_path / "work"), PYTHONPATH="",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # python3: this interpreter
               CUDA_VISIBLE_DEVICES="")  # the CPU whatever the host, as the suite's other commands
    # The pass's own compile cache, as on the device: a worker that compiled in process carries
    # inductor's default folder in its environment (the suite's, hundreds of MiB), which the pass
    # would pack into OUTDIR.
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "tools/device/check.sh", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {ln["name"]: ln for ln in device_summary.read_lines(out / "records.jsonl")}
    assert lines["calibrate"]["outcome"] == "passed" and lines["calibrate"]["result"]["tflops"] > 0
    assert lines["tiny-eager-mb2"]["outcome"] == "passed", lines["tiny-eager-mb2"].get("record", {}).get("error")
    assert lines["tiny-eager-mb2"]["record"]["steps"] == 3
    assert lines["report"]["outcome"] == "passed"
    summary = (out / "summary.md").read_text()
    assert "## echobench report --table md" in summary and "tiny" in summary.split("## echobench report")[1]
    assert sorted(p.name for p in out.iterdir() if p.name != "inductor-cache.tar.gz") == [
        "device-check.log", "env.txt", "logs.tar.gz", "records.jsonl", "summary.md"]


def test_no_compiler_means_no_compile_steps(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert device_check.launcher_problem().startswith("no C compiler")
    monkeypatch.delenv("CC")
    monkeypatch.setattr(device_check.sysconfig, "get_paths", lambda: {"include": "/nonexistent/include"})
    assert device_check.launcher_problem().startswith("no /nonexistent/include/Python.h")


def test_the_commit_is_recorded_where_git_did_not_travel(monkeypatch):
    from echobench.hardware import device as hardware

    monkeypatch.setattr(hardware.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 128, "", "fatal"))
    monkeypatch.delenv("ECHOBENCH_GIT_COMMIT", raising=False)
    assert hardware.git_commit() is None
    monkeypatch.setenv("ECHOBENCH_GIT_COMMIT", "0123abc")
    assert hardware.git_commit() == "0123abc"


def test_the_estimate_is_held_against_the_allocated_peak():
    """The estimate's tensors (no context, workspaces or fragmentation) against what the allocator
    handed out, not against its reserved peak (its cache included)."""
    record = {"status": "ok", "peak_mem_gib": 30.0, "peak_mem_allocated_gib": 20.0, "peak_mem_reserved_gib": 30.0}
    line = {"kind": "run", "name": "r", "status": "ok", "record": record,
            "memory_estimate_gib": {"total": 27.0, "tensors": 22.0, "overhead": 5.0}}
    row = device_summary.steps_table([line])[2].split(" | ")
    assert row[-4:] == ["30.0", "20.0", "22.0", "1.10 |"]


def test_the_given_commit_wins_over_a_stale_copy_of_git(monkeypatch):
    """The lent GPU's copy of .git answered an older HEAD than the tree it ran: the commit passed in
    ECHOBENCH_GIT_COMMIT is the record's."""
    from echobench.hardware import device as hardware

    monkeypatch.setattr(hardware.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, "904afcc\n", ""))
    monkeypatch.delenv("ECHOBENCH_GIT_COMMIT", raising=False)
    assert hardware.git_commit() == "904afcc"
    monkeypatch.setenv("ECHOBENCH_GIT_COMMIT", "19a0fcc")
    assert hardware.git_commit() == "19a0fcc"


def test_an_option_is_not_taken_for_the_output_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert device_check.main(["--help"]) == 0
    assert device_check.main(["-x"]) == 2
    assert device_check.main([]) == 2
    assert "usage: python3 -m tools.device.check OUTDIR" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # no pass started: nothing written where it was called
