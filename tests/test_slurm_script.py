"""The job script a cluster user would review (issue 23): fabric profiles instead of fabric defaults,
setup lines that survive Lmod, the interpreter a setup line activates, CPUs and memory asked for,
labelled unbuffered logs, srun --wait, a port below the ephemeral range, a first-node check. The
rendered scripts are checked as text; the last tests run them on the local SLURM cluster."""

import json
import os
import shlex
import stat
import sys
from pathlib import Path

import pytest

from conftest import ROOT, TINY_CARD, run_cli
from echobench.sweep.executors.slurm_script import render_script
from echobench.train.fabric import FABRICS
from echobench.sweep.cluster import EPHEMERAL, PORT_SPREAD
from echobench.sweep.matrix import expand, parse_matrix


IMAGE = "docker://nvcr.io#nvidia/pytorch:25.01-py3 $(touch PWNED); `touch PWNED` 'x' \"y\""


def script_for(slurm: str, defaults: str = "{parallelism: single}", tmp: Path = Path("/tmp/eb")) -> list[str]:
    m = parse_matrix(f"name: t\nexecutor: slurm\nslurm: {slurm}\ndefaults: {defaults}\n", "m.yaml")
    run = expand(m).runs[0]
    return render_script(run.cfg, tmp / run.id, m.spec.slurm).splitlines()


def exported(lines: list[str]) -> dict:
    return dict(line.removeprefix("export ").split("=", 1) for line in lines
                if line.startswith("export ") and "=" in line and " " not in line.split("=", 1)[0].removeprefix("export "))


def test_no_fabric_settings_unless_a_profile_is_chosen():
    env = exported(script_for("{gpus_per_node: 4}"))
    assert env.get("NCCL_DEBUG") == "VERSION"  # every log names the NCCL that ran
    assert not [k for k in env if k.startswith(("NCCL_IB", "NCCL_SOCKET", "NCCL_NET", "FI_"))], env


def test_the_matrix_admits_exactly_the_profiles_there_are():
    from typing import get_args

    from echobench.sweep.cluster import SlurmSettings

    choices = next(a for a in get_args(SlurmSettings.model_fields["fabric"].annotation) if get_args(a))
    assert set(get_args(choices)) == set(FABRICS)  # or None: not chosen


def test_a_fabric_profile_and_the_matrix_env_over_it():
    env = exported(script_for("{fabric: slingshot, env: {NCCL_CROSS_NIC: 0, NCCL_DEBUG: INFO}}"))
    assert env["NCCL_SOCKET_IFNAME"] == "hsn" and env["NCCL_NET"] == "'AWS Libfabric'"
    assert env["FI_CXI_DISABLE_HOST_REGISTER"] == "1"
    assert env["NCCL_CROSS_NIC"] == "0" and env["NCCL_DEBUG"] == "INFO"
    assert exported(script_for("{fabric: infiniband}"))["NCCL_IB_DISABLE"] == "0"
    with pytest.raises(ValueError, match="fabric"):
        script_for("{fabric: omnipath}")


def test_shipped_gpu_matrices_choose_a_profile_instead_of_overriding_its_variables():
    import yaml

    for path in sorted((ROOT / "matrices").glob("*.yaml")):
        slurm = yaml.safe_load(path.read_text()).get("slurm") or {}
        fabric = FABRICS[slurm.get("fabric") or "none"]
        overridden = {k for k in slurm.get("env", {}) if k in fabric.env}
        assert not overridden, f"{path.name} sets {overridden}: choose another slurm.fabric instead"


def test_the_seeds_cluster_is_gh200_on_infiniband_with_its_own_settings_and_slingshot_has_its_own_matrix():
    """The published runs: quad-GH200 nodes on InfiniBand, docs/guides/route-1-gh200-infiniband.md's four HCAs
    (an exact list) and NCCL_SOCKET_IFNAME=ib0; NCCL's IB transport required. Slingshot: another matrix, CSCS's
    variables."""
    seed = exported(rendered(ROOT / "matrices" / "gh200-published.yaml"))
    assert (seed["NCCL_NET"], seed["NCCL_IB_HCA"], seed["NCCL_SOCKET_IFNAME"]) == ("IB", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3",
                                                                                   "ib0")
    alps = exported(rendered(ROOT / "matrices" / "gh200-slingshot.yaml"))
    assert alps["NCCL_SOCKET_IFNAME"] == "hsn" and alps["GLOO_SOCKET_IFNAME"] == "hsn0"
    assert "NCCL_IB_HCA" not in alps and alps["ECHOBENCH_FABRIC"] == "slingshot"


