"""`echobench sweep / status`: a matrix's runs become jobs in a sweep directory, tracked,
resumable, collected (`echobench plan` is echobench.plan).

    SWEEP/matrix.yaml            a copy of the matrix file
    SWEEP/sweep.json             per run: executor, job id, attempt, whether it is settled
    SWEEP/skipped.json           runs not run: invalid combinations, or too big for the device
    SWEEP/RUN_ID/                run.yaml, job.sh, logs/, job-state, result.json (echobench.executors),
                                 plan.json (the plan's memory estimate, time limit)
    SWEEP/RUN_ID/attempts/N/     an earlier attempt's files, moved aside by --retry-failed
    SWEEP/results.csv|.parquet   one row per run (echobench.results.records_frame)
    SWEEP/cache/                 runs without a peak: the sweep's one GEMM calibration (their ECHOBENCH_CACHE),
                                 measured on this machine (local) or on a compute node (slurm)
    SWEEP/calibrate.log          local: that calibration's output
    SWEEP/calibrate.sh           slurm: the calibration job's script; its output in SWEEP/logs/calibrate-JOBID.out
    SWEEP/profile.yaml           hardware.calibrate_comm: the hardware profile measured once where the runs run
                                 (`calibrate --comm`; a copy in SWEEP/cache/profiles), which `predict --against
                                 SWEEP` prices the runs with; its output in SWEEP/calibrate-comm.log (local) or
                                 SWEEP/logs/calibrate-comm-JOBID.out (slurm: the job's script SWEEP/calibrate-comm.sh)

A second sweep of the same matrix submits only runs without a record; --retry-failed also the
failed ones; ok runs never run twice. Nothing is written outside SWEEP.

A scheduler's sweep keeps at most slurm.max_submitted of its jobs in the queue and submits more as
they end; a refusal that passes with time (a submit limit, a busy controller) leaves the run
`waiting` and is retried with back-off. It reads every tracked job's state in one look per poll
(job_states), the interval doubling up to MAX_POLL_S while nothing changes.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import yaml
from pydantic import BaseModel, ValidationError

from echobench.atomic import write_json_atomic
from echobench.config import RunConfig
from echobench.console import NOT_STARTED, WAITING, Progress, esc, log, state_counts, state_markup
from echobench.estimate import time_limit_s
from echobench.executors import (ACTIVE, CorruptRecord, Executor, JobState, SubmitLater, archive_attempt,
                                 SWEEP_FILE, comm_calibrated, current_record, finish_without_record, job_states,
                                 make_executor, sweep_transport, write_run_files)
from echobench.launch import lost_node_record
from echobench.matrix import Matrix, Plan, PlannedRun, parse_only, select
from echobench.plan import settings_label
from echobench.preflight import passed_before, run_preflight
from echobench.results import Record, export_table, load_records, records_frame, validation_text

RUN_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$"
MAX_POLL_S = 60.0  # a scheduler's jobs: the poll interval doubles up to this while nothing changes
RETRY_S = (10.0, 300.0)  # a refused submission: tried again after 10 s, doubling up to 5 min (sooner when a job ends)
NOT_ALL_SUBMITTED = 75  # `sweep --no-wait` left runs waiting to be submitted (sysexits' EX_TEMPFAIL: try again later)
NEVER_GRACE_S = 120.0  # a pending reason that says a job can never start must hold this long to end it
TEARDOWN_S = 75.0  # a job still running this long after its launcher's failure record hangs (srun --wait=60)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def one_device(runs: list[PlannedRun]) -> str:
    """The device a calibration for these runs asks for: theirs when they agree, else auto."""
    devices = {r.cfg.device for r in runs}
    return devices.pop() if len(devices) == 1 else "auto"


def run_dir(sweep_dir: Path, rid: str) -> Path:
    """SWEEP/RUN_ID, refusing any id that could point elsewhere."""
    if not re.fullmatch(RUN_ID_RE, rid) or rid in (".", ".."):
        raise ValueError(f"run id {rid!r} is not a safe directory name")
    path = sweep_dir / rid
    if path.resolve().parent != sweep_dir.resolve():
        raise ValueError(f"run id {rid!r} leaves the sweep directory")
    return path


# ---- the sweep directory's state: sweep.json ----

class RunEntry(BaseModel):
    """One run in sweep.json: the job that runs (or ran) it, and whether its record is final."""

    executor: str = "local"
    attempt: int = 0  # 1 for the first submission; each --retry-failed adds one
    submitted: str | None = None
    # pending | running | waiting (files written, not taken yet: a submit limit, a busy scheduler) | the record's status
    state: str = "pending"
    job_id: str | None = None  # None: the submission was refused (settled: the record says why), or waiting
    settled: bool = False  # the record is final: the scheduler is not asked again
    detail: str = ""  # the scheduler's words at the last look
    finished: str | None = None
    blocked_since: float | None = None  # time.time() since when its pending reason says it can never start


class CorruptSweepState(ValueError):
    """SWEEP/sweep.json is there but cannot be read, parsed or validated. No command saves over it
    (it may hold the job ids of jobs still running: a fresh state would submit their runs again)."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"{path}: unreadable sweep state ({' '.join(why.split())}): move it aside to start the "
                         f"sweep's bookkeeping afresh (runs with records are kept; check squeue for jobs it listed)")


