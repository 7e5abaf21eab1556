"""hardware.calibrate_comm: a sweep measures its own hardware profile (`echobench calibrate --comm
--matrix MATRIX`, the file the sweep was started with) once, where its runs run, before them;
`validate measured SWEEP` then prices the runs with it. Locally end to end; the SLURM job against
stand-in commands (the real cluster: tests/test_slurm.py). Nothing here asserts a measured speed:
the machine is a loaded CPU."""

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from conftest import run_cli
from echobench.sweep import loop as sw
from echobench.calibrate.commbench import attention_shapes
from echobench.sweep.executors import local
from echobench.records.paths import measured_profile
from echobench.sweep.executors.slurm_script import SRUN_PER_NODE, render_comm_calibration_script
from echobench.hardware.device import gemm_shapes
from echobench.hardware.profile import load_profile
from echobench.sweep.matrix import MatrixError, expand, load_matrix, parse_matrix

TINY = {"scale": "tiny", "steps": 2, "warmup_steps": 1, "micro_batch": 1, "audio_frames": 24, "text_tokens": 8,
        "speaker_frames": 24, "device": "cpu"}
# A second or so of GEMMs and of collectives, messages up to 64 KiB: the profile's structure, quickly.
LIMITS = {"budget_s": 0.5, "comm_budget_s": 1, "max_bytes": 65536}


def write_matrix(path: Path, include: list[dict], **top) -> Path:
    path.write_text(json.dumps({"name": "comm", "executor": "local", "defaults": TINY, "include": include,
                                **top, "hardware": {"peak_tflops": 0.5, "calibrate_comm": True,
                                                    "comm_limits": LIMITS, **top.get("hardware", {})}}))
    return path


def flat(text: str) -> str:
    return " ".join(text.split())


def records(sweep: Path) -> dict[str, dict]:
    return {rid: json.loads((sweep / rid / "result.json").read_text())
            for rid in json.loads((sweep / "sweep.json").read_text())["runs"]}


# ---- the local executor, end to end ----

