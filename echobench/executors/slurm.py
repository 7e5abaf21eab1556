"""The SLURM executor: one sbatch script per run, submitted with `sbatch --parsable`.

The script asks for N nodes with one task each and starts one launcher per node with srun:
`echobench run --nproc GPUS --nnodes N --node-rank $SLURM_NODEID --master-addr FIRST_HOST`,
which runs torchrun there; node 0's launcher assembles the record. Every value from the matrix
that reaches the script is validated (echobench.matrix) and quoted here (shlex.quote); per-node
values reach the srun'd command as arguments, never as code.

A job is tracked by its own status file first (RUN_DIR/job-state), then by sacct where
accounting exists, then by scontrol, then squeue. A job that ended without a record (TIMEOUT,
CANCELLED, NODE_FAIL, OUT_OF_MEMORY, or a crash before the benchmark) gets one from the sweep.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

from echobench.executors import JobState, calibrated, sweep_cache
from echobench.launch import source_root
from echobench.matrix import parse_time
from echobench.peaks import table_peak

# Scheduler states -> record statuses, for a job that is over.
ENDED = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "CANCELLED": "cancelled",
    "PREEMPTED": "cancelled",
    "REVOKED": "cancelled",
    "NODE_FAIL": "node_fail",
    "BOOT_FAIL": "node_fail",
    "OUT_OF_MEMORY": "oom",
    "FAILED": "error",
    "COMPLETED": "error",  # completed without a record of its own
    "SPECIAL_EXIT": "error",
}
PENDING = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "CONFIGURING", "SUSPENDED",
           "STOPPED", "RESIZING"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}

# Shared by every rendered job.sh and scripts/run.sh (a test keeps them identical).
LAUNCH_BODY = r"""MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
mkdir -p "$RUN_DIR"
echo "running $SLURM_JOB_ID $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
set +e
# One launcher per node; each takes its node rank from SLURM_NODEID (not from host names).
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
  'exec "$0" -m echobench run --config "$1" --out "$2" --nproc "$3" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --master-addr "$4" --master-port "$5"' \
  "$PYTHON" "$RUN_CONFIG" "$RUN_DIR" "$NPROC" "$MASTER_ADDR" "$MASTER_PORT"
rc=$?
set -e
echo "exited $SLURM_JOB_ID $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
exit $rc
"""

SAFE_PATH_RE = r"^/[A-Za-z0-9_./+-]+$"  # paths in #SBATCH lines are not shell-quoted by sbatch


def sbatch_path(path: Path) -> str:
    text = str(path.resolve())
    if not re.fullmatch(SAFE_PATH_RE, text):
        raise ValueError(f"the sweep directory {text!r} goes into #SBATCH lines: use a path of letters, digits "
                         f"and . _ + - / only")
    return text


def sbatch_header(slurm, job_name: str, nodes: int, gpus_per_node: int, log: str) -> list[str]:
    """The #SBATCH lines of a job: one task per node, the matrix's SLURM settings. `log` is a
    path checked by sbatch_path, with SLURM's %j."""
    head = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={int(nodes)}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --time={slurm.time}",
        f"#SBATCH --output={log}",
        # A requeue (SLURM's default after a node failure) reruns the job under the same id and
        # truncates its log: no requeue; the run ends as node_fail and --retry-failed reruns it.
        "#SBATCH --no-requeue",
    ]
    if slurm.request_gpus:
        head.append(f"#SBATCH --gpus-per-node={int(gpus_per_node)}")
    if slurm.cpus_per_task:
        head.append(f"#SBATCH --cpus-per-task={int(slurm.cpus_per_task)}")
    if slurm.mem is not None:
        head.append(f"#SBATCH --mem={slurm.mem}")
    if slurm.exclusive:
        head.append("#SBATCH --exclusive")
    for key in ("partition", "account", "qos", "constraint"):
        if (value := getattr(slurm, key)) is not None:
            head.append(f"#SBATCH --{key}={value}")
    return head + [f"#SBATCH {line}" for line in slurm.extra]