class SweepState(BaseModel):
    """SWEEP/sweep.json. Every field has a default, so files of earlier versions load; a missing one
    loads empty; one there but unreadable raises CorruptSweepState."""

    matrix: str | None = None
    updated: str | None = None
    planned: list[str] = []  # every run a `sweep` of this directory was asked to do, in order
    runs: dict[str, RunEntry] = {}
    calibration_job: str | None = None  # slurm: the sweep's calibration job (`echobench cancel` ends it too)
    comm_calibration_job: str | None = None  # slurm: hardware.calibrate_comm's job (likewise)
    preflight_job: str | None = None  # slurm: the last preflight job (likewise)

    def plan(self, run_ids: list[str]) -> None:
        """Adds a sweep's selection to the planned runs (a later --only keeps the earlier ones)."""
        self.planned += [rid for rid in run_ids if rid not in self.planned]

    @classmethod
    def load(cls, sweep_dir: Path) -> SweepState:
        """The state in SWEEP/sweep.json; empty where there is none; CorruptSweepState where it is
        there but unreadable (truncated, not JSON, not a sweep state)."""
        path = sweep_dir / SWEEP_FILE
        try:
            text = path.read_text()
        except FileNotFoundError:
            return cls()
        except (OSError, UnicodeDecodeError) as exc:
            raise CorruptSweepState(path, getattr(exc, "strerror", None) or str(exc)) from None
        try:
            return cls.model_validate(json.loads(text))
        except ValidationError as exc:
            raise CorruptSweepState(path, validation_text(exc)) from None
        except ValueError as exc:  # json's JSONDecodeError
            raise CorruptSweepState(path, f"not JSON: {exc}") from None

    def save(self, sweep_dir: Path) -> None:
        write_json_atomic(sweep_dir / SWEEP_FILE, self.model_dump())


def skipped_entry(settings: dict, reason: str, cfg: RunConfig | None = None) -> dict:
    """One entry of SWEEP/skipped.json: the run's settings, its id when it has one, and why."""
    from echobench.config import run_id

    return {"run_id": run_id(cfg) if cfg else None, "reason": reason,
            "settings": cfg.to_dict() if cfg else dict(settings)}


def record_state(rd: Path) -> tuple[str, Record | None, str]:
    """(state, record, error) from a run's current record: its status; "new" without one; "corrupt",
    with an error naming the file, when it is there but unreadable (a failure, never "new")."""
    try:
        record = current_record(rd)
    except CorruptRecord as exc:
        return "corrupt", None, f"corrupt record: {exc}"
    return (record.status, record, record.error) if record else ("new", None, "")


