"""`echobench run`, `flops` and `calibrate` end to end, as a user runs them."""

import json

import pytest

from conftest import record
from echobench.records.results import Record, configuration_key

TINY = ["--scale", "tiny", "--steps", "3", "--warmup-steps", "1", "--micro-batch", "2",
        "--audio-frames", "50", "--text-tokens", "16", "--speaker-frames", "40"]


def assert_a_complete_record(proc, out) -> dict:
    """A tiny run's record (TINY at a flag peak of 0.5), complete and valid, its figures recomputed
    from what it stores."""
    assert proc.returncode == 0, proc.stderr
    # torchao's start-up warnings (transformers imports it) stay out of the output (cli.quiet_third_party_logs)
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr, proc.stderr
    r = record(out)
    Record.load(out / "result.json")  # a complete, valid record
    assert r["status"] == "ok" and r["error"] == ""
    assert r["peak_tflops"] == 0.5 and r["peak_source"] == "flag"
    assert r["world_size"] == 1 and r["tp"] == 1 and r["dp"] == 1 and r["global_batch"] == 2
    assert r["precision"] == "fp32"  # auto on CPU
    assert len(r["step_times_s"]) == 3 and r["step_time_p10_s"] <= r["step_time_s"] <= r["step_time_p90_s"]
    # Throughput and MFU over the whole measured window, recomputed from the stored step times
    # (each at its slowest rank) and the counted FLOPs, to the last digit.
    total = sum(r["step_times_s"])
    assert r["measured_time_s"] == total and r["measured_steps"] == 3 and r["measured_samples"] == 3 * 2
    assert r["measured_model_flops"] == 6 * r["flops_breakdown"]["model_flops_per_sample"]  # synthetic: full lengths
    assert r["samples_per_s"] == r["measured_samples"] / total
    assert r["mfu"] == r["measured_model_flops"] / (total * r["world_size"] * r["peak_tflops"] * 1e12) and r["mfu"] > 0
    assert r["hfu"] == r["measured_hardware_flops"] / (total * r["world_size"] * r["peak_tflops"] * 1e12)
    assert r["tflops_per_gpu"] == r["measured_model_flops"] / total / r["world_size"] / 1e12
    assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 0.5)
    assert r["audio_seconds_per_s"] == pytest.approx(r["samples_per_s"] * 50 / 25)
    # the median step stays beside it, with the mean and the gap between them
    assert r["step_time_mean_s"] == pytest.approx(total / 3)
    assert r["step_time_mean_vs_median"] == pytest.approx(r["step_time_mean_s"] / r["step_time_s"] - 1)
    assert set(r["flops_breakdown"]["breakdown"]["parts"]) >= {"dit_attention", "text_encoder"}
    # the peak's precision is recorded; no CUDA allocator on CPU
    assert r["peak_precision"] == "bf16" and r["mfu_fp8_peak"] is None
    assert r["num_alloc_retries"] is None and r["num_ooms"] is None
    assert r["repeat"] == 0
    assert 0 <= r["data_wait_frac"] < 1 and r["peak_mem_gib"] > 0
    assert len(r["per_rank"]) == 1 and len(r["losses"]) == 4
    assert r["env"]["torch"] and r["env"]["device_name"].startswith("CPU")
    return r


def test_unknown_device_without_peak_is_an_error_record(cli, tmp_path):
    out = tmp_path / "run"
    proc = cli("run", *TINY, "--out", out)
    assert proc.returncode == 1
    r = record(out)
    assert r["status"] == "error" and "no peak FLOP/s known" in r["error"] and "calibrate" in r["error"]


