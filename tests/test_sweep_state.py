"""The sweep's own bookkeeping, without running a job: sweep.json as a typed state (files of
earlier versions load) and the Executor protocol both executors keep."""

import inspect
import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from conftest import FIXTURES
from echobench.sweep import status as sweep_status

from echobench.sweep.executors import Executor
from echobench.records.paths import SWEEP_FILE
from echobench.sweep.executors.local import LocalExecutor
from echobench.sweep.executors.slurm import SlurmExecutor
from echobench.sweep.state import CorruptSweepState, RunEntry, SweepState

# sweep.json as sweeps wrote it before it was typed: a settled run, a job still pending, a refused
# submission (no job id), and an entry with none of the optional keys.
OLD = {"matrix": "t", "updated": "2026-01-01T00:00:00+00:00", "runs": {
    "a": {"executor": "local", "attempt": 1, "submitted": "2026-01-01T00:00:01+00:00", "state": "ok",
          "job_id": "local-7", "detail": "", "settled": True, "finished": "2026-01-01T00:01:00+00:00"},
    "b": {"executor": "slurm", "attempt": 2, "submitted": "2026-01-01T00:00:02+00:00", "state": "pending",
          "job_id": "42", "detail": "PENDING Priority"},
    "c": {"executor": "slurm", "attempt": 1, "submitted": "2026-01-01T00:00:03+00:00", "state": "error",
          "settled": True},
    "d": {"executor": "local", "attempt": 2, "job_id": "local-1", "settled": True, "state": "ok"},
}}


def test_an_old_sweep_json_loads_and_keeps_every_value(tmp_path):
    (tmp_path / SWEEP_FILE).write_text(json.dumps(OLD))
    state = SweepState.load(tmp_path)
    assert state.matrix == "t" and list(state.runs) == ["a", "b", "c", "d"]
    for rid, old in OLD["runs"].items():
        assert {k: getattr(state.runs[rid], k) for k in old} == old, rid
    assert state.runs["c"].job_id is None and not state.runs["b"].settled
    state.save(tmp_path)
    assert SweepState.load(tmp_path) == state
    saved = json.loads((tmp_path / SWEEP_FILE).read_text())["runs"]
    assert all(saved[rid][k] == v for rid, old in OLD["runs"].items() for k, v in old.items())


def test_a_missing_sweep_json_loads_empty(tmp_path):
    assert SweepState.load(tmp_path) == SweepState()
    assert SweepState.load(tmp_path / "missing") == SweepState()