def job_environment(slurm) -> list[str]:
    """PYTHON, PYTHONPATH, the matrix's env (quoted) and its setup lines (as written)."""
    q = shlex.quote
    lines = [f"PYTHON={q(slurm.python or sys.executable)}",
             f"export PYTHONPATH={q(str(source_root()))}${{PYTHONPATH:+:$PYTHONPATH}}"]
    lines += [f"export {key}={q(value)}" for key, value in slurm.env.items()]
    if slurm.setup:
        lines += ["# setup (from the matrix)", *slurm.setup]
    return lines


def render_script(cfg, run_dir: Path, slurm) -> str:
    """The exact sbatch script for one run. `slurm` is the matrix's SlurmSettings."""
    q = shlex.quote
    rid = run_dir.name
    head = sbatch_header(slurm, f"eb-{rid}", cfg.nodes, cfg.gpus_per_node, f"{sbatch_path(run_dir)}/logs/slurm-%j.out")
    body = [
        "",
        f"# echobench run {rid}: written by `echobench sweep`. By hand: sbatch THIS_FILE [RUN.yaml]",
        "set -euo pipefail",
        f"RUN_DIR={q(str(run_dir.resolve()))}",
        'RUN_CONFIG=${1:-$RUN_DIR/run.yaml}',
        f"NPROC={int(cfg.gpus_per_node)}",
        f"MASTER_PORT=$(( {int(slurm.master_port)} + SLURM_JOB_ID % 10000 ))  # jobs sharing a node need their own",
        *job_environment(slurm),
    ]
    return "\n".join(head + body) + "\n" + LAUNCH_BODY


def render_calibration_script(sweep_dir: Path, slurm, device: str = "auto") -> str:
    """A one-node job that measures the nodes' GEMM rate into SWEEP/cache (`echobench
    calibrate`): runs without a peak read it there (ECHOBENCH_CACHE in their scripts)."""
    q = shlex.quote
    path = sbatch_path(sweep_dir)
    # Calibration takes a minute: ask for at most 10 so that it is scheduled early.
    slurm = slurm.model_copy(update={"time": slurm.time if parse_time(slurm.time) <= 600 else "10"})
    head = sbatch_header(slurm, f"eb-calibrate-{sweep_dir.name}", 1, 1, f"{path}/logs/calibrate-%j.out")
    body = ["", "# echobench: the sweep's one calibration on a compute node, before its runs",
            "set -euo pipefail", *job_environment(slurm), f"export ECHOBENCH_CACHE={q(str(sweep_cache(sweep_dir)))}",
            f'exec "$PYTHON" -m echobench calibrate --device {q(device)}']
    return "\n".join(head + body) + "\n"


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


class SlurmError(RuntimeError):
    pass


