"""Every layout trains on the same samples and the same objective on real, variable-length shards.

On shards the ranks hold different numbers of real frames, so this catches what the synthetic
(full-length) equivalence tests cannot: a rank reading other samples than its slice of the global
batch, draws keyed by anything but the sample, or a loss that is a mean of per-rank means. Each
layout runs `echobench run` as a user does on the tiny model, global batch 4, 3 steps, fp32.
"""

import json

import pytest

from conftest import ONE_THREAD, run_cli
from test_torchtitan import record

SHAPE = ["--scale", "tiny", "--audio-frames", "160", "--text-tokens", "48", "--speaker-frames", "160",
         "--precision", "fp32", "--device", "cpu", "--steps", "3", "--warmup-steps", "0", "--peak-tflops", "1"]
# Same samples, draws and objective: only the order of floating-point sums differs (9e-8 relative,
# measured). Ranks reading other samples moved the losses by 3e-3; a mean of per-rank means over the
# same samples, by 2.5e-4 (both measured on these shards): 1e-5 tells them apart by 100x or more.
RTOL = 1e-5


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """2 shards x 16 samples of 2-6 s (50-150 frames, under the 160-frame maximum: no cropping)."""
    out = tmp_path_factory.mktemp("shards")
    run_cli("data", "synth", "--out", out, "--shards", "2", "--samples-per-shard", "16", "--max-seconds", "6",
            check=True)
    return out


