"""`echobench calibrate` as a MAMF-style sweep: the square and the DiT block's GEMM shapes of a
preset, each timed `iters` times after warm-up; the ceiling is the best shape's median. Nothing
here asserts a measured speed."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from echobench.hardware import device as hardware
from echobench.records.config import RunConfig
from echobench.model.flops import speaker_patches
from echobench.hardware.device import calibrate, gemm_shapes, load_calibration, resolve_peak
from tools.device import summary

CPU = torch.device("cpu")
OLD_KEYS = {"device", "dtype", "size", "iters", "tflops", "tflops_min", "tflops_max", "datasheet_tflops", "torch",
            "time"}
SHAPE_KEYS = {"name", "m", "n", "k", "iters", "tflops_median", "tflops_max", "tflops_min"}
SMALL = dict(scale="tiny", micro_batch=2, audio_frames=40, text_tokens=16, speaker_frames=30)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("scale", ["tiny", "3B"])
def test_the_shapes_are_the_dit_blocks_linears_of_the_preset(scale):
    cfg = RunConfig(scale=scale).model_config()
    mb, frames, tokens, spk = 3, 50, 20, 41
    shapes = gemm_shapes(cfg, mb, frames, tokens, spk)
    dims = {(s.m, s.n, s.k) for s in shapes}
    latent, speaker = mb * frames, mb * speaker_patches(cfg, spk)
    d, hidden = cfg.width, cfg.mlp
    # Fused projections: q/k/v/gate (4 x width), the MLP's gate/up (2 x hidden); out and down.
    assert {(latent, 4 * d, d), (latent, 2 * hidden, d), (latent, d, hidden), (latent, d, d)} <= dims
    assert (mb * tokens, 2 * d, d) in dims and (speaker, 2 * d, cfg.speaker_width) in dims  # cross-attention k+v
    assert (mb, cfg.adaln_rank, d) in dims and (mb, 6 * d, cfg.adaln_rank) in dims  # AdaLN, low rank
    assert len(dims) == len(shapes)  # each shape once
    assert all(s.flops == 2 * s.m * s.n * s.k for s in shapes)


def test_shapes_met_twice_are_timed_once_under_both_names():
    # width == speaker width and text rows == speaker rows: text and speaker k/v are one shape
    cfg = RunConfig(scale="tiny").model_config()
    tokens = speaker_patches(cfg, 40)
    shapes = gemm_shapes(cfg, 2, 40, tokens, 40)
    (both,) = [s for s in shapes if s.m == 2 * tokens and s.n == 2 * cfg.width]
    assert both.name == "text k+v; speaker k+v"


def test_the_sweep_times_every_shape_it_lists_and_the_ceiling_is_the_best_median(cache, monkeypatch):
    timed = []
    real = hardware.time_gemm

    def spy(device, dtype, shape, iters, warmup, time_left_s=None):
        timed.append((shape.name, shape.m, shape.n, shape.k))
        return real(device, dtype, shape, iters, warmup, time_left_s)

    monkeypatch.setattr(hardware, "time_gemm", spy)
    rec = calibrate(CPU, size=64, iters=4, **SMALL)

    assert OLD_KEYS <= set(rec) and {"shapes", "best_shape", "wall_s"} <= set(rec)
    listed = [(s["name"], s["m"], s["n"], s["k"]) for s in rec["shapes"]]
    assert sorted(timed) == sorted(listed) and len(set(listed)) == len(listed)
    cfg = RunConfig(scale="tiny").model_config()
    expected = [(s.name, s.m, s.n, s.k) for s in gemm_shapes(cfg, 2, 40, 16, 30)]
    assert listed == [("square", 64, 64, 64), *expected]
    assert rec["shapes_from"] == SMALL and rec["size"] == 64 and rec["wall_s"] > 0
    for s in rec["shapes"]:
        assert set(s) == SHAPE_KEYS and s["iters"] == 4
        assert s["tflops_min"] <= s["tflops_median"] <= s["tflops_max"]
    best = max(rec["shapes"], key=lambda s: s["tflops_median"])
    assert rec["tflops"] == max(s["tflops_median"] for s in rec["shapes"]) == best["tflops_median"]
    assert rec["best_shape"] == best["name"] and rec["iters"] == best["iters"] == 4
    assert (rec["tflops_min"], rec["tflops_max"]) == (best["tflops_min"], best["tflops_max"])
    assert rec["dtype"] == "float32" and rec["iters_requested"] == 4


def test_the_record_round_trips_and_resolve_peak_takes_it_as_the_ceiling(cache):
    rec = calibrate(CPU, size=32, iters=2, **SMALL)
    stored = load_calibration(rec["device"], torch.float32)
    assert stored == {k: v for k, v in rec.items() if k != "path"}
    assert json.loads((cache / "calibration").glob("*.json").__next__().read_text()) == stored
    peak = resolve_peak(rec["device"], torch.float32)  # a CPU: no datasheet row, the calibration is the peak
    assert peak["ceiling_tflops"] == rec["tflops"] == peak["peak_tflops"]
    assert peak["peak_source"].startswith("calibrated:float32") and peak["peak_precision"] == "fp32"
    assert resolve_peak(rec["device"], torch.float32, flag=10.0)["ceiling_tflops"] == rec["tflops"]


def test_the_budget_cuts_iterations_and_the_record_says_how_many(cache):
    rec = calibrate(CPU, size=256, iters=1000, budget_s=1e-4, **SMALL)
    assert rec["iters_requested"] == 1000 and rec["budget_s"] == 1e-4
    # the budget is spent before the first shape: each is timed once, and says so
    assert [s["iters"] for s in rec["shapes"]] == [1] * len(rec["shapes"]) and rec["iters"] == 1


def test_a_gpu_ceiling_needs_fifty_timed_matmuls_per_shape(cache):
    with pytest.raises(ValueError, match="at least 50 timed matmuls"):
        calibrate(torch.device("cuda"), iters=10)  # refused before anything touches CUDA


def test_cli_prints_the_sweep_table_then_the_headline(tmp_path):
    proc = run_cli("calibrate", "--size", "64", "--iters", "2", "--scale", "tiny", "--micro-batch", "1",
                   "--audio-frames", "24", "--text-tokens", "8", "--speaker-frames", "24", tmp_path=tmp_path,
                   check=True)
    out = " ".join(proc.stdout.split())  # as one line, however rich wraps it
    assert "GEMM sweep: tiny DiT block at micro-batch 1" in out and "(ceiling)" in out
    assert "mlp gate+up" in out and "square" in out
    assert "GEMM ceiling" in out and "best of" in out and "saved " in out
    (path,) = (tmp_path / "cache" / "calibration").glob("*.json")
    rec = json.loads(path.read_text())
    assert rec["shapes_from"]["micro_batch"] == 1 and all(s["iters"] == 2 for s in rec["shapes"])
    bad = run_cli("calibrate", "--scale", "9B", tmp_path=tmp_path)
    assert bad.returncode == 2 and "scale='9B' is not valid" in bad.stderr


def test_device_summary_names_the_ceilings_shape_and_reads_old_records(cache):
    rec = calibrate(CPU, size=32, iters=2, **SMALL)
    best = next(s for s in rec["shapes"] if s["name"] == rec["best_shape"])
    (line,) = summary.comparisons([{"kind": "calibrate", "result": rec}])
    assert line.startswith(f"- GEMM ceiling (float32 {best['name']} {best['m']}x{best['n']}x{best['k']}, best of "
                           f"{len(rec['shapes'])} shapes, median of 2): ")
    old = {k: rec[k] for k in OLD_KEYS}  # a record from before the sweep: no shapes
    (line,) = summary.comparisons([{"kind": "calibrate", "result": old}])
    assert line.startswith("- GEMM ceiling (float32 32^3, median of 2): ")
