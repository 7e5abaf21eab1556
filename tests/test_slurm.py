"""A real sweep on the local SLURM cluster (`bash scripts/slurm-local.sh up 2`): Echo's DDP across two
nodes and megatron TP=2 on one; on a model card's tiny decoder, an injected failure, a worker dying
at start-up on node 1, one SIGKILLed mid-run on node 1, a time-limit kill, a scancel (after a refused
requeue); then resumption; one sweep without a peak that also measures its own hardware profile first, on two nodes.

The module's sweep is submitted first and settled last: its slow run's time limit is brought close
as soon as its rank trains, and the tests that need only the cluster run while it counts down.

Works on any cluster of 2 or more nodes, whatever their names (read from sinfo). Skipped when no
cluster is up, unless ECHOBENCH_REQUIRE_SLURM=1 (CI), where that is a failure.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY_CARD, cli_env, cluster_lock, run_cli, wait_for

# With tests/test_node_failure.py, whose node kill must not meet this module's sweep: in one worker.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm-sweep")]

TINY = {"scale": "tiny", "steps": 3, "warmup_steps": 1, "micro_batch": 2, "audio_frames": 50, "text_tokens": 16,
        "speaker_frames": 40}
MATRIX = {
    "name": "slurm-ci",
    "executor": "slurm",
    # CPU nodes: no --gpus-per-node; `gpus_per_node` is processes per node.
    "slurm": {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1}},
    "hardware": {"peak_tflops": 0.5},
    "defaults": TINY,
    # Echo's two layouts; the failures, time limit and cancel are of the launch and the queue, and hold for
    # any workload: a model card's tiny decoder (TINY_CARD), cheaper to start.
    "include": [
        {"framework": "torchtitan", "parallelism": "ddp", "nodes": 2, "gpus_per_node": 1},
        {"framework": "megatron", "parallelism": "tp2", "nodes": 1, "gpus_per_node": 2},
        {"seed": 1, "fail_at_step": 2, "card": TINY_CARD},
        # USR1 (#SBATCH --signal) makes every rank dump its stacks a minute before SLURM kills it (a third of
        # its 3-minute limit). The limit is raised at once (a loaded machine may take longer to start it)
        # and brought close only once the rank has said it trains (both in `submitted`): the signal then finds
        # it in its loop, where it hangs (idle: its minutes cost the machine no CPU).
        {"seed": 2, "fail_at_step": 1, "fail_kind": "hang", "time_limit": "3", "card": TINY_CARD},
        {"seed": 3, "steps": 100000, "card": TINY_CARD},  # scancel'd by the test
        # Node 1's worker dies before the process group forms while node 0's waits for it. Within
        # its one-minute limit the job must end as an error naming rank 1, not as a timeout.
        # (Five minutes: far below the collective timeout, and room for three torch start-ups on a loaded machine.)
        {"seed": 4, "framework": "torchtitan", "parallelism": "ddp", "nodes": 2, "gpus_per_node": 1,
         "fail_at_step": -1, "fail_rank": 1, "collective_timeout_s": 900, "time_limit": "5", "card": TINY_CARD},
        # Node 1's worker is SIGKILLed mid-run: it writes nothing; rank 0 then loses its connection.
        {"seed": 5, "framework": "torchtitan", "parallelism": "ddp", "nodes": 2, "gpus_per_node": 1,
         "fail_at_step": 1, "fail_rank": 1, "fail_kind": "sigkill", "collective_timeout_s": 900, "time_limit": "5",
         "card": TINY_CARD},
    ],
}


def cluster_nodes() -> list[str]:
    """The names of the cluster's nodes (none when no controller answers)."""
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted(set(nodes.stdout.split())) if "UP" in ping.stdout else []


def hostnames(nodelist: str) -> list[str]:
    """A SLURM node list ("node[1-2]", "a01,b07") as names."""
    return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                          check=True).stdout.split()


@pytest.fixture(scope="module")
def cluster() -> list[str]:
    nodes = cluster_nodes()
    if len(nodes) < 2:
        message = "no local SLURM cluster with 2 or more nodes: bash scripts/slurm-local.sh up 2"
        if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return nodes


def runs(sweep: Path) -> dict:
    return json.loads((sweep / "sweep.json").read_text())["runs"]