@pytest.mark.slow
def test_a_local_sweep_measures_its_profile_once_and_predict_against_prices_its_runs_with_it(tmp_path):
    # Two shapes (micro-batch 1 and 2), the larger run on 2 processes: the calibration takes both shapes, on 2.
    matrix = write_matrix(tmp_path / "m.yaml", [{"seed": 0}, {"micro_batch": 2, "parallelism": "ddp",
                                                              "gpus_per_node": 2}])
    sweep = tmp_path / "sweep"
    proc = run_cli("sweep", matrix, "--out", sweep, tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = flat(proc.stdout)
    assert "measuring a hardware profile once on 2 process(es)" in out and "calibrate-comm.log" in out
    # measured before the first run was submitted
    assert out.index("measuring a hardware profile") < out.index("submitted as")
    assert all(r["status"] == "ok" for r in records(sweep).values())

    profile = load_profile(sweep / "profile.yaml")
    assert profile.measured and profile.gpus_per_node == 2 and set(profile.links) == {"intra"}
    (cached,) = (sweep / "cache" / "profiles").glob("*.yaml")  # calibrated_profile_path under SWEEP/cache
    assert load_profile(cached) == profile
    # Every run's shapes reached the calibration: its DiT block's GEMMs and its attentions.
    points = {(g.m, g.n, g.k) for g in profile.gemm}
    attention = {(a.batch, a.heads, a.head_dim, a.seq_q, a.seq_k) for a in profile.attention}
    for r in expand(load_matrix(matrix)).runs:
        c = r.cfg
        assert {(s.m, s.n, s.k) for s in gemm_shapes(c.model_config(), c.micro_batch, c.audio_frames, c.text_tokens,
                                                       c.speaker_frames)} <= points, r.id
        assert {shape[1:6] for shape in attention_shapes(c)} <= attention, r.id

    # Resumed with a run to do again: the profile is the sweep's already, nothing is measured twice.
    # (the single-process run's record: the cheaper one to run again)
    rid = next(rid for rid, r in records(sweep).items() if r["world_size"] == 1)
    before = (sweep / "profile.yaml").stat().st_mtime_ns
    (sweep / rid / "result.json").unlink()
    proc = run_cli("sweep", matrix, "--out", sweep, tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0 and "1 to run" in proc.stdout, proc.stdout + proc.stderr
    assert "measuring a hardware profile" not in proc.stdout
    assert (sweep / "profile.yaml").stat().st_mtime_ns == before

    # validate measured SWEEP, no --profile: the sweep's own profile (nothing else here would do: a CPU
    # has no shipped profile and this test's cache holds none), named with its file.
    name = f"{profile.name} ({sweep.resolve() / 'profile.yaml'})"
    proc = run_cli("validate", "measured", sweep, "--json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {c["profile"] for c in json.loads(proc.stdout)} == {name}
    proc = run_cli("validate", "measured", sweep, tmp_path=tmp_path)
    assert proc.returncode == 0 and f"profile {name}: " in flat(proc.stdout), proc.stdout + proc.stderr


def in_process_sweep(tmp_path: Path, monkeypatch, matrix_path: Path) -> tuple[int, str, Path]:
    """(exit code, console text, sweep dir) of `echobench sweep` run in this process (its runs are
    real jobs), on the CPU with the cache in tmp_path, as run_cli runs it."""
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    matrix = load_matrix(matrix_path)
    console = Console(record=True, width=400, file=io.StringIO())
    out = tmp_path / "sweep"
    code = sw.run_sweep(matrix, expand(matrix).runs, sw.SweepOptions(executor="local", out=out), console)
    return code, flat(console.export_text()), out


@pytest.mark.slow
def test_a_failing_comm_calibration_is_said_with_its_log_and_the_runs_run(tmp_path, monkeypatch):
    # An option calibrate refuses (--max-bytes below 1024) forced onto the executor's command.
    words = local.comm_command
    monkeypatch.setattr(local, "comm_command", lambda *a: [*words(*a), "--max-bytes", "1"])
    code, text, sweep = in_process_sweep(tmp_path, monkeypatch, write_matrix(tmp_path / "m.yaml", [{"seed": 0}]))
    assert code == 0, text
    log = sweep / "calibrate-comm.log"
    assert f"hardware profile not measured: `echobench calibrate --comm` exited with code 2 (see {log}); the runs go " \
           f"on without it" in text
    assert "--max-bytes" in log.read_text() and not (sweep / "profile.yaml").exists()
    assert [r["status"] for r in records(sweep).values()] == ["ok"]


# A calibration that would never end: it starts a worker in a session of its own (as torchrun's are),
# its command line naming the profile's path (as theirs do), and both sleep.
HANG = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', "
        "sys.argv[1]], start_new_session=True); time.sleep(600)")


@pytest.mark.slow
def test_a_comm_calibration_past_the_local_time_limit_is_stopped_and_the_runs_run(tmp_path, monkeypatch):
    # local.time bounds the calibration (2 s; this one would sleep 10 minutes); the run has a limit of its own.
    popen = subprocess.Popen

    def hanging(cmd, *args, **kwargs):
        if "calibrate" in cmd and "--comm" in cmd:
            cmd = [cmd[0], "-c", HANG, cmd[cmd.index("--out") + 1]]
        return popen(cmd, *args, **kwargs)

    monkeypatch.setattr(local.subprocess, "Popen", hanging)
    matrix = write_matrix(tmp_path / "m.yaml", [{"seed": 0, "time_limit": "5:00"}], local={"time": "0:02"})
    code, text, sweep = in_process_sweep(tmp_path, monkeypatch, matrix)
    assert code == 0, text
    assert (f"hardware profile not measured: `echobench calibrate --comm` was stopped at the local time limit (2 s) "
            f"(see {sweep.resolve() / 'calibrate-comm.log'})") in text
    assert not (sweep / "profile.yaml").exists() and [r["status"] for r in records(sweep).values()] == ["ok"]
    assert not local.processes_mentioning(str(sweep.resolve() / "profile.yaml"))  # the worker too


# ---- the SLURM job ----

def test_the_comm_calibration_job_starts_one_launcher_per_node_with_its_arguments_as_written(tmp_path):
    sweep = tmp_path / "sw+1"
    matrix = parse_matrix(json.dumps({
        "name": "comm", "executor": "slurm", "defaults": TINY,
        "slurm": {"partition": "cpu", "time": "2:00:00", "gpus_per_node": 4, "master_port": 21000,
                  "python": str(tmp_path / "py"), "env": {"X": "$(touch pwned) 'q' \"d\" ;"}},
        "hardware": {"calibrate_comm": True, "comm_limits": LIMITS}}), "m.yaml")
    script = render_comm_calibration_script(sweep, matrix, 2, 4, "cpu")
    lines = script.splitlines()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --partition=cpu", "#SBATCH --time=11", "#SBATCH --no-requeue",
                 f"#SBATCH --output={sweep.resolve()}/logs/calibrate-comm-%j.out", "NPROC=4",
                 "MASTER_PORT=$(( 21000 + SLURM_JOB_ID % 2000 ))", f"export ECHOBENCH_CACHE={sweep.resolve()}/cache",
                 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)${EB_RENDEZVOUS_SUFFIX:-}'):
        assert line in lines, line
    assert SRUN_PER_NODE in script  # the srun of a run's job, one launcher per node
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0

    # Run it as node 1 of 2: scontrol and srun stand-ins (srun runs its `bash -c` as SLURM would), a
    # PYTHON that prints its arguments. They arrive as written; the env value stays a value.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'node7\\nnode8\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nwhile [ "$1" != bash ]; do shift; done\nexec "$@"\n')
    (tmp_path / "py").write_text('#!/bin/bash\nprintf "%s\\n" "$X" "$@"\n')
    for f in (bin_dir / "scontrol", bin_dir / "srun", tmp_path / "py"):
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "7",
           "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[7-8]"}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    value, *argv = proc.stdout.splitlines()
    assert value == "$(touch pwned) 'q' \"d\" ;" and not (tmp_path / "pwned").exists()
    assert argv == ["-m", "echobench", "calibrate", "--comm", "--nproc", "4", "--nnodes", "2", "--node-rank", "1",
                    "--master-addr", "node7", "--master-port", "21007", "--device", "cpu",
                    "--matrix", str(Path("m.yaml").resolve()), "--out", f"{sweep.resolve()}/profile.yaml",
                    "--budget-s", "0.5", "--comm-budget-s", "1.0", "--max-bytes", "65536"]