def test_calibrate_then_run_reports_mfu_against_the_ceiling(cli, tmp_path):
    """A calibrated run reports MFU against the ceiling; a run at a flag peak beside the calibration
    reports MFU against the flag and the ceiling, and writes a complete record (one run serves both)."""
    proc = cli("calibrate", "--size", "256", "--iters", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    cal = json.loads(proc.stdout)
    assert cal["tflops"] > 0 and cal["dtype"] == "float32"
    out = tmp_path / "run"
    assert cli("run", *TINY, "--out", out).returncode == 0
    r = record(out)
    assert r["peak_source"].startswith("calibrated") and r["peak_tflops"] == cal["tflops"]
    assert r["peak_precision"] == "fp32"  # the calibration's GEMM dtype
    assert r["mfu_vs_ceiling"] == pytest.approx(r["mfu"])
    # A datasheet-style peak given by flag: MFU against it, and against the ceiling beside it.
    out2 = tmp_path / "run2"
    r2 = assert_a_complete_record(cli("run", *TINY, "--peak-tflops", "0.5", "--out", out2), out2)
    assert r2["mfu"] == pytest.approx(r2["tflops_per_gpu"] / 0.5)
    assert r2["mfu_vs_ceiling"] == pytest.approx(r2["tflops_per_gpu"] / cal["tflops"])


def assert_a_failed_record(r: dict, status: str) -> None:
    assert r["status"] == status
    assert "injected" in r["error"] and "step 2" in r["error"]
    assert r["traceback_tail"] and r["peak_mem_gib"] > 0


def test_an_out_of_memory_run_still_writes_its_record(cli, tmp_path):
    out = tmp_path / "run"
    proc = cli("run", *TINY, "--peak-tflops", "1", "--fail-at-step", "2", "--fail-kind", "oom", "--out", out)
    assert proc.returncode == 1
    assert_a_failed_record(record(out), "oom")


def test_a_run_that_raised_still_writes_its_record(failing_sweep):
    """The shared failing sweep's run with an error injected at step 2 (conftest.failing_sweep: a
    card's tiny decoder, TINY's steps and warm-up), run by the local executor as `echobench run`."""
    _, sweep, _ = failing_sweep
    (r,) = (r for r in map(record, (p.parent for p in sweep.glob("*/result.json"))) if r["seed"] == 1)
    assert_a_failed_record(r, "error")


def test_bad_settings_are_one_line_errors(cli, tmp_path):
    proc = cli("run", "--scale", "XL", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "scale='XL' is not valid: allowed tiny, 800M, 3B, 8B" in proc.stderr
    assert "Traceback" not in proc.stderr
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("scale: tiny\nmicro_batches: 4\n")
    proc = cli("run", "--config", cfg, "--out", tmp_path / "y")
    assert proc.returncode == 2 and "unknown run key 'micro_batches' (did you mean 'micro_batch'?)" in proc.stderr


def test_run_from_shards_reports_real_lengths(cli, tmp_path):
    shards = tmp_path / "shards"
    assert cli("data", "synth", "--out", shards, "--shards", "2", "--samples-per-shard", "8",
               "--max-seconds", "4").returncode == 0
    out = tmp_path / "run"
    proc = cli("run", "--scale", "tiny", "--steps", "2", "--warmup-steps", "1", "--micro-batch", "4",
               "--audio-frames", "100", "--text-tokens", "80", "--speaker-frames", "100",
               "--peak-tflops", "1", "--data", shards, "--out", out)
    assert proc.returncode == 0, proc.stderr
    r = record(out)
    # Variable-length clips: the per-sample FLOPs on real lengths are below the padded maximum.
    assert r["model_flops_per_sample"] < r["flops_breakdown"]["model_flops_per_sample"]
    # Padding: every row of every measured batch costs the FLOP model at the padded lengths (torch SDPA
    # computes every key), the share of it beyond the real work is padded_flops_frac, and the latent's
    # padded share is what the real audio frames leave of the rows' 100 frames.
    rows = r["measured_steps"] * 4
    assert r["skipped_samples"] == 0 and r["measured_samples"] == rows
    assert r["measured_padded_flops"] == rows * r["flops_breakdown"]["hardware_flops_per_sample"]
    padded, hardware = r["measured_padded_flops"], r["measured_hardware_flops"]
    assert r["padded_flops_frac"] == (padded - hardware) / padded > 0
    frames = r["audio_seconds_per_s"] * r["measured_time_s"] * 25  # the real audio frames measured
    assert r["padded_frac_latent"] == pytest.approx(1 - frames / (rows * 100), rel=1e-9)
    assert all(0 <= r[f"padded_frac_{s}"] < 1 for s in ("latent", "text", "speaker"))


def test_flops_json(cli):
    proc = cli("flops", "--scale", "8B", "--json")
    assert proc.returncode == 0
    report = json.loads(proc.stdout)
    assert report["params"]["trainable"] > 7.2e9
    parts = report["breakdown"]["parts"]
    assert sum(p["total"] for p in parts.values()) == report["model_flops_per_sample"]


@pytest.mark.parametrize("limit", ["run", "profile"])
def test_time_limit_is_not_swallowed_by_broad_exception_handlers(limit):
    """torch.compile catches `Exception` in places (seen: a limit reached during an inductor compile
    was swallowed, the run went on, and no record was written): the limit, and --profile's own bound,
    must get through."""
    import time

    from echobench.train import bench

    start, error = {"run": (bench.start_time_limit, bench.RunTimeout),
                    "profile": (bench.start_profile_limit, bench.ProfileTimeout)}[limit]
    assert not issubclass(error, Exception)
    assert not issubclass(bench.ProfileTimeout, bench.RunTimeout)  # one stops profiling, the other the run
    start(0.2)
    try:
        with pytest.raises(error, match="0.2 s"):
            give_up = time.monotonic() + 5
            while time.monotonic() < give_up:
                try:
                    time.sleep(0.05)
                except Exception:  # noqa: BLE001 - what a library's broad handler does
                    pass
    finally:
        bench.stop_time_limit()


def test_time_limit_stops_a_run_with_status_timeout(cli, tmp_path):
    out = tmp_path / "run"
    proc = cli("run", *TINY, "--steps", "100000", "--peak-tflops", "1", "--time-limit-s", "3", "--out", out)
    assert proc.returncode == 1
    r = record(out)
    assert r["status"] == "timeout" and "time limit of 3 s" in r["error"]


def test_run_repeats_are_independent_launches_of_the_same_settings(cli, tmp_path):
    """Settings from a config file with a flag over one of them, run twice: each repeat a launch of
    its own, both with the file's settings and the flag's."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text("scale: tiny\nsteps: 2\nwarmup_steps: 1\nmicro_batch: 3\naudio_frames: 40\n"
                   "text_tokens: 8\nspeaker_frames: 20\npeak_tflops: 1.0\n")
    out = tmp_path / "run"
    proc = cli("run", "--config", cfg, "--micro-batch", "1", "--repeats", "2", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = (record(out / f"repeat-{k}") for k in range(2))
    for r in (first, second):
        assert r["micro_batch"] == 1 and r["steps"] == 2 and r["audio_frames"] == 40
    assert (first["repeat"], second["repeat"]) == (0, 1) and first["run_id"] != second["run_id"]
    assert second["run_id"] == first["run_id"] + "-r1"
    assert configuration_key(Record.parse(first)) == configuration_key(Record.parse(second))  # one configuration
    assert first["env"]["pid"] != second["env"]["pid"]  # each in a process of its own
    same = {k: v for k, v in first["config"].items() if k != "repeat"}
    assert same == {k: v for k, v in second["config"].items() if k != "repeat"}
    assert "median over 2 ok repeat(s)" in proc.stdout
    proc = cli("run", *TINY, "--repeats", "0", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "--repeats 0: must be >= 1" in proc.stderr
