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

A second sweep of the same matrix submits only runs without a record; --retry-failed also the
failed ones; ok runs never run twice. Nothing is written outside SWEEP.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import yaml
from pydantic import BaseModel

from echobench.atomic import write_json_atomic
from echobench.config import RunConfig
from echobench.console import NOT_STARTED, Progress, esc, log, state_markup
from echobench.executors import (ACTIVE, CorruptRecord, Executor, archive_attempt, current_record,
                                 finish_without_record, make_executor, write_run_files)
from echobench.matrix import Matrix, Plan, PlannedRun, parse_only, select, time_limit_s
from echobench.plan import settings_label
from echobench.results import Record, export_table, load_records, records_frame

SWEEP_FILE = "sweep.json"
RUN_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


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
    state: str = "pending"  # pending | running | the record's status
    job_id: str | None = None  # None: the submission was refused (the record says why)
    settled: bool = False  # the record is final: the scheduler is not asked again
    detail: str = ""  # the scheduler's words at the last look
    finished: str | None = None


class SweepState(BaseModel):
    """SWEEP/sweep.json. Every field has a default, so files of earlier versions load; one that
    cannot be read at all loads empty (its runs then count by their records alone)."""

    matrix: str | None = None
    updated: str | None = None
    planned: list[str] = []  # every run a `sweep` of this directory was asked to do, in order
    runs: dict[str, RunEntry] = {}

    def plan(self, run_ids: list[str]) -> None:
        """Adds a sweep's selection to the planned runs (a later --only keeps the earlier ones)."""
        self.planned += [rid for rid in run_ids if rid not in self.planned]

    @classmethod
    def load(cls, sweep_dir: Path) -> SweepState:
        try:
            return cls.model_validate_json((sweep_dir / SWEEP_FILE).read_text())
        except (OSError, ValueError):  # pydantic's ValidationError is a ValueError
            return cls()

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


def settle(cfg: RunConfig, rd: Path, entry: RunEntry, executor: Executor) -> str:
    """A tracked job's state now; once it is over, its record exists (written here if need be)."""
    if entry.settled:
        return record_state(rd)[0]
    job = executor.state(entry.job_id, rd)
    entry.detail = job.detail
    if job.state in ACTIVE:
        entry.state = job.state
        return job.state
    # exited or gone without a record of its own: an error; else the scheduler's verdict
    # (timeout, cancelled, node_fail, oom, error).
    status, why = {"exited": ("error", f"{entry.job_id}: {job.detail} without writing a record"),
                   "gone": ("error", job.detail)}.get(job.state, (job.state, job.detail))
    record = finish_without_record(cfg, rd, status, why)
    entry.settled, entry.state, entry.finished = True, record.status, now_iso()
    return record.status


def run_state(cfg: RunConfig, rd: Path, entry: RunEntry | None, executor: Executor) -> tuple[str, Record | None, str]:
    """(state, record, error): new | pending | running | a record status, with the run's current
    record as record_state reads it (once: `status --wait` asks again at every poll)."""
    if entry is None or not entry.job_id or entry.settled:
        return record_state(rd)
    state = settle(cfg, rd, entry, executor)
    _, record, error = record_state(rd)
    return state, record, error


# ---- the sweep ----

