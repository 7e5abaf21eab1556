"""The sweep's own bookkeeping, without running a job: sweep.json as a typed state (files of
earlier versions load) and the Executor protocol both executors keep."""

import inspect
import json

import pytest

from echobench.executors import Executor
from echobench.executors.local import LocalExecutor
from echobench.executors.slurm import SlurmExecutor
from echobench.sweep import SWEEP_FILE, RunEntry, SweepState

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


@pytest.mark.parametrize("text", ["{not json", "[]", '{"runs": []}', '{"runs": {"a": {"attempt": "x"}}}'])
def test_an_unreadable_sweep_json_loads_empty(tmp_path, text):
    (tmp_path / SWEEP_FILE).write_text(text)
    assert SweepState.load(tmp_path) == SweepState()
    assert SweepState.load(tmp_path / "missing") == SweepState()


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
