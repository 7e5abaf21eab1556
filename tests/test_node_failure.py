"""A node killed outright mid-run on the local SLURM cluster (issue 33): its slurmd, step daemon,
launcher and workers at once (`scripts/slurm-local.sh kill NODE`), while the other node's rank
trains. The run is recorded `node_fail` naming that node, the survivor's "Connection closed by
peer" said to follow from it; `status` takes it from what the ranks wrote and cancels the job that
waits on the dead node (not SLURM's node timeout, minutes later); `slurm-local.sh up` brings the
node back. Before the kill, SLURM's USR1 (`scancel --signal=USR1`, as --signal sends it before a
time limit) has each rank dump its stacks: the handshake that it is in its training loop."""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from test_slurm import cluster  # noqa: F401 - 2 or more nodes that answer
from test_slurm_submit import wait_for

# It kills a node: the cluster to itself (cluster_lock), in the worker of tests/test_slurm.py, whose
# sweep holds the cluster for minutes (elsewhere this test's worker would idle that long).
pytestmark = [pytest.mark.slurm, pytest.mark.cluster_exclusive, pytest.mark.xdist_group("slurm-sweep")]

TINY = {"scale": "tiny", "steps": 100000, "warmup_steps": 1, "micro_batch": 2, "audio_frames": 50, "text_tokens": 16,
        "speaker_frames": 40}


def local_cluster_only() -> None:
    if not Path("/etc/slurm/slurm.conf").read_text().startswith("# echobench slurm-local"):
        pytest.skip("kills a node: only on the cluster scripts/slurm-local.sh runs")


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
        """every rank dumped a stack inside its training loop (USR1, as --signal sends it); the job's nodes"""
        subprocess.run(["scancel", "--signal=USR1", job], capture_output=True)
        log = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("slurm-*.out"))
        nodes = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
        return nodes if log.count("in run_loop") >= 2 and "0: " in log and "1: " in log else None

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
