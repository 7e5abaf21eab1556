"""`echobench run --nproc N`: launch torchrun for this node, then make sure a record exists.

torchrun ends every worker when one fails, so a dead rank never leaves the others hanging.
The ranks that failed left OUT/ranks/rank-N.json, and each node's torchrun (echobench.train.torchrun)
OUT/ranks/node-K.json naming the workers that died and how; if rank 0 could not write
result.json, this process (the launcher, on node 0) assembles it from those files: no failure
is lost, and a worker killed by a signal is named, not the peers that lost their connection to it.
Every rank of a failed run is in its failed_ranks: a rank that left no word was stopped with the
run (every_rank), so the record does not depend on how far the teardown let each rank get.
SIGTERM (srun ending the job step when another node's launcher failed, scancel, a time limit)
does not lose the record either: node 0's launcher writes it at once from the same files
(stopped_record) before SIGKILL follows.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import yaml

from echobench.records.atomic import write_json_atomic
from echobench.records.config import RunConfig
from echobench.records.results import RECORD_FILE, Env, Record, now_iso, scheduler_context
from echobench.records.states import RunState
from echobench.train.fabric import launch_env
from echobench.train.nodecheck import RUN_PATH, run_imports

# How long node 0 waits, after its workers failed, for the other nodes' torchrun to say how theirs
# ended (they notice a dead worker within torchrun's monitor interval; a shared filesystem may lag).
NODE_NOTE_WAIT_S = 15.0
# Each node's launcher notes every HEARTBEAT_S that it is alive (OUT/ranks/node-K.alive); one silent for
# LOST_AFTER_S, without a note of how its torchrun ended, went down with its node (or was killed).
HEARTBEAT_S = 5.0
LOST_AFTER_S = 30.0
# SLURM sends it before the time limit (#SBATCH --signal, echobench.sweep.executors.slurm) to every process
# of the launch: the workers dump their stacks; the launcher and torchrun's agent, which it would end,
# ignore it (the job script's `trap '' USR1` before the launcher starts; ignored, it stays so in
# their children until a worker registers its dump).
STACK_SIGNAL = signal.SIGUSR1
LAUNCHED = "ECHOBENCH_LAUNCHED"  # set for the workers of echobench's launcher: it prints the record, they do not
# SIGTERM ends a launcher (srun's --kill-on-bad-exit when another node's failed, scancel, a time limit) and SIGKILL
# follows after the cluster's KillWait (30 s by default, 5 s on scripts/slurm-local.sh's): node 0's then waits at
# most this long for the nodes' notes not there yet before it writes the record.
STOPPED_NOTE_WAIT_S = 2.0
STOPPED_EXIT = 128 + signal.SIGTERM  # the launcher's exit code once SIGTERM stopped it, as a shell reports it


class Stopped(BaseException):
    """SIGTERM reached the launcher. A BaseException, as KeyboardInterrupt: no `except Exception` swallows it."""


class SigtermStops:
    """While in place (until restore), SIGTERM raises Stopped in the main thread, once: a second one must
    not cut the record's writing short. Inside `deferred()` it is raised at the block's end: a child being
    started must exist to have SIGTERM passed on. (The disposition stays a handler, never SIG_IGN, which
    a child would inherit.)"""

    def __init__(self):
        self.stopped = self.defer = False
        self.before = signal.signal(signal.SIGTERM, self.handle)

    def handle(self, signum, frame) -> None:
        if self.stopped:
            return
        self.stopped = True
        if not self.defer:
            raise Stopped()

    @contextlib.contextmanager
    def deferred(self):
        self.defer = True
        try:
            yield
        finally:
            self.defer = False
            if self.stopped:
                raise Stopped()

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self.before)


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker. torchrun's own variable, not RANK: pyxis and enroot's
    hooks set RANK / LOCAL_RANK / WORLD_SIZE in a container's launcher process too."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def dump_stacks_on_signal() -> None:
    """A worker: every thread's stack to stderr on STACK_SIGNAL (at the signal, even inside a collective).
    Nothing where stderr is no file (a test's captured output: there is no log to dump into)."""
    try:
        faulthandler.register(STACK_SIGNAL, all_threads=True)
    except (AttributeError, ValueError, io.UnsupportedOperation):
        pass


def ignore_stack_signal() -> None:
    """The launcher and torchrun's agent: STACK_SIGNAL would end them (its default action)."""
    signal.signal(STACK_SIGNAL, signal.SIG_IGN)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def node_note_path(out_dir: Path, node_rank: int) -> Path:
    return Path(out_dir) / "ranks" / f"node-{node_rank}.json"


def rank_failures(out_dir: Path) -> list[dict]:
    """The failures ranks recorded in OUT/ranks/rank-N.json (unreadable files skipped), and one
    for each worker that torchrun saw die without leaving its own (killed by a signal, or gone
    before it could write): its rank, node, host, pid, exit code and signal."""
    ranks = Path(out_dir) / "ranks"
    failures = [f for p in sorted(ranks.glob("rank-*.json")) if (f := _read_json(p)) is not None]
    recorded = {f.get("rank") for f in failures}
    for path in sorted(ranks.glob("node-*.json")):
        note = _read_json(path) or {}
        for worker in note.get("failures", []):
            if worker.get("rank") in recorded:
                continue  # its own file says more
            recorded.add(worker["rank"])
            failures.append(silent_failure(worker, note, int(path.stem.removeprefix("node-"))))
    return failures


def silent_failure(worker: dict, note: dict, node_rank: int) -> dict:
    """A failure entry, like a rank's own, for a worker that died without writing one. Its node is
    named as SLURM names it (what a user can drain or look up), its host name where there is none."""
    rank, code, sig = worker["rank"], worker.get("exit_code"), worker.get("signal")
    how = f"killed by {sig} (exit code {code})" if sig else f"exited with code {code}"
    where = note.get("node") or note.get("host")
    return {"rank": rank, "status": RunState.ERROR, "failed_at": note.get("at"), "node_rank": node_rank,
            "local_rank": worker.get("local_rank"), "hostname": note.get("host"), "pid": worker.get("pid"),
            "exit_code": code, "signal": sig,
            "error": f"rank {rank} (node {node_rank}, {where}, pid {worker.get('pid')}): {how}, "
                     f"leaving no error of its own"}


def every_rank(record: Record, nproc: int, out_dir: Path) -> Record:
    """A failed run's record with every rank in failed_ranks: each rank that left no word of its own
    (no file, not in its torchrun's note, not on a lost node) was stopped with the run, by its
    torchrun or by srun, at whatever point the teardown found it. Which of them got to write first
    is a race; the ranks the record lists are not."""
    if not record.failed_ranks:
        return record
    heard = set(record.failed_ranks)
    quiet = [{"rank": r, "status": RunState.ERROR, "node_rank": r // nproc, "local_rank": r % nproc, "stopped": True,
              "error": f"rank {r} ({', '.join(filter(None, [f'node {r // nproc}', beat_name(out_dir, r // nproc)]))}): "
                       f"stopped with the run, leaving no error of its own"}
             for r in range(record.world_size) if r not in heard]
    return record.update(failed_ranks=sorted(heard | {q["rank"] for q in quiet}), per_rank=[*record.per_rank, *quiet])


def missing_notes(out_dir: Path, nnodes: int) -> list[int]:
    """The nodes other than node 0 (whose launcher asks: its torchrun has ended, or is being stopped with it)
    whose torchrun has not said how it ended."""
    return [k for k in range(1, nnodes) if not node_note_path(out_dir, k).exists()]


def wait_for_node_notes(out_dir: Path, nnodes: int, timeout_s: float | None = None) -> list[int]:
    """Until every other node's torchrun has said how it ended, or timeout_s (NODE_NOTE_WAIT_S); then, for the
    nodes that did not, until each either says so or is lost (its launcher silent for LOST_AFTER_S).
    Returns the lost nodes."""
    deadline = time.monotonic() + (NODE_NOTE_WAIT_S if timeout_s is None else timeout_s)
    while True:
        missing = missing_notes(out_dir, nnodes)
        lost = lost_nodes(out_dir, missing)
        if not missing or (time.monotonic() >= deadline and (lost == missing or
                                                             time.monotonic() >= deadline + LOST_AFTER_S)):
            return lost
        time.sleep(0.2)


def heartbeat_path(out_dir: Path, node_rank: int) -> Path:
    return Path(out_dir) / "ranks" / f"node-{node_rank}.alive"


def start_heartbeat(out_dir: Path, node_rank: int) -> threading.Event:
    """Notes every HEARTBEAT_S, in OUT/ranks/node-K.alive, that this node's launcher lives (the time by
    this node's clock, its host and SLURM node name); set the returned event to stop."""
    stop = threading.Event()
    path = heartbeat_path(out_dir, node_rank)
    me = {"host": socket.gethostname(), "node": os.environ.get("SLURMD_NODENAME"), "pid": os.getpid()}

    def beat() -> None:
        try:
            write_json_atomic(path, {**me, "at": time.time()})  # never half a file: that would read as a lost node
        except OSError:
            pass  # a full or flaky filesystem: the next beat tries again

    def beating() -> None:
        while not stop.wait(HEARTBEAT_S):
            beat()

    beat()  # the first before the launch: the node has its name from the start
    threading.Thread(target=beating, daemon=True, name="echobench-heartbeat").start()
    return stop


def lost_nodes(out_dir: Path, nodes: list[int], now: float | None = None) -> list[int]:
    """Those of `nodes` whose launcher is silent: no note of how their torchrun ended and no heartbeat
    for LOST_AFTER_S (the launcher, torchrun and workers of the node are gone at once: the node died)."""
    now = time.time() if now is None else now
    return [k for k in nodes if not node_note_path(out_dir, k).exists()
            and now - float((_read_json(heartbeat_path(out_dir, k)) or {}).get("at", 0.0)) > LOST_AFTER_S]


def beat_name(out_dir: Path, k: int) -> str | None:
    """Node k's name as its launcher's heartbeat gave it: SLURM's, else the host's (None without one)."""
    beat = _read_json(heartbeat_path(out_dir, k)) or {}
    return beat.get("node") or beat.get("host")


def node_name(out_dir: Path, k: int) -> str:
    """Node k of a run as its heartbeat named it: "node 1 (gpu-0042)"."""
    name = beat_name(out_dir, k)
    return f"node {k}" + (f" ({name})" if name else "")


def blame_lost_nodes(record: Record, lost: list[int], nproc: int, out_dir: Path) -> Record:
    """The run failed because these nodes went down: status node_fail, the first lost node named, and
    the surviving ranks' errors (a peer's "Connection reset by peer", a collective timeout) said to follow
    from it. Each rank of a lost node gets a line in per_rank."""
    peers = f"; the other ranks' errors follow from it (first: {record.error})" if record.error else ""
    gone = [{"rank": k * nproc + i, "status": RunState.NODE_FAIL, "node_rank": k, "local_rank": i,
             "error": f"lost with {node_name(out_dir, k)}"} for k in lost for i in range(nproc)]
    return record.update(
        status=RunState.NODE_FAIL, cause_rank=gone[0]["rank"],
        error=f"{', '.join(node_name(out_dir, k) for k in lost)} went down: its launcher, torchrun and workers "
              f"stopped at once, leaving no word (silent over {LOST_AFTER_S:.0f} s){peers}",
        failed_ranks=sorted({*(record.failed_ranks or []), *(g["rank"] for g in gone)}),
        per_rank=[*record.per_rank, *gone])


def lost_node_record(cfg: RunConfig, out_dir: Path) -> Record | None:
    """The record of a multi-node run whose ranks or nodes said they failed and one of whose nodes went
    silent, where no launcher wrote one (node 0 was the one lost): status node_fail naming the node."""
    if cfg.nodes < 2 or (out_dir / RECORD_FILE).exists():
        return None
    failures = rank_failures(out_dir)
    if not failures and not any(node_note_path(out_dir, k).exists() for k in range(cfg.nodes)):
        return None  # nothing says the run failed: a silent node may be a slow one
    if not (lost := lost_nodes(out_dir, list(range(cfg.nodes)))):
        return None
    record = Record.without_run(cfg, RunState.NODE_FAIL, "")
    if failures:
        record.fail(failures)
    return every_rank(blame_lost_nodes(record, lost, cfg.gpus_per_node, out_dir), cfg.gpus_per_node, out_dir)


def clear_previous(out_dir: Path) -> None:
    """A rerun into the same directory must not report the previous run's result."""
    (out_dir / RECORD_FILE).unlink(missing_ok=True)
    shutil.rmtree(out_dir / "ranks", ignore_errors=True)


def numa_binding_args(binding: str) -> list[str]:
    """torchrun's --numa-binding (each rank on the CPUs near its GPU), where this torch has it.
    ValueError without numactl, which it runs (and does not fall back from)."""
    if shutil.which("numactl") is None:
        raise ValueError(f"slurm.numa_binding={binding} needs the numactl command on the nodes (in the image), and "
                         f"{socket.gethostname()} has none: install numactl, or drop slurm.numa_binding")
    from torch.distributed.run import get_args_parser  # lazy: torch, not needed by the launcher's other paths

    if "--numa-binding" not in get_args_parser()._option_string_actions:
        import torch  # lazy: as above

        print(f"echobench: slurm.numa_binding={binding} ignored: torch {torch.__version__}'s torchrun has no "
              f"--numa-binding (newer releases have it)", file=sys.stderr)
        return []
    return [f"--numa-binding={binding}"]


def rendezvous_problem(nnodes: int, node_rank: int, master_addr: str | None) -> str | None:
    """Why a launcher of these flags would never meet the other nodes, or None. A node other than
    the first without --master-addr would wait at its own 127.0.0.1, silently, for ever."""
    if node_rank < 0:
        return f"--node-rank {node_rank}: must be 0 or more"
    if node_rank >= nnodes:
        return f"--node-rank {node_rank}: must be below --nnodes {nnodes}"
    if node_rank > 0 and not master_addr:
        return (f"--node-rank {node_rank} of --nnodes {nnodes} needs --master-addr: the host name or address of the "
                f"first node (node rank 0), where the nodes meet")
    return None


def rendezvous_note(nnodes: int, node_rank: int, master_addr: str | None, master_port: int) -> str:
    """What a launcher of several nodes says before it waits for the others: torchrun prints
    nothing until every node has come."""
    where = f"{master_addr or '127.0.0.1'}:{master_port}"
    return f"node {node_rank} of {nnodes}: waiting for the other nodes at {where} (rendezvous; --master-addr names " \
           f"the first node)"


def rank_preload(device: str, imports: Sequence[str]) -> tuple[str, ...]:
    """The modules a node's workers are forked with (torchrun_command's preload): on a CPU run, what the node
    check imports (nodecheck.RUN_PATH, then `imports`: a run's run_imports), imported once per node
    instead of once per worker, which is most of a CPU worker's start (torch, transformers, megatron-core).
    () on a GPU (device cuda or auto), whose workers torchrun starts as processes of their
    own: a module that touched CUDA before the fork would leave every forked worker without it, and that has
    not been checked on a GPU."""
    return RUN_PATH + tuple(imports) if device == "cpu" else ()


def torchrun_command(run_args: list[str], nproc: int, nnodes: int, node_rank: int,
                     master_addr: str | None, master_port: int, note: Path, command: str = "run",
                     preload: Sequence[str] = ()) -> list[str]:
    """torchrun (through echobench.train.torchrun, which writes `note` when it ends) for this node, its
    workers running `echobench COMMAND RUN_ARGS` (calibrate --comm too: commcalibrate.launch_node).
    With `preload`, the workers are forked from a forkserver that imported those modules (torchrun's
    --run-path entry point, started with --start-method=forkserver); else each is a `python -m echobench`
    of its own. With several nodes it says on stderr where it is about to wait for the others; ValueError
    (rendezvous_problem) for flags that would wait for ever."""
    if problem := rendezvous_problem(nnodes, node_rank, master_addr):
        raise ValueError(problem)
    cmd = [sys.executable, "-m", "echobench.train.torchrun", str(note)]
    if preload:
        cmd.append(f"--preload={','.join(preload)}")
    cmd.append(f"--nproc-per-node={nproc}")
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node-rank={node_rank}",
                f"--master-addr={master_addr or '127.0.0.1'}", f"--master-port={master_port}"]
    if nnodes > 1:
        print(f"echobench: {rendezvous_note(nnodes, node_rank, master_addr, master_port)}", file=sys.stderr, flush=True)
    if binding := os.environ.get("ECHOBENCH_NUMA_BINDING"):  # slurm.numa_binding, set by the job script
        cmd += numa_binding_args(binding)
    if preload:
        return cmd + ["--run-path", "--start-method=forkserver", str(Path(__file__).parents[1] / "__main__.py"),
                      command, *run_args]
    return cmd + ["-m", "echobench", command, *run_args]


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL torch loads on this node (None without a GPU build)."""
    import torch  # lazy: the launcher's torch, only where a fabric needs the NCCL version

    try:
        return tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - a build without NCCL
        return None


def source_root() -> Path:
    """The directory that holds this echobench package (a source checkout, or site-packages)."""
    return Path(__file__).resolve().parents[2]


def with_source_path(env: dict) -> dict:
    """`env` with source_root() first on PYTHONPATH: works from a source checkout too, the
    children import this very package."""
    env["PYTHONPATH"] = str(source_root()) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: what SLURM or taskset gave the job), not
    every CPU of the node."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def child_env(nproc: int, cfg: RunConfig | None = None) -> dict:
    env = with_source_path(dict(os.environ))
    env[LAUNCHED] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # forked workers' output line by line, as torchrun's `python -u` gives the others
    # Share the job's cores between the local ranks instead of oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cpus() // nproc)))
    if fabric := env.get("ECHOBENCH_FABRIC"):  # the job's slurm.fabric: what only the node can decide
        for key, value in launch_env(fabric, env, nccl_version()).items():
            env[key] = value
    if cfg is not None and cfg.framework == "megatron" and cfg.tp > 1:
        # One hardware queue per device: megatron-core's TP communication then overlaps the GEMMs
        # it is issued beside (read when the CUDA context starts; the record's env keeps it).
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    return env


def launch(cfg: RunConfig, out_dir: Path, nproc: int | None, nnodes: int = 1, node_rank: int = 0,
           master_addr: str | None = None, master_port: int = 29500) -> tuple[Record | None, int]:
    """Runs torchrun for this node (one `echobench run` process when nproc is None); the workers
    read the resolved settings from a YAML file. SIGTERM from here on ends it with a record all the
    same (stopped_record), and exit code STOPPED_EXIT.

    Returns (the run's record, torchrun's exit code); the record is None on nodes other than 0."""
    started = time.time()
    sigterm = SigtermStops()
    nodes = nnodes if nproc is not None else 0
    proc = beating = None
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if node_rank == 0:
            clear_previous(out_dir)
        beating = start_heartbeat(out_dir, node_rank) if nodes > 1 else None
        cmd = node_command(cfg, out_dir, nproc, nnodes, node_rank, master_addr, master_port)
        env = child_env(nproc or 1, cfg)
        ignore_stack_signal()
        with sigterm.deferred():
            proc = subprocess.Popen(cmd, env=env)
        code = proc.wait()
        return (finalize(cfg, out_dir, code, started, nodes) if node_rank == 0 else None), code
    except Stopped:
        pass_on_sigterm(proc)
        return (stopped_record(cfg, out_dir, started, nodes) if node_rank == 0 else None), STOPPED_EXIT
    finally:
        sigterm.restore()
        if beating is not None:
            beating.set()


def node_command(cfg: RunConfig, out_dir: Path, nproc: int | None, nnodes: int, node_rank: int,
                 master_addr: str | None, master_port: int) -> list[str]:
    """This node's command (torchrun, or one `echobench run` process when nproc is None), its
    settings written to OUT/run-nodeK.yaml."""
    config_path = out_dir / f"run-node{node_rank}.yaml"
    config_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    run_args = ["--config", str(config_path), "--out", str(out_dir)]
    if nproc is None:
        return [sys.executable, "-m", "echobench", "run", *run_args]
    return torchrun_command(run_args, nproc, nnodes, node_rank, master_addr, master_port,
                            node_note_path(out_dir, node_rank),
                            preload=rank_preload(cfg.device, run_imports(cfg)))


def pass_on_sigterm(proc: subprocess.Popen | None) -> None:
    """SIGTERM to torchrun, which stops its workers (under SLURM every process of the step has it already;
    a launcher killed by hand passes it on)."""
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)


def launch_repeats(cfg: RunConfig, out_dir: Path, repeats: int, nproc: int | None = None, nnodes: int = 1,
                   node_rank: int = 0, master_addr: str | None = None, master_port: int = 29500) -> tuple[list[Record], int]:
    """`run --repeats N`: N independent launches (fresh processes each) into OUT/repeat-K, the
    repeat index counted from cfg.repeat; returns their records (none on nodes other than 0) and
    the first non-zero torchrun exit code (0 when every launch exited 0)."""
    records, first_code = [], 0
    for k in range(repeats):
        record, code = launch(replace(cfg, repeat=cfg.repeat + k), out_dir / f"repeat-{k}", nproc, nnodes, node_rank,
                              master_addr, master_port)
        first_code = first_code or code
        if record is not None:
            records.append(record)
        if code == STOPPED_EXIT:  # SIGTERM: the job is being ended, start no other launch
            break
    return records, first_code


def finalize(cfg: RunConfig, out_dir: Path, exit_code: int, started: float, nnodes: int = 0) -> Record:
    """Returns the run's record, writing one from the rank files when rank 0 could not (after
    waiting for the notes of the `nnodes` nodes' torchrun, which name workers killed by a signal)."""
    path = out_dir / RECORD_FILE
    if path.exists() and path.stat().st_mtime >= started - 1:
        return Record.load(path)
    from echobench.train.bench_record import start_record  # lazy: imports torch; only a run rank 0 did not record needs it
    from echobench.train.distributed import pick_device

    lost = wait_for_node_notes(out_dir, nnodes) if nnodes > 1 else []
    record = start_record(cfg, pick_device(cfg.device))
    assemble(record, cfg, out_dir, lost, f"torchrun exited with code {exit_code} and no rank left a record; see the log")
    record.save(out_dir)
    return record


