"""Faults on the local SLURM cluster.

A node killed outright mid-run (issue 33): its slurmd, step daemon, launcher and workers at once
(`scripts/slurm-local.sh kill NODE`), while the other node's rank trains. The run is recorded
`node_fail` naming that node, the survivor's "Connection closed by peer" said to follow from it;
`status` takes it from what the ranks wrote and cancels the job that waits on the dead node (not
SLURM's node timeout, minutes later); `slurm-local.sh up` brings the node back. Before the kill,
SLURM's USR1 (`scancel --signal=USR1`, as --signal sends it before a time limit) has each rank dump
its stacks: the handshake that it is in its training loop, required of each rank.

A worker SIGKILLed on node 1 of an HSDP run (issue 43): srun then stops node 0's launcher, before or
after its ranks noticed; the record is the same every time.
"""

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, TINY_CARD, run_cli, wait_for
from test_slurm import cluster, hostnames  # noqa: F401 - 2 or more nodes that answer
from test_slurm_submit import answering_cluster

pytestmark = [pytest.mark.slurm]

# A model card's tiny decoder: what these faults do to a run is the launcher's, whatever it trains.
TINY = {"card": TINY_CARD, "steps": 100000, "warmup_steps": 1, "micro_batch": 2}


def local_cluster_only() -> None:
    if not Path("/etc/slurm/slurm.conf").read_text().startswith("# echobench slurm-local"):
        pytest.skip("kills a node: only on the cluster scripts/slurm-local.sh runs")


def ranks_in_loop(log: str) -> set[str]:
    """The node labels (srun -l's "K: ") of the log's lines that show a stack inside the training loop:
    with one rank per node, the ranks that have said they train."""
    return {label for line in log.splitlines() if "in run_loop" in line
            and (label := line.partition(": ")[0]).isdigit()}


# It kills a node: the cluster to itself (cluster_lock), in the worker of tests/test_slurm.py, whose
# sweep holds the cluster for minutes (elsewhere this test's worker would idle that long).
@pytest.mark.cluster_exclusive
@pytest.mark.xdist_group("slurm-sweep")
def test_a_node_killed_mid_run_is_named_as_the_cause_and_the_run_settled_from_its_ranks(tmp_path, cluster):
    local_cluster_only()
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({
        "name": "nodefail", "executor": "slurm", "hardware": {"peak_tflops": 0.5}, "defaults": TINY,
        "slurm": {"time": "00:15:00", "gpus_per_node": 1, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1}},
        "include": [{"framework": "torchtitan", "parallelism": "ddp", "nodes": 2, "gpus_per_node": 1}]}))
    out = tmp_path / "sweep"
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (rid, entry), = json.loads((out / "sweep.json").read_text())["runs"].items()
    job, run_dir = entry["job_id"], out / rid

    def training():
        """each rank (node 0's and node 1's) dumped a stack inside its training loop (USR1, as --signal sends
        it); the job's nodes"""
        subprocess.run(["scancel", "--signal=USR1", job], capture_output=True)
        log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("slurm-*.out"))
        nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
        return nodes if ranks_in_loop(log) >= {"0", "1"} else None

    try:
        nodes = wait_for(training, timeout_s=600, every_s=5)
        hosts = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True).stdout.split()
        victim = hosts[1]  # node rank 1: node 0's launcher is the one that writes the record
        subprocess.run(["bash", str(ROOT / "scripts" / "slurm-local.sh"), "kill", victim], check=True)

        def settled():
            """status says the run is over"""
            rows = json.loads(run_cli("status", out, "--json", tmp_path=tmp_path).stdout)
            return rows if rows[0]["state"] not in ("pending", "running") else None

        (row,) = wait_for(settled, timeout_s=600, every_s=2)
        record = json.loads((run_dir / "result.json").read_text())
        assert row["state"] == "node_fail" == record["status"], record["error"]
        assert record["error"].startswith(f"node 1 ({victim}) went down: its launcher, torchrun and workers stopped "
                                          f"at once"), record["error"]
        assert "the other ranks' errors follow from it (first: rank 0: " in record["error"]
        assert record["cause_rank"] == 1 and record["failed_ranks"] == [0, 1]
        lost = next(r for r in record["per_rank"] if r["rank"] == 1)
        assert (lost["status"], lost["node_rank"]) == ("node_fail", 1)
        # Settled from the ranks' files, the job that waited on the dead node cancelled: not SLURM's NODE_FAIL.
        state = subprocess.run(["squeue", "-h", "-t", "all", "-j", job, "-o", "%T"], capture_output=True,
                               text=True).stdout.strip()
        assert state in ("CANCELLED", "COMPLETING"), state
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        back = subprocess.run(["bash", str(ROOT / "scripts" / "slurm-local.sh"), "up", str(len(cluster))],
                              capture_output=True, text=True)
    assert back.returncode == 0 and ("brought back: " in back.stdout or "up with" in back.stdout), back.stdout + back.stderr
    assert "*" not in subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout


FAULT = {"framework": "torchtitan", "parallelism": "hsdp", "nodes": 2, "gpus_per_node": 2, "fail_rank": 2,
         "fail_kind": "sigkill", "collective_timeout_s": 900}


@pytest.fixture
def two_nodes(tmp_path):
    """2 or more nodes that answer (this test's own: tests/test_slurm.py's, module-wide, would put it in
    that module's pytest-xdist worker); its jobs scancelled after the test."""
    yield from answering_cluster(tmp_path, min_nodes=2)


def test_a_worker_killed_on_node_1_gives_the_same_record_every_time(tmp_path, two_nodes):
    """kill -9 of rank 2, the first worker of node 1 of an HSDP run (2 nodes x 2): node 1's launcher
    fails, and srun stops node 0's (SIGTERM) at once, whether or not node 0's ranks have noticed the
    dead peer yet. Twice at step 2 (every rank has passed step 1's collectives with rank 2:
    each is in its training loop, and node 0's ranks race srun to say so), once at start-up (node 0's
    ranks wait in the rendezvous and never notice: srun always stops their launcher first). The three
    jobs run side by side, which loads the machine. Every record: status error, rank 2 the cause,
    named by its node's SLURM name and the signal, every rank in failed_ranks, and nothing of the
    job's exit code."""
    matrix = tmp_path / "m.yaml"
    # Two of the racing case (each more costs a 2 x 2 job on the loaded machine) and one at start-up.
    matrix.write_text(json.dumps({
        "name": "fault", "executor": "slurm", "hardware": {"peak_tflops": 0.5}, "defaults": {**TINY, "steps": 20},
        "slurm": {"time": "00:15:00", "gpus_per_node": 2, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1}},
        "include": [{**FAULT, "seed": k, "fail_at_step": 2} for k in range(2)]
                   + [{**FAULT, "seed": 2, "fail_at_step": -1}]}))
    out = tmp_path / "sweep"
    proc = run_cli("sweep", matrix, "--out", out, "--no-preflight", "--poll", "2", tmp_path=tmp_path, timeout=1800)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr  # the runs failed
    seen = set()
    for rid, entry in json.loads((out / "sweep.json").read_text())["runs"].items():
        record = json.loads((out / rid / "result.json").read_text())
        info = subprocess.run(["scontrol", "show", "job", "-o", entry["job_id"]], capture_output=True, text=True).stdout
        node1 = hostnames(re.search(r"\bNodeList=(\S+)", info).group(1))[1]
        pid = next(r["pid"] for r in record["per_rank"] if r["rank"] == 2)
        assert record["error"] == (f"rank 2 (node 1, {node1}, pid {pid}): killed by SIGKILL (exit code -9), leaving no "
                                   f"error of its own"), (rid, record["error"])
        assert (record["status"], record["cause_rank"], record["failed_ranks"]) == ("error", 2, [0, 1, 2, 3]), rid
        seen.add((record["status"], record["cause_rank"], tuple(record["failed_ranks"]),
                  record["error"].replace(f"{node1}, pid {pid}", "NODE, pid PID")))
    assert len(seen) == 1, seen  # three runs, one record
