"""A run that expects a GPU and sees none is an `error` record naming the cause, never `ok`; the
shipped GPU matrices say `device: cuda`; scripts/setup.sh picks the torch build for the machine's
architecture and GPU (tested through its --dry-run and --check modes, nothing installed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, cli_env, record, run_cli
from echobench.sweep.matrix import expand, load_matrix, parse_matrix
from echobench.records.peaks import table_peak

TINY = ["--scale", "tiny", "--steps", "1", "--warmup-steps", "1", "--micro-batch", "1",
        "--audio-frames", "25", "--text-tokens", "8", "--speaker-frames", "25"]


def expect_no_gpu_error(proc, out: Path, *why: str) -> str:
    """The run failed as the guard fails it: exit 1, a record with status error whose one-line
    error says what expected a GPU, why torch sees none and the fix; no traceback on the console."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    r = record(out)
    error = r["error"]
    assert r["status"] == "error" and "\n" not in error, error
    assert "this run expects a GPU (" in error and "but torch sees none" in error, error
    for text in why:
        assert text in error, error
    # the cause: a CPU build of torch here, CUDA_VISIBLE_DEVICES="" on a GPU host (cli_env sets it)
    assert "is a CPU build" in error or "CUDA_VISIBLE_DEVICES=''" in error, error
    assert "install a CUDA build (scripts/setup.sh) or set device: cpu" in error, error
    return error


def test_a_gpu_peak_on_the_cpu_is_an_error_not_an_ok_run(tmp_path):
    """The defect of issue 23: device auto on a CPU-only torch trained on the CPU and ended `ok`
    with an MFU of ~0 against a GPU's 990 TFLOP/s."""
    out = tmp_path / "run"
    proc = run_cli("run", *TINY, "--precision", "bf16", "--peak-tflops", "990", "--out", out, tmp_path=tmp_path)
    expect_no_gpu_error(proc, out, "a GPU peak of 990 TFLOP/s")
    assert record(out)["mfu"] is None  # nothing was measured