def waiting(entry: RunEntry | None) -> bool:
    """Whether the run's attempt has its files but no job yet (the executor could not take it: a
    submit limit, a busy scheduler): not settled, submitted again later."""
    return entry is not None and not entry.job_id and not entry.settled


def look(executor: Executor, entries: dict[str, tuple[RunEntry, Path]],
         sweep_state: SweepState | None = None) -> dict[str, JobState | None]:
    """One look at the executor for every job not settled (run id -> (entry, run directory)):
    run id -> the job's state, None where the scheduler did not answer about it (no news). A job
    pending on a dependency says which of the sweep's jobs it waits for."""
    tracked = {rid: (e, rd) for rid, (e, rd) in entries.items() if e.job_id and not e.settled}
    states = job_states(executor, {e.job_id: rd for e, rd in tracked.values()})
    for job in states.values():
        if job.reason == "Dependency" and sweep_state is not None and (what := waits_for(sweep_state)):
            job.detail += f": waits for {what}"
    return {rid: states.get(e.job_id) for rid, (e, _) in tracked.items()}


def waits_for(state: SweepState) -> str:
    """The sweep's jobs its runs may wait for (SLURM dependencies): its calibrations."""
    return " and ".join(f"the {what} job {job}" for what, job in (("calibration", state.calibration_job),
                                                                 ("comm calibration", state.comm_calibration_job)) if job)


def settle(cfg: RunConfig, rd: Path, entry: RunEntry, executor: Executor, job: JobState | None) -> str:
    """A tracked job's state now (`job`: the executor's answer at this look, from `look`; None: no
    news, the state stays); once it is over, its record exists (written here if need be)."""
    if entry.settled:
        return record_state(rd)[0]
    if job is None:
        return entry.state
    entry.detail = job.detail
    if job.state in ACTIVE:
        if (ended := ended_early(cfg, rd, entry, executor, job)) is not None:
            return ended
        entry.state = job.state
        return job.state
    # exited or gone without a record of its own: an error; else the scheduler's verdict
    # (timeout, cancelled, node_fail, oom, error).
    status, why = {"exited": ("error", f"{entry.job_id}: {job.detail} without writing a record"),
                   "gone": ("error", job.detail)}.get(job.state, (job.state, job.detail))
    record = finish_without_record(cfg, rd, status, why)
    entry.settled, entry.state, entry.finished = True, record.status, now_iso()
    return record.status


def ended_early(cfg: RunConfig, rd: Path, entry: RunEntry, executor: Executor, job: JobState) -> str | None:
    """The status of a run whose job the scheduler still calls pending or running but which is over
    all the same, its job cancelled; None while it is not. Pending: for NEVER_GRACE_S on a reason that
    says it can never start (a transient one passes), recorded `error` naming the limit and the fix.
    Running: a node went down (its launcher's record, or, when node 0 was the one, the ranks' files
    say so: at once, not at the scheduler's node timeout), or its launcher wrote a failure record
    TEARDOWN_S ago (srun's --wait is over: something hangs)."""
    if job.state == "pending":
        if not job.never:
            entry.blocked_since = None
            return None
        entry.blocked_since = entry.blocked_since or time.time()
        held = time.time() - entry.blocked_since
        if held < NEVER_GRACE_S:
            return None
        why = (f"SLURM job {entry.job_id} can never start as it is: {job.detail} for {held:.0f} s: {job.never}; "
               f"cancelled (fix it, then `echobench sweep --retry-failed` reruns it)")
        record = finish_without_record(cfg, rd, "error", why)
    else:
        try:
            own = current_record(rd)
        except CorruptRecord:
            return None
        record = own or lost_node_record(cfg, rd)
        if record is None or record.status == "ok" or (
                own is not None and own.status != "node_fail" and time.time() - own.path.stat().st_mtime < TEARDOWN_S):
            return None
        if own is None:  # node 0 went down with the launcher that would have written it
            record.env.nccl_transport = sweep_transport(rd.parent)
            record.save(rd)
    if (cancel := getattr(executor, "cancel", None)) is not None:
        try:
            cancel([entry.job_id])
        except Exception:  # noqa: BLE001 - the record stands; the scheduler ends the job in its own time
            pass
    entry.settled, entry.state, entry.finished = True, record.status, now_iso()
    return record.status


