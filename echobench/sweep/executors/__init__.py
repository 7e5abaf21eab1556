"""Executors: how a sweep's runs get run. `local` (this machine, one run after another) and
`slurm` (one sbatch job per run). Both write the same files into a run's directory (named and read
in echobench.records.rundir):

    RUN_DIR/run.yaml      the run's settings (RunConfig keys)
    RUN_DIR/job.sh        the exact script that runs it
    RUN_DIR/logs/         the job's output
    RUN_DIR/job-state     written by the job itself: "running ID TIME", then "exited ID RC TIME"
    RUN_DIR/result.json   the record: written by the run, or by the sweep when the job died first
    RUN_DIR/plan.json     what the plan said: memory estimate, time limit
    RUN_DIR/attempts/N/   an earlier attempt's record, job-state and logs (`archive_attempt`)

A job's state is read from its own files first, then from the scheduler; a job that ended
without a record gets one here (`finish_without_record`), with the log tail as its error.
What a sweep asks of an executor is the `Executor` protocol; `make_executor` picks one by name.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from echobench.records.atomic import write_json_atomic
from echobench.records.paths import sweep_profile
from echobench.records.results import PLAN_FILE, RECORD_FILE, Record
from echobench.records.rundir import JOB_STATE, read_job_note, write_run_yaml
from echobench.records.states import RunState
from echobench.sweep.estimate import time_limit
from echobench.sweep.matrix import Matrix, PlannedRun
from echobench.train.launch import every_rank, rank_failures



@dataclass
class JobState:
    state: RunState  # pending | running | exited | gone, or a record status (timeout, cancelled, preempted, node_fail, oom, error)
    detail: str = ""  # scheduler's words: "TIMEOUT (TimeLimit) exit 0:0"
    exit_code: int | None = None
    reason: str = ""  # why a pending job waits (the scheduler's reason code: Priority, Dependency, ...)
    never: str = ""  # the fix, when that reason says it can never start as it is (PartitionNodeLimit, ...)


class SubmitLater(RuntimeError):
    """The executor cannot take the job now, for reasons not the job's own: a submit limit
    (QOSMaxSubmitJobPerUserLimit), a scheduler too busy to answer, an sbatch that timed out with
    no job queued under the run's name. The run waits, not settled, and is submitted again later."""


class Executor(Protocol):
    """How a sweep's runs get run (echobench.sweep.loop needs no more than this). An executor may also
    have `states(jobs)`, every job's state in one look (`job_states` asks `state` per job otherwise)."""

    name: str  # local | slurm: the matrix's `executor`, kept in sweep.json for `echobench status`
    # Jobs at once: 1 on this machine; for a scheduler slurm.max_submitted (None: no cap, it queues them all).
    max_active: int | None
    poll_s: float  # seconds between state checks, unless --poll says otherwise

    def check_dir(self, sweep_dir: Path) -> None:
        """Raises ValueError when the sweep directory cannot serve this executor (before anything is written)."""

    def job_script(self, run: PlannedRun, run_dir: Path, matrix: Matrix, time_limit: str, log: Path | None = None) -> str:
        """The exact RUN_DIR/job.sh of a run (`echobench plan --script` prints it); `log`, where a
        scheduler writes its output when not in RUN_DIR/logs (a script to submit by hand)."""

    def calibrate(self, sweep_dir: Path, matrix: Matrix, device: str, log: Callable[[str], None]) -> None:
        """Runs without a peak are to be submitted: measure the GEMM rate where they will run, once per
        sweep, into SWEEP/cache. Raises ValueError when that cannot start (before any run is submitted)."""

    def calibrate_comm(self, sweep_dir: Path, matrix: Matrix, runs: list[PlannedRun], device: str,
                       log: Callable[[str], None], previous: str | None = None) -> str | None:
        """hardware.calibrate_comm: measure a hardware profile (`echobench calibrate --comm --matrix
        MATRIX`, the matrix file the sweep was started with: comm_command) where the runs will run, on
        the largest of them (comm_size), into sweep_profile(SWEEP) and SWEEP/cache. `previous`: that of an earlier sweep of this directory, still
        queued or running, is waited for instead. Returns the log to name should no profile come of it
        (None when nothing is pending: measured already, or said here); a failure never stops the runs."""

    def submit(self, run: PlannedRun, run_dir: Path, time_limit_s: int) -> str:
        """Starts or queues RUN_DIR/job.sh; returns the job id. Raises SubmitLater when it cannot be
        taken now (the run is submitted again later), another exception when the job is refused."""

    def state(self, job_id: str, run_dir: Path) -> JobState:
        """The job's state now: from its own files first, then from whoever runs it."""

    def cancel_all(self) -> list[str]:
        """Ctrl-C: stops the jobs that must not outlive this process; returns their ids."""

    def detach_message(self) -> str:
        """What Ctrl-C leaves running and how to follow it ("" when nothing)."""


