"""A sweep's bookkeeping: SWEEP/sweep.json (which job runs each run, whether its record is final)
and each run's state, read from its record and the scheduler's answers. The sweep's loop
(echobench.sweep.loop) and `status` / `cancel` (echobench.sweep.status) both go through it."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from pydantic import BaseModel, ValidationError

from echobench.records.atomic import write_json_atomic
from echobench.records.config import RunConfig, run_id
from echobench.sweep.executors import (CorruptRecord, Executor, JobState, current_record, finish_without_record, job_states, sweep_transport)
from echobench.records.paths import SWEEP_FILE
from echobench.train.launch import lost_node_record
from echobench.records.results import Record, now_iso, validation_text
from echobench.records.states import ACTIVE, RunState
RUN_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$"
# A scheduler's jobs: the poll interval doubles while nothing changes, up to MAX_POLL_S while every job waits
# in the queue, up to RUNNING_POLL_S once one runs (a failure then shows within that).
MAX_POLL_S = 60.0
RUNNING_POLL_S = 10.0
NEVER_GRACE_S = 120.0  # a pending reason that says a job can never start must hold this long to end it
TEARDOWN_S = 75.0  # a job still running this long after its launcher's failure record hangs (srun --wait=60)


def poll_cap(cap: float) -> float:
    """CAP, or ECHOBENCH_MAX_POLL_S if lower: the test suite's, whose local cluster answers a poll at
    no cost and whose tests would otherwise wait out the back-off (and a scheduler's first interval)
    after each job they wait for."""
    try:
        return min(cap, float(os.environ["ECHOBENCH_MAX_POLL_S"]))
    except (KeyError, ValueError):
        return cap


def longest_poll(poll_s: float, states) -> float:
    """The poll back-off's cap for jobs in these states (pending, running, ...): RUNNING_POLL_S once one
    runs, MAX_POLL_S while none does (both at most ECHOBENCH_MAX_POLL_S); never below poll_s."""
    return max(poll_s, poll_cap(RUNNING_POLL_S if RunState.RUNNING in states else MAX_POLL_S))


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
    state: str = RunState.PENDING
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
    return {"run_id": run_id(cfg) if cfg else None, "reason": reason,
            "settings": cfg.to_dict() if cfg else dict(settings)}


def record_state(rd: Path) -> tuple[str, Record | None, str]:
    """(state, record, error) from a run's current record: its status; "new" without one; "corrupt",
    with an error naming the file, when it is there but unreadable (a failure, never "new")."""
    try:
        record = current_record(rd)
    except CorruptRecord as exc:
        return RunState.CORRUPT, None, f"corrupt record: {exc}"
    return (record.status, record, record.error) if record else (RunState.NEW, None, "")


def waiting(entry: RunEntry | None) -> bool:
    """Whether the run's attempt has its files but no job yet (the executor could not take it: a
    submit limit, a busy scheduler): not settled, submitted again later."""
    return entry is not None and not entry.job_id and not entry.settled


def tracked_job_states(executor: Executor, entries: dict[str, tuple[RunEntry, Path]],
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
    """A tracked job's state now (`job`: the executor's answer at this look, from
    `tracked_job_states`; None: no news, the state stays); once it is over, its record exists
    (written here if need be)."""
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
    status, why = {RunState.EXITED: (RunState.ERROR, f"{entry.job_id}: {job.detail} without writing a record"),
                   RunState.GONE: (RunState.ERROR, job.detail)}.get(job.state, (job.state, job.detail))
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
    if job.state == RunState.PENDING:
        if not job.never:
            entry.blocked_since = None
            return None
        entry.blocked_since = entry.blocked_since or time.time()
        held = time.time() - entry.blocked_since
        if held < NEVER_GRACE_S:
            return None
        why = (f"SLURM job {entry.job_id} can never start as it is: {job.detail} for {held:.0f} s: {job.never}; "
               f"cancelled (fix it, then `echobench sweep --retry-failed` reruns it)")
        record = finish_without_record(cfg, rd, RunState.ERROR, why)
    else:
        try:
            own = current_record(rd)
        except CorruptRecord:
            return None
        record = own or lost_node_record(cfg, rd)
        if record is None or record.status == RunState.OK or (
                own is not None and own.status != RunState.NODE_FAIL and time.time() - own.path.stat().st_mtime < TEARDOWN_S):
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
        return RunState.WAITING, None, entry.detail
    if entry is None or not entry.job_id or entry.settled:
        return record_state(rd)
    state = settle(cfg, rd, entry, executor, job)
    _, record, error = record_state(rd)
    return state, record, error


def detached(executor: Executor) -> bool:
    """Whether the executor's jobs run without this process (a scheduler queues them): --no-wait
    is possible, jobs are handed over before the wait, Ctrl-C leaves them running (detach_message)."""
    return bool(executor.detach_message())
