"""On a CUDA GPU only (marker `gpu`; skipped elsewhere): what a CPU cannot show.

- the measured steps make no host sync (torch.cuda.set_sync_debug_mode("error"));
- fp8 on the 800M preset at micro-batch 1 and 8: refused in one line, or runs real float8 GEMMs;
- compile + FSDP2 on one GPU trains as eager does;
- megatron TP=1 on its local layers, bf16 parameters in megatron-core's DDP and optimizer (and its
  distributed optimizer), trains as the plain model does;
- FlexAttention's key-padding block mask gives the dense mask's outputs and gradients (the CPU has
  no FlexAttention backward), and a run without padding attends with no mask (FlashAttention).

Tolerances compare bf16 runs: one bf16 rounding step is 2^-8 = 3.9e-3 relative; compiled kernels
fuse element-wise ops and round in other places, so losses agree to about that over a few steps.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import record, run_cli
from echobench.records.config import RunConfig

pytestmark = pytest.mark.gpu

BF16_RTOL = 1e-2
SMALL = ["--scale", "tiny", "--audio-frames", "200", "--text-tokens", "64", "--speaker-frames", "200",
         "--peak-tflops", "989.5", "--device", "cuda"]


def test_measured_steps_make_no_host_sync(monkeypatch, tmp_path):
    """bench.run_loop with sync debug mode "error" from the first measured step's start until the
    timer reads its events: any host sync in a measured step (data, draws, training step) raises.
    Off again once the measured window ends (the kernel profile of the warm-up variants after it
    reads its events on the host)."""
    from echobench.train import bench
    from echobench.train.distributed import DistInfo

    mark, durations, windows = bench.StepTimer.mark, bench.StepTimer.durations, bench.measure_windows

    def windows_then_unwatched(*args, **kwargs):
        try:
            return windows(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def mark_then_watch(self):
        mark(self)
        torch.cuda.set_sync_debug_mode("error")

    def durations_unwatched(self):
        torch.cuda.set_sync_debug_mode(0)
        return durations(self)

    monkeypatch.setattr(bench.StepTimer, "mark", mark_then_watch)
    monkeypatch.setattr(bench.StepTimer, "durations", durations_unwatched)
    monkeypatch.setattr(bench, "measure_windows", windows_then_unwatched)
    cfg = RunConfig(scale="tiny", steps=3, warmup_steps=2, micro_batch=4, audio_frames=200, text_tokens=64,
                    speaker_frames=200, precision="bf16", device="cuda")
    try:
        mine = bench.run_loop(cfg, DistInfo(device=torch.device("cuda", 0)), tmp_path, bench.EchoWorkload(cfg))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(mine["step_times_s"]) == 3 and all(t > 0 for t in mine["step_times_s"])
    assert mine["data_wait_clock"] == "cuda_events" and 0 <= mine["data_wait_frac"] < 1


@pytest.mark.parametrize("micro_batch", [1, 8])
def test_fp8_800m_runs_or_is_refused_in_one_line(tmp_path, micro_batch):
    out = tmp_path / "run"
    proc = run_cli("run", "--scale", "800M", "--precision", "fp8", "--micro-batch", micro_batch, "--steps", "2",
                   "--warmup-steps", "1", "--peak-tflops", "989.5", "--device", "cuda", "--out", out, gpu=True,
                   timeout=900)
    if micro_batch == 1:  # 750 frames x 1 row: not a multiple of 16
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "fp8: " in proc.stderr and "multiple of 8" in proc.stderr
        assert not out.exists()
        return
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    capability = torch.cuda.get_device_capability()
    assert r["backend"]["float8"] == ("tensorwise" if capability >= (8, 9) else "emulated")
    assert all(math.isfinite(x) for x in r["losses"]) and r["mfu"] > 0


def _fsdp_worker(rank: int, store: str, out_path: str) -> None:
    """One GPU, one NCCL rank: the same 3 bf16 steps single eager, FSDP2 eager and FSDP2 compiled."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh

    from echobench.backends import TrainSetup
    from echobench.backends.torchtitan import (
        ECHO_PARTS, apply_compile, apply_fsdp, build_model, build_optimizer, clip_grad_norm_,
    )
    from echobench.train.bench import train_step
    from echobench.data import build_tokenizer, make_loader
    from echobench.model.echo import diffusion_draws

    os.environ.update(RANK="0", WORLD_SIZE="1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1, device_id=device)
    cfg = RunConfig(scale="tiny", micro_batch=4, audio_frames=200, text_tokens=64, speaker_frames=200,
                    precision="bf16", device="cuda")
    model_cfg = cfg.model_config()
    loader = make_loader("synthetic", micro_batch=4, audio_frames=200, text_tokens=64, speaker_frames=200,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None), rank=0, world_size=1,
                         seed=0, skip_bad_samples=False)
    batches = [next(loader) for _ in range(3)]
    loader.close()
    losses = {}
    for name in ("single", "fsdp2", "fsdp2+compile"):
        model = build_model(cfg, device, torch.bfloat16)
        if "compile" in name:
            apply_compile(model, ECHO_PARTS)
        if "fsdp2" in name:
            apply_fsdp(model, ECHO_PARTS, init_device_mesh("cuda", (1,)), torch.bfloat16, force_sum=False,
                       reduce_dtype=torch.float32, reshard_after_forward=True)
        params = model.trainable_parameters()
        setup = TrainSetup(model, build_optimizer(params, device), partial(clip_grad_norm_, params, 1.0),
                           torch.bfloat16)
        model.train()
        losses[name] = []
        for batch in batches:
            draws = diffusion_draws(0, batch.index.tolist(), 200, model_cfg.latent_dim, model_cfg.cfg_dropout, device)
            losses[name].append(float(train_step(setup, [(batch.to(device), draws)], "cuda", dp_size=1)))
    with open(out_path, "w") as f:
        json.dump(losses, f)
    torch.distributed.destroy_process_group()


