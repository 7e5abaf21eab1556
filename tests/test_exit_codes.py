"""The exit codes of `sweep`, `sweep --no-wait`, `status` and `preflight`: one test per row of the
table in docs/reference/failures.md#exit-codes (ROWS names them; a test holds the two together).
Jobs go to the local SLURM cluster, or to a stand-in sbatch on PATH where the scheduler's answer is
what the row is about (a submit limit)."""

import json
import re
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from stubjob import stub_python
from test_slurm_submit import LIMIT_WORDS, bin_dir, cluster, flat, stub  # noqa: F401 - fixtures

# device cpu: no run compiles, so a preflight job skips its compile check (some 3-13 CPU s of inductor on
# the node, which the rows here do not look at; tests/test_preflight.py keeps a preflight that compiles)
TINY = {"scale": "tiny", "steps": 2, "warmup_steps": 1, "micro_batch": 2, "audio_frames": 50, "text_tokens": 16,
        "speaker_frames": 40, "device": "cpu"}


def matrix(path: Path, **slurm) -> Path:
    """One tiny run on the CPU of the local cluster's nodes; `slurm` adds to the SLURM settings."""
    path.write_text(json.dumps({
        "name": "codes", "executor": "slurm", "hardware": {"peak_tflops": 0.5}, "defaults": TINY,
        "slurm": {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1}, **slurm},
        "include": [{"seed": 1}]}))
    return path


def said(proc) -> str:
    return flat(proc.stdout + proc.stderr)


@pytest.mark.slurm
def test_done(tmp_path, cluster):
    """What was asked happened: preflight passed (0); `sweep --no-wait` submitted every run (0);
    `status --wait` saw every run ok (0); `sweep` again: every run ok already (0). The run is a stub
    job (tests/stubjob.py): a real job whose run writes a canned record."""
    m, out = matrix(tmp_path / "m.yaml", python=str(stub_python(tmp_path / "bin"))), tmp_path / "sweep"
    proc = run_cli("preflight", m, "--out", out, tmp_path=tmp_path)
    assert proc.returncode == 0 and "preflight passed" in said(proc), said(proc)
    proc = run_cli("sweep", m, "--out", out, "--no-wait", tmp_path=tmp_path)
    assert proc.returncode == 0 and "submitted 1 runs" in said(proc), said(proc)
    proc = run_cli("status", out, "--wait", "--poll", "1", tmp_path=tmp_path)
    assert proc.returncode == 0 and "1 ok" in said(proc), said(proc)
    proc = run_cli("sweep", m, "--out", out, tmp_path=tmp_path)
    assert proc.returncode == 0 and "1 ok already" in said(proc), said(proc)


def test_run_failed(tmp_path, failing_sweep):
    """Runs' records are failures (an error and a timeout beside an ok run, conftest.failing_sweep):
    `sweep` 1, `status` 1, and `sweep --no-wait` 1 (they are not rerun without --retry-failed:
    nothing is submitted, so no cluster is asked)."""
    m, out, proc = failing_sweep
    assert proc.returncode == 1 and "0 ok already, 0 in progress, 3 to run" in said(proc), said(proc)
    assert sorted(json.loads(p.read_text())["status"] for p in out.glob("*/result.json")) == ["error", "ok", "timeout"]
    proc = run_cli("status", out, tmp_path=tmp_path)
    assert proc.returncode == 1 and "1 error" in said(proc), said(proc)
    proc = run_cli("sweep", m, "--out", out, "--executor", "slurm", "--no-wait", tmp_path=tmp_path)
    assert proc.returncode == 1, said(proc)
    assert "nothing to submit: 3 runs already have records (1 ok, 2 failed: --retry-failed reruns them)" in said(proc)


