"""The device's wheel set is closed (tools/device/stack.py): whatever the device check imports is on
the H200 image or carried, and the carried wheels' own requirements are met there."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.device import stack as device_stack

ROOT = Path(__file__).resolve().parents[1]


def stack_without(tmp_path: Path, line: str, replace: str = "") -> device_stack.Stack:
    text = device_stack.PACKAGES.read_text()
    assert line in text.splitlines()
    path = tmp_path / "device-packages.txt"
    path.write_text("\n".join(replace if ln == line else ln for ln in text.splitlines()) + "\n")
    return device_stack.read_stack(path)


def test_everything_the_device_check_imports_is_there_or_carried():
    assert device_stack.import_problems(device_stack.read_stack()) == []


def test_an_import_that_is_neither_on_the_image_nor_carried_is_named(tmp_path):
    problems = device_stack.import_problems(stack_without(tmp_path, "carried plotly==7.1.0"))
    assert len(problems) == 1 and problems[0].startswith("plotly (plotly) is imported by echobench/"), problems


def test_what_is_imported_and_what_is_optional(tmp_path):
    (tmp_path / "mod.py").write_text(
        "import yaml\n"
        "try:\n    import transformer_engine\nexcept ImportError:\n    transformer_engine = None\n"
        "def f():\n    import plotly\n"
        "@pytest.mark.gpu\ndef test_gpu():\n    import torchao\n"
        "BACKEND = 'echobench.backends.megatron'\n")
    everything = {name for name, _ in device_stack.imports_of(tmp_path / "mod.py")}
    assert {"yaml", "plotly", "torchao", "echobench.backends.megatron"} <= everything
    assert "transformer_engine" not in everything  # guarded: optional
    collected = {name for name, _ in device_stack.imports_of(tmp_path / "mod.py", module_level_only=True)}
    assert "yaml" in collected and "torchao" in collected and "plotly" not in collected


@pytest.fixture(scope="module")
def carried_wheels(tmp_path_factory) -> Path:
    """The carried wheels, downloaded by tools/device/wheels.sh as for a device call (PyPI; CI has it).
    Without network they skip, unless ECHOBENCH_REQUIRE_DEVICE_WHEELS=1 (set in .ci/run)."""
    dest = tmp_path_factory.mktemp("wheels")
    env = dict(os.environ, DEVICE_WHEELS_DEST=str(dest), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "tools/device/wheels.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        why = f"tools/device/wheels.sh failed: {proc.stderr.strip().splitlines()[-1:]}"
        if os.environ.get("ECHOBENCH_REQUIRE_DEVICE_WHEELS") == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return dest


def test_the_carried_wheels_need_only_what_the_device_has(carried_wheels):
    assert device_stack.wheel_problems(device_stack.read_stack(), carried_wheels) == []


def test_a_dropped_wheel_breaks_the_set(carried_wheels, tmp_path):
    for wheel in carried_wheels.glob("*.whl"):
        if not wheel.name.startswith("pydantic_core-"):
            shutil.copy(wheel, tmp_path)
    problems = device_stack.wheel_problems(device_stack.read_stack(), tmp_path)
    assert any(p.startswith("carried pydantic-core==") and "has no wheel" in p for p in problems), problems
    assert any(p.startswith("pydantic 2.") and "pydantic-core" in p for p in problems), problems


def test_a_requirement_the_image_does_not_meet_is_named(carried_wheels, tmp_path):
    stack = stack_without(tmp_path, "image torch==2.11.0", "image torch==2.5.0")
    problems = device_stack.wheel_problems(stack, carried_wheels)
    assert any("megatron-core" in p and "torch>=" in p and "torch 2.5.0" in p for p in problems), problems


def test_a_requirement_missing_from_both_is_named(carried_wheels, tmp_path):
    stack = stack_without(tmp_path, "image narwhals")
    problems = device_stack.wheel_problems(stack, carried_wheels)
    assert any(p.startswith("plotly 7.1.0 requires narwhals") for p in problems), problems