def run_state(cfg: RunConfig, rd: Path, entry: RunEntry | None, executor: Executor,
              job: JobState | None) -> tuple[str, Record | None, str]:
    """(state, record, error): new | waiting | pending | running | a record status, with the run's
    current record as record_state reads it (once: `status --wait` asks again at every poll).
    `job`: the job's state at this look (`look`)."""
    if waiting(entry):
        return WAITING, None, entry.detail
    if entry is None or not entry.job_id or entry.settled:
        return record_state(rd)
    state = settle(cfg, rd, entry, executor, job)
    _, record, error = record_state(rd)
    return state, record, error


# ---- the sweep ----

def detached(executor: Executor) -> bool:
    """Whether the executor's jobs run without this process (a scheduler queues them): --no-wait
    is possible, jobs are handed over before the wait, Ctrl-C leaves them running (detach_message)."""
    return bool(executor.detach_message())


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
    preflight: bool = True  # SLURM: one preflight job before any run (echobench.preflight)

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
    said: set[str] = field(default_factory=set)  # refusals logged already: each once
    comm_log: str | None = None  # a comm calibration job this sweep waits on: its log, named if no profile comes

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
        looks = self.look(runs)
        for run in runs:
            st, _, error = run_state(run.cfg, self.run_dir(run), self.state.runs.get(run.id), self.executor,
                                     looks.get(run.id))
            if st in ("new", WAITING):
                to_submit.append(run)
            elif st in ACTIVE:
                self.tracked[run.id] = run
            elif st != "ok":
                (to_submit if retry_failed else failed_before).append(run)
                if st == "corrupt":
                    self.log(f"{run.id}: [red]{esc(error)}[/]"
                             + ("" if retry_failed else " (--retry-failed reruns it; the file moves to attempts/)"))
        self.save()
        return to_submit, failed_before

    def look(self, runs) -> dict[str, JobState | None]:
        """One look at the executor for the jobs of these runs not settled (run id -> state)."""
        return look(self.executor, {r.id: (e, self.run_dir(r)) for r in runs if (e := self.state.runs.get(r.id))},
                    self.state)

    def preflight(self, runs: list[PlannedRun]) -> bool:
        """SLURM, with runs to submit: the preflight job first (echobench.preflight), unless this very
        matrix passed it before. Whether the runs may go; the network it saw goes into their records."""
        if not runs or self.executor.name != "slurm":
            return True
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
                raise ValueError(f"the preflight job was not submitted: {exc}; no run submitted") from None
            if not result.passed:
                self.log(f"[red]no run submitted[/]: {len(runs)} runs wait for a passing preflight (nothing measured "
                         f"is lost); fix what it says, then run the same `echobench sweep` again")
                return False
        self.executor.transport = result.record_label()
        return True

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
            entry.state, entry.detail = WAITING, f"not submitted yet: {exc}"
            self.refused(run.id, str(exc))
            self.save()
            return False
        except Exception as exc:  # noqa: BLE001 - a rejected submission becomes this run's record
            record = finish_without_record(run.cfg, rd, "error", f"submission failed: {exc}")
            entry.settled, entry.state = True, record.status
            self.log(f"{run.id}: [red]not submitted[/]: {esc(exc)}")
        else:
            entry.submitted = now_iso()
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
        if (said := why.replace(rid, "RUN")) not in self.said:
            self.said.add(said)
            self.log(f"{esc(rid)}: [yellow]not submitted yet[/]: {esc(why)}; it and the runs after it wait and are "
                     f"submitted again " + ("as this sweep's jobs end" if self.tracked else "later")
                     + " (said once)")

    def room(self) -> bool:
        """Whether the executor takes another job now: under max_active, no refusal to wait out."""
        cap = self.executor.max_active
        return (cap is None or len(self.tracked) < cap) and time.monotonic() >= self.retry_at

    def submit_ready(self, queue: list[PlannedRun]) -> bool:
        """Submits from the front of the queue while there is room; a run the executor cannot take
        now stays first. Whether any was submitted (or refused for good)."""
        taken = False
        while queue and self.room():
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
        looks = self.look(list(self.tracked.values()))
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
            note = "" if st == "ok" else f": {esc(record_state(self.run_dir(run))[2][:300])}"
            self.log(f"{rid}: {state_markup(st)}{note}")
        self.save()
        return changed

    def wait(self, queue: list[PlannedRun], runs: list[PlannedRun], poll_s: float) -> bool:
        """Submits the queue as the executor has room and polls until every job is over; False
        when Ctrl-C stopped the waiting. A scheduler's jobs are polled less often while nothing
        changes (poll_s doubling up to MAX_POLL_S; back to poll_s at a change)."""
        longest = max(poll_s, MAX_POLL_S) if detached(self.executor) else poll_s
        interval = poll_s
        with Progress(self.console) as progress:
            try:
                while queue or self.tracked:
                    changed = self.submit_ready(queue)
                    if self.poll():
                        changed = True
                        self.submit_ready(queue)  # room freed: the next runs at once
                    progress.update([(r.id, e.state, e.detail) if (e := self.state.runs.get(r.id))
                                     else (r.id, "queued", "") for r in runs])
                    if queue or self.tracked:
                        interval = poll_s if changed else min(interval * 2, longest)
                        pause = interval
                        if queue and self.retry_at and not self.tracked:
                            pause = min(pause, max(self.retry_at - time.monotonic(), 0.0))
                        time.sleep(max(pause, 0.1))
            except KeyboardInterrupt:
                return False
        return True

    def interrupt(self, runs: list[PlannedRun], during: str | None, ask: Callable[[str], bool] | None = None) -> None:
        """After Ctrl-C: the jobs the executor stopped end as cancelled; a scheduler's keep running
        unless `ask` says to cancel them (`echobench cancel DIR` does it later). Says what was
        interrupted (None: waiting for the jobs, named by their states), each job left behind, that
        nothing measured is lost, and what is left to do."""
        if during is None:  # waiting: for which jobs, by their last states
            during = f"while waiting for its jobs ({state_counts(self.state.runs[rid].state for rid in self.tracked)})"
        for job_id in self.executor.cancel_all():
            rid, run = next((rid, run) for rid, run in self.tracked.items() if self.state.runs[rid].job_id == job_id)
            finish_without_record(run.cfg, self.run_dir(run), "cancelled", "interrupted (Ctrl-C) while running")
            self.state.runs[rid].settled, self.state.runs[rid].state = True, "cancelled"
            del self.tracked[rid]
        self.save()
        left = sum(r.id not in self.state.runs or waiting(self.state.runs[r.id]) for r in runs)
        live = [rid for rid in self.tracked if not self.state.runs[rid].settled]
        self.log(f"interrupted (Ctrl-C) {esc(during)}: finished results are kept"
                 + (f"; {left} of {len(runs)} runs not started (the same `echobench sweep` runs them)" if left else ""))
        if not live or not detached(self.executor):
            return
        shown = [f"{rid} (job {self.state.runs[rid].job_id}, {self.state.runs[rid].state})" for rid in live]
        self.log(f"left in the queue: {esc(', '.join(shown[:5]))}" + (f" and {len(shown) - 5} more" if len(shown) > 5
                                                                       else ""))
        question = f"cancel the {len(live)} {self.executor.name.upper()} job(s) of this sweep still queued or running?"
        try:
            stop = ask is not None and ask(question)
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
    write_json_atomic(sweep_dir / "skipped.json", {"matrix": matrix.name, "skipped": skipped or []})
    state.matrix, state.updated = matrix.name, now_iso()
    return Sweep(matrix, sweep_dir, executor, console, state)


