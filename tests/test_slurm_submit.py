"""A sweep that respects the scheduler: submit limits, timed-out sbatch, batched polling with
back-off, `echobench cancel` and Ctrl-C.

The first tests need no cluster: a stand-in scheduler in Python (FakeScheduler: a queue that
refuses beyond N jobs, as a QOS's MaxSubmitJobsPerUser does, on a fake clock) drives the sweep, and
stand-in sbatch / sacct / squeue scripts on PATH drive the SLURM executor. The tests marked
`slurm` run on the local cluster (`bash scripts/slurm-local.sh up 2`): it keeps no accounting, so
a QOS limit cannot be set there; a stub sbatch on PATH refuses as sbatch does under such a limit
(its exact words) and hands every other submission to the real sbatch, so the jobs really run:
stub jobs (tests/stubjob.py), whose run writes a canned record instead of training.
"""

import io
import json
import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from conftest import default_signals, run_cli, wait_for
from stubjob import STUB_BY, stub_python
from echobench.sweep import loop as sw
from echobench.sweep import state as sweep_state
from echobench.sweep import status as sweep_status
from echobench.sweep.executors import JobState, SubmitLater
from echobench.sweep.executors.slurm import SlurmError, SlurmExecutor, SlurmJobFields
from echobench.sweep.matrix import expand, load_matrix
from echobench.records.results import Record

TINY = {"scale": "tiny", "steps": 3, "warmup_steps": 1, "micro_batch": 2, "audio_frames": 50, "text_tokens": 16,
        "speaker_frames": 40}
# sbatch's words under a QOS with MaxSubmitJobsPerUser (rc 1).
LIMIT_WORDS = ("sbatch: error: QOSMaxSubmitJobPerUserLimit\n"
               "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, "
               "user's size and/or time limits)")


# ---- a stand-in scheduler, on a fake clock ----