@pytest.fixture(scope="module")
def single(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    run_cli("run", *SHAPE, "--data", shards, "--micro-batch", "4", "--out", out, tmp_path=out, check=True, env=ONE_THREAD)
    return record(out)


# Each layout is launched once, padded or bucketed (test_bucketed_layouts_match_single_process_on_shards
# holds ddp and tp2): a launch is seconds of CPU a rank, and both batchings read the same global stream.
@pytest.mark.parametrize("framework,layout,nproc,micro_batch,trace", [
    ("torchtitan", ["--parallelism", "fsdp2"], 2, 2, True),
    ("megatron", ["--tp", "2"], 4, 2, False),  # TP=2 x DP=2
], ids=["fsdp2", "tp2xdp2"])
def test_layout_matches_single_process_on_shards(cli, tmp_path, shards, single, framework, layout, nproc,
                                                 micro_batch, trace):
    """The launched layouts' losses follow one process's; the torchtitan ones are also the suite's
    data-parallel equivalence runs of the backend (assert_data_parallel)."""
    if framework == "megatron":
        pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    proc = cli("run", *SHAPE, "--data", shards, "--framework", framework, *layout, "--nproc", nproc,
               "--micro-batch", micro_batch, *(["--trace"] if trace else []), "--out", out, timeout=900,
               env=ONE_THREAD)
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["status"] == "ok" and r["world_size"] == nproc and r["global_batch"] == 4
    # The same samples: the same real lengths, hence the same FLOPs.
    assert r["model_flops_per_sample"] == single["model_flops_per_sample"]
    assert len(r["losses"]) == 3 and single["losses"][1] != single["losses"][0]  # it trains
    assert r["losses"] == pytest.approx(single["losses"], rel=RTOL, abs=0)
    if framework == "torchtitan":
        assert_data_parallel(r, out, traced=trace)


def assert_data_parallel(r: dict, out, traced: bool) -> None:
    """What a torchtitan data-parallel run of 2 ranks says of itself: each rank's figures, the ranks
    reading different samples (their mean is the step's loss), its mesh; with --trace, a chrome
    trace per rank and where the time went (FSDP's all-gathers and reduce-scatters on gloo's threads)."""
    assert [p["rank"] for p in r["per_rank"]] == [0, 1] and r["slowest_rank"] in (0, 1)
    assert all(p["median_step_time_s"] > 0 and p["peak_mem_gib"] > 0 for p in r["per_rank"])
    assert r["per_rank"][0]["losses"][0] != r["per_rank"][1]["losses"][0]
    backend = r["backend"]
    assert backend["mesh"] == {"dp": 2} and backend["process_group_backend"] == "gloo"
    assert "not sharded" in backend["text_encoder"]
    if r["parallelism"] == "fsdp2":
        assert backend["mixed_precision"] == {"param_dtype": "float32", "reduce_dtype": "float32"}
    if traced:  # of steps after the measured ones (untimed)
        assert min(r["profiled_steps"]) > r["warmup_steps"] + r["steps"] - 1
        for rank in (0, 1):
            trace = json.loads((out / f"trace-rank{rank}.json").read_text())
            assert any("aten::mm" in e.get("name", "") for e in trace["traceEvents"])
        ranks = json.loads((out / "breakdown.json").read_text())["ranks"]
        assert [b["rank"] for b in ranks] == [0, 1] and all(b["communication"]["total_s"] > 0 for b in ranks)


def test_a_stand_in_row_adds_nothing_to_loss_or_gradients():
    """--skip-bad-samples: a stand-in keeps the batch's shape but changes neither the error sum,
    nor the frame count, nor any gradient, even when its CFG draw drops the conditioning."""
    import numpy as np
    import torch

    from echobench.data import STAND_IN, build_tokenizer, collate
    from echobench.data.synth import synth_sample
    from echobench.model.config import PRESETS
    from echobench.model.echo import EchoTTS, diffusion_draws, loss_frames

    cfg = PRESETS["tiny"]
    real = synth_sample(np.random.default_rng(0), "a", max_seconds=3.0)
    tok = build_tokenizer(cfg.text_encoder.vocab)

    def run(samples):
        torch.manual_seed(0)
        model = EchoTTS(cfg)
        batch = collate(samples, tok, audio_frames=80, text_tokens=48, speaker_frames=80)
        draws = diffusion_draws(0, range(len(samples)), 80, cfg.latent_dim, 1.0, torch.device("cpu"))  # drop all
        err = model(batch, draws=draws, reduction="sum")
        err.backward()
        return err, loss_frames(batch), [p.grad for p in model.trainable_parameters()]

    err, frames, grads = run([real])
    err2, frames2, grads2 = run([real, STAND_IN])
    assert torch.isfinite(err2) and err2.item() == pytest.approx(err.item(), rel=1e-6)
    assert frames2 == frames
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


# ---- batching: bucket ----

@pytest.fixture(scope="module")
def single_bucketed(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("single-bucketed")
    run_cli("run", *SHAPE, "--data", shards, "--micro-batch", "4", "--batching", "bucket", "--out", out, tmp_path=out,
            check=True, env=ONE_THREAD)
    return record(out)


@pytest.mark.parametrize("framework,layout,nproc,micro_batch", [
    ("torchtitan", ["--parallelism", "ddp"], 2, 2),
    ("megatron", ["--tp", "2"], 2, 4),  # TP peers read the same 4 samples
], ids=["ddp", "tp2"])
def test_bucketed_layouts_match_single_process_on_shards(cli, tmp_path, shards, single, single_bucketed, framework,
                                                         layout, nproc, micro_batch):
    """Buckets regroup the global stream by length from the shards' indexes: every layout computes
    the same bucketed batches, so the same samples, shapes and losses as one process."""
    if framework == "megatron":
        pytest.importorskip("megatron.core")
    s = single_bucketed
    assert s["status"] == "ok" and sum(s["bucket_steps"].values()) == 3
    assert max(map(int, s["bucket_steps"])) <= 160 and len(s["bucket_steps"]) >= 2  # a few shapes ran
    assert s["padded_flops_frac"] < single["padded_flops_frac"]  # buckets pad less than one shape
    out = tmp_path / "run"
    proc = cli("run", *SHAPE, "--data", shards, "--framework", framework, *layout, "--nproc", nproc,
               "--micro-batch", micro_batch, "--batching", "bucket", "--out", out, timeout=900, env=ONE_THREAD)
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["status"] == "ok" and r["global_batch"] == 4 and r["bucket_steps"] == s["bucket_steps"]
    assert r["model_flops_per_sample"] == s["model_flops_per_sample"]
    assert r["measured_padded_flops"] == s["measured_padded_flops"]
    assert r["losses"] == pytest.approx(s["losses"], rel=RTOL, abs=0)
    if framework == "torchtitan":
        assert_data_parallel(r, out, traced=False)