@pytest.mark.slurm
def test_refused(tmp_path, cluster):
    """sbatch refuses every job for its own reasons (a partition the cluster does not have):
    `sweep --no-wait` 1 (it used to exit 0 saying "nothing submitted"), `sweep` 1, `status` 1,
    `preflight` 1; each names sbatch's words."""
    m = matrix(tmp_path / "m.yaml", partition="nosuchpartition")
    proc = run_cli("sweep", m, "--out", tmp_path / "a", "--no-wait", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 1, said(proc)
    assert "nothing submitted: 1 refused by the scheduler" in said(proc) and "Invalid partition" in said(proc)
    proc = run_cli("status", tmp_path / "a", tmp_path=tmp_path)
    assert proc.returncode == 1 and "submission failed" in said(proc), said(proc)
    proc = run_cli("sweep", m, "--out", tmp_path / "b", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 1 and "not submitted" in said(proc), said(proc)
    proc = run_cli("preflight", m, "--out", tmp_path / "c", tmp_path=tmp_path)
    assert proc.returncode == 1 and "the preflight job was not submitted" in said(proc), said(proc)
    assert "Invalid partition" in said(proc)
    proc = run_cli("sweep", m, "--out", tmp_path / "d", "--no-wait", tmp_path=tmp_path)  # its preflight refused
    assert proc.returncode == 1 and "the preflight job was not submitted" in said(proc), said(proc)


def test_later(tmp_path, bin_dir):
    """sbatch refuses for a submit limit, which passes with time: `sweep --no-wait` 75, `preflight`
    75, `status --wait` 75 (runs left never submitted) while `status` is 0 (nothing failed).
    (`sweep` without --no-wait waits and retries: tests/test_slurm_submit.py.)"""
    stub(bin_dir, "sbatch", f"cat >&2 <<'EOF'\n{LIMIT_WORDS}\nEOF\nexit 1\n")
    stub(bin_dir, "squeue", "exit 0\n")  # no job of the run's name queued: the refusal stands
    m, out = matrix(tmp_path / "m.yaml"), tmp_path / "sweep"
    proc = run_cli("sweep", m, "--out", out, "--no-wait", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 75 and "1 of 1 runs not submitted yet" in said(proc), said(proc)
    proc = run_cli("status", out, tmp_path=tmp_path)
    assert proc.returncode == 0 and "1 waiting" in said(proc), said(proc)
    proc = run_cli("status", out, "--wait", "--poll", "0.1", tmp_path=tmp_path)
    assert proc.returncode == 75 and "1 of 1 runs never submitted" in said(proc), said(proc)
    proc = run_cli("preflight", m, "--out", tmp_path / "p", tmp_path=tmp_path)
    assert proc.returncode == 75 and "QOSMaxSubmitJobPerUserLimit" in said(proc), said(proc)
    proc = run_cli("sweep", m, "--out", tmp_path / "q", "--no-wait", tmp_path=tmp_path)  # its preflight waits
    assert proc.returncode == 75 and "the preflight job was not submitted" in said(proc), said(proc)


@pytest.mark.slurm
def test_preflight_failed(tmp_path, cluster):
    """A setup line that fails on the nodes: `preflight` 1; `sweep` and `sweep --no-wait` 1 with
    no run submitted."""
    m = matrix(tmp_path / "m.yaml", setup=["false"])
    proc = run_cli("preflight", m, "--out", tmp_path / "a", tmp_path=tmp_path)
    assert proc.returncode == 1 and "preflight FAILED" in said(proc), said(proc)
    for args in (["--no-wait"], []):
        proc = run_cli("sweep", m, "--out", tmp_path / "a", *args, tmp_path=tmp_path)
        assert proc.returncode == 1 and "no run submitted" in said(proc), said(proc)
        assert json.loads((tmp_path / "a" / "sweep.json").read_text())["runs"] == {}


def test_nothing_to_do(tmp_path):
    """Every combination filtered out: `sweep`, `sweep --no-wait` and `preflight` 1; `status` of a
    directory with no runs 1."""
    m = matrix(tmp_path / "m.yaml")
    for args in (["sweep"], ["sweep", "--no-wait"], ["preflight"]):
        proc = run_cli(*args, m, "--only", "scale=800M", "--out", tmp_path / "s", tmp_path=tmp_path)
        assert proc.returncode == 1 and "every combination was skipped or filtered out" in said(proc), said(proc)
    (tmp_path / "empty").mkdir()
    proc = run_cli("status", tmp_path / "empty", tmp_path=tmp_path)
    assert proc.returncode == 1 and "no runs here" in said(proc), said(proc)


def test_bad_input(tmp_path):
    """A matrix key that does not exist: `sweep`, `sweep --no-wait` and `preflight` 2; `status` of a
    path that is not a directory 2; nothing written."""
    m = tmp_path / "m.yaml"
    m.write_text(json.dumps({"name": "codes", "executor": "slurm", "defaults": TINY, "nosuchkey": 1}))
    for args in (["sweep"], ["sweep", "--no-wait"], ["preflight"]):
        proc = run_cli(*args, m, "--out", tmp_path / "s", tmp_path=tmp_path)
        assert proc.returncode == 2 and "nosuchkey" in said(proc), said(proc)
    assert not (tmp_path / "s").exists()
    proc = run_cli("status", m, tmp_path=tmp_path)
    assert proc.returncode == 2 and "is not a directory" in said(proc), said(proc)


def stopped_while_submitting(exc: type[BaseException]):
    """An executor whose submit is interrupted by `exc` (Ctrl-C's KeyboardInterrupt, SIGTERM's Terminated)."""
    class Stopped:
        name, poll_s, max_active = "slurm", 5.0, None

        def check_dir(self, sweep_dir):
            pass

        def job_script(self, run, run_dir, matrix, time_limit, log=None):
            return "#!/bin/bash\n"

        def submit(self, run, run_dir, time_limit_s):
            raise exc()

        def cancel_all(self):
            return []

        def detach_message(self):
            return "its jobs keep running"

    return Stopped()


def test_interrupted(tmp_path, monkeypatch):
    """Ctrl-C: `sweep` and `sweep --no-wait` 130 (while submitting), `preflight` 130, `status` 130."""
    from rich.console import Console
    import io

    from echobench.sweep import loop as sw
    from echobench.sweep.matrix import expand, load_matrix

    monkeypatch.setattr(sw, "make_executor", lambda name, matrix=None: stopped_while_submitting(KeyboardInterrupt))
    the_matrix = load_matrix(matrix(tmp_path / "m.yaml"))
    runs = expand(the_matrix, "slurm").runs
    for wait in (True, False):
        opts = sw.SweepOptions(executor="slurm", out=tmp_path / f"s{wait}", wait=wait, preflight=False)
        assert sw.run_sweep(the_matrix, runs, opts, Console(file=io.StringIO())) == sw.INTERRUPTED == 130
    from echobench.cli import sweep as cli_sweep  # `preflight`: Ctrl-C while its job is submitted
    import typer

    monkeypatch.setattr("echobench.sweep.preflight.run_preflight",
                        lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(typer.Exit) as stopped:
        cli_sweep.preflight_command(tmp_path / "m.yaml", None, tmp_path / "p", [], None, dry_run=False, site=None)
    assert stopped.value.exit_code == 130
    # `status --wait`: Ctrl-C while it waits
    monkeypatch.setattr("echobench.sweep.status.status", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr("sys.argv", ["echobench", "status", str(tmp_path), "--wait"])
    from echobench.cli import main

    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 130


def test_sigterm(tmp_path, monkeypatch):
    """SIGTERM (`kill PID`): `sweep` and `sweep --no-wait` stop as after Ctrl-C, exit 143, said as
    SIGTERM, and no question asked (the real signal through a whole sweep: tests/test_sweep_local.py)."""
    from rich.console import Console
    import io

    from echobench.sweep import loop as sw
    from echobench.sweep.matrix import expand, load_matrix

    monkeypatch.setattr(sw, "make_executor", lambda name, matrix=None: stopped_while_submitting(sw.Terminated))
    the_matrix = load_matrix(matrix(tmp_path / "m.yaml"))
    runs = expand(the_matrix, "slurm").runs
    for wait in (True, False):
        out = io.StringIO()
        asked = []
        opts = sw.SweepOptions(executor="slurm", out=tmp_path / f"s{wait}", wait=wait, preflight=False,
                               ask=lambda q: asked.append(q) or True)
        assert sw.run_sweep(the_matrix, runs, opts, Console(file=out, width=200)) == 143
        assert "interrupted (SIGTERM) while submitting" in out.getvalue() and asked == [], out.getvalue()


ROWS = {"what was asked happened": test_done, "a run failed": test_run_failed,
        "sbatch refused a job for good": test_refused, "sbatch takes a job later": test_later,
        "the preflight failed": test_preflight_failed, "nothing to do": test_nothing_to_do,
        "bad input": test_bad_input, "Ctrl-C": test_interrupted,
        "SIGTERM": test_sigterm}


def test_every_row_of_the_exit_code_table_has_a_test():
    page = (ROOT / "docs" / "reference" / "failures.md").read_text()
    table = page.split("## Exit codes", 1)[1].split("\n\n")[2]
    rows = [re.sub(r"\*\*|\s*\(.*", "", line.split("|")[1].strip()) for line in table.splitlines()[2:]]
    assert rows == list(ROWS)