class FakeClock:
    """sweep.time: sleep() advances the clock at once and is recorded."""

    def __init__(self):
        self.now, self.sleeps = 1000.0, []

    def monotonic(self):
        return self.now

    def time(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


class FakeScheduler:
    """A queue that refuses a submission while `limit` jobs are in it (with sbatch's words) and
    ends each job `looks` looks after it was submitted, with the run's ok record."""

    name = "slurm"
    poll_s = 5.0

    def __init__(self, limit=1000, max_submitted=None, looks=2, ends=None, pending=None):
        self.max_active, self.limit, self.looks, self.ends = max_submitted, limit, looks, ends or {}
        # submission index -> [pending reason, looks it lasts]: the job waits with that reason first
        self.pending = {k: list(v) for k, v in (pending or {}).items()}
        self.queue: dict[str, list] = {}
        self.refusals = self.submitted = self.most = self.batches = 0
        self.next_id = 100
        self.cancelled: list[str] = []

    def check_dir(self, sweep_dir):
        pass

    def job_script(self, run, run_dir, matrix, time_limit, log=None):
        return "#!/bin/bash\n"

    def calibrate(self, sweep_dir, matrix, device, log):
        pass

    def submit(self, run, run_dir, time_limit_s):
        if len(self.queue) >= self.limit:
            self.refusals += 1
            raise SubmitLater(f"sbatch refused {run.id} for now: {LIMIT_WORDS.replace(chr(10), ' | ')}")
        self.next_id += 1
        job_id = str(self.next_id)
        self.queue[job_id] = [run_dir, run.cfg, self.ends.get(self.submitted, self.looks), self.pending.get(self.submitted)]
        self.submitted += 1
        self.most = max(self.most, len(self.queue))
        return job_id

    def states(self, jobs):
        self.batches += 1
        out = {}
        for job_id, run_dir in jobs.items():
            job = self.queue.get(job_id)
            if job is None:
                out[job_id] = JobState("gone", "unknown")
                continue
            if (waits := job[3]) is not None and waits[1] > 0:  # pending, as squeue's %r says why
                waits[1] -= 1
                out[job_id] = SlurmExecutor.job_state(job_id, SlurmJobFields("PENDING", "", waits[0]))
                continue
            job[2] -= 1
            if job[2] > 0:
                out[job_id] = SlurmExecutor.job_state(job_id, SlurmJobFields("RUNNING", "", "None"))
                continue
            Record.without_run(job[1], "ok", "").save(run_dir)
            (run_dir / "job-state").write_text(f"exited {job_id} 0 2026-01-01T00:00:00Z\n")
            del self.queue[job_id]
            out[job_id] = JobState("exited", "job exited with code 0", 0)
        return out

    def state(self, job_id, run_dir):
        return self.states({job_id: run_dir})[job_id]

    def cancel(self, job_ids):
        self.cancelled += job_ids
        for job_id in job_ids:
            self.queue.pop(job_id, None)

    def cancel_all(self):
        return []

    def detach_message(self):
        return "the fake jobs keep running: `echobench cancel DIR` stops them"


def fake_sweep(tmp_path, monkeypatch, scheduler, n_runs, wait=True, clock=None):
    """(exit code, console text, sweep dir): a sweep of n_runs tiny runs on `scheduler`."""
    matrix_path = tmp_path / "m.yaml"
    matrix_path.write_text(json.dumps({"name": "limits", "executor": "slurm", "hardware": {"peak_tflops": 0.5},
                                       "slurm": {"request_gpus": False}, "defaults": TINY,
                                       "axes": {"seed": list(range(n_runs))}}))
    matrix = load_matrix(matrix_path)
    runs = expand(matrix, "slurm").runs
    assert len(runs) == n_runs
    for module in (sw, sweep_status):  # the sweep's loop, and `status` after it
        monkeypatch.setattr(module, "make_executor", lambda name, matrix=None: scheduler)
    clock = clock or FakeClock()
    for module in (sw, sweep_state, sweep_status):
        monkeypatch.setattr(module, "time", clock)
    console = Console(record=True, width=200, file=io.StringIO())
    out = tmp_path / "sweep"
    code = sw.run_sweep(matrix, runs, sw.SweepOptions(executor="slurm", out=out, wait=wait, preflight=False), console)
    return code, console.export_text(), out, clock


def flat(text: str) -> str:
    """Console text with rich's line wrapping undone."""
    return " ".join(text.split())


def statuses(out: Path) -> list[str]:
    return sorted(json.loads((d / "result.json").read_text())["status"] for d in out.iterdir()
                  if (d / "result.json").exists())


def stub_records(out: Path) -> bool:
    """Every record of the sweep is a stub job's (tests/stubjob.py), none a trained run's."""
    found = [json.loads(p.read_text())["env"]["recorded_by"] for p in out.glob("*/result.json")]
    return bool(found) and set(found) == {STUB_BY}


def test_under_a_submit_limit_of_5_every_one_of_12_runs_finishes(tmp_path, monkeypatch):
    """Issue 23: with a limit of 5, 7 of 12 runs became errors. Now a refusal keeps the run
    waiting, it is submitted again as jobs end, and the refusal is logged once."""
    scheduler = FakeScheduler(limit=5)
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 12)
    assert code == 0, text
    assert statuses(out) == ["ok"] * 12 and scheduler.submitted == 12
    assert scheduler.refusals >= 1 and scheduler.most <= 5
    assert flat(text).count("QOSMaxSubmitJobPerUserLimit") == 1, text
    entries = json.loads((out / "sweep.json").read_text())["runs"]
    assert all(e["attempt"] == 1 and e["settled"] and e["job_id"] for e in entries.values())
    assert not any((out / rid / "attempts").exists() for rid in entries)  # a refused try is no attempt


def test_max_submitted_caps_the_jobs_in_the_queue(tmp_path, monkeypatch):
    scheduler = FakeScheduler(max_submitted=2)
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 7)
    assert code == 0, text
    assert statuses(out) == ["ok"] * 7 and scheduler.most == 2 and scheduler.refusals == 0
    assert "at most 2 in the queue at once (slurm.max_submitted)" in flat(text)


def test_no_wait_with_runs_left_to_submit_says_so_and_exits_75_then_the_same_sweep_resumes(tmp_path, monkeypatch):
    scheduler = FakeScheduler(limit=2, looks=100)
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 5, wait=False)
    assert code == sw.NOT_ALL_SUBMITTED == 75, text
    assert "3 of 5 runs not submitted yet" in flat(text) and "the same `echobench sweep` submits them" in flat(text), text
    entries = json.loads((out / "sweep.json").read_text())["runs"]
    assert sorted(e["state"] for e in entries.values()) == ["pending", "pending", "waiting"]
    assert not statuses(out)  # no run became an error
    rows = sweep_status.refresh_status(out)
    assert sorted(r["state"] for r in rows) == ["not started", "not started", "running", "running", "waiting"]
    assert "QOSMaxSubmitJobPerUserLimit" in next(r["error"] for r in rows if r["state"] == "waiting")
    # The same sweep, waiting this time: the 2 queued jobs are tracked again, the other 3 submitted as they end.
    scheduler.looks = 2
    for job in scheduler.queue.values():
        job[2] = 2
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 5)
    assert code == 0, text
    assert statuses(out) == ["ok"] * 5 and scheduler.submitted == 5
    assert all(e["attempt"] == 1 for e in json.loads((out / "sweep.json").read_text())["runs"].values())