def record(sweep: Path, rid: str) -> dict:
    return json.loads((sweep / rid / "result.json").read_text())


def squeue_state(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T"], capture_output=True,
                          text=True).stdout.strip()


def in_state(job_id: str, *states: str, timeout_s: float = 900) -> str:
    """Once the job is in one of `states` (as squeue says), that state; an AssertionError naming the job
    and where it stays after timeout_s."""
    def reached():
        return (state := squeue_state(job_id)) in states and state

    reached.__doc__ = f"SLURM job {job_id} {' or '.join(states)} (squeue says {squeue_state(job_id) or 'nothing'})"
    return wait_for(reached, timeout_s=timeout_s, every_s=2)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE")


@pytest.fixture(scope="module")
def submitted(cluster, tmp_path_factory):
    """Submits the matrix (its preflight first, on 2 nodes, fabric tcp), scancels one run once it
    runs; the rest still run. The module holds the cluster (cluster_lock) until they have settled:
    no test of another worker kills a node under them."""
    with cluster_lock():
        base = tmp_path_factory.mktemp("slurm")
        matrix = base / "slurm-ci.yaml"
        slurm = {**MATRIX["slurm"], "fabric": "tcp"}
        matrix.write_text(json.dumps({**MATRIX, "slurm": slurm}))
        out = base / "sweep"
        t0 = time.time()
        proc = run_cli("sweep", matrix, "--out", out, "--no-wait", tmp_path=base, timeout=900)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        preflight = proc.stdout
        submitted = runs(out)
        slow_id = next(rid for rid in submitted if record_seed(out, rid) == 2)
        slow = submitted[slow_id]["job_id"]
        subprocess.run(["scontrol", "update", f"JobId={slow}", "TimeLimit=20"], check=True)
        cancel_id = next(rid for rid in submitted if record_seed(out, rid) == 3)
        job = submitted[cancel_id]["job_id"]
        in_state(job, "RUNNING")
        time.sleep(3)
        # Jobs are submitted with --no-requeue: a requeue (as after a node failure) is refused, so it
        # can neither rerun the job under its id nor truncate its log.
        requeue = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        assert requeue.returncode != 0 and "disabled" in requeue.stderr, requeue
        assert squeue_state(job) == "RUNNING"
        subprocess.run(["scancel", job], check=True)
        # Here, not in `sweep`: the slow run's last minutes then pass while the tests below run.
        dumps = time_limit_once_training(out, slow_id, slow)
        yield {"dir": out, "matrix": matrix, "base": base, "submitted": submitted, "t0": t0, "nodes": cluster,
               "preflight": preflight, "slow_dumps": dumps}


def slurm_log(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("slurm-*.out")))


def run_time_s(job: str) -> int:
    """How long the job has run, by the controller's clock (scontrol's RunTime=[D-]HH:MM:SS)."""
    info = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    days, _, hms = re.search(r"\bRunTime=(\S+)", info).group(1).rpartition("-")
    h, m, s = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def run_loop_stacks(log: str) -> int:
    """How many of the log's stack dumps show the training loop. srun -l puts its "0: " label before each
    piece of output as it reads it, and faulthandler writes a frame's line in several pieces: the
    labels and line breaks go before counting."""
    return re.sub(r"\n(\d+: )?", "", log).count("in run_loop")


def time_limit_once_training(out: Path, rid: str, job: str) -> int:
    """The slow run's time limit, brought to 2 minutes away once its rank has said it is in its training
    loop (a stack dump on the test's own USR1): SLURM's USR1, a minute before the limit, then finds it
    there, however long the loaded machine took to start it. Returns how many of the log's stacks show
    the loop before SLURM's comes (ours, landed: SLURM's cannot come sooner than a minute after the change)."""
    def training():
        """the slow run's rank dumped a stack inside its training loop (on the test's USR1)"""
        if (state := squeue_state(job)) not in ("PENDING", "CONFIGURING", "RUNNING", ""):
            raise AssertionError(f"the slow run's job {job} ended {state} before its rank said it trains: "
                                 f"{slurm_log(out / rid)[-3000:]}")
        subprocess.run(["scancel", "--signal=USR1", job], capture_output=True)
        return run_loop_stacks(slurm_log(out / rid)) > 0

    wait_for(training, timeout_s=900, every_s=5)
    limit = run_time_s(job) + 120
    subprocess.run(["scontrol", "update", f"JobId={job}", f"TimeLimit={limit // 60}:{limit % 60:02d}"], check=True)
    time.sleep(20)  # the test's last dump, written at its signal, is in the log by then
    return run_loop_stacks(slurm_log(out / rid))