def test_compile_and_fsdp2_on_one_gpu_train_as_eager(tmp_path, inductor_cache):
    import torch.multiprocessing as mp

    out = tmp_path / "losses.json"
    mp.spawn(_fsdp_worker, args=(str(tmp_path / "store"), str(out)), nprocs=1, join=True)
    losses = json.loads(out.read_text())
    single = losses["single"]
    assert single[2] != single[0]
    assert losses["fsdp2"] == pytest.approx(single, rel=BF16_RTOL)
    assert losses["fsdp2+compile"] == pytest.approx(single, rel=BF16_RTOL)


def test_megatron_tp1_local_layers_train_as_the_plain_model(tmp_path):
    """megatron TP=1 as Megatron-LM runs it on a GPU (bf16 parameters, fp32 main gradients in
    megatron-core's DDP, megatron-core's optimizer with fp32 main parameters, fused SwiGLU, compiled
    blocks: compile is auto), with and without the distributed optimizer, trains as the plain model."""
    pytest.importorskip("megatron.core")
    common = [*SMALL, "--steps", "3", "--warmup-steps", "1", "--micro-batch", "4"]
    megatron = ["--framework", "megatron", "--tp", "1", "--te", "off"]
    runs = {}
    for name, extra in (("megatron", megatron), ("distributed", [*megatron, "--distributed-optimizer"]),
                        ("plain", [])):
        out = tmp_path / name
        proc = run_cli("run", *common, *extra, "--out", out, gpu=True, timeout=900)
        runs[name] = record(out)
        assert proc.returncode == 0, runs[name]["error"] + proc.stderr[-3000:]
    for name, optimizer in (("megatron", "Float16OptimizerWithFloat16Params"), ("distributed", "DistributedOptimizer")):
        m, b = runs[name], runs[name]["backend"]
        assert m["te"] is False and b["backend"] == "megatron" and m["precision"] == "bf16"
        assert m["env"]["device_type"] == "cuda"
        assert b["param_dtype"] == "bfloat16" and b["main_grad_dtype"] == "float32"
        assert b["optimizer"].startswith(f"megatron-core {optimizer} over torch.optim.adamw.AdamW (fused), fp32 main")
        assert b["distributed_optimizer"] is (name == "distributed")
        assert b["fused_swiglu"].startswith("megatron-core's fused SwiGLU")
        assert m["compile"] is True and m["compile_graph_breaks"] == 0, m["compile_break_reasons"]
        assert m["losses"] == pytest.approx(runs["plain"]["losses"], rel=BF16_RTOL)