def test_no_wait_with_nothing_to_submit_says_so_and_why(tmp_path, monkeypatch):
    """`sweep --no-wait` again: no job submitted, and it says that, and why (queued, done), not "submitted"."""
    scheduler = FakeScheduler(looks=100)
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 2, wait=False)
    assert code == 0 and "submitted 2 runs; follow with: echobench status" in flat(text), text
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 2, wait=False)
    assert code == 0 and scheduler.submitted == 2, text
    assert "nothing to submit: 2 already queued or running; follow with" in flat(text), text
    for job in scheduler.queue.values():  # both end at the next look: ok records
        job[2] = 1
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 2, wait=False)
    assert code == 0 and "nothing to submit: 2 runs already have records (2 ok); follow with" in flat(text), text


def test_polls_back_off_while_nothing_changes_and_reset_at_a_change(tmp_path, monkeypatch):
    """One look per poll for every job; 5 s doubling while nothing changes, up to 10 s while a job
    runs (its failure shows within that); back to 5 s when something does."""
    scheduler = FakeScheduler(ends={0: 3, 1: 10})  # job 1 ends at the 3rd look, job 2 at the 10th
    code, text, out, clock = fake_sweep(tmp_path, monkeypatch, scheduler, 2)
    assert code == 0, text
    # look 1: pending -> running (a change); 2: none; 3: job 1 ends; 4-9: none; 10: job 2 ends
    assert clock.sleeps == [5, 10, 5, 10, 10, 10, 10, 10, 10], clock.sleeps
    assert scheduler.batches == 10  # one look per poll for both jobs, never one per job


def test_polls_back_off_to_a_minute_while_every_job_is_pending(tmp_path, monkeypatch):
    """Nothing runs yet (the queue is full): 5 s doubling up to 60 s; 10 s at most once it runs."""
    scheduler = FakeScheduler(pending={0: ["Priority", 7]}, looks=4)  # pending 7 looks, then runs, ends at the 4th
    code, text, out, clock = fake_sweep(tmp_path, monkeypatch, scheduler, 1)
    assert code == 0, text
    # looks 1-7: pending (no change); 8: running (a change); 9-10: none; 11: it ends
    assert clock.sleeps == [10, 20, 40, 60, 60, 60, 60, 5, 10, 10], clock.sleeps


def test_a_job_that_can_never_start_ends_as_an_error_naming_the_limit_and_frees_its_slot(tmp_path, monkeypatch):
    """PENDING (QOSMaxNodePerJobLimit) would hold the sweep's one slot for ever: after the grace it is
    cancelled, recorded `error` with the limit and the fix, and the next run goes in; a transient
    reason (Priority) is waited for."""
    scheduler = FakeScheduler(max_submitted=1, pending={0: ["QOSMaxNodePerJobLimit", 10**6], 1: ["Priority", 3]})
    code, text, out, clock = fake_sweep(tmp_path, monkeypatch, scheduler, 2)
    assert code == 1, text
    assert statuses(out) == ["error", "ok"] and scheduler.cancelled == ["101"] and scheduler.submitted == 2
    (blocked,) = [json.loads((d / "result.json").read_text()) for d in out.iterdir()
                  if (d / "result.json").exists() and json.loads((d / "result.json").read_text())["status"] == "error"]
    assert blocked["error"].startswith("SLURM job 101 can never start as it is: PENDING (QOSMaxNodePerJobLimit) for ")
    assert "more than the QOS or account allows one job (sacctmgr show qos" in blocked["error"]
    assert "--retry-failed" in blocked["error"] and sum(clock.sleeps) >= sweep_state.NEVER_GRACE_S