def run_sweep(matrix: Matrix, runs: list[PlannedRun], opts: SweepOptions, console,
              skipped: list[dict] | None = None) -> int:
    """Submits what is missing (or failed, with retry), waits, collects. Returns the exit code:
    0 when every run of the selection is ok, 1 when some failed, 130 on Ctrl-C; with --no-wait 0
    once every run is submitted, NOT_ALL_SUBMITTED when some wait to be (slurm.max_submitted, a
    submit limit, a busy scheduler: the same `sweep` again submits them).
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
        if opts.preflight and not sweep.preflight(to_submit):
            return 1
        during = "while calibrating, before any run was submitted"
        sweep.calibrate(to_submit)
        during = "while submitting"
        if detached(sweep.executor):  # a scheduler: hand it what it takes now
            sweep.submit_ready(queue)
    except KeyboardInterrupt:
        sweep.interrupt(runs, during, opts.ask)
        return 130
    if not opts.wait:
        if queue:
            sweep.log(f"[yellow]{len(queue)} of {len(runs)} runs not submitted yet[/] ({esc(sweep.held_because())}): "
                      f"nothing is lost; the same `echobench sweep` submits them (without --no-wait it stays and "
                      f"submits them as jobs end); follow with: echobench status {esc(sweep.dir)}")
            return NOT_ALL_SUBMITTED
        sweep.log(f"submitted; follow with: echobench status {esc(sweep.dir)}")
        return 0
    finished = sweep.wait(queue, runs, opts.poll_s or sweep.executor.poll_s)
    if not finished:
        sweep.interrupt(runs, None, opts.ask)
    else:
        sweep.profile_outcome()
    statuses = collect(sweep.dir, [sweep.run_dir(r) for r in runs], console)
    if not finished:
        return 130
    return 0 if all(statuses.get(r.id) == "ok" for r in runs) else 1


def table_of(run_dirs: list[Path], out_dir: Path) -> tuple[list[dict], list[Path], list[str]]:
    """The runs' current records -> OUT/results.csv and .parquet: (records, paths, unreadable ones)."""
    records, problems = load_records([d / "result.json" for d in run_dirs if (d / "result.json").exists()])
    return records, export_table(records_frame(records), out_dir) if records else [], problems


