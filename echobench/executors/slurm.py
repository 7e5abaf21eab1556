"""The SLURM executor: one sbatch script per run, submitted with `sbatch --parsable`.

The script asks for N nodes with one task each, checks its first node (echobench.nodecheck) and
starts one launcher per node with srun: `echobench run --nproc GPUS --nnodes N --node-rank
$SLURM_NODEID --master-addr FIRST_HOST`, which runs torchrun there; node 0's launcher assembles the
record. Every srun of a job runs in the matrix's environment (environment_options: a pyxis named
container, the Container Engine's EDF, a uenv, apptainer). The sweep's own jobs (the preflight, the
calibrations) are rendered here too. Every value from the matrix that reaches a script is validated
(echobench.matrix) and quoted here (shlex.quote); per-node values reach the srun'd command as
arguments, never as code.

A job is tracked by its own status file first (RUN_DIR/job-state), then by one batched sacct per
poll where accounting exists, then one batched squeue, each with its pending reason (NEVER_STARTS:
the reasons of a job that can never start). A job that ended without a record (TIMEOUT, CANCELLED,
NODE_FAIL, OUT_OF_MEMORY, or a crash before the benchmark) gets one from the sweep.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from echobench.console import esc
from echobench.executors import (ACTIVE, JobState, SubmitLater, calibrated, comm_calibrated, comm_command, comm_size,
                                 read_job_state, sweep_cache)
from echobench.fabric import fabric_env, left_to_hook
from echobench.launch import source_root
from echobench.matrix import PORT_SPREAD, parse_time
from echobench.nodecheck import backend_imports
from echobench.peaks import table_peak

# Scheduler states -> record statuses, for a job that is over.
ENDED = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "CANCELLED": "cancelled",
    "PREEMPTED": "preempted",  # its own status: the cluster took the nodes back, not the user
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

# The rendezvous host and log settings of a job that starts one launcher per node (runs, the comm calibration).
# sed, not head: head closes the pipe after one line, and under pipefail scontrol's SIGPIPE on a long
# node list would fail the job (exit 141).
NODE_LAUNCH_ENV = r"""MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # logs as they happen; a crash dumps its stack
"""
# The srun that starts one launcher per node, up to `bash -c`: the launcher's command and arguments follow.
SRUN_PER_NODE = r"""srun --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}" --kill-on-bad-exit=1 \
    --wait=60 -l -u ${SRUN_ARGS[@]+"${SRUN_ARGS[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} bash -c \
"""

# Shared by every rendered job.sh and scripts/run.sh (a test keeps them identical).
LAUNCH_BODY = NODE_LAUNCH_ENV + r"""mkdir -p "$RUN_DIR"
echo "running $SLURM_JOB_ID $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
set +e
# First node, before the ranks start (echobench.nodecheck): $PYTHON imports echobench's run path and the run's
# backends (IMPORTS), sees a GPU when the job expects them (EXPECT_GPU=1), has a CPU per process and numactl
# for numa_binding; a wrong environment fails here, in seconds. In a container or uenv the check runs there
# (ON_FIRST_NODE: an srun with the job's environment options).
${ON_FIRST_NODE[@]+"${ON_FIRST_NODE[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} "$PYTHON" -m echobench.nodecheck first \
    --expect-gpu "${EXPECT_GPU:-0}" --nproc "$NPROC" --cpus "${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}" \
    --imports "${IMPORTS:-}"
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "echobench: the first-node check failed (exit $rc): the line above says what and the fix ($PYTHON, from slurm.python or slurm.setup, runs every rank)" >&2
else
  # One launcher per node, with every CPU of the job's task; each takes its node rank from SLURM_NODEID (not
  # from host names). Output labelled by node (-l) and unbuffered (-u); once one launcher has ended, the
  # others get 60 s (--wait) before srun stops them, so a node hanging in teardown does not hold the job.
  # USR1 (SLURM's, before the time limit) is ignored but by the ranks, which dump their stacks on it.
  """ + SRUN_PER_NODE + r"""    'trap "" USR1; exec "$0" -m echobench run --config "$1" --out "$2" --nproc "$3" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --master-addr "$4" --master-port "$5"' \
    "$PYTHON" "$RUN_CONFIG" "$RUN_DIR" "$NPROC" "$MASTER_ADDR" "$MASTER_PORT"
  rc=$?
fi
set -e
echo "exited $SLURM_JOB_ID $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
exit $rc
"""
RUN_YAML_END = "ECHOBENCH_RUN_YAML"  # the heredoc that carries a run's settings in its job script

@dataclass
class Seen:
    """What sacct or squeue said of one job."""
    state: str
    detail: str = ""  # sacct: "exit N:S"
    reason: str = ""  # the pending reason, or why it ended
    nodes: str = ""  # its node list


def said(word: str) -> bool:
    """Whether a field of SLURM's says anything: it prints None (or nothing) where it has no reason."""
    return bool(word) and word not in ("None", "(null)", "n/a")


def hostlist(nodes: str) -> list[str]:
    """A SLURM node list (node[1-3],gpu07) as names; the list as given where scontrol cannot expand it."""
    try:
        proc = _run(["scontrol", "show", "hostnames", nodes], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return [nodes]
    return proc.stdout.split() or [nodes]


# Pending reasons of a job that can never start as it is (its own size, the account's used-up budget),
# each with its fix. Others pass with time (Priority, Resources, ReqNodeNotAvail, and the group limits
# on what runs at once, AssocGrpGRES & co, while the group's other jobs run): shown, waited for.
NEVER_STARTS = [
    (r"BadConstraints", "no node has all the job asks for (slurm.constraint, gpus_per_node, mem, cpus): compare "
                        "with sinfo -o '%N %f %G %c %m'"),
    (r"PartitionNodeLimit", "more nodes than the partition allows one job, or than it has up (scontrol show "
                            "partition): fewer nodes, or another slurm.partition"),
    (r"PartitionTimeLimit", "a time limit over the partition's MaxTime: lower slurm.time"),
    (r"(?:QOS|Assoc)Max\w*PerJob\w*", "more than the QOS or account allows one job (sacctmgr show qos, sacctmgr "
                                       "show assoc): fewer nodes, GPUs or time, or another slurm.qos"),
    (r"QOSMin\w+", "less than the QOS's minimum for one job: ask for more, or another slurm.qos"),
    (r"(?:QOS|Assoc)Grp(?!\w*Run)\w*Minutes\w*", "the account's or QOS's budget of minutes is used up (sshare): "
                                                  "another slurm.account, or more budget"),
    (r"InvalidAccount|InvalidQOS|AccountNotAllowed|QOSNotAllowed", "the account or qos is not valid for you there: "
                                                                  "fix slurm.account / slurm.qos"),
    (r"DependencyNeverSatisfied", "a job it waits for failed and the cluster keeps such jobs: see that job's log"),
]


def never_starts(reason: str) -> str | None:
    """The fix, when a pending reason says the job can never start as it is; None otherwise."""
    return next((fix for pattern, fix in NEVER_STARTS if re.fullmatch(pattern, reason or "")), None)


SAFE_PATH_RE = r"^/[A-Za-z0-9_./+-]+$"  # paths in #SBATCH lines are not shell-quoted by sbatch


def sbatch_path(path: Path) -> str:
    text = str(path.resolve())
    if not re.fullmatch(SAFE_PATH_RE, text):
        raise ValueError(f"the sweep directory {text!r} goes into #SBATCH lines: use a path of letters, digits "
                         f"and . _ + - / only")
    return text


def cpus_per_task(slurm, gpus_per_node: int) -> int | None:
    """CPUs of each node's one task, which starts every rank of the node: the matrix's cpus_per_task,
    else cpus_per_gpu per GPU when GPUs are requested, else one per process (CPU runs); none with
    exclusive, which has the node's CPUs already. Without it sbatch gives the task one CPU."""
    if slurm.cpus_per_task:
        return int(slurm.cpus_per_task)
    if slurm.exclusive:
        return None
    return int(slurm.cpus_per_gpu if slurm.request_gpus else 1) * int(gpus_per_node)


def stack_signal_lead_s(time_limit: str) -> int:
    """How long before the time limit SLURM sends the ranks USR1, on which each dumps its stacks: 2
    minutes, a third of a short limit. (The controller checks limits every 30 s or so: it lands up to
    that much later.)"""
    return max(10, min(120, parse_time(time_limit) // 3))


def sbatch_header(slurm, job_name: str, nodes: int, gpus_per_node: int, log: str, stack_signal: bool = False) -> list[str]:
    """The #SBATCH lines of a job: one task per node, the matrix's SLURM settings. `log` is a
    path checked by sbatch_path, with SLURM's %j. `stack_signal`: a run's job, whose ranks dump
    their stacks on USR1 before the time limit (echobench.launch.on_stack_signal)."""
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
    if stack_signal:  # no B: the job's steps get it (every process of the launch), not the batch shell
        head.append(f"#SBATCH --signal=USR1@{stack_signal_lead_s(slurm.time)}")
    if slurm.request_gpus:
        head.append(f"#SBATCH --gpus-per-node={int(gpus_per_node)}")
    if cpus := cpus_per_task(slurm, gpus_per_node):
        head.append(f"#SBATCH --cpus-per-task={cpus}")
    if slurm.mem is not None:
        head.append(f"#SBATCH --mem={slurm.mem}")
    if slurm.exclusive:
        head.append("#SBATCH --exclusive")
    for key in ("partition", "account", "qos", "constraint"):
        if (value := getattr(slurm, key)) is not None:
            head.append(f"#SBATCH --{key}={value}")
    return head + [f"#SBATCH {sbatch_option(option)}" for option in slurm.extra]


def sbatch_option(option: str) -> str:
    """One --name[=value] for a #SBATCH line. sbatch splits the line at spaces, ends it at an
    unquoted # and reads "..." with \\ and \" inside: the value goes in double quotes (bash never
    reads the line, it is a comment to bash)."""
    name, eq, value = option.partition("=")
    if not eq or re.fullmatch(r"[A-Za-z0-9_.,:+/@%=-]+", value):  # nothing sbatch would read otherwise
        return option
    return name + '="' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def bash_array(name: str, words: list[str]) -> str:
    return f"{name}=({' '.join(shlex.quote(w) for w in words)})"


def container_mounts(container, cfg, sweep_dir: Path) -> list[str]:
    """The matrix's mounts, then the sweep directory, echobench's source and the run's data
    directory at their own paths (what the ranks read and write), each once."""
    mounts = list(container.mounts)
    own = [str(sweep_dir.resolve()), str(source_root())]
    if cfg is not None and cfg.data != "synthetic":
        own.append(str(Path(cfg.data).resolve()))
    taken = {m.split(":", 1)[0] for m in mounts}
    return mounts + [p for p in dict.fromkeys(own) if p not in taken]


def pyxis_name(image: str) -> str:
    """The name pyxis keeps a job's container under: the first srun on a node imports the image, the
    job's later sruns there reuse it (pyxis removes named containers at the job's end by default)."""
    return "echobench-" + hashlib.sha256(image.encode()).hexdigest()[:12]


def environment_options(slurm, cfg, sweep_dir: Path) -> tuple[list[str], list[str]]:
    """(srun options that put a step in the job's environment, the command it runs under): pyxis's
    container options (a named container: imported once per node and job), the Container Engine's
    --environment=EDF, uenv's --uenv / --view; apptainer's `apptainer exec ... IMAGE` prefix."""
    if u := slurm.uenv:
        return [f"--uenv={u.image}", *([f"--view={u.view}"] if u.view else [])], []
    c = slurm.container
    if c is None:
        return [], []
    if c.runtime == "ce":
        return [f"--environment={c.image}"], []
    mounts = container_mounts(c, cfg, sweep_dir)
    if c.runtime == "pyxis":
        return [f"--container-image={c.image}", f"--container-name={pyxis_name(c.image)}",
                f"--container-mounts={','.join(mounts)}", *([f"--container-workdir={c.workdir}"] if c.workdir else []),
                *(["--container-writable"] if c.writable else [])], []
    wrap = ["apptainer", "exec", "--nv", "--bind", ",".join(mounts)]
    wrap += ["--pwd", c.workdir] if c.workdir else []
    wrap += ["--writable-tmpfs"] if c.writable else []
    return [], [*wrap, c.image]


def launch_arrays(slurm, cfg, sweep_dir: Path) -> list[str]:
    """SRUN_ARGS (the matrix's srun_args and the environment's options), IN_CONTAINER (the
    apptainer command the ranks run under) and ON_FIRST_NODE (the srun that runs a check on the first
    node inside the container or uenv): bash arrays, every word quoted."""
    into, wrap = environment_options(slurm, cfg, sweep_dir)
    srun_args = [*slurm.srun_args, *into]
    first = ["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", *srun_args] if (into or wrap) else []
    lines = [bash_array("SRUN_ARGS", srun_args), bash_array("IN_CONTAINER", wrap), bash_array("ON_FIRST_NODE", first)]
    if c := slurm.container:  # the record's env.container
        lines.append(f"export ECHOBENCH_CONTAINER_IMAGE={shlex.quote(c.image)}")
    return lines


def job_environment(slurm) -> list[str]:
    """PYTHON, PYTHONPATH, the fabric profile and the matrix's env (quoted), and its setup lines (as
    written, without `set -eu`: Lmod's `module` reads unset variables; each line's failure ends the
    job with its number). A setup line that activates another environment (VIRTUAL_ENV or
    CONDA_PREFIX changes) decides the interpreter, unless slurm.python names one."""
    q = shlex.quote
    # In a container or uenv the interpreter is the image's, not the one running the sweep.
    python = slurm.python or ("python3" if slurm.container or slurm.uenv else sys.executable)
    runtime = slurm.container.runtime if slurm.container else None
    lines = [f"PYTHON={q(python)}",
             f"export PYTHONPATH={q(str(source_root()))}${{PYTHONPATH:+:$PYTHONPATH}}"]
    if hooked := left_to_hook(slurm.fabric, slurm.env, runtime):
        lines.append(f"# fabric {slurm.fabric}: {' '.join(hooked)} left to the Container Engine's aws-ofi-nccl hook")
    lines += [f"export {key}={q(value)}" for key, value in fabric_env(slurm.fabric, slurm.env, runtime).items()]
    if slurm.fabric:  # the launcher adds what only the node knows (launch.child_env: fabric.launch_env)
        lines.append(f"export ECHOBENCH_FABRIC={q(slurm.fabric)}")
    if slurm.numa_binding:
        lines.append(f"export ECHOBENCH_NUMA_BINDING={q(slurm.numa_binding)}")
    if slurm.setup:
        lines += ["# setup (from the matrix)", 'eb_env_before="${VIRTUAL_ENV:-}|${CONDA_PREFIX:-}"', "set +eu"]
        for n, line in enumerate(slurm.setup, 1):
            lines += [line, f'eb_rc=$?; if [ "$eb_rc" -ne 0 ]; then echo "echobench: setup line {n} failed '
                            f'(exit $eb_rc): "{q(line)} >&2; exit "$eb_rc"; fi']
        lines.append("set -eu")
        if not slurm.python:
            lines.append('if [ "${VIRTUAL_ENV:-}|${CONDA_PREFIX:-}" != "$eb_env_before" ]; then '
                         'PYTHON=$(command -v python3 || command -v python); fi')
    return lines


def run_yaml_lines(cfg) -> list[str]:
    """Lines that write RUN_DIR/run.yaml where it is missing (a script from `plan --write-scripts`,
    submitted by hand): the run's settings, in a quoted heredoc (nothing in it is expanded)."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    assert RUN_YAML_END not in text.splitlines()  # safe_dump starts every top-level line with a key
    return ['if [ ! -e "$RUN_DIR/run.yaml" ]; then  # the run\'s settings (the sweep writes the same file)',
            '  mkdir -p "$RUN_DIR"', f"  cat >\"$RUN_DIR/run.yaml\" <<'{RUN_YAML_END}'", *text.splitlines(),
            RUN_YAML_END, "fi"]


def render_script(cfg, run_dir: Path, slurm, log: Path | None = None) -> str:
    """The exact sbatch script for one run. `slurm` is the matrix's SlurmSettings; `log`, SLURM's
    --output (with %j), a file in a directory that exists when it is submitted: RUN_DIR/logs by default
    (the sweep makes it), elsewhere for scripts written to be submitted by hand."""
    q = shlex.quote
    rid = run_dir.name
    log = log or run_dir / "logs" / "slurm-%j.out"
    head = sbatch_header(slurm, f"eb-{rid}", cfg.nodes, cfg.gpus_per_node, f"{sbatch_path(log.parent)}/{log.name}",
                         stack_signal=True)
    expect_gpu = int(cfg.device == "cuda" or (slurm.request_gpus and cfg.device != "cpu"))
    body = [
        "",
        f"# echobench run {rid}: written by `echobench sweep`. By hand: sbatch THIS_FILE [RUN.yaml]",
        "set -euo pipefail",
        f"RUN_DIR={q(str(run_dir.resolve()))}",
        'RUN_CONFIG=${1:-$RUN_DIR/run.yaml}',
        f"NPROC={int(cfg.gpus_per_node)}",
        f"EXPECT_GPU={expect_gpu}",
        f"IMPORTS={q(','.join(backend_imports(cfg.framework, cfg.te, cfg.precision)))}",
        # Jobs sharing a node need their own port; the range stays below the ephemeral ports (matrix.EPHEMERAL).
        f"MASTER_PORT=$(( {int(slurm.master_port)} + SLURM_JOB_ID % {PORT_SPREAD} ))",
        *job_environment(slurm),
        *launch_arrays(slurm, cfg, run_dir.parent),
        *run_yaml_lines(cfg),
    ]
    return "\n".join(head + body) + "\n" + LAUNCH_BODY


def calibration_time(slurm, seconds: int = 600):
    """The matrix's SLURM settings with a calibration job's time limit: `seconds` (in minutes), at most
    slurm.time. A calibration takes a minute or two: a short request is scheduled early."""
    return slurm.model_copy(update={"time": slurm.time if parse_time(slurm.time) <= seconds
                                    else str(math.ceil(seconds / 60))})


def render_calibration_script(sweep_dir: Path, slurm, device: str = "auto") -> str:
    """A one-node job that measures the nodes' GEMM rate into SWEEP/cache (`echobench
    calibrate`): runs without a peak read it there (ECHOBENCH_CACHE in their scripts)."""
    q = shlex.quote
    path = sbatch_path(sweep_dir)
    slurm = calibration_time(slurm)
    head = sbatch_header(slurm, f"eb-calibrate-{sweep_dir.name}", 1, 1, f"{path}/logs/calibrate-%j.out")
    body = ["", "# echobench: the sweep's one calibration on a compute node, before its runs",
            "set -euo pipefail", *job_environment(slurm), *launch_arrays(slurm, None, sweep_dir),
            f"export ECHOBENCH_CACHE={q(str(sweep_cache(sweep_dir)))}",
            'exec ${ON_FIRST_NODE[@]+"${ON_FIRST_NODE[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} "$PYTHON" -m echobench '
            f'calibrate --device {q(device)}']
    return "\n".join(head + body) + "\n"


def comm_log(sweep_dir: Path, job: str = "%j") -> Path:
    """The comm calibration job's log (SLURM's %j: its job id)."""
    return sweep_dir.resolve() / "logs" / f"calibrate-comm-{job}.out"


def per_node_job(slurm, sweep_dir: Path, job_name: str, nodes: int, nproc: int, log: Path, about: str,
                 extra: list[str], launch: str, args: str) -> str:
    """A job of the sweep's own (the comm calibration, the preflight) that starts one process per node
    as a run's job starts its launchers (SRUN_PER_NODE), in the matrix's environment: `launch` is the
    command after `$PYTHON` (its arguments "$1".. are `args`, quoted words), `extra` lines before it."""
    head = sbatch_header(slurm, job_name, nodes, nproc, str(log))
    body = ["", f"# echobench: {about}", "set -euo pipefail", f"NPROC={int(nproc)}",
            f"MASTER_PORT=$(( {int(slurm.master_port)} + SLURM_JOB_ID % {PORT_SPREAD} ))",
            *job_environment(slurm), *launch_arrays(slurm, None, sweep_dir), *extra,
            NODE_LAUNCH_ENV.rstrip("\n"),
            "# One process per node, as a run's job starts its launchers (node rank from SLURM_NODEID)",
            SRUN_PER_NODE + f"""    'exec "$0" {launch}' \\""", f'    "$PYTHON" {args}']
    return "\n".join(head + body) + "\n"


def render_comm_calibration_script(sweep_dir: Path, matrix, nodes: int, nproc: int, device: str = "auto") -> str:
    """hardware.calibrate_comm's job: `echobench calibrate --comm` on `nodes` nodes x `nproc` processes,
    one launcher per node (each torchrun --nnodes with its node rank from SLURM_NODEID and the first host
    as master), so that the profile has an `inter` link across nodes. Every run of SWEEP/matrix.yaml
    gives its shapes; the profile goes to SWEEP/profile.yaml and SWEEP/cache. The arguments reach the
    launchers as arguments, quoted, never as code."""
    q = shlex.quote
    limits = matrix.spec.hardware.comm_limits
    slurm = calibration_time(matrix.spec.slurm, 600 + math.ceil((limits.comm_budget_s or 0) + (limits.budget_s or 0)))
    args = " ".join(q(word) for word in comm_command(sweep_dir, matrix, device))
    return per_node_job(
        slurm, sweep_dir, f"eb-calibrate-comm-{sweep_dir.name}", nodes, nproc, comm_log(Path(sbatch_path(sweep_dir))),
        f"the sweep's hardware profile (hardware.calibrate_comm) on {int(nodes)} node(s) x {int(nproc)} processes, "
        f"before its runs", [f"export ECHOBENCH_CACHE={q(str(sweep_cache(sweep_dir)))}"],
        '-m echobench calibrate --comm --nproc "$1" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" '
        '--master-addr "$2" --master-port "$3" "${@:4}"', f'"$NPROC" "$MASTER_ADDR" "$MASTER_PORT" {args}')


def preflight_log(sweep_dir: Path, job: str = "%j") -> Path:
    """The preflight job's log (SLURM's %j: its job id), where its nodes' check lines are read."""
    return sweep_dir.resolve() / "logs" / f"preflight-{job}.out"


def render_preflight_script(sweep_dir: Path, slurm, spec: dict, limit_s: int) -> str:
    """The preflight job (echobench.preflight): `spec["nodes"]` nodes in the matrix's exact environment
    (its #SBATCH options, setup lines, fabric variables, container or uenv, srun options), one
    `python -m echobench.nodecheck node` per node. `spec` reaches them as one quoted argument (JSON),
    never as code; each node prints its lines (echobench-check {...})."""
    return per_node_job(
        calibration_time(slurm, limit_s), sweep_dir, f"eb-preflight-{sweep_dir.name}", spec["nodes"], spec["nproc"],
        preflight_log(Path(sbatch_path(sweep_dir))), f"preflight: what the runs need, checked on {int(spec['nodes'])} "
        f"node(s) x {int(spec['nproc'])} processes before any run is submitted (`echobench preflight`)", [],
        '-m echobench.nodecheck node --spec "$1" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" '
        '--master-addr "$2" --master-port "$3"', f'{shlex.quote(json.dumps(spec))} "$MASTER_ADDR" "$MASTER_PORT"')


# A sweep driven from inside an allocation (salloc, a batch job; SLURM_JOB_ID set) has that job's
# SLURM_* / SBATCH_* variables, which sbatch reads as options for the new job (as submitit, drop
# them); SLURM_CONF says where the cluster's configuration is, and stays. From a login shell the
# environment goes as it is: SBATCH_ACCOUNT, SBATCH_PARTITION, SBATCH_QOS, SBATCH_RESERVATION
# are the user's own defaults.
SUBMIT_ENV_DROP = ("SLURM_", "SLURMD_", "SBATCH_", "SRUN_", "SALLOC_")


def submit_env(environ=None) -> dict:
    environ = dict(os.environ if environ is None else environ)
    if not environ.get("SLURM_JOB_ID"):
        return environ
    return {k: v for k, v in environ.items() if k == "SLURM_CONF" or not k.startswith(SUBMIT_ENV_DROP)}


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = submit_env() if cmd[0] == "sbatch" else None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


class SlurmError(RuntimeError):
    pass


class SlurmExecutor:
    """Submits with sbatch, reads every tracked job's state in one look per poll (`states`), and
    tells a refusal to retry (a submit limit, a busy scheduler: SubmitLater) from one that is the
    job's own (a bad partition or option: SlurmError, the run's record)."""

    name = "slurm"
    max_active = None  # slurm.max_submitted: the sweep's jobs in the queue at once (None: the scheduler queues them all)
    poll_s = 5.0
    submit_timeout_s = 60.0  # sbatch: past this the job may be queued or not: squeue is asked before anything else
    query_timeout_s = 60.0  # sacct, squeue: past this the look is no news (asked again at the next poll)
    batch = 500  # job ids per sacct / squeue call
    # What sacct prints where the cluster keeps no accounting: then it is never asked again. Any other
    # failure (a timeout, slurmdbd down) is transient: sacct is asked again at the next poll.
    ACCOUNTING_OFF = ("accounting storage is disabled",)
    # sbatch's words for a refusal that is not about the job: a submit limit, a controller too busy.
    SUBMIT_LATER = re.compile(r"MaxSubmitJob|SubmitJobsLimit|submit limit|Socket timed out|temporarily unable|"
                              r"Resource temporarily unavailable|Unable to contact slurm controller|"
                              r"Job violates accounting/QOS policy|Connection (?:refused|timed out|reset)|"
                              r"Transport endpoint is not connected|try again later", re.IGNORECASE)
    # A QOS / association reason named in the refusal: only the submit-count ones pass with time.
    LIMIT_REASON = re.compile(r"\b(?:QOS|Assoc)\w*Limit\b")

    def __init__(self, max_submitted: int | None = None):
        self.max_active = max_submitted
        self.accounting: bool | None = None  # unknown until sacct has answered (False: the cluster has none)
        self.calibration: str | None = None  # the sweep's calibration job: runs without a peak wait for it
        self.comm_calibration: str | None = None  # hardware.calibrate_comm's job: every run waits for it
        self.unsure: set[str] = set()  # job names whose sbatch timed out: looked up in squeue before another
        self.transport: str | None = None  # the network the sweep's preflight saw NCCL choose (into the records)

    def check_dir(self, sweep_dir: Path) -> None:
        sbatch_path(sweep_dir)  # the path goes into #SBATCH lines, which sbatch does not unquote

    def job_script(self, run, run_dir: Path, matrix, time_limit: str, log: Path | None = None) -> str:
        env = dict(matrix.spec.slurm.env)
        if run.cfg.peak_tflops is None:  # where the sweep's calibration job writes (calibrate)
            env.setdefault("ECHOBENCH_CACHE", str(sweep_cache(run_dir.parent)))
        if self.transport:  # what the preflight saw NCCL choose: the record's env.nccl_transport
            env.setdefault("ECHOBENCH_NCCL_TRANSPORT", self.transport)
        return render_script(run.cfg, run_dir, matrix.spec.slurm.model_copy(update={"time": time_limit, "env": env}),
                             log)

    def calibrate(self, sweep_dir: Path, matrix, device: str, log) -> None:
        """One calibration job on a compute node (the login node's device says nothing about the
        nodes'), which the runs without a peak then wait for; none when hardware.device names a
        device with a datasheet peak, or when the sweep has calibrated already."""
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
        except SubmitLater as exc:
            raise ValueError(f"{exc}; nothing submitted: run the sweep again later (or set hardware.peak_tflops "
                             f"in the matrix)") from None
        except SlurmError as exc:
            raise ValueError(f"{exc}; nothing submitted (or set hardware.peak_tflops in the matrix)") from None
        job = esc(self.calibration)
        log(f"no peak_tflops in the matrix: calibrating once on a compute node (job {job}, "
            f"log {esc(sweep_dir / 'logs')}/calibrate-{job}.out); the runs without a peak wait for it")

    def calibrate_comm(self, sweep_dir: Path, matrix, runs, device: str, log, previous: str | None = None) -> str | None:
        """One job on the largest node count of the runs (comm_size), after the GEMM calibration if
        any; every run then waits for it (afterany: whatever becomes of it). An earlier sweep's that is
        still queued or running is waited for instead. A refused submission is said and the runs go on.
        Returns the job's log, which the sweep names should no profile come of it."""
        if comm_calibrated(sweep_dir):
            return None
        if previous and (job := self.states({previous: sweep_dir}).get(previous)) and job.state in ACTIVE:
            self.comm_calibration = previous
            log(f"hardware.calibrate_comm: the profile job {esc(previous)} of an earlier sweep is still {job.state}: "
                f"the runs wait for it")
            return str(comm_log(sweep_dir, previous))
        nodes, nproc = comm_size(runs)
        script = sweep_dir / "calibrate-comm.sh"
        script.write_text(render_comm_calibration_script(sweep_dir, matrix, nodes, nproc, device))
        (sweep_dir / "logs").mkdir(exist_ok=True)
        try:
            # After the GEMM calibration: two calibrations sharing a node would time each other.
            self.comm_calibration = self.sbatch(script, "the comm calibration job", [self.calibration])
        except (SubmitLater, SlurmError) as exc:
            log(f"[red]hardware profile not measured[/]: {esc(exc)}; the runs go on without it")
            return None
        log(f"hardware.calibrate_comm: measuring a hardware profile once on {nodes} node(s) x {nproc} processes (job "
            f"{esc(self.comm_calibration)}, log {esc(comm_log(sweep_dir, self.comm_calibration))}); the runs wait for it")
        return str(comm_log(sweep_dir, self.comm_calibration))

    def submit(self, run, run_dir: Path, time_limit_s: int | None = None) -> str:
        # The time limit is in the script (#SBATCH --time).
        return self.sbatch(run_dir / "job.sh", run.id,
                           [self.calibration if run.cfg.peak_tflops is None else None, self.comm_calibration])

    def sbatch(self, script: Path, what: str, after: Sequence[str | None] = ()) -> str:
        """The job id of `script` once queued. Raises SubmitLater for a refusal that passes with time
        (and for an sbatch that timed out with no job of that name in the queue), SlurmError for one
        that is the job's own. After a timeout the next call looks in squeue before submitting again.
        `after`: the jobs it waits for (None: none)."""
        name = self.job_name(script)
        if name in self.unsure:
            if job_id := self.queued(name, script):
                self.unsure.discard(name)
                return job_id
            self.unsure.discard(name)
        # afterany: the run starts whether or not the calibrations worked (a node with a datasheet peak needs none).
        depend = [f"--dependency=afterany:{':'.join(jobs)}"] if (jobs := [j for j in after if j]) else []
        try:
            proc = _run(["sbatch", "--parsable", *depend, str(script)], timeout=self.submit_timeout_s)
        except FileNotFoundError:
            raise SlurmError("sbatch not found: is this a SLURM login node? (locally: bash scripts/slurm-local.sh up)")
        except subprocess.TimeoutExpired:
            if name is None:
                raise SlurmError(f"sbatch of {what} did not answer within {self.submit_timeout_s:.0f} s") from None
            # The controller may have queued the job all the same: never submit it twice.
            self.unsure.add(name)
            if job_id := self.queued(name, script):
                self.unsure.discard(name)
                return job_id
            raise SubmitLater(f"sbatch did not answer within {self.submit_timeout_s:.0f} s and no job {name} is "
                              f"queued (squeue is asked again before it is submitted again)") from None
        if proc.returncode != 0:
            message = " | ".join(line.strip() for line in (proc.stderr.strip() or proc.stdout.strip()).splitlines())
            if self.refusal_passes(message):
                raise SubmitLater(f"sbatch refused {what} for now: {message}")
            raise SlurmError(f"sbatch rejected {what}: {message}")
        job_id = proc.stdout.strip().split(";")[0]  # "ID" or "ID;cluster"
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
        return job_id

    def refusal_passes(self, message: str) -> bool:
        """Whether sbatch's refusal passes with time: a submit-count limit (QOSMaxSubmitJobPerUserLimit,
        AssocMaxSubmitJobLimit, ...) or a scheduler that could not answer. A refusal naming another limit
        (QOSMaxWallDurationPerJobLimit: the job asks for more than the QOS allows) is the job's own."""
        if reasons := self.LIMIT_REASON.findall(message):
            return all("SubmitJob" in reason for reason in reasons)
        return bool(self.SUBMIT_LATER.search(message))

    @staticmethod
    def job_name(script: Path) -> str | None:
        """The #SBATCH --job-name of a job script (the name squeue finds it by), None without one."""
        try:
            found = re.search(r"^#SBATCH --job-name=(\S+)", script.read_text(), re.MULTILINE)
        except OSError:
            return None
        return found.group(1) if found else None

    def queued(self, name: str, script: Path) -> str | None:
        """The job an sbatch that timed out may have queued: its own job-state file, else squeue by
        the job's name (this user's jobs). Raises SubmitLater when squeue does not answer either."""
        try:
            words = (script.parent / "job-state").read_text().split()
            if len(words) >= 2 and words[0] in ("running", "exited") and words[1].isdigit():
                return words[1]
        except OSError:
            pass
        try:
            proc = _run(["squeue", "-h", "-u", str(os.getuid()), f"--name={name}", "-o", "%i"],
                        timeout=self.query_timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired):
            proc = None
        if proc is None or proc.returncode != 0:
            raise SubmitLater(f"sbatch did not answer within {self.submit_timeout_s:.0f} s, nor did squeue: whether "
                              f"job {name} is queued is asked again before it is submitted again")
        ids = [word for word in proc.stdout.split() if word.isdigit()]
        return max(ids, key=int) if ids else None

    # ---- the scheduler's view: the job's own file, then one sacct, then one squeue for all ----

    def _sacct(self, job_ids: list[str]) -> tuple[dict[str, Seen], bool]:
        """({job id: what sacct says}, whether sacct answered). Accounting is switched off only when
        sacct says there is none; any other failure is no answer this time."""
        if self.accounting is False:
            return {}, True
        seen: dict[str, Seen] = {}
        for k in range(0, len(job_ids), self.batch):
            chunk = job_ids[k:k + self.batch]
            try:
                proc = _run(["sacct", "-n", "-X", "-P", "-j", ",".join(chunk), "-o", "JobID,State,ExitCode,Reason,NodeList"],
                            timeout=self.query_timeout_s)
            except FileNotFoundError:
                self.accounting = False
                return {}, True
            except subprocess.TimeoutExpired:
                return seen, False
            if proc.returncode != 0:
                if any(words in f"{proc.stderr} {proc.stdout}".lower() for words in self.ACCOUNTING_OFF):
                    self.accounting = False
                    return {}, True
                return seen, False
            self.accounting = True
            for line in proc.stdout.splitlines():
                job_id, state, code, reason, nodes = (line.strip().split("|") + [""] * 4)[:5]
                if job_id in chunk and state.split() and job_id not in seen:
                    # "CANCELLED by 0" -> CANCELLED
                    seen[job_id] = Seen(state.split()[0], f"exit {code}" if code else "", reason, nodes)
        return seen, True  # a job missing here is not in the database yet

    def _squeue(self, job_ids: list[str]) -> tuple[dict[str, Seen], bool]:
        """({job id: what squeue says}, whether squeue answered): finished jobs too (-t all), for
        MinJobAge after they end. An id the controller no longer knows is left out."""
        seen: dict[str, Seen] = {}
        for k in range(0, len(job_ids), self.batch):
            chunk = job_ids[k:k + self.batch]
            try:
                proc = _run(["squeue", "-h", "-t", "all", "-j", ",".join(chunk), "-o", "%i|%T|%r|%N"],
                            timeout=self.query_timeout_s)
            except (FileNotFoundError, subprocess.TimeoutExpired):
                return seen, False
            if proc.returncode != 0:
                if "invalid job id" in proc.stderr.lower():  # one id only, and purged: "Invalid job id specified"
                    continue
                return seen, False
            for line in proc.stdout.splitlines():
                job_id, state, reason, nodes = (line.strip().split("|") + [""] * 3)[:4]
                if job_id in chunk and state:
                    seen[job_id] = Seen(state, "", reason, nodes)
        return seen, True

    def states(self, jobs: dict[str, Path]) -> dict[str, JobState]:
        """Every job's state (job id -> run directory) in one look: its own status file first, then
        one sacct for all where accounting exists, then one squeue for the jobs sacct did not know.
        A job neither answered about is left out (no news: asked again at the next poll); it is
        `gone` only when both answered and neither knows it."""
        out: dict[str, JobState] = {}
        ask = []
        for job_id, run_dir in jobs.items():
            own = read_job_state(run_dir, job_id)
            if own is not None and own.state == "exited":
                out[job_id] = own
            else:
                ask.append(job_id)
        if not ask:
            return out
        seen, sure = self._sacct(ask)
        if rest := [job_id for job_id in ask if job_id not in seen]:
            more, answered = self._squeue(rest)
            seen.update(more)
            sure = sure and answered
        failed = [seen[j].nodes for j in ask if j in seen and seen[j].state in ("NODE_FAIL", "BOOT_FAIL")]
        down = self.down_nodes(failed) if failed else {}
        for job_id in ask:
            if job_id in seen:
                out[job_id] = self.job_state(job_id, seen[job_id], down)
            elif sure:
                out[job_id] = JobState("gone", f"SLURM job {job_id} is unknown to the scheduler (purged?) and left "
                                               f"no exit status")
        return out

    def down_nodes(self, nodelists: list[str]) -> dict[str, str]:
        """{node: "state (reason)"} of the nodes of these node lists that are down, failing or not
        responding (one sinfo for all): the node a NODE_FAIL job lost."""
        try:
            proc = _run(["sinfo", "-h", "-N", "-n", ",".join(n for n in nodelists if n), "-o", "%N|%T|%E"],
                        timeout=self.query_timeout_s)
        except (FileNotFoundError, subprocess.TimeoutExpired):
            return {}
        out = {}
        for line in proc.stdout.splitlines():
            node, state, reason = (line.strip().split("|") + [""] * 2)[:3]
            if re.search(r"down|fail|drain|not_responding|\*", state, re.IGNORECASE):
                out[node] = state + (f" ({reason})" if said(reason) else "")
        return out

    @classmethod
    def job_state(cls, job_id: str, seen: Seen, down: dict[str, str] | None = None) -> JobState:
        reason = seen.reason if said(seen.reason) else ""
        words = " ".join(filter(None, [seen.state, f"({reason})" if reason else "", seen.detail]))
        if seen.state in PENDING:
            return JobState("pending", words, reason=reason, never=never_starts(reason) or "")
        if seen.state in RUNNING:
            return JobState("running", words)
        why = f"({', '.join(filter(None, [reason, seen.detail]))})" if reason or seen.detail else ""
        lost = [f"{node} {state}" for node, state in (down or {}).items()
                if node in hostlist(seen.nodes)] if seen.state in ("NODE_FAIL", "BOOT_FAIL") else []
        where = f": lost node {', '.join(lost)}" if lost else ""
        return JobState(ENDED.get(seen.state, "error"), f"SLURM job {job_id} ended {seen.state} {why}".rstrip() + where)

    def state(self, job_id: str, run_dir: Path) -> JobState:
        """One job's state (the sweep asks `states` for all at once)."""
        return self.states({job_id: run_dir}).get(job_id) or JobState(
            "pending", "the scheduler did not answer (sacct / squeue): asked again at the next look")

    def cancel(self, job_ids: list[str]) -> None:
        """scancel of these jobs, in one call. Ids already over are no error (cancelling twice is
        harmless); raises SlurmError when scancel cannot do it."""
        try:
            proc = _run(["scancel", *job_ids], timeout=self.query_timeout_s)
        except FileNotFoundError:
            raise SlurmError("scancel not found: is this a SLURM login node?")
        except subprocess.TimeoutExpired:
            raise SlurmError(f"scancel did not answer within {self.query_timeout_s:.0f} s") from None
        problems = [line.strip() for line in proc.stderr.splitlines() if line.strip() and not re.search(
            r"already completing or completed|Invalid job id", line, re.IGNORECASE)]
        if proc.returncode != 0 and problems:
            raise SlurmError(f"scancel {' '.join(job_ids)}: {' | '.join(problems)}")

    def cancel_all(self) -> list[str]:
        return []  # Ctrl-C while waiting leaves SLURM jobs running (see detach_message; `echobench cancel DIR`)

    def detach_message(self) -> str:
        return "the SLURM jobs keep running: `echobench status DIR` follows them, `echobench cancel DIR` stops them"