@dataclass
class SweepOptions:
    executor: str
    out: Path
    wait: bool = True
    retry_failed: bool = False
    poll_s: float | None = None

    def __post_init__(self):  # refused before anything is written
        if not self.wait and make_executor(self.executor).max_active is not None:
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
    """A sweep under way: its directory, state file and executor, and the jobs not yet over."""

    matrix: Matrix
    dir: Path
    executor: Executor
    console: object
    state: SweepState
    tracked: dict[str, PlannedRun] = field(default_factory=dict)  # submitted, not settled

    def log(self, text: str) -> None:
        log(self.console, text)

    def run_dir(self, run: PlannedRun) -> Path:
        return run_dir(self.dir, run.id)

    def save(self) -> None:
        self.state.save(self.dir)

    def triage(self, runs: list[PlannedRun], retry_failed: bool) -> tuple[list[PlannedRun], list[PlannedRun]]:
        """(to submit, failed earlier and not rerun): runs without a record, and failed ones with
        --retry-failed, are to submit; jobs still going are tracked again; ok runs never rerun."""
        to_submit, failed_before = [], []
        for run in runs:
            st, _, error = run_state(run.cfg, self.run_dir(run), self.state.runs.get(run.id), self.executor)
            if st == "new":
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

    def calibrate(self, runs: list[PlannedRun]) -> None:
        """Runs to submit without a peak of their own: the executor measures one where they run."""
        if no_peak := [r for r in runs if r.cfg.peak_tflops is None]:
            devices = {r.cfg.device for r in no_peak}
            self.executor.calibrate(self.dir, self.matrix, devices.pop() if len(devices) == 1 else "auto", self.log)

    def submit(self, run: PlannedRun) -> None:
        """A new attempt: the last one's files moved aside, the run's files written, its job started."""
        rd, before = self.run_dir(run), self.state.runs.get(run.id)
        attempt = (before.attempt if before else 0) + 1
        archive_attempt(rd, attempt - 1)
        write_run_files(run, rd, self.matrix, self.executor)
        entry = self.state.runs[run.id] = RunEntry(executor=self.executor.name, attempt=attempt, submitted=now_iso())
        try:
            entry.job_id = self.executor.submit(run, rd, time_limit_s(self.matrix, self.executor.name, run))
        except Exception as exc:  # noqa: BLE001 - a rejected submission becomes this run's record
            record = finish_without_record(run.cfg, rd, "error", f"submission failed: {exc}")
            entry.settled, entry.state = True, record.status
            self.log(f"{run.id}: [red]not submitted[/]: {esc(exc)}")
        else:
            self.tracked[run.id] = run
            self.log(f"{run.id}: submitted as {esc(entry.job_id)}")
        self.save()

    def poll(self) -> None:
        """Asks after each tracked job once; one that is over leaves the tracked ones, logged."""
        for rid, run in list(self.tracked.items()):
            entry = self.state.runs[rid]
            before = entry.state
            st = settle(run.cfg, self.run_dir(run), entry, self.executor)
            if st in ACTIVE:
                if st != before:
                    self.log(f"{rid}: {esc(st)}")
                continue
            del self.tracked[rid]
            note = "" if st == "ok" else f": {esc(record_state(self.run_dir(run))[2][:300])}"
            self.log(f"{rid}: {state_markup(st)}{note}")
        self.save()

    def wait(self, queue: list[PlannedRun], runs: list[PlannedRun], poll_s: float) -> bool:
        """Submits the queue as the executor has room and polls until every job is over; False
        when Ctrl-C stopped the waiting."""
        with Progress(self.console) as progress:
            try:
                while queue or self.tracked:
                    while queue and len(self.tracked) < self.executor.max_active:
                        self.submit(queue.pop(0))
                    self.poll()
                    progress.update([(r.id, e.state, e.detail) if (e := self.state.runs.get(r.id))
                                     else (r.id, "queued", "") for r in runs])
                    if queue or self.tracked:
                        time.sleep(poll_s)
            except KeyboardInterrupt:
                return False
        return True

    def interrupt(self, runs: list[PlannedRun], during: str) -> None:
        """After Ctrl-C: the jobs the executor stopped end as cancelled; the rest keep running.
        Says what was interrupted, that nothing measured is lost, and what is left to do."""
        for job_id in self.executor.cancel_all():
            rid, run = next((rid, run) for rid, run in self.tracked.items() if self.state.runs[rid].job_id == job_id)
            finish_without_record(run.cfg, self.run_dir(run), "cancelled", "interrupted (Ctrl-C) while running")
            self.state.runs[rid].settled, self.state.runs[rid].state = True, "cancelled"
        self.save()
        detach = self.executor.detach_message()
        left = sum(r.id not in self.state.runs for r in runs)
        self.log(f"interrupted (Ctrl-C) {esc(during)}: finished results are kept"
                 + (f"; {left} of {len(runs)} runs not started (the same `echobench sweep` runs them)" if left else "")
                 + (f"; {esc(detach)}" if detach else ""))


def open_sweep(matrix: Matrix, opts: SweepOptions, console, skipped: list[dict] | None) -> Sweep:
    """The sweep directory with the matrix, skipped.json and sweep.json; refuses, before it writes
    anything, what the executor cannot do."""
    sweep_dir = opts.out.resolve()
    executor = make_executor(opts.executor, matrix)
    executor.check_dir(sweep_dir)  # raises ValueError
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "matrix.yaml").write_text(matrix.text)
    write_json_atomic(sweep_dir / "skipped.json", {"matrix": matrix.name, "skipped": skipped or []})
    state = SweepState.load(sweep_dir)
    state.matrix, state.updated = matrix.name, now_iso()
    return Sweep(matrix, sweep_dir, executor, console, state)