def test_device_cuda_without_a_gpu_is_an_error_record(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("run", *TINY, "--device", "cuda", "--peak-tflops", "1", "--out", out, tmp_path=tmp_path)
    expect_no_gpu_error(proc, out, "device: cuda")


def test_a_cpu_class_peak_or_an_explicit_cpu_device_still_runs(tmp_path):
    """No false positive: a small peak with device auto, and a GPU peak on a run told device: cpu
    (the way out the error names), run on the CPU and end ok."""
    for args in (["--peak-tflops", "1"], ["--peak-tflops", "990", "--device", "cpu"]):
        out = tmp_path / "-".join(args).strip("-")
        proc = run_cli("run", *TINY, *args, "--out", out, tmp_path=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert record(out)["status"] == "ok"


def test_a_matrix_naming_a_gpu_gives_its_auto_runs_the_guard(tmp_path):
    """hardware.device GH200 with device auto: the planned run is a cuda one (run.yaml says so),
    and run on this CPU it is an error record; device: cpu in the matrix keeps the CPU."""
    text = ("name: t\nexecutor: local\nhardware: {device: GH200}\n"
            "defaults: {scale: tiny, steps: 1, warmup_steps: 1, micro_batch: 1, audio_frames: 25, text_tokens: 8,"
            " speaker_frames: 25}\n")
    plan = expand(parse_matrix(text))
    assert [r.cfg.device for r in plan.runs] == ["cuda"]
    assert "device" not in plan.runs[0].settings  # what the matrix itself set is unchanged
    plan_cpu = expand(parse_matrix(text.replace("scale: tiny,", "scale: tiny, device: cpu,")))
    assert [r.cfg.device for r in plan_cpu.runs] == ["cpu"] and plan_cpu.runs[0].id == plan.runs[0].id
    plan_none = expand(parse_matrix(text.replace("hardware: {device: GH200}", "hardware: {memory_gib: 80}")))
    assert [r.cfg.device for r in plan_none.runs] == ["auto"]
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(plan.runs[0].cfg.to_dict()))
    out = tmp_path / "run"
    proc = run_cli("run", "--config", config, "--out", out, tmp_path=tmp_path)
    expect_no_gpu_error(proc, out, "device: cuda")


def gpu_matrices() -> list[Path]:
    """The shipped matrices for GPUs: those naming a GPU in hardware.device, or SLURM ones that
    request GPUs with a GPU peak."""
    found = []
    for path in sorted((ROOT / "matrices").glob("*.yaml")):
        spec = load_matrix(path).spec
        named = spec.hardware.device is not None and table_peak(spec.hardware.device) is not None
        if named or (spec.executor == "slurm" and spec.slurm.request_gpus and (spec.hardware.peak_tflops or 0) > 50):
            found.append(path)
    return found


def test_the_shipped_gpu_matrices_say_device_cuda_and_plan_on_a_cpu(tmp_path):
    paths = gpu_matrices()
    assert {p.name for p in paths} >= {"gh200-published.yaml", "h200-single.yaml"}
    for path in paths:
        matrix = load_matrix(path)
        assert matrix.defaults.get("device") == "cuda", path
        plan = expand(matrix)
        assert plan.runs and all(r.cfg.device == "cuda" for r in plan.runs), path
        proc = run_cli("plan", path, "--json", tmp_path=tmp_path)  # planning needs no GPU
        assert proc.returncode == 0, proc.stderr


# ---- scripts/setup.sh: which torch it installs where ----

SETUP = ROOT / "scripts" / "setup.sh"
CUDA_AARCH64 = "https://download.pytorch.org/whl/cu128"


def fake_nvidia_smi(bin_dir: Path, gpu: bool) -> None:
    """nvidia-smi as a GPU node's (`-L` lists a GPU) or as a node without a working one (exit 9)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    body = 'echo "GPU 0: NVIDIA GH200 480GB (UUID: GPU-0)"' if gpu else 'echo "NVIDIA-SMI has failed" >&2; exit 9'
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)


def setup(tmp_path: Path, *args: str, arch: str, gpu: bool, **env: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / f"bin-{arch}-{gpu}"
    fake_nvidia_smi(bin_dir, gpu)
    full = {k: v for k, v in cli_env().items() if k not in ("TORCH_INDEX_URL", "ECHOBENCH_SETUP_GPU")}
    full.update(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", ECHOBENCH_SETUP_ARCH=arch, **env)
    return subprocess.run(["bash", str(SETUP), *args], env=full, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("arch, gpu, expected", [
    ("x86_64", False, "python -m pip install -q torch==2.13.0"),
    ("x86_64", True, "python -m pip install -q torch>=2.6"),
    ("aarch64", True, f"python -m pip install -q torch>=2.6 --index-url {CUDA_AARCH64}"),
    ("aarch64", False, "python -m pip install -q torch==2.13.0"),
])
def test_setup_chooses_the_torch_build_for_the_architecture_and_gpu(tmp_path, arch, gpu, expected):
    proc = setup(tmp_path, "--dry-run", arch=arch, gpu=gpu)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [expected]
    # TORCH_INDEX_URL is honoured in every branch, in place of the default index
    proc = setup(tmp_path, "--dry-run", arch=arch, gpu=gpu, TORCH_INDEX_URL="https://example.invalid/whl/x")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines() == [
        expected.split(" --index-url")[0] + " --index-url https://example.invalid/whl/x"]


def test_setup_dry_run_installs_nothing(tmp_path):
    venv = tmp_path / "venv"
    proc = setup(tmp_path, "--dry-run", arch="x86_64", gpu=True, ECHOBENCH_VENV=str(venv))
    assert proc.returncode == 0 and not venv.exists()


def test_setup_check_fails_on_a_gpu_machine_with_a_cpu_torch(tmp_path):
    """After installing (and alone, as --check), a GPU that torch cannot use fails setup with one
    line: the cause and the fix. This venv's torch is a CPU build; with no GPU the check passes."""
    import torch

    if torch.version.cuda is not None:
        pytest.skip("needs a CPU build of torch (this venv's is a CUDA one)")
    venv = str(ROOT / ".venv")
    proc = setup(tmp_path, "--check", arch="aarch64", gpu=True, ECHOBENCH_VENV=venv)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"torch {torch.__version__} is a CPU build" in lines[0] and "NVIDIA GPU" in lines[0]
    assert f"TORCH_INDEX_URL={CUDA_AARCH64} scripts/setup.sh" in lines[0]
    assert setup(tmp_path, "--check", arch="aarch64", gpu=False, ECHOBENCH_VENV=venv).returncode == 0


def test_setup_on_a_login_node_without_a_gpu_can_set_up_for_gpu_nodes(tmp_path):
    """ECHOBENCH_SETUP_GPU=1: the choice of a GPU node, where the node running setup has none."""
    proc = setup(tmp_path, "--dry-run", arch="aarch64", gpu=False, ECHOBENCH_SETUP_GPU="1")
    assert proc.stdout.strip() == f"python -m pip install -q torch>=2.6 --index-url {CUDA_AARCH64}"
    proc = setup(tmp_path, "--dry-run", arch="x86_64", gpu=True, ECHOBENCH_SETUP_GPU="0")
    assert proc.stdout.strip() == "python -m pip install -q torch==2.13.0"
    assert setup(tmp_path, "--bogus", arch="x86_64", gpu=False).returncode == 2


def fake_venv(root: Path, cuda: str | None, archs: str) -> Path:
    """A venv whose python imports a stand-in torch: a CUDA build (`cuda`, kernels for `archs`) or a
    CPU one, on a machine without a driver (torch.cuda.is_available() is False, as there)."""
    (root / "site" / "torch").mkdir(parents=True)
    (root / "site" / "torch" / "__init__.py").write_text(
        f"__version__ = '2.9.0+{'cu128' if cuda else 'cpu'}'\n"
        f"class version:\n    cuda = {cuda!r}\n"
        "class cuda:\n    @staticmethod\n    def is_available():\n        return False\n"
        f"class _C:\n    @staticmethod\n    def _cuda_getArchFlags():\n        return {archs!r}\n")
    (root / "bin").mkdir()
    (root / "bin" / "python").write_text(f'#!/bin/sh\nPYTHONPATH={root / "site"} exec {sys.executable} "$@"\n')
    (root / "bin" / "python").chmod(0o755)
    return root


def test_setup_for_gpu_nodes_on_a_login_node_without_a_driver_checks_the_build_not_the_device(tmp_path):
    """ECHOBENCH_SETUP_GPU=1 where no driver answers: torch.cuda.is_available() is False there for any
    build, so the check is the build itself: CUDA, with kernels for the nodes' architecture."""
    cuda = fake_venv(tmp_path / "cuda", "12.8", "sm_80 sm_90 sm_100")
    proc = setup(tmp_path, "--check", arch="aarch64", gpu=False, ECHOBENCH_SETUP_GPU="1", ECHOBENCH_VENV=str(cuda))
    assert proc.returncode == 0, proc.stderr
    assert "no NVIDIA driver here: torch 2.9.0+cu128 is a CUDA 12.8 build for sm_80 sm_90 sm_100" in proc.stdout
    cpu = fake_venv(tmp_path / "cpu", None, "")
    proc = setup(tmp_path, "--check", arch="aarch64", gpu=False, ECHOBENCH_SETUP_GPU="1", ECHOBENCH_VENV=str(cpu))
    assert proc.returncode == 1 and "torch 2.9.0+cpu is a CPU build" in proc.stderr
    old = fake_venv(tmp_path / "old", "11.8", "sm_70 sm_80")
    proc = setup(tmp_path, "--check", arch="x86_64", gpu=False, ECHOBENCH_SETUP_GPU="1", ECHOBENCH_VENV=str(old))
    assert proc.returncode == 1 and "has no kernels for sm_90 (built for sm_70 sm_80)" in proc.stderr
