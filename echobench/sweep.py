"""`echobench plan / sweep / status`: a matrix becomes jobs in a sweep directory, tracked,
resumable, collected.

    SWEEP/matrix.yaml            a copy of the matrix file
    SWEEP/sweep.json             per run: executor, job id, attempt, whether it is settled
    SWEEP/skipped.json           runs not run: invalid combinations, or too big for the device
    SWEEP/RUN_ID/                run.yaml, job.sh, logs/, job-state, result.json (echobench.executors),
                                 plan.json (the plan's memory estimate, time limit)
    SWEEP/RUN_ID/attempts/N/     an earlier attempt's files, moved aside by --retry-failed
    SWEEP/results.csv|.parquet   one row per run (echobench.results.records_frame)
    SWEEP/cache/                 local sweeps without a peak: this machine's GEMM calibration

A second sweep of the same matrix submits only runs without a record; --retry-failed also the
failed ones; ok runs never run twice. Nothing is written outside SWEEP.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from echobench.config import RunConfig
from echobench.console import esc
from echobench.executors import ACTIVE, CorruptRecord, current_record, finish_without_record
from echobench.matrix import Matrix, Plan, PlannedRun, expand, parse_time
from echobench.results import PLAN_FILE, Record, export_table, load_records, records_frame, write_json_atomic

SWEEP_FILE = "sweep.json"
RUN_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$"
STARTUP_S = 120  # per job, for the GPU-hours estimate: allocation, imports, model build
COMPILE_S = 60


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


def default_out(matrix: Matrix) -> Path:
    return Path("runs") / matrix.name


# ---- plan: time and GPU-hours ----

def time_limit(matrix: Matrix, executor: str, run: PlannedRun | None = None) -> str:
    if run is not None and run.time_limit:
        return run.time_limit
    return matrix.spec.slurm.time if executor == "slurm" else matrix.spec.local.time


def time_limit_s(matrix: Matrix, executor: str, run: PlannedRun | None = None) -> int:
    return parse_time(time_limit(matrix, executor, run))


def planned_peak(run: PlannedRun, matrix: Matrix) -> tuple[float | None, str | None]:
    """The peak TFLOP/s a run will use as far as the plan can tell, and where it comes from: the
    matrix, else the datasheet entry of hardware.device; (None, None) when only the node can tell."""
    if run.cfg.peak_tflops is not None:
        return run.cfg.peak_tflops, "matrix"
    device = matrix.spec.hardware.device
    if device:
        from echobench.hardware import table_peak  # imports torch: only when asked

        if hit := table_peak(device):
            return hit[0], hit[1]
    return None, None


def peak_note(runs: list[PlannedRun], matrix: Matrix, executor: str) -> str | None:
    """Which runs have no peak in the plan, and where theirs will come from."""
    missing = [r.id for r in runs if planned_peak(r, matrix)[0] is None]
    if not missing:
        return None
    which = f"all {len(runs)} runs" if len(missing) == len(runs) else f"{len(missing)} of {len(runs)} runs ({', '.join(missing)})"
    where = "on a compute node, in a job the runs wait for" if executor == "slurm" else "on this machine"
    return (f"no peak known for {which}: each takes its node's datasheet peak when the device is in the table, "
            f"else the GEMM rate the sweep calibrates once {where} (SWEEP/cache); "
            f"set hardware.peak_tflops or hardware.device to fix it in the matrix")


def estimated_seconds(run: PlannedRun, matrix: Matrix) -> float | None:
    """Startup plus all steps at the matrix's assumed MFU; None without a known peak."""
    from echobench.flops import hardware_flops, model_flops
    hw = matrix.spec.hardware
    peak = planned_peak(run, matrix)[0]
    if peak is None:
        return None
    cfg = run.cfg
    model = cfg.model_config()
    per_sample = hardware_flops(model, model_flops(model, cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames), cfg.ac)
    work = (cfg.steps + cfg.warmup_steps) * cfg.global_batch * per_sample
    return STARTUP_S + (COMPILE_S if cfg.compile else 0) + work / (cfg.world_size * peak * 1e12 * hw.assumed_mfu)


