"""log_metrics: a run's progress figures and its record's figures in TensorBoard (read back from the
event files a real run wrote) or Weights & Biases (through the calls wandb's API takes); a missing
package is one line before anything runs."""

import importlib.machinery
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from conftest import record
from echobench.cli import app
from echobench.train import metrics_log
from echobench.train.progress import Progress

TINY = ["--scale", "tiny", "--steps", "3", "--warmup-steps", "2", "--micro-batch", "1", "--audio-frames", "30",
        "--text-tokens", "8", "--speaker-frames", "30", "--peak-tflops", "0.5", "--device", "cpu"]


def test_a_run_logs_its_progress_and_its_record_to_tensorboard(cli, tmp_path):
    pytest.importorskip("tensorboard")  # in the dev extra: CI has it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    proc = cli("run", *TINY, "--progress-every-s", "0", "--log-metrics", "tensorboard", "--out", out)
    assert proc.returncode == 0, proc.stderr
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"progress/mfu", "progress/samples_per_s", "progress/step_time_s", "progress/memory_gib",
            "result/mfu", "result/samples_per_s", "result/step_time_s"} <= tags
    # every step printed a line (progress_every_s 0): the 2 warm-up and 3 measured steps are logged
    assert [e.step for e in events.Scalars("progress/step_time_s")] == [1, 2, 3, 4, 5]
    rec = record(out)
    assert events.Scalars("result/mfu")[0].value == pytest.approx(rec["mfu"], rel=1e-6)
    assert events.Scalars("result/step_time_s")[0].value == pytest.approx(rec["step_time_s"], rel=1e-6)
    assert rec["config"]["log_metrics"] == "tensorboard" and rec["status"] == "ok"


def test_wandb_gets_each_step_line_and_the_record_summary(monkeypatch, tmp_path):
    calls = []

    class Run:
        summary = {}

        def log(self, figures, step):
            calls.append(("log", step, figures))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "echo-mfu")
    logger = metrics_log.open_metrics_log("wandb", tmp_path, "run-1", {"scale": "tiny"})
    now = [0.0]
    p = Progress(0.0, total_steps=4, samples_per_step=8, flops_per_step=2e12, peak_tflops=4.0,
                 device=torch.device("cpu"), clock=lambda: now[0], out=lambda line: None, metrics=logger)
    p.start()
    for step in (1, 2):
        now[0] += 2.0
        p.step(step, "measured", None)
    metrics_log.finish(logger, {"mfu": 0.25})
    assert calls[0] == ("init", {"project": "echo-mfu", "name": "run-1", "config": {"scale": "tiny"},
                                 "dir": str(tmp_path)})
    assert [(c[0], c[1]) for c in calls[1:3]] == [("log", 1), ("log", 2)]
    assert calls[1][2]["progress/mfu"] == pytest.approx(2e12 / 2.0 / 1e12 / 4.0)  # 1 TFLOP/s of 4
    assert "progress/loss" not in calls[1][2]  # the measured window reads no loss (no device sync)
    assert calls[-1] == ("finish",) and Run.summary == {"result/mfu": 0.25}


def test_a_missing_package_is_one_line_before_anything_runs(monkeypatch, tmp_path):
    real = metrics_log.importlib.util.find_spec
    monkeypatch.setattr(metrics_log.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    result = CliRunner().invoke(app, ["run", *TINY, "--log-metrics", "wandb", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "pip install 'echobench[wandb]'" in result.output
    assert not (tmp_path / "x").exists()


def test_a_logger_that_fails_at_the_end_fails_nothing(capsys):
    class Broken:
        def finish(self, figures):
            raise OSError("disk full\nsecond line")

    metrics_log.finish(Broken(), {"mfu": 0.1})
    assert capsys.readouterr().out == "[echobench] log_metrics: the logger did not finish: OSError: disk full\n"