@pytest.mark.parametrize("text", ["{not json", "", "[]", '{"runs": []}', '{"runs": {"a": {"attempt": "x"}}}',
                                  json.dumps(OLD)[:len(json.dumps(OLD)) // 2], b"\xff\xfe"])
def test_an_unreadable_sweep_json_is_one_line_naming_it_and_the_fix(tmp_path, text):
    path = tmp_path / SWEEP_FILE
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CorruptSweepState) as caught:
        SweepState.load(tmp_path)
    message = str(caught.value)
    assert message.startswith(f"{path}: unreadable sweep state (") and "\n" not in message
    assert message.endswith("move it aside to start the sweep's bookkeeping afresh (runs with records are kept; "
                            "check squeue for jobs it listed)")
    assert isinstance(caught.value, ValueError)  # the CLI's `except ValueError` turns it into `error: ...`


def corrupt_sweep(tmp_path) -> tuple[Path, bytes]:
    """A sweep directory whose sweep.json, naming a SLURM job still running, was cut in half:
    (the directory, the file's bytes, which no command may change)."""
    sweep = tmp_path / "sweep"
    (sweep / "a").mkdir(parents=True)
    (sweep / "a" / "run.yaml").write_text("scale: tiny\n")
    SweepState(matrix="t", planned=["a"], runs={"a": RunEntry(executor="slurm", attempt=1, job_id="4242",
                                                              state="running")}).save(sweep)
    text = (sweep / SWEEP_FILE).read_bytes()
    (sweep / SWEEP_FILE).write_bytes(text[:len(text) // 2])
    return sweep, text[:len(text) // 2]


def test_status_and_cancel_stop_at_an_unreadable_sweep_json_and_keep_it(tmp_path, monkeypatch):
    sweep, kept = corrupt_sweep(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no scancel / sacct is ever called
    with pytest.raises(CorruptSweepState, match="unreadable sweep state"):
        sweep_status.cancel_sweep(sweep, Console(file=io.StringIO()), wait_s=0)
    with pytest.raises(CorruptSweepState, match="unreadable sweep state"):
        sweep_status.status(sweep)
    assert (sweep / SWEEP_FILE).read_bytes() == kept


def test_a_sweep_over_an_unreadable_sweep_json_writes_nothing(tmp_path, cli):
    sweep, kept = corrupt_sweep(tmp_path)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({"name": "t", "executor": "local", "hardware": {"peak_tflops": 1},
                                  "defaults": {"scale": "tiny"}}))
    proc = cli("sweep", matrix, "--out", sweep)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{sweep.resolve() / SWEEP_FILE}: unreadable sweep state" in proc.stderr.replace("\n", "")
    assert (sweep / SWEEP_FILE).read_bytes() == kept
    assert sorted(p.name for p in sweep.iterdir()) == ["a", SWEEP_FILE]  # no matrix.yaml, no skipped.json


def test_the_report_goes_on_from_the_records_with_a_warning(tmp_path):
    from echobench.report import load_report_input

    sweep, _ = corrupt_sweep(tmp_path)
    shutil.copy(FIXTURES / "record-v2.json", sweep / "a" / "result.json")
    data = load_report_input([sweep])
    assert len(data.records) == 1
    (warning,) = [p for p in data.problems if SWEEP_FILE in p]
    assert warning.startswith(f"{sweep / SWEEP_FILE}: unreadable sweep state (") and "records alone" in warning


def test_a_new_entry_is_pending_and_not_settled():
    entry = RunEntry(executor="slurm", attempt=1)
    assert (entry.state, entry.settled, entry.job_id) == ("pending", False, None)


@pytest.mark.parametrize("executor", [LocalExecutor, SlurmExecutor])
def test_each_executor_keeps_the_protocol(executor):
    """Every attribute and method of Executor, each method with the protocol's parameters."""
    for name in Executor.__annotations__:
        assert hasattr(executor, name), name
    methods = [n for n, v in vars(Executor).items() if inspect.isfunction(v) and not n.startswith("_")]
    assert {"submit", "state", "cancel_all", "detach_message", "job_script", "calibrate"} <= set(methods)
    for name in methods:
        want = list(inspect.signature(getattr(Executor, name)).parameters)
        assert list(inspect.signature(getattr(executor, name)).parameters) == want, name


def test_no_wait_on_the_local_executor_is_refused_before_anything_is_written(cli, tmp_path):
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({"name": "t", "executor": "local", "hardware": {"peak_tflops": 1},
                                  "defaults": {"scale": "tiny"}}))
    proc = cli("sweep", matrix, "--out", tmp_path / "sweep", "--no-wait")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--no-wait needs --executor slurm" in proc.stderr and not (tmp_path / "sweep").exists()


def test_status_and_cancel_say_so_in_one_line_and_exit_2(tmp_path, cli):
    sweep, kept = corrupt_sweep(tmp_path)
    for command in ("status", "cancel"):
        proc = cli(command, sweep)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (command, proc.stderr)
        assert proc.stderr.startswith("error: ") and "unreadable sweep state" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout
    assert (sweep / SWEEP_FILE).read_bytes() == kept


def test_cancel_names_a_missing_directory_apart_from_one_that_is_no_sweep(tmp_path, cli):
    proc = cli("cancel", tmp_path / "nope")
    assert proc.returncode == 2 and "no such directory" in proc.stderr and not (tmp_path / "nope").exists()
    (tmp_path / "plain").mkdir()
    proc = cli("cancel", tmp_path / "plain")
    assert proc.returncode == 2 and "not a sweep directory" in proc.stderr


def test_run_states_are_one_vocabulary_whose_words_on_disk_are_unchanged(tmp_path):
    """The record's statuses, the sweep's states, what a job says and the scheduler's verdicts are
    RunState's; the words written to records and sweep.json are the ones files always held."""
    from typing import get_args

    from echobench.records.config import RunConfig
    from echobench.records.results import Record
    from echobench.records.states import ACTIVE, ENDED, RunState, Status
    from echobench.sweep.executors.slurm import ENDED as SLURM_ENDED

    assert [s.value for s in RunState] == ["ok", "oom", "error", "timeout", "cancelled", "node_fail", "preempted",
                                           "not started", "queued", "new", "waiting", "pending", "running",
                                           "corrupt", "unreadable", "exited", "gone"]
    assert get_args(Status) == tuple(ENDED) and set(SLURM_ENDED.values()) <= set(ENDED)
    assert set(ACTIVE) == {"pending", "running"}
    Record.without_run(RunConfig(scale="tiny"), RunState.NODE_FAIL, "lost").save(tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "node_fail"
    state = SweepState()
    state.runs["r"] = RunEntry(state=RunState.WAITING)
    state.save(tmp_path)
    assert json.loads((tmp_path / SWEEP_FILE).read_text())["runs"]["r"]["state"] == "waiting"
    assert SweepState.load(tmp_path).runs["r"].state == RunState.WAITING


@pytest.mark.parametrize("text", [None, "scale: [", "- a list", "scale: nope"])
def test_a_run_yaml_missing_or_invalid_is_one_error_naming_it(tmp_path, text):
    from echobench.records.rundir import RUN_YAML, read_run_config

    if text is not None:
        (tmp_path / RUN_YAML).write_text(text)
    with pytest.raises(ValueError, match=f"^{tmp_path / RUN_YAML} is missing or invalid$"):
        read_run_config(tmp_path)


@pytest.mark.parametrize("text,note", [("running 42 2026-12-07T09:00:00Z", ("running", "42", None)),
                                       ("exited local 3 2026-12-07T09:00:00Z", ("exited", "local", 3)),
                                       ("", None), ("exited 42", None)])
def test_the_job_state_a_job_writes_is_read_in_one_place(tmp_path, text, note):
    from echobench.records.rundir import JOB_STATE, read_job_note
    from echobench.sweep.executors import read_job_state

    (tmp_path / JOB_STATE).write_text(text)
    got = read_job_note(tmp_path)
    assert (got and (got.state, got.job_id, got.exit_code)) == note
    job = read_job_state(tmp_path, note[1]) if note else None
    assert (job and (job.state, job.exit_code)) == (note and (note[0], note[2]))


def test_the_suites_poll_cap_lowers_a_schedulers_first_interval_and_its_back_off(monkeypatch):
    from echobench.sweep.executors.slurm import SlurmExecutor
    from echobench.sweep.state import MAX_POLL_S, RUNNING_POLL_S, longest_poll, poll_cap

    monkeypatch.delenv("ECHOBENCH_MAX_POLL_S", raising=False)
    assert poll_cap(SlurmExecutor.poll_s) == SlurmExecutor.poll_s
    assert longest_poll(SlurmExecutor.poll_s, {"pending"}) == MAX_POLL_S
    monkeypatch.setenv("ECHOBENCH_MAX_POLL_S", "2")
    assert poll_cap(SlurmExecutor.poll_s) == 2.0
    assert longest_poll(2.0, {"running"}) == 2.0 < RUNNING_POLL_S
    monkeypatch.setenv("ECHOBENCH_MAX_POLL_S", "soon")  # not a number: the cap stands
    assert poll_cap(SlurmExecutor.poll_s) == SlurmExecutor.poll_s
