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

from echobench.executors import JobState

KILL_GRACE_S = 10


def source_root() -> Path:
    return Path(__file__).resolve().parent.parent.parent


def render_local_script(cfg, run_dir: Path, python: str | None = None) -> str:
    q = shlex.quote
    python = python or sys.executable
    run_dir = run_dir.resolve()
    return "\n".join([
        "#!/bin/bash",
        f"# echobench run {run_dir.name}: written by `echobench sweep --executor local`.",
        "set -euo pipefail",
        f"RUN_DIR={q(str(run_dir))}",
        f"export PYTHONPATH={q(str(source_root()))}${{PYTHONPATH:+:$PYTHONPATH}}",
        'echo "running local $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"',
        "set +e",
        f'{q(python)} -m echobench run --config "$RUN_DIR/run.yaml" --out "$RUN_DIR" --nproc {int(cfg.gpus_per_node)}',
        "rc=$?",
        "set -e",
        'echo "exited local $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"',
        "exit $rc",
        "",
    ])


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the job's process group, then SIGKILL what is left after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            # The leader is gone; make sure no worker of its group is left either.
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def job_alive(job_id: str, run_dir: Path) -> bool:
    """Whether local job `local-PID` still runs this run's job.sh (a pid may be reused)."""
    try:
        pid = int(job_id.removeprefix("local-"))
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (ValueError, OSError):
        return False
    return str(run_dir / "job.sh").encode() in cmdline


class LocalExecutor:
    name = "local"
    max_active = 1  # one run at a time: runs on one machine must not share it

    def __init__(self, env: dict | None = None):
        self.env = env or {}
        self.jobs: dict[str, tuple[subprocess.Popen, float, int]] = {}

    def submit(self, run, run_dir: Path, time_limit_s: int) -> str:
        log = open(run_dir / "logs" / "local.log", "ab")
        env = {**os.environ, **self.env}
        proc = subprocess.Popen(["bash", str(run_dir / "job.sh")], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        job_id = f"local-{proc.pid}"
        self.jobs[job_id] = (proc, time.monotonic() + time_limit_s, time_limit_s)
        return job_id

    def state(self, job_id: str, run_dir: Path) -> JobState:
        if job_id not in self.jobs:
            if job_alive(job_id, run_dir):  # run by another sweep process that is still going
                return JobState("running", "run by another echobench process")
            return JobState("gone", "the local sweep that ran it stopped before it finished")
        proc, deadline, limit = self.jobs[job_id]
        code = proc.poll()
        if code is not None:
            del self.jobs[job_id]
            return JobState("exited", f"job exited with code {code}", code)
        if time.monotonic() > deadline:
            stop_group(proc)
            del self.jobs[job_id]
            return JobState("timeout", f"local time limit of {limit} s exceeded: stopped")
        return JobState("running")

    def cancel_all(self) -> list[str]:
        """Ctrl-C: stop every running job; returns their ids."""
        stopped = list(self.jobs)
        for proc, _, _ in self.jobs.values():
            stop_group(proc)
        self.jobs.clear()
        return stopped

    def detach_message(self) -> str:
        return ""