def run_sweep(matrix: Matrix, runs: list[PlannedRun], opts: SweepOptions, console,
              skipped: list[dict] | None = None) -> int:
    """Submits what is missing (or failed, with retry), waits, collects. Returns the exit code:
    0 when every run of the selection is ok, 1 when some failed, 130 on Ctrl-C.
    `skipped` (skipped_entry dicts) goes to SWEEP/skipped.json for the report."""
    sweep = open_sweep(matrix, opts, console, skipped)
    sweep.state.plan([r.id for r in runs])
    to_submit, failed_before = sweep.triage(runs, opts.retry_failed)
    done = len(runs) - len(to_submit) - len(sweep.tracked) - len(failed_before)
    sweep.log(f"{matrix.name}: {len(runs)} runs: {done} ok already, {len(sweep.tracked)} in progress, "
              f"{len(to_submit)} to run" + (f", {len(failed_before)} failed earlier (not rerun: --retry-failed)"
                                           if failed_before else "") + f" -> {esc(sweep.dir)}")
    try:
        during = "while calibrating, before any run was submitted"
        sweep.calibrate(to_submit)
        queue = list(to_submit)
        during = "while submitting"
        if sweep.executor.max_active is None:  # a scheduler: hand it everything now
            while queue:
                sweep.submit(queue.pop(0))
    except KeyboardInterrupt:
        sweep.interrupt(runs, during)
        return 130
    if not opts.wait:
        sweep.log(f"submitted; follow with: echobench status {esc(sweep.dir)}")
        return 0
    finished = sweep.wait(queue, runs, opts.poll_s or sweep.executor.poll_s)
    if not finished:
        sweep.interrupt(runs, "while running")
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
    refreshed from the scheduler; jobs that are over are settled."""
    sweep_dir = sweep_dir.resolve()
    state = SweepState.load(sweep_dir)
    ids = list(dict.fromkeys(state.planned + list(state.runs)))
    ids += sorted(p.parent.name for p in sweep_dir.glob("*/run.yaml") if p.parent.name not in ids)
    executors: dict[str, Executor] = {}
    rows = []
    for rid in ids:
        if rid not in state.runs and not (sweep_dir / rid / "run.yaml").exists():
            rows.append(status_row(rid, NOT_STARTED, None))  # planned, never submitted (an interrupted sweep)
            continue
        try:
            rd = run_dir(sweep_dir, rid)
            cfg = RunConfig.from_dict(yaml.safe_load((rd / "run.yaml").read_text()))
        except (OSError, ValueError, TypeError, yaml.YAMLError):
            rows.append({"run_id": rid, "state": "unreadable",
                         "error": f"{sweep_dir / rid / 'run.yaml'} is missing or invalid"})
            continue
        entry = state.runs.get(rid)
        name = entry.executor if entry else "local"
        st, record, error = run_state(cfg, rd, entry, executors.setdefault(name, make_executor(name)))
        rows.append(status_row(rid, st, record, error, entry))
    if state.runs:
        state.save(sweep_dir)
    return rows


def status(runs_dir: Path, wait: bool = False, poll_s: float = 5.0) -> tuple[list[dict], list[str]]:
    """`echobench status`: (rows, unreadable records). A sweep's runs are refreshed from the
    scheduler (with `wait`, until none is pending or running); a directory of records that is
    not a sweep gives one row per record."""
    if not is_sweep(runs_dir):
        records, problems = load_records([runs_dir])
        return [status_row(r.run_id, r.status, r, r.error or "") for r in records], problems
    rows = refresh_status(runs_dir)
    while wait and any(r["state"] in ACTIVE for r in rows):
        time.sleep(poll_s)
        rows = refresh_status(runs_dir)
    return rows, []


def export_status(runs_dir: Path, rows: list[dict]) -> tuple[list[Path], list[str]]:
    """`status --export`: the rows' records -> DIR/results.csv and .parquet. Returns the paths and
    the unreadable records of a sweep (`status` names those of a plain directory already)."""
    if not is_sweep(runs_dir):
        return export_table(records_frame(load_records([runs_dir])[0]), runs_dir), []
    return table_of([runs_dir.resolve() / r["run_id"] for r in rows], runs_dir.resolve())[1:]