def rendered(matrix_path: Path, tmp: Path = Path("/tmp/eb")) -> list[str]:
    """The job script of a shipped matrix's first run, as lines."""
    from echobench.sweep.matrix import load_matrix

    m = load_matrix(matrix_path)
    run = expand(m).runs[0]
    return render_script(run.cfg, tmp / run.id, m.spec.slurm).splitlines()


def test_cpus_and_memory_are_asked_for():
    lines = script_for("{gpus_per_node: 4, cpus_per_gpu: 18}", "{parallelism: ddp, gpus_per_node: 4}")
    assert "#SBATCH --cpus-per-task=72" in lines  # one task per node starts all 4 ranks
    assert "#SBATCH --cpus-per-task=1" not in lines
    assert not [x for x in script_for("{exclusive: true, mem: 0}") if x.startswith("#SBATCH --cpus-per-task")]
    assert "#SBATCH --mem=0" in script_for("{exclusive: true, mem: 0}")
    body = "\n".join(script_for("{}"))
    assert '--cpus-per-task="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}"' in body  # srun does not inherit it
    assert "export ECHOBENCH_NUMA_BINDING=socket" in script_for("{numa_binding: socket}")


def test_logs_teardown_and_port():
    body = "\n".join(script_for("{}"))
    assert " --wait=60 -l -u " in body
    assert "export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1" in body
    assert f"MASTER_PORT=$(( 29500 + SLURM_JOB_ID % {PORT_SPREAD} ))" in body
    assert 29500 + PORT_SPREAD <= EPHEMERAL[0]
    with pytest.raises(ValueError, match="ephemeral"):
        script_for("{master_port: 40000}")


def test_setup_lines_run_without_nounset_and_each_failure_is_named():
    lines = script_for("{setup: ['module load cuda', 'source /opt/venv/bin/activate']}")
    i = lines.index("set +eu")
    assert lines[i + 1] == "module load cuda" and "setup line 1 failed" in lines[i + 2]
    assert lines[i + 3] == "source /opt/venv/bin/activate" and "setup line 2 failed" in lines[i + 4]
    assert lines[i + 5] == "set -eu" and "PYTHON=$(command -v python3" in lines[i + 6]
    pinned = script_for("{python: /opt/py/bin/python3, setup: ['source /opt/venv/bin/activate']}")
    assert not [x for x in pinned if "command -v python3" in x]  # slurm.python decides


# ---- on the local cluster ----

@pytest.fixture(scope="module")
def script_sweep(tmp_path_factory):
    from test_slurm import cluster_nodes

    if len(cluster_nodes()) < 1:
        if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
            pytest.fail("no local SLURM cluster: bash scripts/slurm-local.sh up 2")
        pytest.skip("no local SLURM cluster: bash scripts/slurm-local.sh up 2")
    base = tmp_path_factory.mktemp("script")
    # A stand-in for `source venv/bin/activate`: another VIRTUAL_ENV, its python3 first on PATH, a
    # wrapper that notes each call (the job must start its ranks with it) and runs this interpreter.
    venv = base / "other-venv"
    (venv / "bin").mkdir(parents=True)
    wrapper = venv / "bin" / "python3"
    wrapper.write_text(f'#!/bin/sh\necho "$$" >> {venv}/used\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    (venv / "bin" / "activate").write_text(f'export VIRTUAL_ENV={venv}\nexport PATH={venv}/bin:$PATH\n')
    # What these jobs show is the job script's (setup lines, GPU requests, containers), whatever is trained.
    tiny = {"card": TINY_CARD, "steps": 2, "warmup_steps": 1, "micro_batch": 1}
    # Lmod's `module` reads variables that may be unset; under `set -u` that ended the job.
    lmod_like = 'if [ -n "$ECHOBENCH_NEVER_SET_ANYWHERE" ]; then echo set; fi'
    matrices = {
        "setup-ok": {"slurm": {"fabric": "tcp", "setup": [lmod_like, f"source {venv}/bin/activate"]}},
        "setup-fails": {"slurm": {"setup": ["true", "false"]}},
        "wants-gpu": {"slurm": {}, "defaults": {"device": "cuda"}},
        # A container (apptainer: a stand-in on PATH that notes its arguments and runs the command),
        # an image name and an srun option with shell metacharacters, which must arrive as written.
        "container": {"slurm": {"container": {"runtime": "apptainer", "image": IMAGE, "mounts": ["/tmp:/tmp:ro"],
                                              "writable": True},
                                "srun_args": [f"--chdir={base / 'start here'}"],
                                "python": sys.executable, "pythonpath": [str(ROOT)]}},
    }
    (base / "start here").mkdir()
    stub_bin = base / "stub-bin"
    stub_bin.mkdir()
    stub = stub_bin / "apptainer"
    # exec --nv --bind MOUNTS [--pwd W] [--writable-tmpfs] IMAGE CMD...: note them, then run CMD here.
    stub.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open({str(base / 'apptainer-calls')!r}, "a") as f:
    f.write(json.dumps({{"argv": args, "cwd": os.getcwd()}}) + "\\n")
i = args.index("--writable-tmpfs") + 2 if "--writable-tmpfs" in args else 5
os.execvp(args[i], args[i:])
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    out = {}
    for name, extra in matrices.items():
        slurm = {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1},
                 **extra["slurm"]}
        spec = {"name": name, "executor": "slurm", "slurm": slurm, "hardware": {"peak_tflops": 0.5},
                "defaults": {**tiny, **extra.get("defaults", {})}}
        path = base / f"{name}.yaml"
        path.write_text(json.dumps(spec))
        # As from inside another allocation: its variables must not reach the new jobs' sbatch
        # (SBATCH_PARTITION overrides the script's options: a partition that does not exist).
        inside = {"SBATCH_PARTITION": "no-such-partition", "SLURM_JOB_ID": "999999", "SLURM_NTASKS": "64",
                  "PATH": f"{stub_bin}:{os.environ['PATH']}"}
        proc = run_cli("sweep", path, "--out", base / name, "--no-wait", "--no-preflight", tmp_path=base,
                       env=inside)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out[name] = base / name
    for name, sweep in out.items():
        proc = run_cli("status", sweep, "--wait", "--poll", "3", tmp_path=base, timeout=900)
    return {"dirs": out, "venv": venv, "base": base}