def test_flex_and_dense_key_masks_give_the_same_outputs_and_gradients():
    """fp32 on the GPU: the DiT with padded keys (gaps in [latent | text | speaker], a sample with
    its conditioning dropped) through FlexAttention's block mask and through SDPA's dense mask."""
    from test_model import dit_keys, padded_dit_inputs, perturb_adaln

    from echobench.model.config import PRESETS
    from echobench.model.echo import EchoTTS

    torch.manual_seed(0)
    model = EchoTTS(PRESETS["tiny"]).cuda()
    perturb_adaln(model)
    x, t, text, speaker, masks = padded_dit_inputs(device="cuda")
    outs, grads = [], []
    for masking in ("dense", "flex"):
        model.zero_grad()
        out = model.dit(x, t, text, speaker, dit_keys(model, *masks, masking))
        (out * masks[0][..., None]).pow(2).sum().backward()
        outs.append(out[masks[0]])
        grads.append(torch.cat([p.grad.flatten() for p in model.dit.parameters() if p.grad is not None]))
    assert torch.allclose(outs[0], outs[1], atol=1e-4)
    assert torch.allclose(grads[0], grads[1], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("compiled", [False, True])
def test_merged_attention_on_the_gpu_flash_kernel_equals_the_masked_reference(compiled):
    """bf16 on the GPU's flash kernel (eager, and compiled by inductor as a DiT block is): the merged
    attention's outputs and gradients within twice the masked bf16 SDPA's own error against float32."""
    import torch.nn.functional as F

    from echobench.model.components import merged_attention

    g = torch.Generator("cuda").manual_seed(0)
    b, h, la, lc, d = 4, 4, 200, 77, 128
    shapes = [(b, h, la, d)] * 3 + [(b, h, lc, d)] * 2
    exact = [torch.randn(s, device="cuda", generator=g).requires_grad_() for s in shapes]
    half = [t.detach().bfloat16().requires_grad_() for t in exact]
    keep = torch.tensor([True, False, False, True], device="cuda")
    mask = torch.cat([torch.ones(b, la, dtype=torch.bool, device="cuda"), keep[:, None].expand(-1, lc)], 1)[:, None, None]
    grad = torch.randn(b, h, la, d, device="cuda", generator=g)

    def masked(q, k_a, v_a, k_b, v_b):
        return F.scaled_dot_product_attention(q, torch.cat([k_a, k_b], 2), torch.cat([v_a, v_b], 2), attn_mask=mask)

    fn = torch.compile(merged_attention, fullgraph=True, dynamic=False) if compiled else merged_attention
    results = []
    for f, inputs in ((masked, exact), (masked, half), (lambda *a: fn(*a, keep), half)):
        out = f(*inputs)
        results.append([out.float(), *(x.float() for x in torch.autograd.grad(out, inputs, grad.to(out.dtype)))])
    for ref, bf16, merged in zip(*results):
        assert (merged - ref).abs().max() <= 2 * max((bf16 - ref).abs().max(), 2 ** -8)


def test_a_synthetic_run_attends_without_a_mask_on_flash_attention(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("run", *SMALL, "--steps", "3", "--warmup-steps", "1", "--micro-batch", "2", "--no-compile",
                   "--out", out, gpu=True, timeout=600)
    r = record(out)
    assert proc.returncode == 0, r["error"]
    assert r["sdpa_backends_predicted"]["dit"] in ("FLASH_ATTENTION", "CUDNN_ATTENTION")
    unmasked = [kernels for variant, kernels in r["attention_kernels"].items() if "dit none" in variant]
    assert unmasked and any("flash" in k or "cudnn" in k or "fmha" in k for k in unmasked[0]), r["attention_kernels"]
    assert r["compiles_in_window"] == 0 and not r["window_restarts"]
    assert r["attention_paths"]["speaker_encoder"] == {"none": 3} and r["attention_paths"]["text_encoder"] == {"none": 3}
    # split (no mask) where a sample dropped its conditioning: nothing is padded
    assert set(r["attention_paths"]["dit"]) <= {"none", "split"}
    assert r["backend"]["cfg_drop_attention"] == "split"
