"""Site routes (issue 33), each rendered as its job scripts: the seed's quad-GH200 InfiniBand cluster,
an Alps-like Slingshot system through the Container Engine or a uenv, H100 / H200 HGX through
pyxis; the fabrics' variables; time limits that allow for the image, the setup lines and compile;
what every run's script asks of SLURM (a signal before the limit, CPUs per process) and what it
carries (its run.yaml)."""

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from echobench.sweep.estimate import COMPILE_S, LOCAL_IMAGE_S, PULL_S, SETUP_LINE_S, STARTUP_S, startup_parts
from echobench.sweep.executors.slurm_script import (render_calibration_script, render_preflight_script, render_script,
                                              stack_signal_lead_s)
from echobench.train.fabric import FABRICS, fabric_env, launch_env
from echobench.sweep.matrix import MatrixError, expand, parse_matrix
from echobench.sweep.preflight import preflight_spec

SWEEP = Path("/tmp/eb-routes")


def matrix(slurm: dict, defaults: dict | None = None, **top):
    return parse_matrix(json.dumps({"name": "r", "executor": "slurm", "slurm": slurm,
                                    "defaults": {"parallelism": "ddp", "gpus_per_node": 4, **(defaults or {})}, **top}),
                        "m.yaml")


def scripts(m) -> dict[str, list[str]]:
    """Every script of the matrix's first run: the run's, the preflight's and the calibration's."""
    runs = expand(m).runs
    run = runs[0]
    return {"run": render_script(run.cfg, SWEEP / run.id, m.spec.slurm).splitlines(),
            "preflight": render_preflight_script(SWEEP, m.spec.slurm, preflight_spec(m, runs, "slurm"), 600).splitlines(),
            "calibration": render_calibration_script(SWEEP, m.spec.slurm).splitlines()}


def arrays(lines: list[str]) -> dict[str, list[str]]:
    """SRUN_ARGS / IN_CONTAINER / ON_FIRST_NODE as bash reads them."""
    defs = [x for x in lines if x.startswith(("SRUN_ARGS=", "IN_CONTAINER=", "ON_FIRST_NODE="))]
    out = subprocess.run(["bash", "-c", "\n".join(defs) + '\nfor a in SRUN_ARGS IN_CONTAINER ON_FIRST_NODE; do '
                          'declare -n r=$a; printf "%s\\0" "$a" "${#r[@]}" "${r[@]}"; done'],
                         capture_output=True, text=True, check=True).stdout.split("\0")
    got, i = {}, 0
    while i < len(out) - 1:
        name, n = out[i], int(out[i + 1])
        got[name], i = out[i + 2:i + 2 + n], i + 2 + n
    return got


def exported(lines: list[str]) -> dict[str, str]:
    return {k.removeprefix("export "): v for k, _, v in (x.partition("=") for x in lines if x.startswith("export "))}


def test_the_container_engine_route_puts_the_edf_on_every_srun():
    """Alps: --environment=EDF on the ranks' srun, the first-node check's, the preflight's and the
    calibration's; the EDF holds mounts and hooks, so the matrix may not."""
    m = matrix({"gpus_per_node": 4, "fabric": "slingshot",
                "container": {"runtime": "ce", "image": "/users/me/.edf/echobench.toml"}})
    for name, lines in scripts(m).items():
        got = arrays(lines)
        assert "--environment=/users/me/.edf/echobench.toml" in got["SRUN_ARGS"], name
        assert got["ON_FIRST_NODE"][:4] == ["srun", "--nodes=1", "--ntasks=1", "--kill-on-bad-exit=1"], name
        assert "--environment=/users/me/.edf/echobench.toml" in got["ON_FIRST_NODE"] and not got["IN_CONTAINER"], name
        assert "PYTHON=python3" in lines  # the image's
    with pytest.raises(MatrixError, match="runtime ce: the Container Engine takes mounts, workdir and writable from "
                                          "the EDF"):
        matrix({"container": {"runtime": "ce", "image": "x.toml", "mounts": ["/a:/a"]}})