def only_record(sweep: Path) -> tuple[dict, str]:
    rid = next(iter(json.loads((sweep / "sweep.json").read_text())["runs"]))
    log = "\n".join(p.read_text(errors="replace") for p in sorted((sweep / rid / "logs").glob("slurm-*.out")))
    return json.loads((sweep / rid / "result.json").read_text()), log


@pytest.mark.slurm
def test_setup_lines_survive_nounset_and_the_activated_interpreter_runs(script_sweep):
    """Also: submitted from an environment with another allocation's SLURM_* / SBATCH_* variables."""
    r, log = only_record(script_sweep["dirs"]["setup-ok"])
    assert r["status"] == "ok", r["error"] + log[-2000:]
    assert (script_sweep["venv"] / "used").read_text().split(), "the activated environment's python3 never ran"
    assert "echobench job: imports: " in log and "gpus: torch " in log  # the first-node check
    assert [line for line in log.splitlines() if line.startswith("0: ")], "srun -l labels each line by node"
    env = r["env"]  # the scheduler and fabric context, in the record
    assert env["scheduler"]["job_id"] == json.loads((script_sweep["dirs"]["setup-ok"] / "sweep.json").read_text())[
        "runs"][r["run_id"]]["job_id"]
    assert env["scheduler"]["nodelist"] and env["comm_env"]["NCCL_DEBUG"] == "VERSION"
    assert env["comm_env"]["NCCL_NET"] == "Socket" and env["comm_env"]["NCCL_IB_DISABLE"] == "1"  # fabric: tcp


@pytest.mark.slurm
def test_a_failing_setup_line_is_named(script_sweep):
    r, log = only_record(script_sweep["dirs"]["setup-fails"])
    assert r["status"] == "error"
    assert "echobench: setup line 2 failed (exit 1): false" in log
    assert "setup line 2 failed" in r["error"], r["error"]


@pytest.mark.slurm
def test_a_job_that_wants_a_gpu_and_sees_none_fails_at_the_first_node_check(script_sweep):
    r, log = only_record(script_sweep["dirs"]["wants-gpu"])
    assert r["status"] == "error"
    assert "echobench: the first-node check failed: gpus: torch " in log and "is a CPU build" in log
    assert "first-node check failed" in r["error"], r["error"]
    assert "0: " not in log  # no srun started