class SlurmExecutor:
    name = "slurm"
    max_active = None  # the scheduler queues them
    poll_s = 5.0

    def __init__(self):
        self.accounting: bool | None = None  # unknown until sacct has been tried
        self.calibration: str | None = None  # the sweep's calibration job: runs without a peak wait for it

    def check_dir(self, sweep_dir: Path) -> None:
        sbatch_path(sweep_dir)  # the path goes into #SBATCH lines, which sbatch does not unquote

    def job_script(self, run, run_dir: Path, matrix, time_limit: str) -> str:
        env = dict(matrix.spec.slurm.env)
        if run.cfg.peak_tflops is None:  # where the sweep's calibration job writes (calibrate)
            env.setdefault("ECHOBENCH_CACHE", str(sweep_cache(run_dir.parent)))
        return render_script(run.cfg, run_dir, matrix.spec.slurm.model_copy(update={"time": time_limit, "env": env}))

    def calibrate(self, sweep_dir: Path, matrix, device: str, log) -> None:
        """One calibration job on a compute node (the login node's device says nothing about the
        nodes'), which the runs without a peak then wait for; none when hardware.device names a
        device with a datasheet peak, or when the sweep has calibrated already."""
        from echobench.console import esc

        if calibrated(sweep_dir):
            return
        if device_name := matrix.spec.hardware.device:
            if table_peak(device_name):
                return
        script = sweep_dir / "calibrate.sh"
        script.write_text(render_calibration_script(sweep_dir, matrix.spec.slurm, device))
        (sweep_dir / "logs").mkdir(exist_ok=True)
        try:
            self.calibration = self.sbatch(script, "the calibration job")
        except SlurmError as exc:
            raise ValueError(f"{exc}; nothing submitted (or set hardware.peak_tflops in the matrix)") from None
        job = esc(self.calibration)
        log(f"no peak_tflops in the matrix: calibrating once on a compute node (job {job}, "
            f"log {esc(sweep_dir / 'logs')}/calibrate-{job}.out); the runs without a peak wait for it")

    def submit(self, run, run_dir: Path, time_limit_s: int | None = None) -> str:
        # The time limit is in the script (#SBATCH --time).
        return self.sbatch(run_dir / "job.sh", run.id, self.calibration if run.cfg.peak_tflops is None else None)

    def sbatch(self, script: Path, what: str, after: str | None = None) -> str:
        # afterany: the run starts whether or not the calibration worked (a node with a datasheet peak needs none).
        depend = [f"--dependency=afterany:{after}"] if after else []
        try:
            proc = _run(["sbatch", "--parsable", *depend, str(script)])
        except FileNotFoundError:
            raise SlurmError("sbatch not found: is this a SLURM login node? (locally: bash scripts/slurm-local.sh up)")
        if proc.returncode != 0:
            raise SlurmError(f"sbatch rejected {what}: {proc.stderr.strip() or proc.stdout.strip()}")
        job_id = proc.stdout.strip().split(";")[0]  # "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
        return job_id

    # ---- the scheduler's view, most authoritative first ----

    def _sacct(self, job_id: str) -> tuple[str, str] | None:
        if self.accounting is False:
            return None
        try:
            proc = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
        except (FileNotFoundError, subprocess.TimeoutExpired):
            self.accounting = False
            return None
        if proc.returncode != 0:  # "Slurm accounting storage is disabled"
            self.accounting = False
            return None
        self.accounting = True
        line = proc.stdout.strip().splitlines()[:1]
        if not line:
            return None  # not in the database yet
        state, _, code = line[0].partition("|")
        return state.split()[0], f"exit {code}"  # "CANCELLED by 0" -> CANCELLED

    def _scontrol(self, job_id: str) -> tuple[str, str] | None:
        try:
            proc = _run(["scontrol", "show", "job", "-o", job_id])
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return None
        if proc.returncode != 0:
            return None  # "Invalid job id specified": purged after MinJobAge
        fields = dict(re.findall(r"(\w+)=(\S*)", proc.stdout))
        if "JobState" not in fields:
            return None
        return fields["JobState"], f"{fields.get('Reason', '')} exit {fields.get('ExitCode', '?')}".strip()

    def _squeue(self, job_id: str) -> tuple[str, str] | None:
        try:
            proc = _run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T %r"])
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return None
        words = proc.stdout.split()
        if proc.returncode != 0 or not words:
            return None
        return words[0], " ".join(words[1:])

    def scheduler_state(self, job_id: str) -> tuple[str, str] | None:
        return self._sacct(job_id) or self._scontrol(job_id) or self._squeue(job_id)

    def state(self, job_id: str, run_dir: Path) -> JobState:
        from echobench.executors import read_job_state

        own = read_job_state(run_dir, job_id)
        if own is not None and own.state == "exited":
            return own
        seen = self.scheduler_state(job_id)
        if seen is None:
            return JobState("gone", f"SLURM job {job_id} is unknown to the scheduler (purged?) and left no exit status")
        state, detail = seen
        if state in PENDING:
            return JobState("pending", f"{state} {detail}")
        if state in RUNNING:
            return JobState("running", f"{state} {detail}")
        status = ENDED.get(state, "error")
        return JobState(status, f"SLURM job {job_id} ended {state} ({detail})")

    def cancel_all(self) -> list[str]:
        return []  # Ctrl-C while waiting leaves SLURM jobs running (see detach_message)

    def detach_message(self) -> str:
        return "the SLURM jobs keep running: `echobench status DIR` follows them, `scancel` stops them"
