"""`echobench sweep / status`: a matrix's runs become jobs in a sweep directory, tracked,
resumable, collected (`echobench plan` is echobench.sweep.plan).

    SWEEP/matrix.yaml            a copy of the matrix file
    SWEEP/site.yaml              a copy of the site file it took (echobench.sweep.site), if any
    SWEEP/sweep.json             per run: executor, job id, attempt, whether it is settled
    SWEEP/skipped.json           runs not run: invalid combinations, or too big for the device
    SWEEP/RUN_ID/                run.yaml, job.sh, logs/, job-state, result.json (echobench.sweep.executors),
                                 plan.json (the plan's memory estimate, time limit)
    SWEEP/RUN_ID/attempts/N/     an earlier attempt's files, moved aside by --retry-failed
    SWEEP/results.csv|.parquet   one row per run (echobench.records.results.records_frame)
    SWEEP/cache/                 runs without a peak: the sweep's one GEMM calibration (their ECHOBENCH_CACHE),
                                 measured on this machine (local) or on a compute node (slurm)
    SWEEP/calibrate.log          local: that calibration's output
    SWEEP/calibrate.sh           slurm: the calibration job's script; its output in SWEEP/logs/calibrate-JOBID.out
    SWEEP/profile.yaml           hardware.calibrate_comm: the hardware profile measured once where the runs run
                                 (`calibrate --comm`; a copy in SWEEP/cache/profiles), which `validate measured
                                 SWEEP` prices the runs with; its output in SWEEP/calibrate-comm.log (local) or
                                 SWEEP/logs/calibrate-comm-JOBID.out (slurm: the job's script SWEEP/calibrate-comm.sh)

A second sweep of the same matrix submits only runs without a record; --retry-failed also the
failed ones; ok runs never run twice. Nothing is written outside SWEEP.

A scheduler's sweep keeps at most slurm.max_submitted of its jobs in the queue and submits more as
they end; a refusal that passes with time (a submit limit, a busy controller) leaves the run
`waiting` and is retried with back-off. It reads every tracked job's state in one look per poll
(job_states), the interval doubling while nothing changes: up to MAX_POLL_S while every job is pending,
RUNNING_POLL_S once one runs (sweep_state.longest_poll).
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from echobench.records.atomic import write_json_atomic
from echobench.records.console import SweepProgress, esc, log, state_counts, state_markup
from echobench.records.paths import comm_calibrated
from echobench.records.results import now_iso
from echobench.records.states import ACTIVE, RunState
from echobench.sweep.estimate import time_limit_s
from echobench.sweep.executors import (Executor, JobState, SubmitLater, archive_attempt, finish_without_record,
                                       make_executor, write_run_files)
from echobench.sweep.matrix import Matrix, Plan, PlannedRun, parse_only, select
from echobench.sweep.plan import settings_label
from echobench.sweep.preflight import passed_before, run_preflight
from echobench.sweep.state import (RunEntry, SweepState, detached, longest_poll, poll_cap, record_state, run_dir, run_state, settle,
                                   skipped_entry, tracked_job_states, waiting)
from echobench.sweep.status import cancel_sweep, table_of

RETRY_S = (10.0, 300.0)  # a refused submission: tried again after 10 s, doubling up to 5 min (sooner when a job ends)
# The exit codes of `sweep`, `sweep --no-wait`, `status` and `preflight` (one table in
# docs/reference/failures.md#exit-codes): 0 only when what was asked happened.
DONE = 0
FAILED = 1  # a run failed or was refused for good, a preflight failed, nothing to do
NOT_ALL_SUBMITTED = 75  # runs wait to be submitted (sysexits' EX_TEMPFAIL: the same command later)
INTERRUPTED = 130  # Ctrl-C


def refusal_code(exc: BaseException) -> int:
    """The exit code of a job sbatch would not take: NOT_ALL_SUBMITTED for a refusal that passes with
    time (a submit limit, a busy controller), FAILED for one that does not (the job's own options)."""
    return NOT_ALL_SUBMITTED if isinstance(exc, SubmitLater) else FAILED


def one_device(runs: list[PlannedRun]) -> str:
    """The device a calibration for these runs asks for: theirs when they agree, else auto."""
    devices = {r.cfg.device for r in runs}
    return devices.pop() if len(devices) == 1 else "auto"


# ---- the sweep ----

@dataclass
class SweepOptions:
    executor: str
    out: Path
    wait: bool = True
    retry_failed: bool = False
    poll_s: float | None = None
    # After Ctrl-C, with a scheduler's jobs still queued or running: asked whether to cancel them
    # (the CLI asks on a terminal); None leaves them running and says how to cancel them.
    ask: Callable[[str], bool] | None = None
    preflight: bool = True  # SLURM: one preflight job before any run (echobench.sweep.preflight)

    def __post_init__(self):  # refused before anything is written
        if not self.wait and not detached(make_executor(self.executor)):
            raise ValueError(f"--no-wait needs --executor slurm: the {self.executor} executor runs each job from "
                             f"this process")


def choose_runs(plan: Plan, only: list[str], force: bool, console) -> tuple[list[PlannedRun], list[dict]]:
    """The runs `sweep` does: those of --only KEY=VALUE, less (unless --force) those the memory
    estimate says do not fit; and SWEEP/skipped.json's entries. Prints what it leaves out;
    raises MatrixError for a bad --only."""
    runs, skipped = select(plan.runs, parse_only(only)), []
    for s in plan.skipped:
        console.print(f"[dim]skipped[/] {esc(settings_label(plan, s.settings))}: {esc(s.reason)}", highlight=False)
        skipped.append(skipped_entry(s.settings, s.reason, s.cfg))
    if force:
        return runs, skipped
    for r in (r for r in runs if r.fits is False):
        why = f"needs ~{r.memory.total_gib:.1f} GiB per GPU, more than the device has (--force runs it anyway)"
        console.print(f"[yellow]not run[/] {esc(r.id)}: {esc(why)}", highlight=False)
        skipped.append(skipped_entry(r.settings, why, r.cfg))
    return [r for r in runs if r.fits is not False], skipped


class Terminated(KeyboardInterrupt):
    """SIGTERM reached `echobench sweep` (`kill`, a CI runner or a scheduler stopping it): it stops as
    after Ctrl-C, however it was started. A KeyboardInterrupt, so every Ctrl-C handler handles it."""


# How an interrupted sweep says it was stopped, and its exit code (as a shell reports the signal).
STOPPED_BY = {"Ctrl-C": INTERRUPTED, "SIGTERM": 128 + signal.SIGTERM}


def stopped_by(exc: KeyboardInterrupt) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"


@contextlib.contextmanager
def sigterm_stops_the_sweep():
    """While in place, SIGTERM raises Terminated in the main thread. SIGINT is left as the sweep found
    it: a background job of a non-interactive shell, or one under nohup, starts with SIGINT ignored
    (the shell's Ctrl-C is not meant for it), and it stays ignored; SIGTERM stops such a sweep."""
    def stop(signum, frame):
        raise Terminated()

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@dataclass
class Sweep:
    """A sweep under way: its directory, state file and executor, the jobs not yet over, and the
    back-off of refused submissions."""

    matrix: Matrix
    dir: Path
    executor: Executor
    console: object
    state: SweepState
    tracked: dict[str, PlannedRun] = field(default_factory=dict)  # submitted, not settled
    retry_at: float = 0.0  # time.monotonic() before which no submission is tried (after a refusal)
    retry_delay: float = 0.0  # the last back-off; doubles with each refusal in a row
    refusal: str = ""  # the last refusal that passes with time ("" once a submission is taken)
    logged_refusals: set[str] = field(default_factory=set)  # each logged once (its run id as RUN)
    comm_log: str | None = None  # a comm calibration job this sweep waits on: its log, named if no profile comes
    submitted: int = 0  # jobs this sweep submitted
    stopped_by: str = "Ctrl-C"  # what interrupted it (a key of STOPPED_BY)

    def log(self, text: str) -> None:
        log(self.console, text)

    def run_dir(self, run: PlannedRun) -> Path:
        return run_dir(self.dir, run.id)

    def save(self) -> None:
        self.state.save(self.dir)

    def triage(self, runs: list[PlannedRun], retry_failed: bool) -> tuple[list[PlannedRun], list[PlannedRun]]:
        """(to submit, failed earlier and not rerun): runs without a record or waiting to be submitted,
        and failed ones with --retry-failed, are to submit; jobs still going are tracked again; ok
        runs never rerun."""
        to_submit, failed_before = [], []
        looks = self.tracked_job_states(runs)
        for run in runs:
            st, _, error = run_state(run.cfg, self.run_dir(run), self.state.runs.get(run.id), self.executor,
                                     looks.get(run.id))
            if st in (RunState.NEW, RunState.WAITING):
                to_submit.append(run)
            elif st in ACTIVE:
                self.tracked[run.id] = run
            elif st != RunState.OK:
                (to_submit if retry_failed else failed_before).append(run)
                if st == RunState.CORRUPT:
                    self.log(f"{run.id}: [red]{esc(error)}[/]"
                             + ("" if retry_failed else " (--retry-failed reruns it; the file moves to attempts/)"))
        self.save()
        return to_submit, failed_before

    def tracked_job_states(self, runs) -> dict[str, JobState | None]:
        """One look at the executor for the jobs of these runs not settled (run id -> state)."""
        return tracked_job_states(self.executor, {r.id: (e, self.run_dir(r)) for r in runs
                                                  if (e := self.state.runs.get(r.id))}, self.state)

    def preflight(self, runs: list[PlannedRun]) -> int:
        """SLURM, with runs to submit: the preflight job first (echobench.sweep.preflight), unless this very
        matrix passed it before. DONE when the runs may go (the network it saw goes into their records),
        else the sweep's exit code: FAILED, or NOT_ALL_SUBMITTED when sbatch will take the job later."""
        if not runs or self.executor.name != "slurm":
            return DONE
        result = passed_before(self.dir, self.matrix, runs, self.executor.name)
        if result is not None:
            self.log(f"preflight passed before for this matrix (job {esc(result.job)}, {esc(result.time)}): not run "
                     f"again (`echobench preflight` runs it)")
        else:
            def keep(job: str) -> None:
                self.state.preflight_job = job
                self.save()

            try:
                result = run_preflight(self.matrix, runs, self.executor, self.dir, self.console, keep)
            except Exception as exc:  # noqa: BLE001 - sbatch's refusal (SubmitLater, SlurmError), one line
                self.log(f"[red]the preflight job was not submitted[/]: {esc(exc)}; no run submitted (the same "
                         f"`echobench sweep` tries again)")
                return refusal_code(exc)
            if not result.passed:
                self.log(f"[red]no run submitted[/]: {len(runs)} runs wait for a passing preflight (nothing measured "
                         f"is lost); fix what it says, then run the same `echobench sweep` again")
                return FAILED
        self.executor.transport = result.record_label()
        return DONE

    def calibrate(self, runs: list[PlannedRun]) -> None:
        """Runs to submit without a peak of their own: the executor measures one where they run. With
        hardware.calibrate_comm, and runs to submit, a hardware profile too, unless the sweep has one."""
        if no_peak := [r for r in runs if r.cfg.peak_tflops is None]:
            self.executor.calibrate(self.dir, self.matrix, one_device(no_peak), self.log)
            if job := getattr(self.executor, "calibration", None):
                self.state.calibration_job = job
                self.save()
        if runs and self.matrix.spec.hardware.calibrate_comm and not comm_calibrated(self.dir):
            self.comm_log = self.executor.calibrate_comm(self.dir, self.matrix, runs, one_device(runs), self.log,
                                                         self.state.comm_calibration_job)
            if job := getattr(self.executor, "comm_calibration", None):
                self.state.comm_calibration_job = job
                self.save()

    def profile_outcome(self) -> None:
        """After the runs: a comm calibration job that left no profile is said, with its log, once."""
        if self.comm_log and not comm_calibrated(self.dir):
            self.log(f"[red]hardware profile not measured[/]: the comm calibration job failed or was stopped (see "
                     f"{esc(self.comm_log)}); the runs went on without it")

    def submit(self, run: PlannedRun) -> bool:
        """A new attempt: the last one's files moved aside, the run's files written, its job started.
        False when the executor cannot take it now (SubmitLater): the run is `waiting`, its files
        written, and the next submit of it is the same attempt."""
        rd, before = self.run_dir(run), self.state.runs.get(run.id)
        if waiting(before):
            attempt = before.attempt  # prepared earlier, never taken: nothing of it to move aside
        else:
            attempt = (before.attempt if before else 0) + 1
            archive_attempt(rd, attempt - 1)
        write_run_files(run, rd, self.matrix, self.executor)
        entry = self.state.runs[run.id] = RunEntry(executor=self.executor.name, attempt=attempt)
        try:
            entry.job_id = self.executor.submit(run, rd, time_limit_s(self.matrix, self.executor.name, run))
        except SubmitLater as exc:
            entry.state, entry.detail = RunState.WAITING, f"not submitted yet: {exc}"
            self.refused(run.id, str(exc))
            self.save()
            return False
        except Exception as exc:  # noqa: BLE001 - a rejected submission becomes this run's record
            record = finish_without_record(run.cfg, rd, RunState.ERROR, f"submission failed: {exc}")
            entry.settled, entry.state = True, record.status
            self.log(f"{run.id}: [red]not submitted[/]: {esc(exc)}")
        else:
            entry.submitted = now_iso()
            self.submitted += 1
            self.tracked[run.id] = run
            self.log(f"{run.id}: submitted as {esc(entry.job_id)}"
                     + (" (the scheduler takes jobs again)" if self.refusal else ""))
            self.refusal, self.retry_delay = "", 0.0
        self.save()
        return True

    def refused(self, rid: str, why: str) -> None:
        """A refusal that passes with time: no submission before the back-off (or a job's end);
        each refusal logged once, whichever run it was about."""
        self.retry_delay = min(max(self.retry_delay * 2, RETRY_S[0]), RETRY_S[1])
        self.retry_at, self.refusal = time.monotonic() + self.retry_delay, why
        if (refusal := why.replace(rid, "RUN")) not in self.logged_refusals:
            self.logged_refusals.add(refusal)
            self.log(f"{esc(rid)}: [yellow]not submitted yet[/]: {esc(why)}; it and the runs after it wait and are "
                     f"submitted again " + ("as this sweep's jobs end" if self.tracked else "later")
                     + " (said once)")

    def may_submit(self) -> bool:
        """Whether the executor takes another job now: under max_active, no refusal to wait out."""
        cap = self.executor.max_active
        return (cap is None or len(self.tracked) < cap) and time.monotonic() >= self.retry_at

    def submit_ready(self, queue: list[PlannedRun]) -> bool:
        """Submits from the front of the queue while there is room; a run the executor cannot take
        now stays first. Whether any was submitted (or refused for good)."""
        taken = False
        while queue and self.may_submit():
            if not self.submit(queue[0]):
                break
            queue.pop(0)
            taken = True
        return taken

    def held_because(self) -> str:
        """Why runs of the queue are not submitted yet (for --no-wait's message)."""
        if self.refusal:
            return self.refusal
        return f"slurm.max_submitted: {self.executor.max_active} of this sweep's jobs in the queue at once"

    def poll(self) -> bool:
        """Asks after every tracked job in one look; one that is over leaves the tracked ones,
        logged (and lets refused submissions be tried again at once). Whether anything changed."""
        looks = self.tracked_job_states(list(self.tracked.values()))
        changed = False
        for rid, run in list(self.tracked.items()):
            entry = self.state.runs[rid]
            before = entry.state
            st = settle(run.cfg, self.run_dir(run), entry, self.executor, looks.get(rid))
            if st in ACTIVE:
                if st != before:
                    self.log(f"{rid}: {esc(st)}")
                    changed = True
                continue
            del self.tracked[rid]
            changed, self.retry_at = True, 0.0  # room in the queue: a limit that refused a run may take it now
            note = "" if st == RunState.OK else f": {esc(record_state(self.run_dir(run))[2][:300])}"
            self.log(f"{rid}: {state_markup(st)}{note}")
        self.save()
        return changed

    def wait(self, queue: list[PlannedRun], runs: list[PlannedRun], poll_s: float) -> bool:
        """Submits the queue as the executor has room and polls until every job is over; False
        when Ctrl-C stopped the waiting. A scheduler's jobs are polled less often while nothing
        changes (poll_s doubling up to longest_poll; back to poll_s at a change)."""
        interval = poll_s
        with SweepProgress(self.console) as progress:
            try:
                while queue or self.tracked:
                    changed = self.submit_ready(queue)
                    if self.poll():
                        changed = True
                        self.submit_ready(queue)  # room freed: the next runs at once
                    progress.update([(r.id, e.state, e.detail, self.run_dir(r)) if (e := self.state.runs.get(r.id))
                                     else (r.id, RunState.QUEUED, "", None) for r in runs])
                    if queue or self.tracked:
                        longest = longest_poll(poll_s, {self.state.runs[rid].state for rid in self.tracked}) \
                            if detached(self.executor) else poll_s
                        interval = poll_s if changed else min(interval * 2, longest)
                        pause = interval
                        if queue and self.retry_at and not self.tracked:
                            pause = min(pause, max(self.retry_at - time.monotonic(), 0.0))
                        time.sleep(max(pause, 0.1))
            except KeyboardInterrupt as exc:
                self.stopped_by = stopped_by(exc)
                return False
        return True

    def interrupt(self, runs: list[PlannedRun], during: str | None, ask: Callable[[str], bool] | None = None) -> None:
        """After Ctrl-C (or SIGTERM: self.stopped_by): the jobs the executor stopped end as cancelled; a
        scheduler's keep running unless `ask` says to cancel them (`echobench cancel DIR` does it
        later; never asked after SIGTERM, which no one at a terminal sent). Says what was interrupted
        (None: waiting for the jobs, named by their states), each job left behind, that nothing
        measured is lost, and what is left to do."""
        if during is None:  # waiting: for which jobs, by their last states
            during = f"while waiting for its jobs ({state_counts(self.state.runs[rid].state for rid in self.tracked)})"
        for job_id in self.executor.cancel_all():
            rid, run = next((rid, run) for rid, run in self.tracked.items() if self.state.runs[rid].job_id == job_id)
            finish_without_record(run.cfg, self.run_dir(run), RunState.CANCELLED, f"interrupted ({self.stopped_by}) while running")
            self.state.runs[rid].settled, self.state.runs[rid].state = True, RunState.CANCELLED
            del self.tracked[rid]
        self.save()
        left = sum(r.id not in self.state.runs or waiting(self.state.runs[r.id]) for r in runs)
        live = [rid for rid in self.tracked if not self.state.runs[rid].settled]
        self.log(f"interrupted ({self.stopped_by}) {esc(during)}: finished results are kept"
                 + (f"; {left} of {len(runs)} runs not started (the same `echobench sweep` runs them)" if left else ""))
        if not live or not detached(self.executor):
            return
        shown = [f"{rid} (job {self.state.runs[rid].job_id}, {self.state.runs[rid].state})" for rid in live]
        self.log(f"left in the queue: {esc(', '.join(shown[:5]))}" + (f" and {len(shown) - 5} more" if len(shown) > 5
                                                                       else ""))
        question = f"cancel the {len(live)} {self.executor.name.upper()} job(s) of this sweep still queued or running?"
        try:
            stop = ask is not None and self.stopped_by == "Ctrl-C" and ask(question)
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - Ctrl-C or EOF at the question: leave them
            stop = False
        if stop:
            cancel_sweep(self.dir, self.console, self.state)
            return
        self.log(esc(self.executor.detach_message().replace("DIR", str(self.dir))))


def open_sweep(matrix: Matrix, opts: SweepOptions, console, skipped: list[dict] | None) -> Sweep:
    """The sweep directory with the matrix, skipped.json and sweep.json; refuses, before it writes
    anything, what the executor cannot do."""
    sweep_dir = opts.out.resolve()
    executor = make_executor(opts.executor, matrix)
    executor.check_dir(sweep_dir)  # raises ValueError
    state = SweepState.load(sweep_dir)  # CorruptSweepState (a ValueError): refused before anything is written
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "matrix.yaml").write_text(matrix.text)
    if matrix.site is not None:  # what the matrix stood on: the copy names it, this is its text then
        (sweep_dir / "site.yaml").write_text(matrix.site_text)
    write_json_atomic(sweep_dir / "skipped.json", {"matrix": matrix.name, "skipped": skipped or []})
    state.matrix, state.updated = matrix.name, now_iso()
    return Sweep(matrix, sweep_dir, executor, console, state)