def test_status_shows_the_pending_reason_and_what_a_dependency_waits_for(tmp_path):
    class Pending:
        name, poll_s, max_active = "slurm", 5.0, None

        def states(self, jobs):
            return {j: SlurmExecutor.job_state(j, SlurmJobFields("PENDING", "", "Dependency")) for j in jobs}

    entry = sweep_state.RunEntry(executor="slurm", job_id="12")
    looks = sweep_state.tracked_job_states(Pending(), {"r": (entry, tmp_path)}, sweep_state.SweepState(calibration_job="7"))
    assert looks["r"].detail == "PENDING (Dependency): waits for the calibration job 7"
    assert SlurmExecutor.job_state("5", SlurmJobFields("RUNNING", "", "None")).detail == "RUNNING"  # no literal None
    ended = SlurmExecutor.job_state("5", SlurmJobFields("CANCELLED", "exit 0:15", "None"))
    assert ended.detail == "SLURM job 5 ended CANCELLED (exit 0:15)" and ended.state == "cancelled"


def test_ctrl_c_names_the_runs_and_jobs_it_leaves_and_says_they_are_pending(tmp_path, monkeypatch):
    scheduler = FakeScheduler(looks=100, pending={0: ["Priority", 100]})
    clock = FakeClock()

    def interrupted(seconds):
        raise KeyboardInterrupt

    clock.sleep = interrupted
    code, text, out, _ = fake_sweep(tmp_path, monkeypatch, scheduler, 2, clock=clock)
    rids = json.loads((out / "sweep.json").read_text())["runs"]
    assert code == 130, text
    assert "interrupted (Ctrl-C) while waiting for its jobs (1 pending, 1 running)" in flat(text), text
    first, second = rids
    assert f"left in the queue: {first} (job 101, pending), {second} (job 102, running)" in flat(text)


# ---- the SLURM executor against stand-in commands ----

def stub(bin_dir: Path, name: str, body: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}{os.environ['PATH']}")
    return path


def job_script(run_dir: Path, name: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    script = run_dir / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name={name}\ntrue\n")
    return script


@pytest.mark.parametrize("words, later", [
    (LIMIT_WORDS, True),
    ("sbatch: error: AssocMaxSubmitJobLimit\nsbatch: error: Batch job submission failed: Job violates "
     "accounting/QOS policy (job submit limit, user's size and/or time limits)", True),
    ("sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, user's "
     "size and/or time limits)", True),
    ("sbatch: error: Batch job submission failed: Socket timed out on send/recv operation", True),
    ("sbatch: error: Slurm temporarily unable to accept job, sleeping and retrying\n"
     "sbatch: error: Batch job submission failed: Resource temporarily unavailable", True),
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)", True),
    # the job's own: never better with time
    ("sbatch: error: QOSMaxWallDurationPerJobLimit\nsbatch: error: Batch job submission failed: Job violates "
     "accounting/QOS policy (job submit limit, user's size and/or time limits)", False),
    ("sbatch: error: invalid partition specified: gpu\n"
     "sbatch: error: Batch job submission failed: Invalid partition name specified", False),
    ("sbatch: unrecognized option '--bogus-opt'\nTry \"sbatch --help\" for more information", False),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", False),
])
def test_a_refusal_that_passes_with_time_waits_another_stays_an_error(tmp_path, bin_dir, words, later):
    stub(bin_dir, "sbatch", f"cat >&2 <<'EOF'\n{words}\nEOF\nexit 1\n")
    script = job_script(tmp_path / "r", "eb-r")
    with pytest.raises(SubmitLater if later else SlurmError) as exc:
        SlurmExecutor().sbatch(script, "r")
    assert type(exc.value) is (SubmitLater if later else SlurmError)
    assert words.splitlines()[-1].strip() in str(exc.value)


def test_a_login_shells_sbatch_defaults_reach_sbatch_and_an_allocations_do_not(tmp_path, bin_dir, monkeypatch):
    """SBATCH_ACCOUNT & co from a login shell are the user's account and reservation: kept. Inside an
    allocation (SLURM_JOB_ID set) the SLURM_* / SBATCH_* variables are that job's: dropped."""
    seen = tmp_path / "seen"
    stub(bin_dir, "sbatch", f'echo "${{SBATCH_ACCOUNT:-none}} ${{SBATCH_RESERVATION:-none}}" >>"{seen}"\necho 42\n')
    monkeypatch.setenv("SBATCH_ACCOUNT", "proj1")
    monkeypatch.setenv("SBATCH_RESERVATION", "bench")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert SlurmExecutor().sbatch(job_script(tmp_path / "r", "eb-r"), "r") == "42"
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    SlurmExecutor().sbatch(job_script(tmp_path / "s", "eb-s"), "s")
    assert seen.read_text().splitlines() == ["proj1 bench", "none none"]


