"""`echobench status` and `echobench cancel`: a sweep's runs looked at, exported and stopped from
outside the sweep's own loop (echobench.sweep.loop), through its state (echobench.sweep.state)."""

from __future__ import annotations

import time
from pathlib import Path

from rich.table import Table

from echobench.records.config import RunConfig
from echobench.records.console import esc, fmt, log, state_markup
from echobench.records.paths import SWEEP_FILE
from echobench.records.results import (RECORD_FILE, Record, export_table, load_records, now_iso, record_settings,
                                       records_frame)
from echobench.records.rundir import RUN_YAML, read_run_config, read_run_settings
from echobench.records.states import ACTIVE, RunState
from echobench.sweep.matrix import settings_match
from echobench.sweep.executors import Executor, JobState, finish_without_record, job_states, make_executor
from echobench.sweep.state import (RunEntry, SweepState, detached, longest_poll, run_dir, run_state, settle,
                                   tracked_job_states, waiting)


def table_of(run_dirs: list[Path], out_dir: Path) -> tuple[list[dict], list[Path], list[str]]:
    """The runs' current records -> OUT/results.csv and .parquet: (records, paths, unreadable ones)."""
    records, problems = load_records([d / RECORD_FILE for d in run_dirs if (d / RECORD_FILE).exists()])
    return records, export_table(records_frame(records), out_dir) if records else [], problems


# ---- status ----

def is_sweep(d: Path) -> bool:
    return (d / SWEEP_FILE).exists() or any(d.glob(f"*/{RUN_YAML}"))


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
    ids += sorted(p.parent.name for p in sweep_dir.glob(f"*/{RUN_YAML}") if p.parent.name not in ids)
    rows: dict[str, dict] = {}
    readable: dict[str, tuple[RunConfig, Path, RunEntry | None]] = {}
    for rid in ids:
        if rid not in state.runs and not (sweep_dir / rid / RUN_YAML).exists():
            rows[rid] = status_row(rid, RunState.NOT_STARTED, None)  # planned, never submitted (an interrupted sweep)
            continue
        try:
            rd = run_dir(sweep_dir, rid)
            readable[rid] = read_run_config(rd), rd, state.runs.get(rid)
        except ValueError as exc:
            rows[rid] = {"run_id": rid, "state": RunState.UNREADABLE, "error": str(exc)}
    executors: dict[str, Executor] = {}
    looks: dict[str, JobState | None] = {}
    for name in {entry.executor for _, _, entry in readable.values() if entry}:
        executors[name] = make_executor(name)
        mine = {rid: (entry, rd) for rid, (_, rd, entry) in readable.items() if entry and entry.executor == name}
        looks.update(tracked_job_states(executors[name], mine, state))
    for rid, (cfg, rd, entry) in readable.items():
        name = entry.executor if entry else "local"
        st, record, error = run_state(cfg, rd, entry, executors.setdefault(name, make_executor(name)), looks.get(rid))
        rows[rid] = status_row(rid, st, record, error, entry)
    if state.runs:
        state.save(sweep_dir)
    return [rows[rid] for rid in ids]


# States of a run that has not failed: done well, under way, or not begun ("new": files, no record yet).
NOT_FAILED = (RunState.OK, *ACTIVE, RunState.WAITING, RunState.NOT_STARTED, RunState.NEW)


def failed_runs(rows: list[dict]) -> list[dict]:
    """The rows of runs that failed: a failure record (error, oom, timeout, node_fail, cancelled,
    preempted), or one that cannot be read (corrupt, unreadable)."""
    return [r for r in rows if r["state"] not in NOT_FAILED]


def status(runs_dir: Path, wait: bool = False, poll_s: float = 5.0,
           only: dict[str, list] | None = None) -> tuple[list[dict], list[str]]:
    """`echobench status`: (rows, unreadable records). A sweep's runs are refreshed from the
    scheduler (with `wait`, until none is pending or running: poll_s doubling while no state
    changes, up to sweep_state.longest_poll); a directory of records that is not a sweep gives one row per record.
    `only` (--only): the runs whose stored settings have those values (a run never started has none
    stored: left out)."""
    if not is_sweep(runs_dir):
        records, problems = load_records([runs_dir])
        return [status_row(r.run_id, r.status, r, r.error or "") for r in records
                if not only or settings_match(record_settings(r), only)], problems
    keep = (lambda rows: rows) if not only else (lambda rows: [r for r in rows if stored_match(runs_dir, r, only)])
    rows = keep(refresh_status(runs_dir))
    interval = poll_s
    while wait and any(r["state"] in ACTIVE for r in rows):
        time.sleep(interval)
        before, rows = [r["state"] for r in rows], keep(refresh_status(runs_dir))
        states = [r["state"] for r in rows]
        interval = poll_s if states != before else min(interval * 2, longest_poll(poll_s, states))
    return rows, []


def stored_match(sweep_dir: Path, row: dict, only: dict[str, list]) -> bool:
    """Whether a sweep's run has the --only values in its run.yaml (False where there is none)."""
    try:
        return settings_match(read_run_settings(run_dir(sweep_dir, row["run_id"])), only)
    except ValueError:
        return False


# ---- cancel ----

def status_table(title: str, rows: list[dict]) -> Table:
    """`echobench status`'s table: one row per run (its error goes under the table, not in it)."""
    table = Table(title=esc(title))
    table.add_column("run id", overflow="fold")  # folds only where the terminal is narrower than the ids
    for col in ("state", "job", "step time s", "samples/s", "MFU", "mem GiB"):
        table.add_column(col)
    for r in rows:
        table.add_row(esc(r["run_id"]), state_markup(r["state"]), esc(r.get("job_id") or "-"),
                      fmt(r.get("step_time_s"), ".4f"), fmt(r.get("samples_per_s"), ".3g"),
                      "-" if r.get("mfu") is None else f"{r['mfu']:.2%}", fmt(r.get("peak_mem_gib"), ".2f"))
    return table


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
                    out[rid] = read_run_config(rd), rd, e
                except ValueError as exc:
                    log(console, f"{esc(rid)}: [red]{esc(exc)}[/]: job {esc(e.job_id)} left as it is")
        return out

    def settle_all(live: dict, executor: Executor, why: str | None = None) -> dict:
        """Settles what is over (or, with `why`, everything: recorded cancelled); returns the rest."""
        looks = tracked_job_states(executor, {rid: (e, rd) for rid, (_, rd, e) in live.items()})
        rest = {}
        for rid, (cfg, rd, e) in live.items():
            st = settle(cfg, rd, e, executor, looks.get(rid))
            if st in ACTIVE and why is not None:
                record = finish_without_record(cfg, rd, RunState.CANCELLED, why.format(job=e.job_id, detail=e.detail))
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
                         f"(or SIGTERM to it, `kill PID`, where it runs in the background) stops them")
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