def run_sweep(matrix: Matrix, runs: list[PlannedRun], opts: SweepOptions, console,
              skipped: list[dict] | None = None) -> int:
    """Submits what is missing (or failed, with retry), waits, collects. Returns the exit code:
    DONE when every run of the selection is ok, FAILED when some failed (or the preflight did),
    INTERRUPTED on Ctrl-C (STOPPED_BY: 143 on SIGTERM); with --no-wait (no_wait_code) DONE once every run is submitted or ok.
    `skipped` (skipped_entry dicts) goes to SWEEP/skipped.json for the report."""
    sweep = open_sweep(matrix, opts, console, skipped)
    sweep.state.plan([r.id for r in runs])
    to_submit, failed_before = sweep.triage(runs, opts.retry_failed)
    done = len(runs) - len(to_submit) - len(sweep.tracked) - len(failed_before)
    cap = sweep.executor.max_active if detached(sweep.executor) else None
    sweep.log(f"{matrix.name}: {len(runs)} runs: {done} ok already, {len(sweep.tracked)} in progress, "
              f"{len(to_submit)} to run" + (f", {len(failed_before)} failed earlier (not rerun: --retry-failed)"
                                           if failed_before else "")
              + (f"; at most {cap} in the queue at once (slurm.max_submitted)" if cap and to_submit else "")
              + f" -> {esc(sweep.dir)}")
    queue = list(to_submit)
    try:
        during = "during the preflight, before any run was submitted"
        if opts.preflight and (code := sweep.preflight(to_submit)) != DONE:
            return code
        during = "while calibrating, before any run was submitted"
        sweep.calibrate(to_submit)
        during = "while submitting"
        if detached(sweep.executor):  # a scheduler: hand it what it takes now
            sweep.submit_ready(queue)
    except KeyboardInterrupt as exc:
        sweep.stopped_by = stopped_by(exc)
        sweep.interrupt(runs, during, opts.ask)
        return STOPPED_BY[sweep.stopped_by]
    if not opts.wait:
        return no_wait_code(sweep, queue, runs, len(to_submit), done, len(failed_before))
    finished = sweep.wait(queue, runs, opts.poll_s or poll_cap(sweep.executor.poll_s))
    if not finished:
        sweep.interrupt(runs, None, opts.ask)
    else:
        sweep.profile_outcome()
    statuses = collect(sweep.dir, [sweep.run_dir(r) for r in runs], console)
    if not finished:
        return STOPPED_BY[sweep.stopped_by]
    return DONE if all(statuses.get(r.id) == RunState.OK for r in runs) else FAILED