def test_an_sbatch_that_timed_out_is_looked_up_by_name_before_anything_is_recorded(tmp_path, bin_dir):
    calls = tmp_path / "calls.txt"
    stub(bin_dir, "sbatch", f'echo "sbatch $*" >>"{calls}"\nexec sleep 30\n')  # the controller queues it, slowly
    stub(bin_dir, "squeue", f'echo "squeue $*" >>"{calls}"\n[[ " $* " == *" --name=eb-r "* ]] && echo 4242\nexit 0\n')
    ex = SlurmExecutor()
    ex.submit_timeout_s = 1
    assert ex.sbatch(job_script(tmp_path / "r", "eb-r"), "r") == "4242"
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and lines[0].startswith("sbatch") and "--name=eb-r" in lines[1], lines

    # Not in the queue (yet): not recorded as failed; the next try asks squeue again before submitting again.
    calls.unlink()
    with pytest.raises(SubmitLater, match="did not answer within 1 s and no job eb-s is queued"):
        ex.sbatch(job_script(tmp_path / "s", "eb-s"), "s")
    stub(bin_dir, "sbatch", f'echo "sbatch $*" >>"{calls}"\necho 4343\n')
    assert ex.sbatch(tmp_path / "s" / "job.sh", "s") == "4343"
    words = [line.split()[0] for line in calls.read_text().splitlines()]
    assert words == ["sbatch", "squeue", "squeue", "sbatch"], words


FAKE_SACCT = r'''import sys
ids = sys.argv[sys.argv.index("-j") + 1].split(",")
open(sys.argv[0] + ".calls", "a").write(" ".join(sys.argv[1:]) + "\n")
for i in ids:
    print(f"{i}|{'TIMEOUT' if int(i) % 3 == 0 else 'RUNNING'}|0:0")
'''


def test_one_sacct_per_poll_for_every_job(tmp_path, bin_dir):
    (bin_dir / "sacct.py").write_text(FAKE_SACCT)
    stub(bin_dir, "sacct", f'exec {sys.executable} "{bin_dir / "sacct.py"}" "$@"\n')
    stub(bin_dir, "squeue", f'echo squeue >>"{tmp_path / "squeue.calls"}"\n')
    jobs = {str(1000 + k): tmp_path / f"run{k}" for k in range(30)}
    ex = SlurmExecutor()
    for poll in range(1, 4):
        states = ex.states(jobs)
        calls = (bin_dir / "sacct.py.calls").read_text().splitlines()
        assert len(calls) == poll, calls  # not one per job
        assert calls[-1].split()[calls[-1].split().index("-j") + 1].split(",") == list(jobs)
    assert {states[j].state for j in jobs if int(j) % 3 == 0} == {"timeout"}
    assert {states[j].state for j in jobs if int(j) % 3} == {"running"}
    assert not (tmp_path / "squeue.calls").exists()  # sacct knew every job


def test_a_transient_sacct_failure_is_no_news_and_does_not_switch_accounting_off(tmp_path, bin_dir):
    """slurmdbd down for a moment: this poll says nothing about a job squeue no longer knows (it is
    not `gone`), and the next poll asks sacct again, which knows it ended TIMEOUT."""
    flag = tmp_path / "failed-once"
    stub(bin_dir, "sacct", f'echo "sacct $*" >>"{tmp_path / "calls"}"\n'
                           f'if [ ! -e "{flag}" ]; then touch "{flag}"; echo "sacct: error: Problem talking to the '
                           f'database: Connection refused" >&2; exit 1; fi\necho "77|TIMEOUT|0:0"\n')
    stub(bin_dir, "squeue", f'echo "squeue $*" >>"{tmp_path / "calls"}"\n')  # purged: squeue lists nothing
    ex = SlurmExecutor()
    assert ex.states({"77": tmp_path}) == {}  # no news
    assert ex.accounting is not False
    assert ex.states({"77": tmp_path})["77"].state == "timeout"
    assert [line.split()[0] for line in (tmp_path / "calls").read_text().splitlines()] == ["sacct", "squeue", "sacct"]


# ---- on the local SLURM cluster ----

