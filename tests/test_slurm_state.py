"""How the SLURM executor reads a job's state (its own file, sacct, scontrol, squeue) and turns a
job that died into a record, against stand-in scheduler commands (no cluster needed)."""

import os
from pathlib import Path

import pytest

from echobench.records.config import RunConfig
from echobench.sweep.executors import finish_without_record
from echobench.sweep.executors.slurm import SlurmExecutor
from echobench.records.results import Record


# What sacct prints (rc 1) on a cluster without accounting: the one failure that switches it off.
NO_ACCOUNTING = "!Slurm accounting storage is disabled"


def fake_commands(tmp_path: Path, monkeypatch, **outputs) -> Path:
    """Puts sacct / scontrol / squeue on PATH; each prints its text (rc 0) or fails (None: rc 1;
    "!TEXT": TEXT on stderr, rc 1). Every call is logged to calls.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    for name in ("sacct", "scontrol", "squeue"):
        text = outputs.get(name)
        if text is None:
            out = "exit 1\n"
        elif text.startswith("!"):
            out = f"echo '{text[1:]}' >&2\nexit 1\n"
        else:
            out = f"cat <<'EOF'\n{text}\nEOF\n"
        body = f'echo {name} >>"{calls}"\n' + out
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


@pytest.mark.parametrize("sacct, expected", [
    ("42|CANCELLED by 0|0:15", "cancelled"),
    ("42|TIMEOUT|0:0", "timeout"),
    ("42|OUT_OF_MEMORY|0:125", "oom"),
    ("42|NODE_FAIL|1:0", "node_fail"),
    ("42|PREEMPTED|0:15", "preempted"),
    ("42|FAILED|1:0", "error"),
    ("42|RUNNING|0:0", "running"),
    ("42|PENDING|0:0", "pending"),
])
def test_sacct_first_where_accounting_exists(tmp_path, monkeypatch, sacct, expected):
    calls = fake_commands(tmp_path, monkeypatch, sacct=sacct, scontrol=None, squeue=None)
    state = SlurmExecutor().state("42", tmp_path)
    assert state.state == expected and calls.read_text().split() == ["sacct"]


def test_without_accounting_squeue(tmp_path, monkeypatch):
    calls = fake_commands(tmp_path, monkeypatch, sacct=NO_ACCOUNTING, squeue="42|TIMEOUT|TimeLimit")
    ex = SlurmExecutor()
    state = ex.state("42", tmp_path)
    assert state.state == "timeout" and "TIMEOUT (TimeLimit)" in state.detail
    ex.state("42", tmp_path)
    assert calls.read_text().split() == ["sacct", "squeue", "squeue"]  # sacct tried once only

    calls = fake_commands(tmp_path / "b", monkeypatch, sacct=NO_ACCOUNTING, squeue="42|COMPLETED|None")
    assert SlurmExecutor().state("42", tmp_path).state == "error"  # completed, yet no exit line of its own
    fake_commands(tmp_path / "c", monkeypatch, sacct=NO_ACCOUNTING, squeue="")
    assert SlurmExecutor().state("42", tmp_path).state == "gone"


def test_the_jobs_own_status_file_comes_first(tmp_path, monkeypatch):
    calls = fake_commands(tmp_path, monkeypatch, sacct="43|RUNNING|0:0")
    (tmp_path / "job-state").write_text("exited 42 3 2026-01-01T00:00:00Z\n")
    state = SlurmExecutor().state("42", tmp_path)
    assert state.state == "exited" and state.exit_code == 3 and not calls.exists()
    # A status file from another job (an earlier attempt) does not count.
    assert SlurmExecutor().state("43", tmp_path).state == "running"


def test_scheduler_verdict_replaces_a_failure_record_but_never_an_ok_one(tmp_path):
    cfg = RunConfig(scale="tiny", steps=3)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "slurm-7.out").write_text(
        "step 1\nslurmstepd: error: *** JOB 7 ON node1 CANCELLED AT 2026 DUE TO TIME LIMIT ***\n" + "noise\n" * 50)
    Record.without_run(cfg, "error", "torchrun exited with code 1").save(tmp_path)
    record = finish_without_record(cfg, tmp_path, "timeout", "SLURM job 7 ended TIMEOUT")
    assert record.status == "timeout" and record.run_error == "torchrun exited with code 1"
    assert "DUE TO TIME LIMIT" in record.error and "DUE TO TIME LIMIT" in record.log_tail
    assert Record.load(tmp_path / "result.json").model_dump() == record.model_dump()  # saved, complete and valid
    Record.without_run(cfg, "ok", "").save(tmp_path)
    assert finish_without_record(cfg, tmp_path, "cancelled", "late scancel").status == "ok"