def no_wait_code(sweep: Sweep, queue: list[PlannedRun], runs: list[PlannedRun], to_submit: int, done: int,
                 failed: int) -> int:
    """`sweep --no-wait`'s last line and exit code: DONE when every run is submitted, queued or ok;
    FAILED when sbatch refused some for good or some failed earlier (not rerun); else
    NOT_ALL_SUBMITTED when some wait to be submitted (slurm.max_submitted, a submit limit, a busy
    scheduler: the same `sweep` again submits them)."""
    follow = f"follow with: echobench status {esc(sweep.dir)}"
    if queue:
        sweep.log(f"[yellow]{len(queue)} of {len(runs)} runs not submitted yet[/] ({esc(sweep.held_because())}): "
                  f"nothing is lost; the same `echobench sweep` submits them (without --no-wait it stays and "
                  f"submits them as jobs end); {follow}")
    rejected = to_submit - len(queue) - sweep.submitted
    if rejected or failed or not queue:
        sweep.log(f"{submitted_words(sweep, rejected, done, failed)}; {follow}")
    if rejected or failed:
        return FAILED
    return NOT_ALL_SUBMITTED if queue else DONE


def submitted_words(sweep: Sweep, rejected: int, done: int, failed: int) -> str:
    """What `sweep --no-wait` did: how many runs it submitted, and why the others needed nothing or
    were not taken; `rejected`: refused for the job's own reasons (each run's record says why)."""
    have, going = done + failed, len(sweep.tracked) - sweep.submitted
    why = ([f"{have} runs already have records ({done} ok"
            + (f", {failed} failed: --retry-failed reruns them" if failed else "") + ")"] if have else []) \
        + ([f"{going} already queued or running"] if going else []) \
        + ([f"{rejected} refused by the scheduler (above)"] if rejected else [])
    if sweep.submitted:
        return f"submitted {sweep.submitted} runs" + (f" ({'; '.join(why)})" if why else "")
    return ("nothing submitted" if rejected else "nothing to submit") + (f": {'; '.join(why)}" if why else "")


def collect(sweep_dir: Path, run_dirs: list[Path], console) -> dict[str, str]:
    """One table of the runs' current records -> SWEEP/results.csv and .parquet."""
    records, paths, problems = table_of(run_dirs, sweep_dir)
    for p in problems:
        log(console, f"[yellow]skipped a corrupt record[/]: {esc(p)}")
    if paths:
        log(console, f"results: {esc(', '.join(str(p) for p in paths))}")
    return {r.run_id: r.status for r in records}