@pytest.mark.slurm
def test_the_ranks_run_in_the_container_with_the_srun_options(script_sweep):
    r, log = only_record(script_sweep["dirs"]["container"])
    assert r["status"] == "ok", r["error"] + log[-2000:]
    base = script_sweep["base"]
    calls = [json.loads(line) for line in (base / "apptainer-calls").read_text().splitlines()]
    assert len(calls) == 2  # the first-node check and the one node's launcher
    sweep = script_sweep["dirs"]["container"]
    for call in calls:
        argv = call["argv"]
        assert argv[:3] == ["exec", "--nv", "--bind"] and IMAGE in argv and "--writable-tmpfs" in argv
        mounts = argv[3].split(",")
        # slurm.pythonpath's checkout is mounted: the image's echobench is not taken
        assert mounts[0] == "/tmp:/tmp:ro" and str(sweep.resolve()) in mounts and str(ROOT) in mounts
        assert call["cwd"] == str(base / "start here")  # srun_args reached srun
    assert not list(base.rglob("PWNED")) and not (ROOT / "PWNED").exists()
    assert r["env"]["container"] == IMAGE


def test_pyxis_options_and_srun_args_arrive_as_written(tmp_path):
    """The arrays the job script defines, read back by bash: every word as the matrix wrote it."""
    import subprocess

    slurm = json.dumps({"container": {"image": IMAGE, "mounts": ["/lustre:/lustre"], "workdir": "/work dir",
                                      "writable": True}, "srun_args": ["--mpi=pmix", "--network=a b;c"]})
    lines = script_for(slurm, tmp=tmp_path)
    arrays = [line for line in lines if line.startswith(("SRUN_ARGS=", "IN_CONTAINER=", "ON_FIRST_NODE="))]
    out = subprocess.run(["bash", "-c", "\n".join(arrays) + '\nprintf "%s\\n" "${SRUN_ARGS[@]}" -- "${ON_FIRST_NODE[@]}"'],
                         capture_output=True, text=True, cwd=tmp_path, check=True).stdout.splitlines()
    srun = out[:out.index("--")]
    assert srun[:2] == ["--mpi=pmix", "--network=a b;c"]
    assert srun[2] == f"--container-image={IMAGE}" and srun[3].startswith("--container-name=echobench-")
    mounts = srun[4].removeprefix("--container-mounts=").split(",")
    assert mounts[0] == "/lustre:/lustre" and str(tmp_path.resolve()) in mounts
    assert str(ROOT) not in mounts and not [x for x in lines if x.startswith("export PYTHONPATH")]  # the image's echobench
    assert srun[5:] == ["--container-workdir=/work dir", "--container-writable"]
    assert out[out.index("--") + 1:] == ["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1", *srun]
    assert not list(tmp_path.rglob("PWNED"))
    assert "PYTHON=python3" in lines  # the image's interpreter, not the sweep's
    assert "export ECHOBENCH_CONTAINER_IMAGE=" + shlex.quote(IMAGE) in lines


def test_no_container_no_srun_args_means_empty_arrays():
    lines = script_for("{}")
    assert {"SRUN_ARGS=()", "IN_CONTAINER=()", "ON_FIRST_NODE=()"} <= set(lines)
    assert not [line for line in lines if "CONTAINER_IMAGE" in line]


@pytest.mark.parametrize("bad", [{"srun_args": ["-n 2"]}, {"srun_args": ["--x=a\nb"]}, {"extra": ["--x=a\rb"]},
                                 {"container": {"image": "a\nb"}}, {"container": {"image": "x", "mounts": ["a,b"]}},
                                 {"container": {"image": "x", "runtime": "docker"}}])
def test_bad_options_and_containers_are_refused(bad):
    from echobench.sweep.matrix import MatrixError

    with pytest.raises(MatrixError):
        parse_matrix(json.dumps({"name": "t", "executor": "slurm", "slurm": bad}), "m.yaml")


def test_sbatch_options_with_hash_brackets_spaces_and_quotes_reach_slurm_as_written(tmp_path):
    """sbatch reads #SBATCH lines itself (bash never does): a held job on the local cluster shows
    the option's value exactly, and nothing in it ran."""
    import subprocess

    from test_slurm import cluster_nodes

    value = 'nvcr.io#nvidia/pytorch:25.01 [a b] "q" x\\y $(touch PWNED) `touch PWNED`; \'s'
    lines = script_for(json.dumps({"extra": [f"--comment={value}", "--hold"], "request_gpus": False}), tmp=tmp_path)
    assert "#SBATCH --hold" in lines
    if not cluster_nodes():
        if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
            pytest.fail("no local SLURM cluster: bash scripts/slurm-local.sh up 2")
        pytest.skip("no local SLURM cluster: bash scripts/slurm-local.sh up 2")
    script = tmp_path / "job.sh"
    script.write_text("\n".join(lines) + "\n")
    job = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout.strip().split(";")[0]
    try:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
        comment = next(line.strip().removeprefix("Comment=") for line in shown.splitlines()
                       if line.strip().startswith("Comment="))
        assert comment == value
        assert "JobState=PENDING" in shown  # --hold too
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    assert not list(tmp_path.rglob("PWNED"))