def collect(sweep_dir: Path, run_dirs: list[Path], console) -> dict[str, str]:
    """One table of the runs' current records -> SWEEP/results.csv and .parquet."""
    records, paths, problems = table_of(run_dirs, sweep_dir)
    for p in problems:
        log(console, f"[yellow]skipped a corrupt record[/]: {esc(p)}")
    if paths:
        log(console, f"results: {esc(', '.join(str(p) for p in paths))}")
    return {r.run_id: r.status for r in records}


# ---- status ----

def is_sweep(d: Path) -> bool:
    return (d / SWEEP_FILE).exists() or any(d.glob("*/run.yaml"))


def status_row(rid: str, state: str, record: Record | None, error: str = "", entry: RunEntry | None = None) -> dict:
    """One row of `echobench status`."""
    error = error or (entry.detail if entry and state in ACTIVE else "")
    return {"run_id": rid, "state": state, "job_id": entry and entry.job_id, "attempt": entry and entry.attempt,
            **{k: getattr(record, k, None) for k in ("step_time_s", "samples_per_s", "mfu", "peak_mem_gib")},
            "error": error}


def refresh_status(sweep_dir: Path) -> list[dict]:
    """Every run directory of a sweep (those with a run.yaml; in sweep.json order first), its state
    refreshed from the scheduler (one look per executor for all the jobs); jobs that are over are
    settled."""
    sweep_dir = sweep_dir.resolve()
    state = SweepState.load(sweep_dir)
    ids = list(dict.fromkeys(state.planned + list(state.runs)))
    ids += sorted(p.parent.name for p in sweep_dir.glob("*/run.yaml") if p.parent.name not in ids)
    rows: dict[str, dict] = {}
    readable: dict[str, tuple[RunConfig, Path, RunEntry | None]] = {}
    for rid in ids:
        if rid not in state.runs and not (sweep_dir / rid / "run.yaml").exists():
            rows[rid] = status_row(rid, NOT_STARTED, None)  # planned, never submitted (an interrupted sweep)
            continue
        try:
            rd = run_dir(sweep_dir, rid)
            readable[rid] = RunConfig.from_dict(yaml.safe_load((rd / "run.yaml").read_text())), rd, state.runs.get(rid)
        except (OSError, ValueError, TypeError, yaml.YAMLError):
            rows[rid] = {"run_id": rid, "state": "unreadable",
                         "error": f"{sweep_dir / rid / 'run.yaml'} is missing or invalid"}
    executors: dict[str, Executor] = {}
    looks: dict[str, JobState | None] = {}
    for name in {entry.executor for _, _, entry in readable.values() if entry}:
        executors[name] = make_executor(name)
        looks.update(look(executors[name], {rid: (entry, rd) for rid, (_, rd, entry) in readable.items()
                                            if entry and entry.executor == name}, state))
    for rid, (cfg, rd, entry) in readable.items():
        name = entry.executor if entry else "local"
        st, record, error = run_state(cfg, rd, entry, executors.setdefault(name, make_executor(name)), looks.get(rid))
        rows[rid] = status_row(rid, st, record, error, entry)
    if state.runs:
        state.save(sweep_dir)
    return [rows[rid] for rid in ids]