def answering_cluster(tmp_path, min_nodes: int = 1):
    """A SLURM cluster of min_nodes or more that answers (else a skip, or a failure where
    ECHOBENCH_REQUIRE_SLURM=1); afterwards every job whose script lies under tmp_path is scancelled,
    whatever the test left. For `yield from` in a fixture."""
    from test_slurm import cluster_nodes

    if len(cluster_nodes()) < min_nodes:
        message = f"no local SLURM cluster with {min_nodes} or more nodes: bash scripts/slurm-local.sh up 2"
        if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    yield
    queue = subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True).stdout.splitlines()
    if left := [line.split()[0] for line in queue if len(line.split()) == 2 and line.split()[1].startswith(str(tmp_path))]:
        subprocess.run(["scancel", *left])


@pytest.fixture
def cluster(tmp_path):
    """A SLURM cluster that answers; its jobs scancelled after the test (answering_cluster)."""
    yield from answering_cluster(tmp_path)


def real(name: str) -> str:
    for d in os.environ["PATH"].split(os.pathsep):
        if os.access(p := os.path.join(d, name), os.X_OK) and "stubs" not in d:
            return p
    raise FileNotFoundError(name)


def limited_sbatch(stubs: Path, sweep: Path, limit: int, hold_until_refused: bool = False) -> Path:
    """A stub sbatch on PATH that refuses as sbatch does under MaxSubmitJobsPerUser=limit while
    `limit` jobs of this sweep are in the queue, and hands the rest to the real sbatch. A job whose
    script has exited (its job-state says so) has left as far as the sweep can tell: SLURM may list it
    COMPLETING a moment longer, and a refusal in that moment says nothing of the sweep. Each
    submission and refusal is a line of the returned log. `hold_until_refused`: the jobs are
    submitted held until the first refusal, which releases them: it comes whatever the machine's speed."""
    log = stubs.parent / "sbatch.log"
    release = (f'  {real("scontrol")} release $({real("squeue")} -h -t PENDING -o "%i %o" | awk -v d="{sweep}/" '
               f"'index($2, d) == 1 {{print $1}}') 2>/dev/null\n") if hold_until_refused else ""
    hold = f'grep -q "^refused" "{log}" 2>/dev/null || set -- --hold "$@"\n' if hold_until_refused else ""
    stub(stubs, "sbatch", f'''n=0
while read -r script; do
  case "$script" in "{sweep}/"*) ;; *) continue ;; esac
  grep -q "^exited" "$(dirname "$script")/job-state" 2>/dev/null || n=$((n + 1))
done < <({real("squeue")} -h -t PENDING,RUNNING,CONFIGURING,COMPLETING,SUSPENDED -o "%o")
if [ "$n" -ge {limit} ]; then
  echo "refused with $n queued" >>"{log}"
{release}  cat >&2 <<'EOF'
{LIMIT_WORDS}
EOF
  exit 1
fi
echo "submitted with $n queued" >>"{log}"
{hold}exec {real("sbatch")} "$@"
''')
    return log


def slurm_matrix(path: Path, n: int, hang: bool = False, **slurm) -> Path:
    """n tiny runs (seeds 0..n-1) on the CPU nodes as stub jobs (tests/stubjob.py: real jobs whose run
    writes a canned record, or with `hang` runs until cancelled); `slurm` adds to the SLURM settings."""
    python = str(stub_python(path.parent / "bin", hang=hang))
    path.write_text(json.dumps({
        "name": "limits", "executor": "slurm", "hardware": {"peak_tflops": 0.5},
        "slurm": {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1},
                  "python": python, **slurm},
        "defaults": TINY, "axes": {"seed": list(range(n))}}))
    return path


def with_stubs(stubs: Path) -> dict:
    return {"PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}


def squeue_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True).stdout.strip()


