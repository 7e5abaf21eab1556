"""The sbatch scripts of the SLURM executor (echobench.sweep.executors.slurm): a run's job script, and the
sweep's own jobs (the preflight, the GEMM and comm calibrations).

The script asks for N nodes with one task each, checks its first node (echobench.train.nodecheck) and
starts one launcher per node with srun: `echobench run --nproc GPUS --nnodes N --node-rank
$SLURM_NODEID --master-addr FIRST_HOST`, which runs torchrun there; node 0's launcher assembles the
record. Every srun of a job runs in the matrix's environment (environment_options: a pyxis named
container, the Container Engine's EDF, a uenv, apptainer). Every value from the matrix that reaches
a script is validated (echobench.sweep.matrix) and quoted here (shlex.quote); per-node values reach the
srun'd command as arguments, never as code.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shlex
import sys
from pathlib import Path

import yaml

from echobench.sweep.executors import comm_command, sweep_cache
from echobench.train.fabric import fabric_env, left_to_hook
from echobench.train.launch import source_root
from echobench.sweep.cluster import PORT_SPREAD, parse_time
from echobench.train.nodecheck import run_imports


# The rendezvous host and log settings of a job that starts one launcher per node (runs, the comm calibration).
# sed, not head: head closes the pipe after one line, and under pipefail scontrol's SIGPIPE on a long
# node list would fail the job (exit 141).
# slurm.rendezvous (job_environment sets EB_RENDEZVOUS_*) changes the address the nodes meet at, after the setup lines.
NODE_LAUNCH_ENV = r"""MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)${EB_RENDEZVOUS_SUFFIX:-}
if [ -n "${EB_RENDEZVOUS_COMMAND:-}" ]; then
  MASTER_ADDR=$(eval "$EB_RENDEZVOUS_COMMAND" | sed -n 1p)
  [ -n "$MASTER_ADDR" ] || { echo "echobench: slurm.rendezvous.command printed no address: $EB_RENDEZVOUS_COMMAND" >&2; exit 1; }
elif [ -n "${EB_RENDEZVOUS_INTERFACE:-}" ]; then
  MASTER_ADDR=$( (ip -4 -o addr show dev "$EB_RENDEZVOUS_INTERFACE" 2>/dev/null || true) | awk '{split($4, a, "/"); print a[1]}' | sed -n 1p)
  [ -n "$MASTER_ADDR" ] || { echo "echobench: slurm.rendezvous.interface $EB_RENDEZVOUS_INTERFACE has no IPv4 address on $(hostname) (ip -4 addr lists the node's interfaces)" >&2; exit 1; }
fi
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
# First node, before the ranks start (echobench.train.nodecheck): $PYTHON imports echobench's run path and the run's
# backends (IMPORTS), sees a GPU when the job expects them (EXPECT_GPU=1), has a CPU per process and numactl
# for numa_binding; a wrong environment fails here, in seconds. In a container or uenv the check runs there
# (ON_FIRST_NODE: an srun with the job's environment options).
${ON_FIRST_NODE[@]+"${ON_FIRST_NODE[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} "$PYTHON" -m echobench.train.nodecheck first \
    --expect-gpu "${EXPECT_GPU:-0}" --nproc "$NPROC" --cpus "${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-}}" \
    --imports "${IMPORTS:-}"
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "echobench: the first-node check failed (exit $rc): the line above says what and the fix ($PYTHON, from slurm.python or slurm.setup, runs every rank)" >&2
else
  # One launcher per node, with every CPU of the job's task; each takes its node rank from SLURM_NODEID (not
  # from host names). Output labelled by node (-l) and unbuffered (-u). A launcher that fails has srun stop the
  # others at once (--kill-on-bad-exit: SIGTERM, SIGKILL after KillWait; node 0's then writes the record from
  # the files the ranks and nodes left); after one that ends well the others get 60 s (--wait), so a node
  # hanging in teardown does not hold the job. USR1 (SLURM's, before the time limit) is ignored but by the
  # ranks, which dump their stacks on it.
  """ + SRUN_PER_NODE + r"""    'trap "" USR1; exec "$0" -m echobench run --config "$1" --out "$2" --nproc "$3" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --master-addr "$4" --master-port "$5"' \
    "$PYTHON" "$RUN_CONFIG" "$RUN_DIR" "$NPROC" "$MASTER_ADDR" "$MASTER_PORT"
  rc=$?
fi
set -e
echo "exited $SLURM_JOB_ID $rc $(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$RUN_DIR/job-state"
exit $rc
"""
RUN_YAML_END = "ECHOBENCH_RUN_YAML"  # the heredoc that carries a run's settings in its job script
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
    their stacks on USR1 before the time limit (echobench.train.launch.on_stack_signal)."""
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