def status(runs_dir: Path, wait: bool = False, poll_s: float = 5.0) -> tuple[list[dict], list[str]]:
    """`echobench status`: (rows, unreadable records). A sweep's runs are refreshed from the
    scheduler (with `wait`, until none is pending or running: poll_s doubling up to MAX_POLL_S
    while no state changes); a directory of records that is not a sweep gives one row per record."""
    if not is_sweep(runs_dir):
        records, problems = load_records([runs_dir])
        return [status_row(r.run_id, r.status, r, r.error or "") for r in records], problems
    rows = refresh_status(runs_dir)
    interval = poll_s
    while wait and any(r["state"] in ACTIVE for r in rows):
        time.sleep(interval)
        before, rows = [r["state"] for r in rows], refresh_status(runs_dir)
        interval = poll_s if [r["state"] for r in rows] != before else min(interval * 2, max(poll_s, MAX_POLL_S))
    return rows, []


# ---- cancel ----

def active_calibrations(executor: Executor, state: SweepState, sweep_dir: Path) -> list[str]:
    """The sweep's own jobs before its runs (preflight, GEMM and comm calibrations) still queued or
    running, in one look."""
    jobs = [j for j in (state.preflight_job, state.calibration_job, state.comm_calibration_job) if j]
    looks = job_states(executor, {j: sweep_dir for j in jobs})
    return [j for j in jobs if (st := looks.get(j)) is not None and st.state in ACTIVE]