def test_the_slingshot_fabric_sets_cscs_variables_and_leaves_the_hooks_to_the_container_engine():
    plain = exported(scripts(matrix({"fabric": "slingshot", "setup": ["module load aws-ofi-nccl"]}))["run"])
    assert plain["NCCL_NET"] == "'AWS Libfabric'" and plain["FI_CXI_RX_MATCH_MODE"] == "software"
    assert plain["FI_CXI_DEFAULT_TX_SIZE"] == "32768" and plain["FI_CXI_DEFAULT_CQ_SIZE"] == "131072"
    assert plain["GLOO_SOCKET_IFNAME"] == "hsn0" and "NCCL_PROTO" not in plain  # NCCL_PROTO: at launch, by version
    m = matrix({"fabric": "slingshot", "env": {"FI_CXI_RX_MATCH_MODE": "hardware"},
                "container": {"runtime": "ce", "image": "echobench"}})
    lines = scripts(m)["run"]
    ce = exported(lines)
    hooked = FABRICS["slingshot"].hook_sets
    assert not (set(ce) & hooked) - {"FI_CXI_RX_MATCH_MODE"}  # the hook's: not exported...
    assert ce["FI_CXI_RX_MATCH_MODE"] == "hardware"  # ... unless the matrix says so itself
    assert ce["NCCL_SOCKET_IFNAME"] == "hsn" and ce["ECHOBENCH_FABRIC"] == "slingshot"
    note = next(x for x in lines if x.startswith("# fabric slingshot:"))
    assert "NCCL_NET" in note and "aws-ofi-nccl hook" in note


@pytest.mark.parametrize("version, proto", [((2, 27, 3), "^LL128"), ((2, 28, 0), "^LL128"), ((2, 26, 5), None),
                                            (None, None)])
def test_slingshot_turns_ll128_off_from_nccl_2_27_at_launch(version, proto):
    assert launch_env("slingshot", {}, version).get("NCCL_PROTO") == proto
    assert launch_env("slingshot", {"NCCL_PROTO": "Simple"}, (2, 27, 0)) == {}  # the matrix's own stays
    assert launch_env("infiniband", {}, (2, 27, 0)) == {}


def test_the_uenv_route_mounts_the_image_on_every_srun():
    m = matrix({"fabric": "slingshot", "uenv": {"image": "prgenv-gnu/24.11:v1", "view": "default"}})
    for name, lines in scripts(m).items():
        got = arrays(lines)
        assert got["SRUN_ARGS"][-2:] == ["--uenv=prgenv-gnu/24.11:v1", "--view=default"], name
        assert got["ON_FIRST_NODE"][-2:] == ["--uenv=prgenv-gnu/24.11:v1", "--view=default"], name
    with pytest.raises(MatrixError, match="container and uenv"):
        matrix({"uenv": {"image": "a/1:v1"}, "container": {"image": "b"}})
    with pytest.raises(MatrixError, match="uenv.image"):
        matrix({"uenv": {"image": "a b; rm -rf /"}})


def test_pyxis_imports_the_image_once_per_node_and_job():
    """The first-node check's srun imports it under a name; the ranks' srun finds it by that name."""
    m = matrix({"gpus_per_node": 8, "fabric": "infiniband", "container": {"image": "nvcr.io#nvidia/pytorch:25.01-py3"}})
    got = arrays(scripts(m)["run"])
    named = [a for a in got["SRUN_ARGS"] if a.startswith("--container-name=")]
    assert len(named) == 1 and named[0] in got["ON_FIRST_NODE"]
    assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in got["SRUN_ARGS"]
    other = matrix({"container": {"image": "/lustre/images/pytorch.sqsh"}})
    assert named[0] not in arrays(scripts(other)["run"])["SRUN_ARGS"]  # another image, another name


def test_time_limits_allow_for_the_image_the_setup_lines_and_compile():
    pulled = matrix({"fabric": "none", "container": {"image": "nvcr.io#nvidia/pytorch:25.01-py3"},
                     "setup": ["module load a", "module load b"]})
    assert startup_parts(pulled, compile=True) == {"start-up": STARTUP_S, "image": PULL_S,
                                                    "setup lines": 2 * SETUP_LINE_S, "compile": COMPILE_S}
    squashfs = matrix({"container": {"image": "/lustre/images/pytorch.sqsh"}})
    assert startup_parts(squashfs)["image"] == LOCAL_IMAGE_S
    assert startup_parts(matrix({"uenv": {"image": "prgenv-gnu/24.11:v1"}}))["image"] == LOCAL_IMAGE_S
    assert startup_parts(matrix({})) == {"start-up": STARTUP_S}
    # The per-run limit follows: the same run asks for more where the image is pulled.
    from echobench.sweep.estimate import time_limit_s

    rule = {"time": "04:00:00", "time_from_estimate": {"factor": 1, "floor": "00:01:00"}}
    runs = {name: (m, expand(m).runs[0]) for name, m in
            (("bare", matrix(rule, hardware={"peak_tflops": 900})),
             ("pulled", matrix({**rule, "container": {"image": "nvcr.io#nvidia/pytorch:25.01-py3"}},
                               hardware={"peak_tflops": 900})))}
    bare, pulled_limit = (time_limit_s(m, "slurm", r) for m, r in runs.values())
    assert pulled_limit - bare >= PULL_S - 60  # whole minutes