def import_path(slurm) -> list[str]:
    """The entries a job puts first on PYTHONPATH: slurm.pythonpath where given; else this checkout,
    but only where the site names no interpreter (venv, python, container, uenv): the one route that
    takes echobench from the submitting checkout, which must then be at the same path on every node."""
    if slurm.pythonpath is not None:
        return list(slurm.pythonpath)
    return [] if slurm.names_interpreter() else [str(source_root())]


def job_python(slurm) -> str:
    """The ranks' interpreter: slurm.venv's, slurm.python, the image's python3 in a container or uenv,
    else the one running the sweep (a setup line that activates an environment takes its python then)."""
    if slurm.venv:
        return slurm.venv.rstrip("/") + "/bin/python"
    return slurm.python or ("python3" if slurm.container or slurm.uenv else sys.executable)


def container_mounts(container, cfg, sweep_dir: Path, slurm) -> list[str]:
    """The matrix's mounts, then the sweep directory, the job's import path (import_path) and the
    run's data directory at their own paths (what the ranks read and write), each once."""
    mounts = list(container.mounts)
    own = [str(sweep_dir.resolve()), *import_path(slurm)]
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
    mounts = container_mounts(c, cfg, sweep_dir, slurm)
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
    """PYTHON (job_python), PYTHONPATH (import_path), the fabric profile and the matrix's env (quoted),
    and its setup lines (as written, without `set -eu`: Lmod's `module` reads unset variables; each
    line's failure ends the job with its number). Where the site names no interpreter, a setup line
    that activates another environment (VIRTUAL_ENV or CONDA_PREFIX changes) decides the interpreter
    and its import path: the checkout is then left off PYTHONPATH."""
    q = shlex.quote
    runtime = slurm.container.runtime if slurm.container else None
    paths = import_path(slurm)
    checkout = slurm.pythonpath is None and bool(paths)  # the submitting checkout's route
    lines = [f"PYTHON={q(job_python(slurm))}"]
    if not checkout:  # sbatch passes the submitter's environment on, and starts the job in its folder (a
        # checkout, which `python -m` would import first): neither is the site's import path
        lines += ["unset PYTHONPATH", "export PYTHONSAFEPATH=1"]
    path_line = f"export PYTHONPATH={q(':'.join(paths))}${{PYTHONPATH:+:$PYTHONPATH}}" if paths else ""
    if path_line and not (checkout and slurm.setup):
        lines.append(path_line)
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
        if checkout:
            lines.append('if [ "${VIRTUAL_ENV:-}|${CONDA_PREFIX:-}" != "$eb_env_before" ]; then '
                         f'PYTHON=$(command -v python3 || command -v python); else {path_line}; fi')
        elif not slurm.names_interpreter():
            lines.append('if [ "${VIRTUAL_ENV:-}|${CONDA_PREFIX:-}" != "$eb_env_before" ]; then '
                         'PYTHON=$(command -v python3 || command -v python); fi')
    if rdv := slurm.rendezvous:  # read where the address is made (NODE_LAUNCH_ENV), after the setup lines
        lines.extend(f"EB_RENDEZVOUS_{key.upper()}={q(value)}" for key, value in
                     (("suffix", rdv.suffix), ("interface", rdv.interface), ("command", rdv.command)) if value)
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
        f"IMPORTS={q(','.join(run_imports(cfg)))}",
        # Jobs sharing a node need their own port; the range stays below the ephemeral ports (cluster.EPHEMERAL).
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
    as master), so that the profile has an `inter` link across nodes. Every run of the sweep's matrix
    file gives its shapes; the profile goes to SWEEP/profile.yaml and SWEEP/cache. The arguments reach the
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


def render_preflight_script(sweep_dir: Path, slurm, spec: dict, limit_s: int, log: Path | None = None) -> str:
    """The preflight job (echobench.sweep.preflight): `spec["nodes"]` nodes in the matrix's exact environment
    (its #SBATCH options, setup lines, fabric variables, container or uenv, srun options), one
    `python -m echobench.train.nodecheck node` per node. `spec` reaches them as one quoted argument (JSON),
    never as code; each node prints its lines (echobench-check {...}). `log`: where SLURM writes its
    output when not SWEEP/logs (a script to submit by hand)."""
    return per_node_job(
        calibration_time(slurm, limit_s), sweep_dir, f"eb-preflight-{sweep_dir.name}", spec["nodes"], spec["nproc"],
        log or preflight_log(Path(sbatch_path(sweep_dir))), f"preflight: what the runs need, checked on {int(spec['nodes'])} "
        f"node(s) x {int(spec['nproc'])} processes before any run is submitted (`echobench preflight`)", [],
        '-m echobench.train.nodecheck node --spec "$1" --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" '
        '--master-addr "$2" --master-port "$3"', f'{shlex.quote(json.dumps(spec))} "$MASTER_ADDR" "$MASTER_PORT"')