@pytest.fixture(scope="module")
def sweep(submitted):
    """The submitted sweep once every run has settled."""
    out, base = submitted["dir"], submitted["base"]
    proc = run_cli("status", out, "--wait", "--poll", "3", tmp_path=base, timeout=900)
    wall = time.time() - submitted["t0"]
    print(f"SLURM sweep wall time: {wall:.0f} s\n{proc.stdout}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr  # runs failed, as meant
    return {**submitted, "wall_s": wall}


# ---- while the module's sweep runs (`submitted`: these start once it is submitted) ----

def test_scripts_run_sh_works_by_hand(submitted):
    """`sbatch --nodes=1 scripts/run.sh RUN.yaml OUT`: the same launch, no sweep involved."""
    base = submitted["base"]
    run_yaml = base / "by-hand.yaml"
    run_yaml.write_text(json.dumps({**TINY, "card": TINY_CARD, "peak_tflops": 0.5}))
    out = base / "by-hand"
    env = {**cli_env(), "PYTHON": sys.executable}
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=1", f"--output={base}/by-hand-%j.out",
                           str(ROOT / "scripts" / "run.sh"), str(run_yaml), str(out)],
                          capture_output=True, text=True, env=env, cwd=base)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip()
    assert in_state(job, *ENDED) == "COMPLETED", (base / f"by-hand-{job}.out").read_text(errors="replace")
    assert json.loads((out / "result.json").read_text())["status"] == "ok"


def test_a_script_from_plan_write_scripts_submitted_by_hand_makes_what_it_needs(submitted):
    """Its run directory and run.yaml do not exist yet: the script writes them (its log goes beside
    the scripts, a directory that exists)."""
    base = submitted["base"]
    matrix = base / "by-hand-plan.yaml"
    matrix.write_text(json.dumps({**MATRIX, "name": "by-hand-plan", "include": [{"seed": 7, "card": TINY_CARD}]}))
    scripts, target = base / "scripts", base / "by-hand-sweep"
    proc = run_cli("plan", matrix, "--write-scripts", scripts, "--out", target, tmp_path=base)
    assert proc.returncode == 0 and not target.exists(), proc.stdout + proc.stderr
    (script,) = [p for p in scripts.glob("*.sh") if p.name != "preflight.sh"]  # the run's (and the preflight's)
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, cwd=base, check=True,
                         env=cli_env()).stdout.strip()
    ended = in_state(job, *ENDED)
    log = (scripts / "logs" / f"{script.stem}-{job}.out").read_text(errors="replace")
    assert ended == "COMPLETED", log[-3000:]
    assert json.loads((target / script.stem / "result.json").read_text())["status"] == "ok"
    assert (target / script.stem / "run.yaml").exists()


