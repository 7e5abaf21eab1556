"""The launcher on a node (issue 33): threads from the CPUs the job has, not the node's; a worker
told apart from a launcher by torchrun's own variable; numactl required by numa_binding; stacks on
SLURM's USR1 before the time limit; a node that went down named as the cause from the files its
peers left; the lines of a log that explain an end."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import ROOT, cli_env, default_signals
from echobench.train import launch
from echobench.records.config import RunConfig
from echobench.sweep.executors import explaining_lines, short_tail
from echobench.records.results import Record


def test_threads_per_rank_follow_the_jobs_cpus_not_the_nodes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 288)  # a GH200 node's 4 x 72 cores
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))  # what SLURM gave this job
    env = launch.child_env(4)
    assert env["OMP_NUM_THREADS"] == "4" and env[launch.LAUNCHED] == "1"


def test_the_slingshot_launcher_adds_nccl_proto_for_nccl_2_27(monkeypatch):
    monkeypatch.setenv("ECHOBENCH_FABRIC", "slingshot")
    monkeypatch.delenv("NCCL_PROTO", raising=False)
    monkeypatch.setattr(launch, "nccl_version", lambda: (2, 27, 5))
    assert launch.child_env(4)["NCCL_PROTO"] == "^LL128"
    monkeypatch.setattr(launch, "nccl_version", lambda: (2, 21, 5))
    assert "NCCL_PROTO" not in launch.child_env(4)


def test_a_worker_is_told_by_torchruns_own_variable_not_rank(monkeypatch):
    """pyxis and enroot's hooks set RANK / LOCAL_RANK / WORLD_SIZE in a container's launcher too."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "0")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not launch.under_torchrun()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launch.under_torchrun()


def test_numa_binding_without_numactl_is_refused_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match=r"slurm.numa_binding=node needs the numactl command on the nodes .* install "
                                         r"numactl, or drop slurm.numa_binding"):
        launch.numa_binding_args("node")