def varying_keys(plan: Plan) -> list[str]:
    keys = list(plan.matrix.axes)
    for inc in plan.matrix.include:
        keys += [k for k in inc if k not in keys]
    return keys


# ---- the sweep directory's state ----

def load_state(sweep_dir: Path) -> dict:
    try:
        state = json.loads((sweep_dir / SWEEP_FILE).read_text())
    except (OSError, ValueError):
        return {"runs": {}}
    return state if isinstance(state.get("runs"), dict) else {"runs": {}}


def save_state(sweep_dir: Path, state: dict) -> None:
    write_json_atomic(sweep_dir / SWEEP_FILE, state)


def make_executor(name: str, matrix: Matrix | None = None, env: dict | None = None):
    if name == "slurm":
        from echobench.executors.slurm import SlurmExecutor

        return SlurmExecutor()
    from echobench.executors.local import LocalExecutor

    # The matrix's env applies to local runs too (as process environment: no shell involved).
    return LocalExecutor({**(matrix.spec.slurm.env if matrix is not None else {}), **(env or {})})


def render_job_script(run: PlannedRun, rd: Path, matrix: Matrix, executor: str) -> str:
    if executor == "slurm":
        from echobench.executors.slurm import render_script

        env = dict(matrix.spec.slurm.env)
        if run.cfg.peak_tflops is None:  # where the sweep's calibration job writes (calibrate_on_slurm)
            env.setdefault("ECHOBENCH_CACHE", str(rd.parent.resolve() / "cache"))
        slurm = matrix.spec.slurm.model_copy(update={"time": time_limit(matrix, "slurm", run), "env": env})
        return render_script(run.cfg, rd, slurm)
    from echobench.executors.local import render_local_script

    return render_local_script(run.cfg, rd)


def archive_attempt(rd: Path, attempt: int) -> None:
    """Moves an earlier attempt's record, status and logs aside: nothing measured is lost."""
    names = ["result.json", "result.json.corrupt", "job-state", "logs", "ranks"]
    if not any((rd / n).exists() for n in names):
        return
    dest = rd / "attempts" / str(attempt)
    dest.mkdir(parents=True, exist_ok=True)
    for n in names:
        if (rd / n).exists():
            shutil.move(str(rd / n), str(dest / n))


def write_run_files(run: PlannedRun, rd: Path, matrix: Matrix, executor: str) -> None:
    rd.mkdir(parents=True, exist_ok=True)
    (rd / "logs").mkdir(exist_ok=True)
    (rd / "run.yaml").write_text(yaml.safe_dump(run.cfg.to_dict(), sort_keys=False))
    (rd / "job.sh").write_text(render_job_script(run, rd, matrix, executor))
    # What the plan said about this run (the report shows the estimate beside the measured peak).
    write_json_atomic(rd / PLAN_FILE, {
        "run_id": run.id, "matrix": matrix.name, "executor": executor, "time_limit": time_limit(matrix, executor, run),
        "memory_estimate_gib": run.memory.total_gib if run.memory else None,
        "memory_estimate": run.memory.as_gib() if run.memory else None, "fits": run.fits,
    })


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


def settle(cfg: RunConfig, rd: Path, entry: dict, executor) -> str:
    """A tracked job's state now; once it is over, its record exists (written here if need be)."""
    if entry.get("settled"):
        return record_state(rd)[0]
    job = executor.state(entry["job_id"], rd)
    entry["detail"] = job.detail
    if job.state in ACTIVE:
        entry["state"] = job.state
        return job.state
    if job.state == "exited":
        why = f"{entry['job_id']}: {job.detail} without writing a record"
        record = finish_without_record(cfg, rd, "error", why)
    elif job.state == "gone":
        record = finish_without_record(cfg, rd, "error", job.detail)
    else:  # the scheduler's verdict: timeout, cancelled, node_fail, oom, error
        record = finish_without_record(cfg, rd, job.state, job.detail)
    entry.update(settled=True, state=record.status, finished=now_iso())
    return record.status


