"""Every layout trains on the same samples and the same objective on real, variable-length shards.

On shards the ranks hold different numbers of real frames, so this catches what the synthetic
(full-length) equivalence tests cannot: a rank reading other samples than its slice of the global
batch, draws keyed by anything but the sample, or a loss that is a mean of per-rank means. Each
layout runs `echobench run` as a user does on the tiny model, global batch 4, 3 steps, fp32.
"""

import pytest

from conftest import run_cli
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
    run_cli("run", *SHAPE, "--data", shards, "--micro-batch", "4", "--out", out, tmp_path=out, check=True)
    return record(out)


@pytest.mark.parametrize("framework,layout,nproc,micro_batch", [
    ("torchtitan", ["--parallelism", "ddp"], 2, 2),
    ("torchtitan", ["--parallelism", "fsdp2"], 2, 2),
    ("megatron", ["--tp", "2"], 2, 4),  # TP peers read the same 4 samples
    ("megatron", ["--tp", "2"], 4, 2),  # TP=2 x DP=2
], ids=["ddp", "fsdp2", "tp2", "tp2xdp2"])
def test_layout_matches_single_process_on_shards(cli, tmp_path, shards, single, framework, layout, nproc,
                                                 micro_batch):
    if framework == "megatron":
        pytest.importorskip("megatron.core")
    out = tmp_path / "run"
    proc = cli("run", *SHAPE, "--data", shards, "--framework", framework, *layout, "--nproc", nproc,
               "--micro-batch", micro_batch, "--out", out, timeout=900)
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["status"] == "ok" and r["world_size"] == nproc and r["global_batch"] == 4
    # The same samples: the same real lengths, hence the same FLOPs.
    assert r["model_flops_per_sample"] == single["model_flops_per_sample"]
    assert len(r["losses"]) == 3 and single["losses"][1] != single["losses"][0]  # it trains
    assert r["losses"] == pytest.approx(single["losses"], rel=RTOL, abs=0)