@pytest.mark.slurm
def test_a_sweep_under_a_submit_limit_of_1_finishes_every_run(tmp_path, cluster):
    """The acceptance test of issue 23: 2 runs, no cap in the matrix, sbatch refusing beyond 1
    queued job with a QOS limit's words (the second is refused: the first is held until it is).
    Every run ends ok; the refusal is logged once."""
    out, stubs = tmp_path / "sweep", tmp_path / "stubs"
    log = limited_sbatch(stubs, out, 1, hold_until_refused=True)
    proc = run_cli("sweep", slurm_matrix(tmp_path / "m.yaml", 2), "--out", out, "--poll", "1", "--no-preflight",
                   tmp_path=tmp_path, timeout=1200, env=with_stubs(stubs))
    print(proc.stdout, log.read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert statuses(out) == ["ok"] * 2 and stub_records(out)
    tries = log.read_text().splitlines()
    assert sum(t.startswith("submitted") for t in tries) == 2 and any(t.startswith("refused") for t in tries)
    assert flat(proc.stdout).count("QOSMaxSubmitJobPerUserLimit") == 1, proc.stdout


@pytest.mark.slurm
def test_max_submitted_keeps_the_queue_under_the_limit(tmp_path, cluster):
    """slurm.max_submitted: 1 under the same limit: never refused, every run ok."""
    out, stubs = tmp_path / "sweep", tmp_path / "stubs"
    log = limited_sbatch(stubs, out, 1)
    proc = run_cli("sweep", slurm_matrix(tmp_path / "m.yaml", 2, max_submitted=1), "--out", out, "--poll", "1", "--no-preflight",
                   tmp_path=tmp_path, timeout=1200, env=with_stubs(stubs))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert statuses(out) == ["ok"] * 2 and stub_records(out)
    assert log.read_text().splitlines() == [line for line in log.read_text().splitlines()
                                            if line.startswith("submitted")], log.read_text()


@pytest.mark.slurm
def test_no_wait_under_a_limit_then_cancel_ends_the_sweeps_jobs(tmp_path, cluster):
    """--no-wait with a run left to submit: exit 75 naming it; `echobench cancel DIR` then ends the
    two queued jobs (records cancelled, as the sweep writes them), and again does nothing."""
    out, stubs = tmp_path / "sweep", tmp_path / "stubs"
    limited_sbatch(stubs, out, 2)
    matrix = slurm_matrix(tmp_path / "m.yaml", 3, hang=True)
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", "--no-preflight", tmp_path=tmp_path,
                   env=with_stubs(stubs))
    assert proc.returncode == 75, proc.stdout + proc.stderr
    assert "1 of 3 runs not submitted yet" in flat(proc.stdout) and "QOSMaxSubmitJobPerUserLimit" in proc.stdout
    entries = json.loads((out / "sweep.json").read_text())["runs"]
    jobs = [e["job_id"] for e in entries.values() if e["job_id"]]
    assert len(jobs) == 2 and [e["state"] for e in entries.values() if not e["job_id"]] == ["waiting"]
    wait_for(lambda: any(squeue_state(j) == "RUNNING" for j in jobs))
    proc = run_cli("cancel", out, tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cancelled 2 slurm job(s)" in flat(proc.stdout) and "1 runs never submitted (waiting)" in flat(proc.stdout)
    assert {squeue_state(j) for j in jobs} == {"CANCELLED"}
    for rid, e in json.loads((out / "sweep.json").read_text())["runs"].items():
        if e["job_id"]:
            r = json.loads((out / rid / "result.json").read_text())
            assert e["settled"] and r["status"] == "cancelled" and "CANCELLED" in r["error"], r["error"]
            assert r["env"]["recorded_by"].startswith("echobench sweep")
    before = (out / "sweep.json").read_text()
    proc = run_cli("cancel", out, tmp_path=tmp_path)
    assert proc.returncode == 0 and "nothing to cancel" in flat(proc.stdout), proc.stdout + proc.stderr
    assert json.loads((out / "sweep.json").read_text())["runs"] == json.loads(before)["runs"]
    rows = json.loads(run_cli("status", out, "--json", tmp_path=tmp_path).stdout)
    assert sorted(r["state"] for r in rows) == ["cancelled", "cancelled", "waiting"]


def interrupted_sweep(tmp_path: Path, answer: str | None) -> tuple[subprocess.CompletedProcess, str, Path]:
    """`echobench sweep` of one long run, Ctrl-C once its job runs; stdin a terminal answering
    `answer`, or no terminal (None). (exit code and output, the job id, the sweep dir)."""
    out = tmp_path / "sweep"
    matrix = slurm_matrix(tmp_path / "m.yaml", 1, hang=True)
    cmd = [sys.executable, "-m", "echobench", "sweep", str(matrix), "--out", str(out), "--poll", "1",
           "--no-preflight"]
    from conftest import ROOT, cli_env

    master = slave = None
    if answer is not None:
        master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=cli_env(tmp_path), stdin=slave if slave is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=default_signals)

    def job_running():
        """the job runs"""
        try:
            (entry,) = json.loads((out / "sweep.json").read_text())["runs"].values()
        except (OSError, ValueError):
            return None
        return entry["job_id"] if entry["job_id"] and squeue_state(entry["job_id"]) == "RUNNING" else None

    try:
        job = wait_for(job_running)
        proc.send_signal(signal.SIGINT)
        if master is not None:
            os.write(master, answer.encode() + b"\n")  # buffered by the terminal until the question reads it
        text, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        for fd in (master, slave):
            if fd is not None:
                os.close(fd)
    return subprocess.CompletedProcess(cmd, proc.returncode, text, ""), job, out


