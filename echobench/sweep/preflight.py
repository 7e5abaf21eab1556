"""Preflight: one short job, in a matrix's exact environment, that checks what its runs need before
any of them is submitted (`echobench preflight MATRIX`; the first job of every SLURM sweep).

On 2 nodes where the matrix has multi-node runs (else 1), with its #SBATCH options, setup lines,
fabric variables, container or uenv and srun options, each node runs `python -m echobench.train.nodecheck
node`: the run path's and the backends' imports, the GPUs (a CUDA build, the count, the device and
its architecture), the CPUs per task, numactl for numa_binding, the interfaces named for NCCL and
gloo, a tiny compile where a run compiles, and an all-reduce across every node's processes (NCCL on
GPUs, whose INFO lines say which network it chose, held against the fabric; gloo on CPUs). Each
check is a line in the job's log, which is read here: they arrive even where the sweep directory is
not mounted in a container. A passed preflight is kept in SWEEP/preflight.json with the matrix's
hash: the same matrix is not checked again; the network NCCL chose goes into every run's record.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from pydantic import BaseModel

from echobench.records.atomic import write_json_atomic
from echobench.records.console import esc, log
from echobench.records.states import ACTIVE
from echobench.sweep.estimate import startup_parts
from echobench.sweep.executors import PREFLIGHT_FILE, PREFLIGHT_SCRIPT, explaining_lines, job_states, transport_label
from echobench.sweep.executors.slurm_script import preflight_log, render_preflight_script
from echobench.train.launch import with_source_path
from echobench.sweep.matrix import Matrix, PlannedRun, gpu_run
from echobench.sweep.state import poll_cap
from echobench.train.nodecheck import MARK, RUN_PATH, run_imports, source_identity

CHECKS_S = 300  # the checks themselves: imports, a compile, torchrun and an all-reduce (plus the start-up allowance)
POLL_S = (2.0, 30.0)  # how often the job is looked at: from 2 s, doubling to 30 s while nothing changes
# What a job that died before its checks says in its log, and what to do about it.
HINTS = [
    (r"setup line \d+ failed", "fix that line of slurm.setup"),
    (r"No module named '?echobench|module specification for 'echobench",
     "echobench is not where $PYTHON runs: install it there (slurm.venv, the image), or name its checkout in "
     "slurm.pythonpath (mounted in a pyxis or apptainer container; under runtime ce the EDF's mounts)"),
    (r"pyxis|enroot", "the container did not start: check slurm.container.image (`enroot import` it by hand to see why)"),
    (r"uenv", "the uenv did not start: check slurm.uenv (`uenv image ls` on a login node)"),
    (r"environment|EDF|\.toml", "the Container Engine did not start: check the EDF named in slurm.container.image"),
    (r"command not found|No such file or directory|cannot execute", "slurm.venv or slurm.python: no such interpreter on the nodes (the nodes' path, made for their architecture)"),
]


class Preflight(BaseModel):
    """A preflight's outcome (SWEEP/preflight.json)."""

    passed: bool
    executor: str
    job: str | None = None
    nodes: int = 1
    nproc: int = 1
    fabric: str | None = None
    checks: list[dict] = []  # each node's lines: name, ok (None: skipped), detail, fix, seen, node, host
    problem: str = ""  # why it failed without a failed check: the job ended before its nodes said theirs
    transport: str | None = None  # the network NCCL chose across the nodes (NET/IB), where it could tell
    matrix_sha: str = ""
    spec: dict = {}  # what it checked (preflight_spec)
    log: str | None = None
    time: str = ""

    def record_label(self) -> str | None:
        """What the runs' records keep as the transport seen (env.nccl_transport)."""
        return transport_label(self.transport, self.job)


def matrix_sha(matrix: Matrix) -> str:
    return hashlib.sha256((matrix.text + matrix.site_text).encode()).hexdigest()