def test_a_multi_node_gpu_matrix_names_its_fabric():
    with pytest.raises(MatrixError, match="slurm.fabric: runs on several GPU nodes need their fabric named"):
        expand(matrix({"gpus_per_node": 4}, {"nodes": 2}))
    expand(matrix({"gpus_per_node": 4, "fabric": "none"}, {"nodes": 2}))  # `none` is a choice
    expand(matrix({"gpus_per_node": 4}, {"nodes": 1}))  # one node: no fabric between nodes
    expand(matrix({"gpus_per_node": 2, "request_gpus": False}, {"nodes": 2, "device": "cpu"}))  # CPU nodes


def test_infiniband_requires_ib_binds_gloo_and_takes_exact_hca_lists():
    env = fabric_env("infiniband", {})
    assert env["NCCL_NET"] == "IB" and env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "NCCL_SOCKET_IFNAME" not in env  # NCCL's default (ib* first) beats "^lo,docker0"
    assert all("GLOO_SOCKET_IFNAME" in FABRICS[f].env for f in ("infiniband", "slingshot"))
    with pytest.raises(MatrixError, match=r"NCCL_IB_HCA=mlx5_0,mlx5_1: NCCL matches each name as a prefix \(mlx5_1 "
                                          r"also takes mlx5_10, mlx5_11, .*write =mlx5_0,mlx5_1 for exactly these"):
        matrix({"env": {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}})
    for fine in ("=mlx5_0,mlx5_1", "^=mlx5_4", "mlx5", "mlx5_0:1"):
        matrix({"env": {"NCCL_IB_HCA": fine}})


def test_a_runs_job_asks_for_a_signal_before_its_limit_and_a_cpu_per_process():
    m = matrix({"time": "00:30:00", "request_gpus": False}, {"nodes": 1, "gpus_per_node": 2, "device": "cpu"})
    every = scripts(m)
    assert "#SBATCH --signal=USR1@120" in every["run"] and "#SBATCH --cpus-per-task=2" in every["run"]
    assert not [x for x in every["preflight"] + every["calibration"] if x.startswith("#SBATCH --signal")]
    assert stack_signal_lead_s("1") == 20 and stack_signal_lead_s("2-00:00:00") == 120


def test_a_runs_script_carries_its_settings_for_when_it_is_submitted_by_hand(tmp_path):
    """A script from `plan --write-scripts` finds no run.yaml: it writes the run's own (the heredoc, run by bash)."""
    m = matrix({"request_gpus": False}, {"nodes": 1, "gpus_per_node": 2, "device": "cpu", "tokenizer": "EOF $(x) 'y'"})
    run = expand(m).runs[0]
    lines = render_script(run.cfg, tmp_path / run.id, m.spec.slurm).splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith('if [ ! -e "$RUN_DIR/run.yaml" ]'))
    end = lines.index("fi", start)
    subprocess.run(["bash", "-c", "\n".join([f"RUN_DIR={tmp_path / run.id}", *lines[start:end + 1]])], check=True)
    assert yaml.safe_load((tmp_path / run.id / "run.yaml").read_text()) == run.cfg.to_dict()


def test_the_shipped_routes_name_their_hcas_exactly():
    """A bare NCCL_IB_HCA prefix (mlx5) also takes an Ethernet mlx5 port: every shipped matrix and
    every route page's matrix and every shipped site file that names HCAs lists them exactly (=...)."""
    root = Path(__file__).resolve().parent.parent
    found = []
    for path in sorted([*(root / "matrices").glob("*.yaml"), *(root / "sites").glob("*.yaml")]):
        found.append((path.name, (yaml.safe_load(path.read_text()).get("slurm") or {}).get("env", {})))
    for path in sorted((root / "docs" / "guides").glob("route-*.md")):
        for block in path.read_text().split("```yaml")[1:]:
            found.append((path.name, ((yaml.safe_load(block.split("```")[0]) or {}).get("slurm") or {}).get("env", {})))
    named = {(name, env["NCCL_IB_HCA"]) for name, env in found if "NCCL_IB_HCA" in env}
    assert ("gh200-published.yaml", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3") in named
    assert ("route-1-gh200-infiniband.md", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3") in named
    assert ("gh200-infiniband-venv.yaml", "=mlx5_0,mlx5_1,mlx5_2,mlx5_3") in named
    assert all(hca.startswith(("=", "^=")) for _, hca in named), named