def test_the_submit_environment_is_clean_inside_an_allocation_and_the_users_own_outside():
    from echobench.sweep.executors.slurm import submit_env

    env = submit_env({"SLURM_JOB_ID": "1", "SBATCH_PARTITION": "x", "SRUN_CPUS_PER_TASK": "4", "SLURM_CONF": "/etc/s.conf",
                      "PATH": "/bin", "NCCL_DEBUG": "INFO"})
    assert env == {"SLURM_CONF": "/etc/s.conf", "PATH": "/bin", "NCCL_DEBUG": "INFO"}
    # A login shell: SBATCH_ACCOUNT & co are the user's defaults (an account, a reservation), kept.
    login = {"SBATCH_ACCOUNT": "proj1", "SBATCH_PARTITION": "gpu", "SBATCH_QOS": "high", "SBATCH_RESERVATION": "bench",
             "PATH": "/bin"}
    assert submit_env(login) == login


def test_plan_writes_every_job_script_without_submitting(tmp_path):
    out = tmp_path / "scripts"
    proc = run_cli("plan", ROOT / "matrices" / "gh200-published.yaml", "--write-scripts", out, "--out", tmp_path / "sw",
                   tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    scripts = sorted(p for p in out.glob("*.sh") if p.name != "preflight.sh")  # and the preflight job's
    assert len(scripts) == 12 and not (tmp_path / "sw").exists()  # nothing submitted, no sweep directory
    assert "echobench.train.nodecheck node" in (out / "preflight.sh").read_text()
    rid = scripts[0].stem
    one = run_cli("plan", ROOT / "matrices" / "gh200-published.yaml", "--script", rid, "--out", tmp_path / "sw",
                  tmp_path=tmp_path)
    # The same script, but for its log: SLURM does not start a job whose --output directory is missing,
    # and the run's directory is not there until the script makes it: the log goes beside the scripts.
    written = scripts[0].read_text().splitlines()
    assert f"#SBATCH --output={out}/logs/{rid}-%j.out" in written and (out / "logs").is_dir()
    assert [x for x in one.stdout.splitlines() if not x.startswith("#SBATCH --output=")] == \
        [x for x in written if not x.startswith("#SBATCH --output=")]


def test_plan_write_scripts_names_its_own_flag_and_takes_no_script(tmp_path):
    matrix = ROOT / "matrices" / "smoke.yaml"
    (tmp_path / "afile").write_text("")
    bad = run_cli("plan", matrix, "--write-scripts", tmp_path / "afile", tmp_path=tmp_path)
    assert bad.returncode == 2 and f"--write-scripts {tmp_path / 'afile'}: cannot write" in " ".join(bad.stderr.split())
    rid = json.loads(run_cli("plan", matrix, "--json", tmp_path=tmp_path, check=True).stdout)["runs"][0]["run_id"]
    (tmp_path / "s" / f"{rid}.sh").mkdir(parents=True)  # a directory where a script goes
    bad = run_cli("plan", matrix, "--write-scripts", tmp_path / "s", tmp_path=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "cannot write" in bad.stderr, bad.stderr
    bad = run_cli("plan", matrix, "--write-scripts", tmp_path / "t", "--script", rid, tmp_path=tmp_path)
    assert bad.returncode == 2 and "give one of them" in bad.stderr and not (tmp_path / "t").exists()


def test_the_rendezvous_host_survives_a_long_node_list_under_pipefail(tmp_path):
    """The first hostname is taken without closing scontrol's pipe early: `head -n 1` would leave a
    long list's scontrol to die of SIGPIPE, and under pipefail the job with it (exit 141)."""
    import subprocess

    from echobench.sweep.executors.slurm_script import NODE_LAUNCH_ENV

    line = NODE_LAUNCH_ENV.splitlines()[0]
    assert line.startswith("MASTER_ADDR=$(scontrol show hostnames")
    (tmp_path / "scontrol").write_text("#!/bin/bash\nfor i in $(seq 1 200000); do echo node$i; done\n")
    (tmp_path / "scontrol").chmod(0o755)
    script = f"set -euo pipefail\n{line}\necho \"$MASTER_ADDR\"\n"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "x"})
    assert (proc.returncode, proc.stdout.strip()) == (0, "node1"), proc.stderr