@pytest.fixture(scope="module")
def calibrating_sweep(cluster, submitted, tmp_path_factory):
    """One sweep for the two calibrations (the GEMM one, then the profile's, then the runs): no peak
    and hardware.calibrate_comm, a two-node run and a single one. (sweep dir, its `sweep` process)."""
    base = tmp_path_factory.mktemp("calibrating")
    matrix = base / "calibrating.yaml"
    matrix.write_text(json.dumps({
        **{k: v for k, v in MATRIX.items() if k not in ("hardware", "include")}, "name": "calibrating",
        "hardware": {"calibrate_comm": True, "comm_limits": {"budget_s": 0.5, "comm_budget_s": 2, "max_bytes": 65536}},
        "include": [{"framework": "torchtitan", "parallelism": "ddp", "nodes": 2, "gpus_per_node": 1}, {"seed": 1}]}))
    out = base / "sweep"
    proc = run_cli("sweep", matrix, "--out", out, "--poll", "2", "--no-preflight", tmp_path=base, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc


def test_a_sweep_without_a_peak_calibrates_once_on_a_compute_node(calibrating_sweep):
    """The CI cluster's nodes are CPUs: no datasheet peak. The sweep submits one calibration job
    into SWEEP/cache; the runs wait for it and report MFU against it."""
    out, proc = calibrating_sweep
    assert "calibrating once on a compute node" in proc.stdout
    (calibration,) = (out / "cache" / "calibration").glob("*.json")
    for rid in runs(out):
        r = record(out, rid)
        assert r["status"] == "ok" and r["peak_source"].startswith("calibrated"), r["error"]
        assert r["peak_tflops"] == json.loads(calibration.read_text())["tflops"]
    assert list((out / "logs").glob("calibrate-*.out"))


def test_a_two_node_sweep_with_calibrate_comm_measures_a_profile_with_an_inter_link_first(calibrating_sweep, tmp_path):
    """hardware.calibrate_comm on the cluster: one job on the sweep's largest node count (2 x 1) measures
    SWEEP/profile.yaml, one launcher per node, before the runs (which wait for it); `validate measured
    SWEEP` then prices the runs with it."""
    from echobench.hardware.profile import load_profile

    out, proc = calibrating_sweep
    assert "measuring a hardware profile once on 2 node(s) x 1 processes" in " ".join(proc.stdout.split())
    job = json.loads((out / "sweep.json").read_text())["comm_calibration_job"]
    log = (out / "logs" / f"calibrate-comm-{job}.out").read_text(errors="replace")
    profile = load_profile(out / "profile.yaml")
    assert profile.measured and "inter" in profile.links and "2 node(s)" in profile.note, log[-3000:]
    assert {p.group_size for fit in profile.links["inter"].values() for p in fit.points} == {2}  # one rank per node
    for rid in runs(out):
        assert record(out, rid)["status"] == "ok", record(out, rid)["error"]
    proc = run_cli("validate", "measured", out, "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {c["profile"] for c in json.loads(proc.stdout)} == {f"{profile.name} ({out.resolve() / 'profile.yaml'})"}


# ---- once it has settled ----

def test_the_sweep_runs_its_preflight_first_and_its_records_claim_no_nccl_transport_on_gloo(sweep):
    said = " ".join(sweep["preflight"].split())
    assert said.index("preflight passed") < said.index("submitted as"), said
    assert "(job " in said and "2 node(s) x 2 process(es), fabric tcp" in said
    for check in ("imports", "cpus", "interfaces", "collective"):
        assert f"ok {check} node 0" in said, check
    # These CPU nodes all-reduce on gloo: the transport check says so and reads no NCCL network.
    assert "(gloo)" in said and "skipped transport node 0,1: gloo: the ranks ran no NCCL" in said, said
    saved = json.loads((sweep["dir"] / "preflight.json").read_text())
    assert saved["passed"] and saved["transport"] is None
    for rid in sweep["submitted"]:
        assert record(sweep["dir"], rid)["env"]["nccl_transport"] is None, rid


def record_seed(sweep: Path, rid: str) -> int:
    import yaml

    return yaml.safe_load((sweep / rid / "run.yaml").read_text())["seed"]


def by_layout(sweep_info) -> dict:
    out = {}
    for rid in sweep_info["submitted"]:
        r = record(sweep_info["dir"], rid)
        key = (r["framework"], r["parallelism"]) if r["seed"] == 0 else r["seed"]
        out[key] = r
    return out


def test_ddp_ranks_rendezvous_across_two_nodes(sweep):
    r = by_layout(sweep)[("torchtitan", "ddp")]
    assert r["status"] == "ok", r["error"]
    assert r["nodes"] == 2 and r["gpus_per_node"] == 1 and r["world_size"] == 2 and len(r["per_rank"]) == 2
    run_dir = sweep["dir"] / r["run_id"]
    # One launcher per node, node rank from SLURM_NODEID: both wrote their settings file.
    assert (run_dir / "run-node0.yaml").exists() and (run_dir / "run-node1.yaml").exists()
    job = runs(sweep["dir"])[r["run_id"]]["job_id"]
    info = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    used = hostnames(re.search(r"\bNodeList=(\S+)", info).group(1))
    assert len(set(used)) == 2 and set(used) <= set(sweep["nodes"]), (used, sweep["nodes"])


def test_megatron_tp2_on_one_node(sweep):
    r = by_layout(sweep)[("megatron", "tp2")]
    assert r["status"] == "ok", r["error"]
    assert r["tp"] == 2 and r["dp"] == 1 and r["nodes"] == 1 and r["world_size"] == 2


def test_a_worker_dying_at_startup_on_node_1_ends_the_job_as_an_error_naming_it(sweep):
    r = by_layout(sweep)[4]
    # Not `timeout`: node 1's launcher exited with torchrun's code, srun stopped node 0's at once.
    assert r["status"] == "error", r["error"]
    assert r["error"].startswith("rank 1: InjectedFailure: injected failure at start-up on rank 1"), r["error"]
    assert r["cause_rank"] == 1 and 1 in r["failed_ranks"]


def test_a_worker_killed_by_a_signal_on_node_1_is_the_rank_named(sweep):
    """Not rank 0's "Connection reset by peer": the rank that died, its node and the signal (from
    node 1's torchrun, in RUN/ranks/node-1.json)."""
    r = by_layout(sweep)[5]
    assert r["status"] == "error" and r["cause_rank"] == 1, r["error"]
    assert r["error"].startswith("rank 1 (node 1, ") and "killed by SIGKILL (exit code -9)" in r["error"], r["error"]
    dead = next(p for p in r["per_rank"] if p["rank"] == 1)
    assert (dead["signal"], dead["node_rank"]) == ("SIGKILL", 1)


def test_failure_timeout_and_cancel_become_record_statuses(sweep):
    layouts = by_layout(sweep)
    failed, slow, cancelled = layouts[1], layouts[2], layouts[3]
    assert failed["status"] == "error" and "injected failure at step 2" in failed["error"]
    assert slow["status"] == "timeout" and "TIMEOUT" in slow["error"] and "TIME LIMIT" in slow["log_tail"]
    # Before the kill, SLURM's USR1 (the limit brought close once the rank trained): the rank's stacks in
    # the log, in its training loop, after those the test's own signal asked for.
    log = slurm_log(sweep["dir"] / slow["run_id"])
    assert run_loop_stacks(log) > sweep["slow_dumps"], log[-3000:]
    assert re.search(r'File "[^"]*echobench/[^"]*\.py", line \d+ in run_loop', re.sub(r"\n(\d+: )?", "", log)), log[-3000:]
    assert cancelled["status"] == "cancelled" and "CANCELLED" in cancelled["error"]
    for r in (slow, cancelled):  # written by the sweep from the scheduler's state: complete records
        assert r["env"]["recorded_by"].startswith("echobench sweep") and r["run_id"] in sweep["submitted"]
    proc = run_cli("status", sweep["dir"], "--export", tmp_path=sweep["base"])
    assert proc.returncode == 1 and "1 cancelled" in proc.stdout and "1 timeout" in proc.stdout
    import pandas as pd

    table = pd.read_parquet(sweep["dir"] / "results.parquet")
    assert sorted(table["run_id"]) == sorted(sweep["submitted"])


def test_second_sweep_submits_nothing_then_retry_failed_resubmits_exactly_the_failed(sweep):
    out, matrix, base = sweep["dir"], sweep["matrix"], sweep["base"]
    before = runs(out)
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", tmp_path=base)
    # 1: runs failed and are not rerun (docs/reference/failures.md#exit-codes)
    assert proc.returncode == 1 and "0 to run" in proc.stdout and "submitted as" not in proc.stdout
    assert "nothing to submit: 7 runs already have records (2 ok, 5 failed: --retry-failed reruns them)" in \
        " ".join(proc.stdout.split()), proc.stdout
    assert runs(out) == before
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", "--retry-failed", tmp_path=base)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    after = runs(out)
    try:
        failed = {rid for rid, e in before.items() if record_status(out, rid, e) != "ok"}
        resubmitted = {rid for rid in after if after[rid]["job_id"] != before[rid]["job_id"]}
        assert len(failed) == 5 and resubmitted == failed
        for rid in failed:
            assert after[rid]["attempt"] == 2 and (out / rid / "attempts" / "1" / "result.json").exists()
    finally:
        new_jobs = [after[rid]["job_id"] for rid in after if after[rid]["job_id"] != before[rid]["job_id"]]
        if new_jobs:
            subprocess.run(["scancel", *new_jobs])


def record_status(out: Path, rid: str, entry: dict) -> str:
    if (out / rid / "attempts" / "1" / "result.json").exists():
        return json.loads((out / rid / "attempts" / "1" / "result.json").read_text())["status"]
    return record(out, rid)["status"]