def run_state(cfg: RunConfig, rd: Path, entry: dict | None, executor) -> str:
    """new | pending | running | a record status."""
    if entry is None or not entry.get("job_id"):
        return record_state(rd)[0]
    return settle(cfg, rd, entry, executor)


# ---- progress ----

@dataclass
class Progress:
    console: object
    live: object = None

    def table(self, rows: list[tuple[str, str, str]]):
        from rich.table import Table

        counts: dict[str, int] = {}
        for _, state, _ in rows:
            counts[state] = counts.get(state, 0) + 1
        table = Table(title="sweep: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
        for col in ("run", "state", "detail"):
            table.add_column(col, overflow="fold")
        for rid, state, detail in rows:
            color = {"ok": "green", "running": "cyan", "pending": "yellow"}.get(state, "red" if state != "queued" else "")
            table.add_row(esc(rid), f"[{color}]{esc(state)}[/]" if color else esc(state), esc(detail[:80]))
        return table

    def __enter__(self):
        if getattr(self.console, "is_terminal", False):
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def update(self, rows):
        if self.live is not None:
            self.live.update(self.table(rows))

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)


def log(console, text: str) -> None:
    """One timestamped line; `text` is rich markup: pass outside strings through esc()."""
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}", highlight=False)


# ---- the sweep ----

@dataclass
class SweepOptions:
    executor: str
    out: Path
    wait: bool = True
    retry_failed: bool = False
    force: bool = False
    poll_s: float | None = None


