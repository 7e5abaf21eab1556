"""The local executor: each run's job.sh (`echobench run --nproc N`, i.e. torchrun) on this
machine, one run after another, with a per-run time limit. Each job runs in its own session,
so a time-limit kill or Ctrl-C stops the whole process tree: launcher, torchrun, workers."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from echobench.records.console import esc
from echobench.sweep.estimate import time_limit_s
from echobench.sweep.executors import JobState, calibrated, comm_command, comm_size, sweep_cache
from echobench.records.paths import comm_calibrated
from echobench.records.states import RunState
from echobench.train.launch import source_root, with_source_path

KILL_GRACE_S = 30


def render_local_script(cfg, run_dir: Path) -> str:
    q = shlex.quote
    run_dir = run_dir.resolve()
    return "\n".join([
        "#!/bin/bash",
        f"# echobench run {run_dir.name}: written by `echobench sweep --executor local`.",
        "set -euo pipefail",
        f"RUN_DIR={q(str(run_dir))}",
        f"export PYTHONPATH={q(str(source_root()))}${{PYTHONPATH:+:$PYTHONPATH}}",
        'echo "running local $(date -u +%Y-%m-%dT%H:%M:%SZ)" | tee "$RUN_DIR/job-state"  # the log\'s first line',
        "set +e",
        f'{q(sys.executable)} -m echobench run --config "$RUN_DIR/run.yaml" --out "$RUN_DIR" --nproc {int(cfg.gpus_per_node)}',
        "rc=$?",
        "set -e",
        'echo "exited local $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"',
        "exit $rc",
        "",
    ])


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (a run directory: unique to one run)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def stop_group(proc: subprocess.Popen, run_dir: Path) -> None:
    """SIGTERM the job's process group and give torchrun time to stop its workers (they run in
    sessions of their own); then SIGKILL whatever of the run is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or the group never looks empty
        if not group_alive(proc.pid):
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for pid in processes_mentioning(str(run_dir)):  # workers orphaned by a SIGKILLed torchrun
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def job_alive(job_id: str, run_dir: Path) -> bool:
    """Whether local job `local-PID` still runs this run's job.sh (a pid may be reused)."""
    try:
        pid = int(job_id.removeprefix("local-"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (ValueError, OSError):
        return False
    return str(run_dir / "job.sh").encode() in cmdline


def calibrate_here(sweep_dir: Path, device: str, log) -> Path:
    """`echobench calibrate` on this machine, once per sweep: its GEMM rate into SWEEP/cache, the
    peak of runs without one (CPU devices have no datasheet peak). Returns the cache directory."""
    cache = sweep_cache(sweep_dir)
    if calibrated(sweep_dir):
        return cache
    log("no peak_tflops in the matrix: running `echobench calibrate` once for this sweep")
    env = with_source_path({**os.environ, "ECHOBENCH_CACHE": str(cache)})
    with open(sweep_dir / "calibrate.log", "w") as out:
        code = subprocess.call([sys.executable, "-m", "echobench", "calibrate", "--device", device], stdout=out,
                               stderr=subprocess.STDOUT, env=env)
    if code != 0:
        log(f"[red]calibration failed[/] (see {esc(sweep_dir / 'calibrate.log')}); runs without a peak will fail")
    return cache


def calibrate_comm_here(sweep_dir: Path, matrix, runs, device: str, env: dict, log) -> None:
    """`echobench calibrate --comm` on this machine, once per sweep, on as many processes as the
    largest run has (one: in one process), within local.time: the sweep's hardware profile into
    SWEEP/profile.yaml and SWEEP/cache, its output in SWEEP/calibrate-comm.log. A failure, a time-limit
    kill included, is said in one line and the runs go on; Ctrl-C stops it and goes on up (the sweep
    is interrupted before any run, as during the GEMM calibration)."""
    if comm_calibrated(sweep_dir):
        return
    nproc, limit, out = comm_size(runs)[1], time_limit_s(matrix, "local"), sweep_dir / "calibrate-comm.log"
    log(f"hardware.calibrate_comm: measuring a hardware profile once on {nproc} process(es) "
        f"(`echobench calibrate --comm`, log {esc(out)})")
    cmd = [sys.executable, "-m", "echobench", "calibrate", "--comm", "--nproc", str(nproc),
           *comm_command(sweep_dir, matrix, device)]
    # The cache of the runs' own calibration: calibrated_profile_path lands in the sweep too.
    env = with_source_path({**os.environ, **env, "ECHOBENCH_CACHE": str(sweep_cache(sweep_dir))})
    with open(out, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)  # its own group: a kill reaches torchrun's workers
    try:
        why = f"exited with code {proc.wait(timeout=limit)}"
    except subprocess.TimeoutExpired:
        stop_group(proc, sweep_dir / "profile.yaml")  # the workers' command lines name the profile's path
        why = f"was stopped at the local time limit ({limit} s)"
    except KeyboardInterrupt:
        stop_group(proc, sweep_dir / "profile.yaml")
        raise
    if not comm_calibrated(sweep_dir):
        log(f"[red]hardware profile not measured[/]: `echobench calibrate --comm` {esc(why)} (see {esc(out)}); "
            f"the runs go on without it")


class LocalExecutor:
    name = "local"
    max_active = 1  # one run at a time: runs on one machine must not share it
    poll_s = 1.0

    def __init__(self, env: dict | None = None):
        self.env = env or {}
        self.jobs: dict[str, tuple[subprocess.Popen, float, int, Path]] = {}

    def check_dir(self, sweep_dir: Path) -> None:
        pass  # any directory: the scripts quote its path

    def job_script(self, run, run_dir: Path, matrix, time_limit: str, log: Path | None = None) -> str:
        return render_local_script(run.cfg, run_dir)  # the time limit is kept by this process (state); log: local.log

    def calibrate(self, sweep_dir: Path, matrix, device: str, log) -> None:
        self.env["ECHOBENCH_CACHE"] = str(calibrate_here(sweep_dir, device, log))

    def calibrate_comm(self, sweep_dir: Path, matrix, runs, device: str, log, previous: str | None = None) -> None:
        calibrate_comm_here(sweep_dir, matrix, runs, device, self.env, log)  # done here: nothing left pending

    def submit(self, run, run_dir: Path, time_limit_s: int) -> str:
        log = open(run_dir / "logs" / "local.log", "ab")
        env = {**os.environ, **self.env}
        proc = subprocess.Popen(["bash", str(run_dir / "job.sh")], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        job_id = f"local-{proc.pid}"
        self.jobs[job_id] = (proc, time.monotonic() + time_limit_s, time_limit_s, run_dir)
        return job_id

    def state(self, job_id: str, run_dir: Path) -> JobState:
        if job_id not in self.jobs:
            if job_alive(job_id, run_dir):  # run by another sweep process that is still going
                return JobState(RunState.RUNNING, "run by another echobench process")
            return JobState(RunState.GONE, "the local sweep that ran it stopped before it finished")
        proc, deadline, limit, _ = self.jobs[job_id]
        code = proc.poll()
        if code is not None:
            del self.jobs[job_id]
            return JobState(RunState.EXITED, f"job exited with code {code}", code)
        if time.monotonic() > deadline:
            stop_group(proc, run_dir)
            del self.jobs[job_id]
            return JobState(RunState.TIMEOUT, f"local time limit of {limit} s exceeded: stopped")
        return JobState(RunState.RUNNING)

    def cancel_all(self) -> list[str]:
        """Ctrl-C: stop every running job; returns their ids."""
        stopped = list(self.jobs)
        for proc, _, _, run_dir in self.jobs.values():
            stop_group(proc, run_dir)
        self.jobs.clear()
        return stopped

    def detach_message(self) -> str:
        return ""