def cancel_sweep(sweep_dir: Path, console, state: SweepState | None = None, wait_s: float = 120.0,
                 poll_s: float = 1.0) -> int:
    """`echobench cancel DIR` (and Ctrl-C's yes): one scancel of every job of the sweep not yet
    over (its calibration job too), then each one's record as the sweep writes it once the
    scheduler says it ended: cancelled (a run that finished first keeps its own record). A job
    the scheduler still calls active after wait_s is recorded cancelled all the same. Runs
    waiting to be submitted stay so (nothing runs them until the next `sweep`). Idempotent:
    jobs already over are left as they are. Returns the exit code: 0, or 1 when scancel failed."""
    sweep_dir = sweep_dir.resolve()
    state = state if state is not None else SweepState.load(sweep_dir)

    def entries() -> dict[str, tuple[RunConfig, Path, RunEntry]]:
        out = {}
        for rid, e in state.runs.items():
            if e.job_id and not e.settled:
                try:
                    rd = run_dir(sweep_dir, rid)
                    out[rid] = RunConfig.from_dict(yaml.safe_load((rd / "run.yaml").read_text())), rd, e
                except (OSError, ValueError, TypeError, yaml.YAMLError):
                    log(console, f"{esc(rid)}: [red]{esc(sweep_dir / rid / 'run.yaml')} is missing or invalid[/]: "
                                 f"job {esc(e.job_id)} left as it is")
        return out

    def settle_all(live: dict, executor: Executor, why: str | None = None) -> dict:
        """Settles what is over (or, with `why`, everything: recorded cancelled); returns the rest."""
        looks = look(executor, {rid: (e, rd) for rid, (_, rd, e) in live.items()})
        rest = {}
        for rid, (cfg, rd, e) in live.items():
            st = settle(cfg, rd, e, executor, looks.get(rid))
            if st in ACTIVE and why is not None:
                record = finish_without_record(cfg, rd, "cancelled", why.format(job=e.job_id, detail=e.detail))
                e.settled, e.state, e.finished, st = True, record.status, now_iso(), record.status
            if st in ACTIVE:
                rest[rid] = (cfg, rd, e)
            else:
                log(console, f"{esc(rid)}: {state_markup(st)} (job {esc(e.job_id)})")
        state.save(sweep_dir)
        return rest

    code = 0
    all_live = entries()
    for name in sorted({e.executor for _, _, e in all_live.values()}):
        live = {rid: v for rid, v in all_live.items() if v[2].executor == name}
        executor = make_executor(name)
        if not detached(executor) or not hasattr(executor, "cancel"):
            log(console, f"{len(live)} {esc(name)} jobs run under their `echobench sweep` process: Ctrl-C there "
                         f"stops them")
            continue
        live = settle_all(live, executor)  # jobs over already keep the verdict they ended with
        ids = [e.job_id for _, _, e in live.values()]
        if name == "slurm":
            ids += active_calibrations(executor, state, sweep_dir)
        if not ids:
            continue
        try:
            executor.cancel(ids)
        except Exception as exc:  # noqa: BLE001 - scancel's own words, one line
            log(console, f"[red]not cancelled[/]: {esc(exc)}")
            code = 1
            continue
        log(console, f"cancelled {len(ids)} {esc(name)} job(s): {esc(' '.join(ids))}")
        deadline = time.monotonic() + wait_s
        while live and time.monotonic() < deadline:
            time.sleep(poll_s)
            live = settle_all(live, executor)
        if live:
            settle_all(live, executor, why=f"cancelled by `echobench cancel` (job {{job}}; after {wait_s:.0f} s the "
                                           f"scheduler still said: {{detail}})")
    waiting_runs = [rid for rid, e in state.runs.items() if waiting(e)]
    if waiting_runs:
        log(console, f"{len(waiting_runs)} runs never submitted (waiting) stay so: the next `echobench sweep` "
                     f"submits them")
    if not all_live and code == 0:
        log(console, "nothing to cancel: no job of this sweep is queued or running")
    state.save(sweep_dir)
    return code


def export_status(runs_dir: Path, rows: list[dict]) -> tuple[list[Path], list[str]]:
    """`status --export`: the rows' records -> DIR/results.csv and .parquet. Returns the paths and
    the unreadable records of a sweep (`status` names those of a plain directory already)."""
    if not is_sweep(runs_dir):
        return export_table(records_frame(load_records([runs_dir])[0]), runs_dir), []
    return table_of([runs_dir.resolve() / r["run_id"] for r in rows], runs_dir.resolve())[1:]