def calibrate_once(sweep_dir: Path, console, device: str = "auto") -> dict:
    """A local sweep with no peak given: measure this machine's GEMM rate once, in the sweep
    directory, so the runs report MFU against it (CPU devices have no datasheet peak)."""
    cache = sweep_dir / "cache"
    if not list((cache / "calibration").glob("*.json")):
        log(console, "no peak_tflops in the matrix: running `echobench calibrate` once for this sweep")
        env = {**os.environ, "ECHOBENCH_CACHE": str(cache)}
        from echobench.executors.local import source_root

        env["PYTHONPATH"] = str(source_root()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        with open(sweep_dir / "calibrate.log", "w") as out:
            code = subprocess.call([sys.executable, "-m", "echobench", "calibrate", "--device", device], stdout=out,
                                   stderr=subprocess.STDOUT, env=env)
        if code != 0:
            log(console, f"[red]calibration failed[/] (see {esc(sweep_dir / 'calibrate.log')}); runs without a peak will fail")
    return {"ECHOBENCH_CACHE": str(cache)}


def calibrate_on_slurm(sweep_dir: Path, matrix: Matrix, executor, console, device: str = "auto") -> None:
    """A SLURM sweep with no peak given: one calibration job on a compute node (the login node's
    device says nothing about the nodes'), which the runs without a peak then wait for.
    Raises ValueError, before any run is submitted, when SLURM refuses it."""
    if list((sweep_dir / "cache" / "calibration").glob("*.json")):
        return
    from echobench.executors.slurm import SlurmError, render_calibration_script

    script = sweep_dir / "calibrate.sh"
    script.write_text(render_calibration_script(sweep_dir, matrix.spec.slurm, device))
    (sweep_dir / "logs").mkdir(exist_ok=True)
    try:
        executor.calibration = executor.sbatch(script, "the calibration job")
    except SlurmError as exc:
        raise ValueError(f"{exc}; nothing submitted (or set hardware.peak_tflops in the matrix)") from None
    job = esc(executor.calibration)
    log(console, f"no peak_tflops in the matrix: calibrating once on a compute node (job {job}, "
                 f"log {esc(sweep_dir / 'logs')}/calibrate-{job}.out); the runs without a peak wait for it")


def run_sweep(matrix: Matrix, runs: list[PlannedRun], opts: SweepOptions, console,
              skipped: list[dict] | None = None) -> int:
    """Submits what is missing (or failed, with retry), waits, collects. Returns the exit code:
    0 when every run of the selection is ok, 1 when some failed, 130 on Ctrl-C.
    `skipped` (skipped_entry dicts) goes to SWEEP/skipped.json for the report."""
    sweep_dir = opts.out.resolve()
    if opts.executor == "slurm":
        from echobench.executors.slurm import sbatch_path

        sbatch_path(sweep_dir)  # raises ValueError, before anything is written
    sweep_dir.mkdir(parents=True, exist_ok=True)
    (sweep_dir / "matrix.yaml").write_text(matrix.text)
    write_json_atomic(sweep_dir / "skipped.json", {"matrix": matrix.name, "skipped": skipped or []})
    state = load_state(sweep_dir)
    state.update(matrix=matrix.name, updated=now_iso())
    entries = state["runs"]
    executor = make_executor(opts.executor, matrix)
    by_id = {r.id: r for r in runs}
    dirs = {r.id: run_dir(sweep_dir, r.id) for r in runs}

    to_submit, tracked, failed_before = [], [], []
    for run in runs:
        st = run_state(run.cfg, dirs[run.id], entries.get(run.id), executor)
        if st == "new":
            to_submit.append(run)
        elif st in ACTIVE:
            tracked.append(run.id)
        elif st != "ok":
            (to_submit if opts.retry_failed else failed_before).append(run)
            if st == "corrupt":
                log(console, f"{run.id}: [red]{esc(record_state(dirs[run.id])[2])}[/]"
                             + ("" if opts.retry_failed else " (--retry-failed reruns it; the file moves to attempts/)"))
    save_state(sweep_dir, state)
    done = len(runs) - len(to_submit) - len(tracked) - len(failed_before)
    log(console, f"{matrix.name}: {len(runs)} runs: {done} ok already, {len(tracked)} in progress, "
                 f"{len(to_submit)} to run" + (f", {len(failed_before)} failed earlier (not rerun: --retry-failed)"
                                              if failed_before else "") + f" -> {esc(sweep_dir)}")
    if no_peak := [r for r in to_submit if r.cfg.peak_tflops is None]:
        devices = {r.cfg.device for r in no_peak}
        device = devices.pop() if len(devices) == 1 else "auto"
        if opts.executor == "local":
            executor.env.update(calibrate_once(sweep_dir, console, device))
        elif any(planned_peak(r, matrix)[0] is None for r in no_peak):  # hardware.device in the table needs none
            calibrate_on_slurm(sweep_dir, matrix, executor, console, device)

    def submit(run: PlannedRun) -> None:
        rd = dirs[run.id]
        entry = entries.get(run.id, {})
        attempt = entry.get("attempt", 0) + 1
        archive_attempt(rd, attempt - 1)
        write_run_files(run, rd, matrix, opts.executor)
        entries[run.id] = {"executor": opts.executor, "attempt": attempt, "submitted": now_iso(), "state": "pending"}
        try:
            job_id = executor.submit(run, rd, time_limit_s(matrix, opts.executor, run))
        except Exception as exc:  # noqa: BLE001 - a rejected submission becomes this run's record
            record = finish_without_record(run.cfg, rd, "error", f"submission failed: {exc}")
            entries[run.id].update(settled=True, state=record.status)
            log(console, f"{run.id}: [red]not submitted[/]: {esc(exc)}")
        else:
            entries[run.id]["job_id"] = job_id
            tracked.append(run.id)
            log(console, f"{run.id}: submitted as {esc(job_id)}")
        save_state(sweep_dir, state)

    queue = list(to_submit)
    if executor.max_active is None:  # a scheduler: hand it everything now
        while queue:
            submit(queue.pop(0))
    if not opts.wait:
        if queue:
            raise ValueError("--no-wait needs a scheduler: the local executor runs jobs in this process")
        log(console, f"submitted; follow with: echobench status {esc(sweep_dir)}")
        return 0

    poll_s = opts.poll_s or (1.0 if opts.executor == "local" else 5.0)
    interrupted = False
    with Progress(console) as progress:
        try:
            while queue or tracked:
                while queue and len(tracked) < executor.max_active:
                    submit(queue.pop(0))
                for rid in list(tracked):
                    before = entries[rid].get("state")
                    st = settle(by_id[rid].cfg, dirs[rid], entries[rid], executor)
                    if st not in ACTIVE:
                        tracked.remove(rid)
                        note = "" if st == "ok" else f": {esc(record_state(dirs[rid])[2][:300])}"
                        log(console, f"{rid}: [{'green' if st == 'ok' else 'red'}]{esc(st)}[/]{note}")
                    elif st != before:
                        log(console, f"{rid}: {esc(st)}")
                save_state(sweep_dir, state)
                rows = [(r.id, entries.get(r.id, {}).get("state", "queued"), entries.get(r.id, {}).get("detail", ""))
                        for r in runs]
                progress.update(rows)
                if queue or tracked:
                    time.sleep(poll_s)
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:
        for job_id in executor.cancel_all():
            rid = next(r for r in tracked if entries[r].get("job_id") == job_id)
            finish_without_record(by_id[rid].cfg, dirs[rid], "cancelled", "interrupted (Ctrl-C) while running")
            entries[rid].update(settled=True, state="cancelled")
        save_state(sweep_dir, state)
        log(console, "interrupted: finished results are kept" + (f"; {esc(executor.detach_message())}"
                                                               if executor.detach_message() else ""))
    statuses = collect(sweep_dir, [dirs[r.id] for r in runs], console)
    if interrupted:
        return 130
    return 0 if all(statuses.get(r.id) == "ok" for r in runs) else 1


def collect(sweep_dir: Path, run_dirs: list[Path], console) -> dict[str, str]:
    """One table of the runs' current records -> SWEEP/results.csv and .parquet."""
    records, problems = load_records([d / "result.json" for d in run_dirs if (d / "result.json").exists()])
    for p in problems:
        log(console, f"[yellow]skipped a corrupt record[/]: {esc(p)}")
    if records:
        paths = export_table(records_frame(records), sweep_dir)
        log(console, f"results: {esc(', '.join(str(p) for p in paths))}")
    return {r.run_id: r.status for r in records}


# ---- status ----

def sweep_runs(sweep_dir: Path) -> list[tuple[str, RunConfig | None, Path]]:
    """Every run directory of a sweep (those with a run.yaml), in sweep.json order first."""
    state = load_state(sweep_dir)
    ids = list(state["runs"])
    ids += sorted(p.parent.name for p in sweep_dir.glob("*/run.yaml") if p.parent.name not in ids)
    out = []
    for rid in ids:
        try:
            rd = run_dir(sweep_dir, rid)
            cfg = RunConfig.from_dict(yaml.safe_load((rd / "run.yaml").read_text()))
        except (OSError, ValueError, TypeError, yaml.YAMLError):
            cfg, rd = None, sweep_dir / rid
        out.append((rid, cfg, rd))
    return out


def refresh_status(sweep_dir: Path) -> list[dict]:
    """The state of every run, refreshed from the scheduler; settles jobs that are over."""
    sweep_dir = sweep_dir.resolve()
    state = load_state(sweep_dir)
    executors: dict[str, object] = {}
    rows = []
    for rid, cfg, rd in sweep_runs(sweep_dir):
        entry = state["runs"].get(rid)
        if cfg is None:
            rows.append({"run_id": rid, "state": "unreadable", "error": f"{rd / 'run.yaml'} is missing or invalid"})
            continue
        name = (entry or {}).get("executor", "local")
        executor = executors.setdefault(name, make_executor(name))
        st = run_state(cfg, rd, entry, executor)
        _, record, error = record_state(rd)
        rows.append({"run_id": rid, "state": st, "job_id": (entry or {}).get("job_id"),
                     "attempt": (entry or {}).get("attempt"),
                     **{k: getattr(record, k, None) for k in ("step_time_s", "samples_per_s", "mfu", "peak_mem_gib")},
                     "error": error or ((entry or {}).get("detail") if st in ACTIVE else "")})
    if state["runs"]:
        save_state(sweep_dir, state)
    return rows