STACKS = """
import sys, time
from echobench.train.launch import dump_stacks_on_signal, ignore_stack_signal
ignore_stack_signal() if sys.argv[1] == "launcher" else dump_stacks_on_signal()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("who", ["worker", "launcher"])
def test_usr1_makes_a_worker_dump_its_stacks_and_a_launcher_go_on(who):
    """SLURM sends USR1 (#SBATCH --signal) to every process of the launch: workers dump every
    thread's stack (faulthandler: even inside a collective); the launcher and torchrun's agent, for
    which USR1 would be the end, ignore it."""
    proc = subprocess.Popen([sys.executable, "-c", STACKS, who], env=cli_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    said = []
    try:
        assert proc.stdout.readline() == "ready\n"  # handlers in place
        proc.send_signal(signal.SIGUSR1)
        if who == "worker":
            said.append(proc.stderr.readline())
            while "<module>" not in said[-1] and said[-1]:  # the dump, to its outermost frame
                said.append(proc.stderr.readline())
        proc.send_signal(signal.SIGUSR1)  # a second one: still alive after it
        assert proc.poll() is None
    finally:
        proc.kill()
        err = "".join(said) + proc.communicate()[1]
    assert proc.returncode == -signal.SIGKILL  # ended by the kill, not by USR1
    if who == "worker":
        assert "most recent call first" in err and "<module>" in err, err
    else:
        assert err == "", err


def beat(out, node: int, age_s: float, name: str) -> None:
    path = launch.heartbeat_path(out, node)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": "vm", "node": name, "pid": 1, "at": time.time() - age_s}))


def rank_file(out, rank: int, error: str) -> None:
    path = out / "ranks" / f"rank-{rank}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rank": rank, "status": "error", "failed_at": 1.0, "error": error}))


def note(out, node: int) -> None:
    launch.node_note_path(out, node).write_text(json.dumps({"host": "vm", "ended": "workers failed", "at": 2.0,
                                                            "failures": [{"rank": node, "local_rank": 0, "pid": 9,
                                                                          "exit_code": 1, "signal": None}]}))


RESET = "rank 0: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29400"


def test_node_0s_launcher_names_the_node_that_went_down_not_its_survivors_error(tmp_path, monkeypatch):
    """Node 1 went down (its launcher, torchrun and workers at once): no note of how its torchrun
    ended, a heartbeat gone stale. Rank 0's "Connection closed by peer" follows from it."""
    monkeypatch.setattr(launch, "NODE_NOTE_WAIT_S", 0.2)
    rank_file(tmp_path, 0, RESET)
    note(tmp_path, 0)
    beat(tmp_path, 0, 0, "node1")
    beat(tmp_path, 1, launch.LOST_AFTER_S + 5, "node2")
    cfg = RunConfig(parallelism="ddp", nodes=2, gpus_per_node=1)
    record = launch.finalize(cfg, tmp_path, 1, time.time(), nnodes=2)
    assert record.status == "node_fail" and record.cause_rank == 1 and record.failed_ranks == [0, 1]
    assert record.error.startswith("node 1 (node2) went down: its launcher, torchrun and workers stopped at once")
    assert record.error.endswith(f"the other ranks' errors follow from it (first: {RESET})")
    assert Record.load(tmp_path / "result.json").status == "node_fail"


def test_a_silent_node_still_beating_is_not_taken_for_a_lost_one(tmp_path, monkeypatch):
    """A node whose launcher lives (NCCL peers wait in a collective until their timeout) is no node failure."""
    monkeypatch.setattr(launch, "NODE_NOTE_WAIT_S", 0.2)
    monkeypatch.setattr(launch, "LOST_AFTER_S", 0.5)
    rank_file(tmp_path, 0, RESET)
    note(tmp_path, 0)
    beat(tmp_path, 1, -60, "node2")  # a beat from the future stays fresh for this test's minute
    record = launch.finalize(RunConfig(parallelism="ddp", nodes=2, gpus_per_node=1), tmp_path, 1, time.time(), 2)
    assert record.status == "error" and record.cause_rank == 0


def test_the_sweep_names_node_0_lost_from_the_files_of_the_nodes_that_lived(tmp_path):
    """Node 0 went down with the launcher that writes the record: node 1's rank and note say the run
    failed, node 0's heartbeat stopped; the sweep writes the record (launch.lost_node_record)."""
    cfg = RunConfig(parallelism="ddp", nodes=2, gpus_per_node=1)
    assert launch.lost_node_record(cfg, tmp_path) is None  # nothing says it failed
    beat(tmp_path, 0, launch.LOST_AFTER_S + 5, "node1")
    beat(tmp_path, 1, 0, "node2")
    assert launch.lost_node_record(cfg, tmp_path) is None  # a slow node 0 is no failure yet
    rank_file(tmp_path, 1, "rank 1: RuntimeError: Connection reset by peer")
    note(tmp_path, 1)
    record = launch.lost_node_record(cfg, tmp_path)
    assert record.status == "node_fail" and record.cause_rank == 0 and "node 0 (node1) went down" in record.error
    assert record.env.recorded_by.startswith("echobench sweep")


def test_node_0s_launcher_stopped_by_sigterm_writes_the_record_from_the_files_at_once(tmp_path):
    """srun's --kill-on-bad-exit: node 1's launcher failed (its torchrun's note names rank 1, SIGKILLed),
    and SIGTERM reaches node 0's launcher before its own rank noticed (here it waits at the rendezvous for
    ever). It passes SIGTERM on to its torchrun and writes the record at once: rank 1 the cause, rank 0
    stopped with the run, exit 143."""
    from conftest import free_port
    from echobench.sweep.executors.local import processes_mentioning

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "echobench", "run", "--scale", "tiny", "--steps", "3", "--parallelism", "ddp",
           "--out", str(out), "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port())]
    env = {**cli_env(tmp_path), "ECHOBENCH_NCCL_TRANSPORT": "NET/Socket (preflight job 9)"}  # as the sweep sets it
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    try:
        said = []
        while not said or "waiting for the other nodes" not in said[-1]:  # its handler is in place; files cleared
            said.append(proc.stderr.readline())
            assert said[-1], "".join(said)
        launch.node_note_path(out, 1).parent.mkdir(exist_ok=True)
        launch.node_note_path(out, 1).write_text(json.dumps({
            "host": "vm", "node": "node7", "ended": "workers failed", "at": time.time(),
            "failures": [{"rank": 1, "local_rank": 0, "pid": 41, "exit_code": -9, "signal": "SIGKILL"}]}))
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    record = Record.load(out / "result.json")
    assert record.status == "error" and record.cause_rank == 1 and record.failed_ranks == [0, 1], record.error
    assert record.error == "rank 1 (node 1, node7, pid 41): killed by SIGKILL (exit code -9), leaving no error of its own"
    stopped = next(r for r in record.per_rank if r.rank == 0)
    assert stopped.stopped and stopped.error.startswith(f"rank 0 (node 0, {socket.gethostname()}): stopped with the run"), stopped.error
    assert record.env.recorded_by.startswith("echobench launcher, node 0 (stopped by SIGTERM")
    assert (record.env.pid, record.env.nccl_transport) == (proc.pid, "NET/Socket (preflight job 9)")
    deadline = time.monotonic() + 120  # its torchrun, SIGTERMed, goes too (by hand nobody else stops it)
    while processes_mentioning(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_mentioning(str(out)), "torchrun outlived its launcher's SIGTERM"


# A node failure's log as the local cluster wrote it: warnings, then the survivors' and srun's words.
NODE_FAIL_LOG = """\
0: /venv/lib/python3.11/site-packages/megatron/core/optimizer/__init__.py:24: UserWarning: Transformer Engine and Apex are not installed. Falling back to Torch optimizers.
0:   warnings.warn(
1: /venv/lib/python3.11/site-packages/torch/distributed/fsdp/_init_utils.py:444: FutureWarning: ...
1:   warnings.warn(
0: echobench: node 0 of 2: waiting for the other nodes at node1:29506 (rendezvous; --master-addr names the first node)
0: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29400
0: torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
srun: error: node1: task 0: Exited with exit code 1
0: /venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:9: UserWarning: ...
0:   warnings.warn(
"""


def test_the_lines_kept_of_a_log_explain_the_end_not_the_warnings():
    kept = explaining_lines(NODE_FAIL_LOG)
    assert kept == ["0: [rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection "
                    "closed by peer [127.0.0.1]:29400", "0: torch.distributed.elastic.multiprocessing.errors."
                    "ChildFailedError:", "srun: error: node1: task 0: Exited with exit code 1"]
    assert "warnings.warn" not in short_tail(NODE_FAIL_LOG)
    verdict = "slurmstepd: error: *** JOB 7 ON node1 CANCELLED AT 2026-12-02T01:00:00 DUE TO NODE FAILURE ***"
    assert explaining_lines(verdict + "\n" + NODE_FAIL_LOG)[0] == verdict
    assert explaining_lines("step 1\nstep 2\n") == ["step 1", "step 2"]  # nothing telling: the last lines