def preflight_spec(matrix: Matrix, runs: list[PlannedRun], executor: str) -> dict:
    """What the nodes check, for these runs (JSON: it reaches each node as one argument)."""
    slurm = matrix.spec.slurm
    gpus = (any(gpu_run(r, slurm) for r in runs) if executor == "slurm"
            else any(r.cfg.device == "cuda" for r in runs))
    extras = [m for r in runs for m in run_imports(r.cfg)]
    return {"nodes": 2 if executor == "slurm" and any(r.cfg.nodes > 1 for r in runs) else 1,
            "nproc": max(r.cfg.gpus_per_node for r in runs), "expect_gpus": gpus, "device": "cuda" if gpus else "cpu",
            "device_name": matrix.spec.hardware.device, "imports": list(dict.fromkeys([*RUN_PATH, *extras])),
            "numa_binding": slurm.numa_binding, "compile": any(r.cfg.may_compile() for r in runs), "fabric": slurm.fabric,
            "bytes": 64 << 20 if gpus else 1 << 20, "timeout_s": CHECKS_S,
            # its version and commit, not where it lies: the job names no path of the submitting checkout
            "echobench": {k: v for k, v in source_identity().items() if k != "path"}}


def limit_s(matrix: Matrix) -> int:
    """The preflight job's time limit: its checks plus the environment's start-up allowance."""
    return CHECKS_S + sum(startup_parts(matrix).values())


# ---- reading the nodes' lines ----

def parse_checks(text: str) -> list[dict]:
    """The check lines of a preflight log (`echobench-check {json}`, behind srun's node label "K: ").
    srun may pass a line on in pieces, each with the label: a line that does not parse yet takes the
    next pieces of the same label; one that never does (a node that died mid-line) is dropped. A piece
    may even end inside the marker ("0: echo", then "0: bench-check {...}"): it is held for the next."""
    checks, open_lines, marker_start = [], {}, {}
    for line in text.splitlines():
        label, sep, rest = line.partition(": ")
        label = label if sep and label.isdigit() else ""
        piece = rest if label else line
        if label in marker_start:
            piece = marker_start.pop(label) + piece
            line = f"{label}: {piece}" if label else piece
        if label not in open_lines and piece and (MARK + " ").startswith(piece) and piece != MARK + " ":
            marker_start[label] = piece
            continue
        if MARK + " " in line:
            open_lines[label] = line.partition(MARK + " ")[2]
        elif label in open_lines:
            open_lines[label] += rest if label else line
        else:
            continue
        try:
            checks.append(json.loads(open_lines[label]))
        except ValueError:
            continue  # not whole yet
        del open_lines[label]
    return checks


def verdict(spec: dict, checks: list[dict], ended: str, log_text: str, job: str | None) -> tuple[bool, str]:
    """(passed, why not when no check failed): passed when every node said every check, the last
    one (transport) included, and none failed."""
    if any(c.get("ok") is False for c in checks):
        return False, ""
    done = {c.get("node") for c in checks if c.get("name") == "transport"}
    missing = [k for k in range(spec["nodes"]) if k not in done]
    if not missing:
        return True, ""
    lines = explaining_lines(log_text, 3)
    hint = next((fix for pattern, fix in HINTS if any(re.search(pattern, line) for line in lines)), "")
    said = " | ".join(lines) or "its log is empty"
    return False, (f"preflight job {job} ended ({ended}) before node(s) {', '.join(map(str, missing))} said their "
                   f"checks: {said}" + (f"; fix: {hint}" if hint else ""))[:900]