def job_states(executor: Executor, jobs: dict[str, Path]) -> dict[str, JobState]:
    """The state of every job (job id -> its run directory) in one look where the executor can
    (SLURM: one sacct for all), else one `state` per job. A job missing from the answer is no
    news: the scheduler did not answer about it this time, ask again at the next look."""
    if not jobs:
        return {}
    if (batch := getattr(executor, "states", None)) is not None:
        return batch(jobs)
    return {job_id: executor.state(job_id, rd) for job_id, rd in jobs.items()}


def make_executor(name: str, matrix: Matrix | None = None) -> Executor:
    if name == "slurm":
        from echobench.sweep.executors.slurm import SlurmExecutor  # lazy: slurm imports this package, its home

        return SlurmExecutor(matrix.spec.slurm.max_submitted if matrix is not None else None)
    from echobench.sweep.executors.local import LocalExecutor  # lazy: as slurm above

    # The matrix's env applies to local runs too (as process environment: no shell involved).
    return LocalExecutor(dict(matrix.spec.slurm.env) if matrix is not None else {})


def sweep_cache(sweep_dir: Path) -> Path:
    """SWEEP/cache: where a sweep's one calibration goes (ECHOBENCH_CACHE of its runs without a peak)."""
    return sweep_dir.resolve() / "cache"


def calibrated(sweep_dir: Path) -> bool:
    """Whether the sweep has measured its GEMM rate already (a file under SWEEP/cache/calibration)."""
    return any((sweep_cache(sweep_dir) / "calibration").glob("*.json"))


PREFLIGHT_FILE = "preflight.json"  # a sweep's last preflight (echobench.sweep.preflight.Preflight)
PREFLIGHT_SCRIPT = "preflight.sh"  # its SLURM job's script (and `plan --write-scripts`' copy)


def transport_label(transport: str | None, job: str | None) -> str | None:
    """The record's env.nccl_transport: the network a preflight saw NCCL choose, and which preflight."""
    return f"{transport} (preflight job {job})" if transport else None


