"""tools/predict_cpu_passes.py: each pass of the CPU check tabulated with its load, the median pass,
and --reprice pricing a committed pass's records again on its own profile (reports/predict-cpu-2026-12-04)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "predict_cpu_passes.py"


def a_pass(folder: Path, errors: dict[str, float], load: str) -> Path:
    folder.mkdir(parents=True)
    rows = [{"run_id": f"{run}-mb4-0000", "error": e} for run, e in errors.items()]
    (folder / "against.json").write_text(json.dumps(rows))
    (folder / "pass.log").write_text(f"predict-cpu-sweep: 10:00:00 load {load} 1.0 1.0: calibrate --comm\n"
                                     f"predict-cpu-sweep: 10:00:30 load 2.00 1.0 1.0: sweep\n")
    return folder / "against.json"


def test_each_pass_its_load_and_the_median_pass(tmp_path):
    paths = [a_pass(tmp_path / "pass-1", {"single": 0.10, "ddp": -0.30}, "0.50"),
             a_pass(tmp_path / "pass-2", {"single": -0.20, "ddp": 0.40}, "1.50"),
             a_pass(tmp_path / "pass-3", {"single": 0.05, "ddp": -0.05}, "0.70")]
    out = subprocess.run([sys.executable, str(TOOL), *map(str, paths)], capture_output=True, text=True, check=True).stdout
    assert "| pass-1 | 0.50 / 2.00 | -30.0% | +10.0% | 20.0% | 30.0% |" in out
    assert "3 passes: median mean |error| 20.0% (range 5.0%-30.0%), median max |error| 30.0%" in out
    assert "single: median error +5.0% over 3 passes (-20.0% .. +10.0%)" in out


def test_reprice_prices_a_committed_pass_with_this_checkouts_model():
    folder = ROOT / "reports" / "predict-cpu-2026-12-04" / "pass-01"
    out = subprocess.run([sys.executable, str(TOOL), "--reprice", str(folder)], capture_output=True, text=True,
                         check=True, cwd=ROOT, timeout=600).stdout
    priced = json.loads(subprocess.run([sys.executable, "-m", "echobench", "validate", "measured", str(folder / "runs"),
                                        "--profile", str(folder / "profile.yaml"), "--json"], capture_output=True,
                                       text=True, check=True, cwd=ROOT, timeout=600).stdout)
    assert len(priced) == 4
    mean = sum(abs(r["error"]) for r in priced) / len(priced)
    assert f"| {mean:.1%} |" in out and "| pass-01 | 0.43 / 1.47 |" in out
    for r in priced:  # each against its record, not a copy of the committed figure
        assert r["error"] == pytest.approx(r["step_time_s"] / r["measured_step_time_s"] - 1)