def outcome(matrix: Matrix, spec: dict, executor: str, job: str | None, ended: str, log_path: Path) -> Preflight:
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        text = ""
    checks = parse_checks(text)
    passed, problem = verdict(spec, checks, ended, text, job)
    transport = next((c.get("seen") for c in checks if c.get("name") == "transport" and c.get("seen")), None)
    return Preflight(passed=passed, executor=executor, job=job, nodes=spec["nodes"], nproc=spec["nproc"],
                     fabric=spec["fabric"], checks=checks, problem=problem, transport=transport,
                     matrix_sha=matrix_sha(matrix), spec=spec, log=str(log_path),
                     time=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


# ---- showing it ----

def lines(result: Preflight) -> list[str]:
    """Rich markup: the verdict, then one line per check (nodes that said the same thing on one line)."""
    what = (f"job {result.job}: " if result.job else "") + f"{result.nodes} node(s) x {result.nproc} process(es), " \
           f"fabric {result.fabric or 'not named'}"
    head = "[green]preflight passed[/]" if result.passed else "[red]preflight FAILED[/]"
    out = [f"{head} ({esc(what)}; log {esc(result.log)})"]
    grouped: dict[tuple, list] = {}
    for c in result.checks:
        grouped.setdefault((c.get("name"), c.get("ok"), c.get("detail"), c.get("fix")), []).append(c.get("node"))
    order = list(dict.fromkeys(name for name, *_ in grouped))  # the checks in the order the nodes ran them
    for (name, ok, detail, fix), nodes in sorted(grouped.items(), key=lambda kv: order.index(kv[0][0])):
        mark = {True: "[green]ok[/]     ", False: "[red]FAILED[/] ", None: "[dim]skipped[/]"}[ok]
        where = "node " + ",".join(str(n) for n in sorted(nodes, key=str))
        out.append(f"  {mark} {esc(name):<11} {esc(where)}: {esc(detail)}" + (f" [bold]fix:[/] {esc(fix)}" if ok is False
                                                                          and fix else ""))
    if result.problem:
        out.append(f"  [red]FAILED[/]  {esc(result.problem)}")
    return out


def show(result: Preflight, console) -> None:
    for line in lines(result):
        log(console, line)


# ---- running it ----

def saved(sweep_dir: Path) -> Preflight | None:
    try:
        return Preflight.model_validate(json.loads((sweep_dir / PREFLIGHT_FILE).read_text()))
    except (OSError, ValueError):
        return None


def covers(before: dict, now: dict) -> bool:
    """Whether a preflight of spec `before` checked all that one of `now` would (a sweep with --only
    checks fewer runs: a later one of all of them may need more nodes or modules)."""
    return (before.get("nodes", 0) >= now["nodes"] and before.get("nproc", 0) >= now["nproc"]
            and set(before.get("imports", [])) >= set(now["imports"]) and before.get("compile") >= now["compile"]
            and all(before.get(k) == now[k] for k in ("expect_gpus", "device", "device_name", "numa_binding", "fabric"))
            and _same_source(before.get("echobench"), now["echobench"]))


def _same_source(before: dict | None, now: dict) -> bool:
    """Whether a preflight checked the nodes against this echobench (a new version or commit: again)."""
    return before is not None and all(before.get(k) == now[k] for k in ("version", "commit"))


def passed_before(sweep_dir: Path, matrix: Matrix, runs: list[PlannedRun], executor: str) -> Preflight | None:
    """An earlier preflight of this very matrix file that passed and checked all these runs need
    (none is run again for them)."""
    before = saved(sweep_dir)
    if before is None or not before.passed or before.matrix_sha != matrix_sha(matrix):
        return None
    return before if covers(before.spec, preflight_spec(matrix, runs, executor)) else None


def run_preflight(matrix: Matrix, runs: list[PlannedRun], executor, sweep_dir: Path, console,
                  on_job=lambda job: None) -> Preflight:
    """Runs the preflight for these runs where they will run (SLURM: a job; local: this machine),
    shows its lines and saves SWEEP/preflight.json. `on_job(id)`: the SLURM job, as soon as it is
    queued (the sweep keeps it for `cancel`). Ctrl-C while it waits cancels it and goes on up."""
    spec = preflight_spec(matrix, runs, executor.name)
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    if executor.name == "slurm":
        result = on_slurm(matrix, spec, executor, sweep_dir, console, on_job)
    else:
        result = here(matrix, spec, sweep_dir, console)
    write_json_atomic(sweep_dir / PREFLIGHT_FILE, result.model_dump())
    show(result, console)
    return result


def preflight_script(matrix: Matrix, runs: list[PlannedRun], sweep_dir: Path, log: Path | None = None) -> str:
    """The SLURM preflight job's script for these runs, exactly as `sweep` and `preflight` submit it
    into sweep_dir (`plan --write-scripts` and `preflight --dry-run` show it; `log`: its output elsewhere)."""
    return render_preflight_script(sweep_dir, matrix.spec.slurm, preflight_spec(matrix, runs, "slurm"), limit_s(matrix),
                                   log)


def local_command(spec: dict) -> list[str]:
    """The local executor's preflight: the node check on this machine."""
    return [sys.executable, "-m", "echobench.train.nodecheck", "node", "--spec", json.dumps(spec), "--nnodes", "1",
            "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", "0"]


def on_slurm(matrix: Matrix, spec: dict, executor, sweep_dir: Path, console, on_job) -> Preflight:
    script = sweep_dir / PREFLIGHT_SCRIPT
    script.write_text(render_preflight_script(sweep_dir, matrix.spec.slurm, spec, limit_s(matrix)))
    job = executor.sbatch(script, "the preflight job")  # SubmitLater / SlurmError: the caller says it
    on_job(job)
    log(console, f"preflight: job {esc(job)} on {spec['nodes']} node(s) x {spec['nproc']} process(es) checks the runs' "
                 f"environment before any is submitted (log {esc(preflight_log(sweep_dir, job))})")
    try:
        ended = wait_for(executor, job, sweep_dir, console)
    except KeyboardInterrupt:
        log(console, cancel_on_interrupt(executor, job))
        raise
    return outcome(matrix, spec, "slurm", job, ended, preflight_log(sweep_dir, job))


def cancel_on_interrupt(executor, job: str) -> str:
    """Ctrl-C while the preflight job waits: scancel of it; the line that says what became of it."""
    try:
        executor.cancel([job])
    except Exception as exc:  # noqa: BLE001 - scancel's own words, one line
        return f"preflight: job {esc(job)} [red]not cancelled[/]: {esc(exc)}; `scancel {esc(job)}` ends it"
    return f"preflight: job {esc(job)} cancelled (Ctrl-C)"


def wait_for(executor, job: str, sweep_dir: Path, console) -> str:
    """Until the job is over; its end in the scheduler's words. Its pending reason is said when it
    changes; a reason that says it can never start ends it (cancelled) with the fix."""
    interval, said = POLL_S[0], ""
    while True:
        state = job_states(executor, {job: sweep_dir}).get(job)
        if state is not None and state.state not in ACTIVE:
            return state.detail
        if state is not None and state.never:
            executor.cancel([job])
            return f"{state.detail}: it can never start as it is: {state.never}; cancelled"
        if state is not None and state.detail != said:
            said = state.detail
            log(console, f"preflight: job {esc(job)} {esc(state.detail or state.state)}")
            interval = POLL_S[0]
        time.sleep(interval)
        interval = min(interval * 2, poll_cap(POLL_S[1]))


def here(matrix: Matrix, spec: dict, sweep_dir: Path, console) -> Preflight:
    """The local executor's preflight: the node check on this machine, with the matrix's env."""
    out = sweep_dir / "logs" / "preflight-local.out"
    log(console, f"preflight: checking the runs' environment on this machine (log {esc(out)})")
    cmd = local_command(spec)
    env = with_source_path({**os.environ, **matrix.spec.slurm.env})
    with open(out, "w") as sink:
        code = subprocess.call(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    return outcome(matrix, spec, "local", None, f"exit {code}", out)