def stub(bin_dir: Path, name: str, body: str) -> None:
    (bin_dir / name).write_text("#!/bin/bash\n" + body)
    (bin_dir / name).chmod(0o755)


def test_a_slurm_sweep_submits_the_comm_calibration_on_its_largest_nodes_and_every_run_waits_for_it(
        tmp_path, monkeypatch):
    """Against stand-in sbatch / sacct / scancel (the real cluster: tests/test_slurm.py): the GEMM
    calibration (a run without a peak) is job 101, the comm calibration 102 after it, on 2 nodes x 2;
    the run without a peak waits for both, the other for the comm one; `echobench cancel` ends both."""
    bin_dir, calls, cancels = tmp_path / "bin", tmp_path / "calls.txt", tmp_path / "scancel.txt"
    bin_dir.mkdir()
    stub(bin_dir, "sbatch", f'echo "$@" >>"{calls}"\necho $((100 + $(wc -l <"{calls}")))\n')
    stub(bin_dir, "sacct", 'ids=$(echo "$@" | sed -E "s/.*-j ([0-9,]+).*/\\1/")\n'
                           'for i in ${ids//,/ }; do echo "$i|RUNNING|0:0"; done\n')
    stub(bin_dir, "scancel", f'echo "$@" >>"{cancels}"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({
        "name": "t", "executor": "slurm", "slurm": {"request_gpus": False}, "defaults": TINY,
        "hardware": {"calibrate_comm": True},
        "include": [{"seed": 1}, {"seed": 2, "peak_tflops": 3, "parallelism": "ddp", "nodes": 2, "gpus_per_node": 2}]}))
    sweep = tmp_path / "sweep"
    proc = run_cli("sweep", matrix, "--out", sweep, "--no-wait", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gemm, comm, *jobs = calls.read_text().splitlines()
    assert gemm.endswith(f"{sweep}/calibrate.sh")
    assert comm == f"--parsable --dependency=afterany:101 {sweep}/calibrate-comm.sh"
    assert "measuring a hardware profile once on 2 node(s) x 2 processes (job 102, log " \
           f"{sweep}/logs/calibrate-comm-102.out)" in flat(proc.stdout)
    script = (sweep / "calibrate-comm.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "NPROC=2" in script
    # the matrix the sweep started with (a card named relative to it resolves there, not in the sweep's copy)
    assert f"--matrix {matrix} --out {sweep}/profile.yaml" in script
    waits = {yaml.safe_load((Path(job.split()[-1]).parent / "run.yaml").read_text())["seed"]:
             job.split()[1] for job in jobs}
    assert waits == {1: "--dependency=afterany:101:102", 2: "--dependency=afterany:102"}
    state = json.loads((sweep / "sweep.json").read_text())
    assert (state["calibration_job"], state["comm_calibration_job"]) == ("101", "102")

    proc = run_cli("sweep", matrix, "--out", sweep, "--no-wait", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 0 and len(calls.read_text().splitlines()) == 4  # nothing submitted twice

    assert sw.cancel_sweep(sweep, Console(file=io.StringIO()), wait_s=0) == 0
    assert set(cancels.read_text().split()) == {"101", "102", "103", "104"}


def test_a_resumed_slurm_sweep_waits_for_the_comm_calibration_job_still_queued(tmp_path, monkeypatch):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    stub(bin_dir, "sbatch", f'echo "$@" >>"{calls}"\necho $((100 + $(wc -l <"{calls}")))\n')
    stub(bin_dir, "sacct", 'echo "77|PENDING|0:0"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    sw.SweepState(comm_calibration_job="77").save(sweep)
    matrix = write_matrix(tmp_path / "m.yaml", [{"seed": 0}], executor="slurm", slurm={"request_gpus": False})
    proc = run_cli("sweep", matrix, "--out", sweep, "--no-wait", "--no-preflight", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the profile job 77 of an earlier sweep is still pending: the runs wait for it" in flat(proc.stdout)
    (job,) = calls.read_text().splitlines()
    assert job.startswith("--parsable --dependency=afterany:77 ") and job.endswith("/job.sh")


# ---- calibrate --comm --matrix, the setting, plan, predict ----

def test_calibrate_takes_the_matrix_or_the_shape_flags_not_both(tmp_path):
    matrix = write_matrix(tmp_path / "m.yaml", [{"seed": 0}])
    bad = run_cli("calibrate", "--comm", "--matrix", matrix, "--scale", "tiny", "--micro-batch", "2", tmp_path=tmp_path)
    assert bad.returncode == 2 and f"--matrix {matrix} gives the shapes (every run of it): drop --scale, " \
                                   f"--micro-batch" in flat(bad.stderr)
    bad = run_cli("calibrate", "--matrix", matrix, tmp_path=tmp_path)
    assert bad.returncode == 2 and "--matrix: an option of calibrate --comm: add --comm" in bad.stderr
    bad = run_cli("calibrate", "--out", tmp_path / "p.yaml", "--nproc", "2", tmp_path=tmp_path)
    assert bad.returncode == 2 and "--nproc, --out: options of calibrate --comm: add --comm" in bad.stderr
    bad = run_cli("calibrate", "--comm", "--nnodes", "2", "--node-rank", "2", tmp_path=tmp_path)
    assert bad.returncode == 2 and "--node-rank 2: must be below --nnodes 2" in bad.stderr
    none = tmp_path / "none.yaml"
    none.write_text(json.dumps({"name": "n", "include": [{"parallelism": "tp2"}]}))  # torchtitan has no TP: skipped
    bad = run_cli("calibrate", "--comm", "--matrix", none, tmp_path=tmp_path)
    assert bad.returncode == 2 and "no runs to take shapes from" in bad.stderr


def test_calibrate_comm_checks_out_and_the_shape_before_measuring(tmp_path):
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir").mkdir()
    for out, said in ((tmp_path / "afile" / "p.yaml", "cannot write"), (tmp_path / "adir", "is a directory")):
        bad = run_cli("calibrate", "--comm", "--nproc", "1", "--out", out, tmp_path=tmp_path)
        assert bad.returncode == 2 and f"--out {out}" in flat(bad.stderr) and said in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr and not (tmp_path / "cache" / "profiles").exists()  # nothing measured
    bad = run_cli("calibrate", "--comm", "--nproc", "1", "--micro-batch", "0", tmp_path=tmp_path)
    assert bad.returncode == 2 and "micro_batch=0 is not valid" in bad.stderr and "Traceback" not in bad.stderr


def test_the_matrix_setting_its_limits_and_what_plan_says(tmp_path, cli):
    matrix = write_matrix(tmp_path / "m.yaml", [{"seed": 0}, {"parallelism": "ddp", "gpus_per_node": 2}])
    spec = load_matrix(matrix).spec.hardware
    assert spec.calibrate_comm and spec.comm_limits.flags() == ["--budget-s", "0.5", "--comm-budget-s", "1.0",
                                                                "--max-bytes", "65536"]
    with pytest.raises(MatrixError, match=r"hardware\.comm_limits\.max_bytes"):
        parse_matrix("name: t\nhardware: {calibrate_comm: true, comm_limits: {max_bytes: 10}}\n", "m.yaml")
    assert not parse_matrix("name: t\n", "m.yaml").spec.hardware.calibrate_comm  # off unless asked for
    proc = cli("plan", matrix)
    assert proc.returncode == 0 and ("calibrate_comm: a hardware profile is measured once before the runs (on this "
                                     "machine, 2 process(es))") in flat(proc.stdout)
    note = json.loads(cli("plan", matrix, "--json").stdout)["calibrate_comm"]
    assert note.startswith("calibrate_comm: a hardware profile is measured once")
    assert json.loads(cli("plan", matrix, "--json", "--executor", "slurm").stdout)["calibrate_comm"].startswith(
        "calibrate_comm: a hardware profile is measured once before the runs (in a job on 1 node(s) x 2 processes")


def test_a_sweeps_profile_is_taken_for_its_records_of_the_same_device_only(tmp_path):
    from echobench import predict as pr
    from echobench.hardware.profile import find_profile, save_profile

    shipped = load_profile(find_profile("h100-hgx-ib"))
    sweep = tmp_path / "sweep"
    (sweep / "run").mkdir(parents=True)
    sw.SweepState().save(sweep)
    record = sweep / "run" / "result.json"
    assert pr.profile_for_device("NVIDIA H100 80GB HBM3", str(record)) == shipped  # none measured: the shipped one
    save_profile(shipped.model_copy(update={"name": "ours", "measured": True}), sweep / "profile.yaml")
    ours = pr.profile_for_device("NVIDIA H100 80GB HBM3", str(record))
    assert ours.name == f"ours ({sweep.resolve() / 'profile.yaml'})" and ours.measured
    # measured on other hardware: not the sweep's; the shipped profile of the records' device, or none
    assert pr.profile_for_device("NVIDIA A100-SXM4-80GB", str(record)).name == "a100-sxm-80gb"
    assert pr.profile_for_device("NVIDIA L4", str(record)) is None
    assert measured_profile(tmp_path) is None  # not in a sweep
    (sweep / "profile.yaml").write_text("schema_version: 99\n")
    with pytest.raises(pr.PredictError, match="profile.yaml"):
        pr.profile_for_device("NVIDIA H100 80GB HBM3", str(record))