@pytest.mark.slurm
def test_ctrl_c_without_a_terminal_leaves_the_jobs_running_and_says_how_to_cancel(tmp_path, cluster):
    proc, job, out = interrupted_sweep(tmp_path, None)
    print(proc.stdout)
    try:
        assert proc.returncode == 130, proc.stdout
        assert f"`echobench cancel {out.resolve()}` stops them" in flat(proc.stdout), proc.stdout
        assert squeue_state(job) == "RUNNING"
        proc = run_cli("cancel", out, tmp_path=tmp_path)
        assert proc.returncode == 0 and squeue_state(job) == "CANCELLED", proc.stdout + proc.stderr
    finally:
        subprocess.run(["scancel", job])
    (rid,) = json.loads((out / "sweep.json").read_text())["runs"]
    assert json.loads((out / rid / "result.json").read_text())["status"] == "cancelled"


@pytest.mark.slurm
def test_ctrl_c_on_a_terminal_asks_and_yes_cancels_the_jobs(tmp_path, cluster):
    proc, job, out = interrupted_sweep(tmp_path, "y")
    print(proc.stdout)
    try:
        assert proc.returncode == 130, proc.stdout
        assert "still queued or running?" in flat(proc.stdout) and "cancelled 1 slurm job(s)" in flat(proc.stdout), proc.stdout
        assert squeue_state(job) == "CANCELLED"
    finally:
        subprocess.run(["scancel", job])
    (rid,) = json.loads((out / "sweep.json").read_text())["runs"]
    assert json.loads((out / rid / "result.json").read_text())["status"] == "cancelled"


@pytest.mark.slurm
def test_one_look_per_poll_on_the_cluster(tmp_path, monkeypatch, cluster):
    """Real jobs, real commands behind wrappers that log their argv: each look at N jobs is one sacct
    (until sacct says the cluster keeps no accounting: then none) and one squeue, never one per job;
    the words sacct prints without accounting switch it off."""
    stubs = tmp_path / "stubs"
    calls = tmp_path / "calls"
    for name in ("sacct", "squeue", "scontrol"):
        stub(stubs, name, f'echo "{name} $*" >>"{calls}"\nexec {real(name)} "$@"\n')
    monkeypatch.setenv("PATH", f"{stubs}{os.pathsep}{os.environ['PATH']}")
    script = tmp_path / "sleep.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/%j.out\n#SBATCH --time=5\nsleep 600\n")
    jobs = [subprocess.run([real("sbatch"), "--parsable", str(script)], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(4)]
    try:
        ex = SlurmExecutor()
        for look in range(3):
            states = ex.states({j: tmp_path for j in jobs})
            assert set(states) == set(jobs) and {s.state for s in states.values()} <= {"pending", "running"}
        lines = calls.read_text().splitlines()
        sacct = [line for line in lines if line.startswith("sacct")]
        squeue = [line for line in lines if line.startswith("squeue")]
        assert not [line for line in lines if line.startswith("scontrol")]
        if ex.accounting is False:  # the local cluster: "Slurm accounting storage is disabled"
                assert len(sacct) == 1 and len(squeue) == 3
        else:
            assert len(sacct) == 3 and len(squeue) <= 3  # squeue only for jobs not in the database yet
        assert all(",".join(jobs) in line for line in sacct + squeue), lines
        subprocess.run(["scancel", *jobs], check=True)

        def all_cancelled():
            """every job reads cancelled"""
            now = ex.states({j: tmp_path for j in jobs})
            return set(now) == set(jobs) and all(v.state == "cancelled" for v in now.values())

        wait_for(all_cancelled, timeout_s=120)
    finally:
        subprocess.run(["scancel", *jobs])