def sweep_transport(sweep_dir: Path) -> str | None:
    """transport_label of the sweep's passed preflight (for the records the sweep writes itself)."""
    try:
        seen = json.loads((sweep_dir / PREFLIGHT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return transport_label(seen.get("transport"), seen.get("job")) if seen.get("passed") else None


def comm_size(runs: list[PlannedRun]) -> tuple[int, int]:
    """(nodes, processes per node) of the comm calibration: the largest of the runs' (at least 1 x 1),
    so that its groups are those the runs form."""
    return max([1, *(r.cfg.nodes for r in runs)]), max([1, *(r.cfg.gpus_per_node for r in runs)])


def comm_command(sweep_dir: Path, matrix: Matrix, device: str) -> list[str]:
    """The words after `python -m echobench calibrate --comm` that every executor's calibration passes
    (the launch's own --nproc / --nnodes / rendezvous come before them): the device, every run of the
    matrix file the sweep was started with (their GEMM and attention shapes; its file, not the copy
    SWEEP/matrix.yaml: a card's relative path is taken from the matrix's folder, matrix.card_beside,
    and names no file beside the copy), the profile's file and the matrix's limits."""
    site = ["--site", str(matrix.site.resolve())] if matrix.site_flag and matrix.site is not None else []
    return ["--device", device, "--matrix", str(matrix.path.resolve()), *site,
            "--out", str(sweep_profile(sweep_dir)), *matrix.spec.hardware.comm_limits.flags()]


def read_job_state(run_dir: Path, job_id: str) -> JobState | None:
    """The job's own status file (records.rundir.read_job_note), when it is about this job."""
    note = read_job_note(run_dir)
    if note is None or note.job_id != job_id:
        return None
    if note.state == RunState.EXITED:
        return JobState(RunState.EXITED, f"job exited with code {note.exit_code}", note.exit_code)
    return JobState(RunState.RUNNING)


def log_tail(run_dir: Path, lines: int = 40) -> str:
    """The last lines of the run's newest log file."""
    logs = sorted((run_dir / "logs").glob("*"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return ""
    try:
        text = logs[-1].read_text(errors="replace")
    except OSError:
        return ""
    all_lines = text.rstrip().splitlines()
    tail = all_lines[-lines:]
    # SLURM's own verdict ("*** JOB 7 ON node1 CANCELLED AT ... DUE TO TIME LIMIT ***") may sit
    # above a long traceback: keep it.
    verdict = [line for line in all_lines[:-lines] if "***" in line and "slurmstepd" in line][-2:]
    return "\n".join(verdict + tail)


# Log lines that never explain an end: Python's warnings (the line and its `warnings.warn(` echo).
NOISE = re.compile(r"warnings\.warn\(|\b\w*Warning: |^(\d+: )?\s*$")
# Lines that say why something ended.
TELLS = re.compile(r"error|fail|killed|signal|traceback|\*\*\*|exception|timed? ?out|reset by peer|refused|"
                   r"cancel|lost|went down|abort|terminat|not found|no such|cannot|exit(ed)? (with )?code", re.IGNORECASE)


def explaining_lines(tail: str, lines: int = 3) -> list[str]:
    """The lines of a log tail that explain how the job ended: SLURM's own `*** ... ***` verdict, then
    the last `lines` that say an error, a signal, a lost peer (else the last lines), warnings left out."""
    kept = [line.strip() for line in tail.splitlines() if line.strip() and not NOISE.search(line)]
    verdict = [line for line in kept if "***" in line][-1:]
    telling = [line for line in kept if TELLS.search(line) and line not in verdict][-lines:]
    return verdict + (telling or [line for line in kept[-lines:] if line not in verdict])


def short_tail(tail: str, lines: int = 3, limit: int = 400) -> str:
    """A few log lines for the one-line error (explaining_lines)."""
    return " | ".join(explaining_lines(tail, lines))[:limit]


def archive_attempt(rd: Path, attempt: int) -> None:
    """Moves an earlier attempt's record, status and logs aside: nothing measured is lost."""
    names = [RECORD_FILE, f"{RECORD_FILE}.corrupt", JOB_STATE, "logs", "ranks"]
    if not any((rd / n).exists() for n in names):
        return
    dest = rd / "attempts" / str(attempt)
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (rd / n).exists():
            shutil.move(str(rd / n), str(dest / n))


def write_run_files(run: PlannedRun, rd: Path, matrix: Matrix, executor: Executor) -> None:
    """RUN_DIR/run.yaml, job.sh and plan.json of a new attempt (logs/ for the job's output)."""
    limit = time_limit(matrix, executor.name, run)
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "logs").mkdir(exist_ok=True)
    write_run_yaml(rd, run.cfg)
    (rd / "job.sh").write_text(executor.job_script(run, rd, matrix, limit))
    # What the plan said about this run (the report shows the estimate beside the measured peak).
    write_json_atomic(rd / PLAN_FILE, {
        "run_id": run.id, "matrix": matrix.name, "executor": executor.name, "time_limit": limit,
        "memory_estimate_gib": run.memory.total_gib if run.memory else None,
        "memory_estimate": run.memory.as_gib() if run.memory else None, "fits": run.fits,
    })


class CorruptRecord(ValueError):
    """A run's result.json is there but is not a readable record (the message names the file)."""


def current_record(run_dir: Path) -> Record | None:
    """The run's record, None while it has none. A record that is there but unreadable raises
    CorruptRecord: it is never taken for a missing one (and then rerun or overwritten silently)."""
    path = run_dir / RECORD_FILE
    if not path.exists():
        return None
    try:
        return Record.load(path)
    except ValueError as exc:
        raise CorruptRecord(str(exc)) from None


def finish_without_record(cfg, run_dir: Path, status: str, why: str) -> Record:
    """The record of a job that ended by the scheduler's hand or before writing its own.

    A record the run wrote itself stands when it is ok; a failure record it left (e.g. the
    launcher noticing its workers die under a time-limit kill) is replaced by the scheduler's
    verdict, keeping the run's own error beside it. A corrupt one is kept as result.json.corrupt.
    Where the ranks' files say why the run failed and the scheduler says no more than that the job
    ended without a record (status error), the record is the one node 0's launcher would have written.
    """
    try:
        own, corrupt = current_record(run_dir), None
    except CorruptRecord as exc:
        own, corrupt = None, str(exc)
        (run_dir / RECORD_FILE).replace(run_dir / f"{RECORD_FILE}.corrupt")
    if own is not None and (own.status == RunState.OK or status == RunState.ERROR):
        return own
    tail = log_tail(run_dir)
    record = Record.without_run(cfg, status, why, log_tail=tail)
    record.env.nccl_transport = sweep_transport(run_dir.parent)
    if own is None and (failures := rank_failures(run_dir)):
        # A rank recorded why it failed, but no launcher assembled the record (node 0's was SIGKILLed before it
        # could): that rank's error is the error; a verdict of the scheduler's other than a plain error (timeout,
        # cancelled, oom) is the status, said after it.
        every_rank(record.fail(failures), cfg.gpus_per_node, run_dir)
        if status == RunState.ERROR and corrupt is None:
            record.save(run_dir)
            return record
        why, record.status = f"{record.error}; {why}", status
    record.error = f"{why}; log: {short_tail(tail)}" if tail else why
    if own is not None:
        record.run_error = own.error
    if corrupt is not None:
        record.update(error=f"{why}; its own record was corrupt (kept as result.json.corrupt): {corrupt}",
                      run_error=corrupt)
    record.save(run_dir)
    return record
