"""`echobench tune` with real runs: the tiny preset on 2 CPU processes through the local executor,
ranked on a profile the test writes. What the runs measure is not asserted (the machine is loaded):
the winner is the best of what was measured, each family's best is measured, an interrupted or
repeated tune runs nothing twice, and the written config and one-run matrix run the winner."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import record, run_cli
from echobench.hardware.profile import save_profile
from echobench.sweep.matrix import expand, load_matrix
from echobench.records.results import load_records
from test_predict import profile

TUNE = {
    "name": "t-runs", "executor": "local", "local": {"time": "00:05:00"},
    # peak_tflops set: no GEMM calibration before the runs (their MFU is not what this test holds)
    "defaults": {"steps": 3, "warmup_steps": 1, "device": "cpu", "audio_frames": 64, "text_tokens": 16,
                 "speaker_frames": 48, "peak_tflops": 1.0},
    "scale": "tiny", "nodes": [1], "gpus_per_node": 2, "search": {"micro_batch": [2], "ac": ["none"]},
    "top_k": 1, "max_rounds": 1,
}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    (root / "tune.yaml").write_text(yaml.safe_dump(TUNE))
    save_profile(profile(device="CPU synthetic", gpus_per_node=2), root / "cpu.yaml")
    args = ("tune", root / "tune.yaml", "--out", root / "out", "--profile", root / "cpu.yaml")
    proc = run_cli(*args, tmp_path=root, timeout=1200)
    return root, args, proc


def test_the_winner_is_the_best_measured_and_every_family_was_measured(tuned):
    root, _, proc = tuned
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((root / "out" / "tune.json").read_text())
    (problem,) = doc["problems"]
    records, problems = load_records([root / "out" / "sweep"])
    assert not problems and records and all(r.status == "ok" for r in records)
    best = max(records, key=lambda r: r.samples_per_s)
    assert problem["winner"] == best.run_id
    measured = [c for c in problem["candidates"] if c["measured"]]
    assert {c["family"] for c in measured} == {"ddp", "fsdp2", "megatron-tp"}
    assert {c["run_id"] for c in measured} == {r.run_id for r in records}
    for c in measured:  # the residual is the record's samples/s against the prediction
        r = next(r for r in records if r.run_id == c["run_id"])
        assert c["residual"] == pytest.approx(r.samples_per_s / c["predicted"]["samples_per_s"] - 1)
    assert problem["winner"] in (root / "out" / "report.md").read_text()


def test_a_second_tune_runs_nothing_twice(tuned):
    root, args, _ = tuned
    files = sorted((root / "out" / "sweep").glob("*/result.json"))
    before = {f: f.stat().st_mtime_ns for f in files}
    winner = json.loads((root / "out" / "tune.json").read_text())["problems"][0]["winner"]
    proc = run_cli(*args, tmp_path=root, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(files)} ok already" in proc.stdout and "0 to run" in proc.stdout
    assert {f: f.stat().st_mtime_ns for f in files} == before
    assert json.loads((root / "out" / "tune.json").read_text())["problems"][0]["winner"] == winner


def test_the_written_config_and_matrix_run_the_winner(tuned, tmp_path):
    root, _, _ = tuned
    problem = json.loads((root / "out" / "tune.json").read_text())["problems"][0]
    proc = run_cli("run", "--config", problem["files"]["config"], "--nproc", 2, "--out", tmp_path / "run",
                   tmp_path=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = record(tmp_path / "run")
    assert got["status"] == "ok" and got["run_id"] == problem["winner"]
    plan = expand(load_matrix(problem["files"]["matrix"]))
    assert [r.id for r in plan.runs] == [problem["winner"]]