def stopped_record(cfg: RunConfig, out_dir: Path, started: float, nnodes: int = 0) -> Record:
    """The record when SIGTERM stopped node 0's launcher: rank 0's own if it wrote one, else one
    from the ranks' and nodes' files as finalize writes it, at once (the notes of other nodes waited
    for STOPPED_NOTE_WAIT_S at most, and no torch to import: SIGKILL follows), without the device
    details only torch would give."""
    path = out_dir / RECORD_FILE
    if path.exists() and path.stat().st_mtime >= started - 1:
        return Record.load(path)
    deadline = time.monotonic() + STOPPED_NOTE_WAIT_S
    while nnodes > 1 and missing_notes(out_dir, nnodes) and time.monotonic() < deadline:
        time.sleep(0.1)
    lost = lost_nodes(out_dir, missing_notes(out_dir, nnodes)) if nnodes > 1 else []
    record = Record.without_run(cfg, RunState.ERROR, "", env=launcher_env(
        "echobench launcher, node 0 (stopped by SIGTERM: srun ending the job step, scancel or a time limit)"))
    assemble(record, cfg, out_dir, lost, "the launcher was stopped by SIGTERM (srun ending the job step, scancel or "
                                         "a time limit) before any rank failed; see the log")
    record.save(out_dir)
    return record


def launcher_env(recorded_by: str) -> Env:
    """The record's env as this launcher knows it without torch: its host, pid, Python, the time, the
    scheduler's, fabric's and container's context (the device's details are the ranks', which torch gives)."""
    return Env(hostname=socket.gethostname(), pid=os.getpid(), python=platform.python_version(), time=now_iso(),
               recorded_by=recorded_by, **scheduler_context())


def assemble(record: Record, cfg: RunConfig, out_dir: Path, lost: list[int], no_failure: str) -> Record:
    """A run's record from what its ranks and nodes left: the failures, the lost nodes, every rank
    accounted for; `no_failure` is the error where neither says anything."""
    if failures := rank_failures(out_dir):
        record.fail(failures)
    elif not lost:
        record.update(status=RunState.ERROR, error=no_failure)
    if lost:
        blame_lost_nodes(record, lost, cfg.gpus_per_node, out_dir)
    return every_rank(record, cfg.gpus_per_node, out_dir)
