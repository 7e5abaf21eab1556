"""master_weights: bf16 compute weights with an fp32 master copy (backends.master) trains as torch's
AMP recipe does (fp32 weights under bf16 autocast), without casting a weight in any micro-batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from echobench.backends import build_training, parallelism_problem
from echobench.records.config import RunConfig

SHAPES = dict(scale="tiny", micro_batch=2, audio_frames=24, text_tokens=12, speaker_frames=20, device="cpu")


def setup_of(shapes: dict = SHAPES, **kw):
    from echobench.train.bench import resolve_dtype
    from echobench.train.distributed import DistInfo

    cfg = RunConfig(**shapes, **kw)
    device = torch.device("cpu")
    return cfg, build_training(cfg, DistInfo(device=device), resolve_dtype(cfg.precision, device))


def train_losses(steps: int, grad_accum: int, shapes: dict = SHAPES, **kw) -> tuple[list[float], dict]:
    """The step losses of a tiny run on synthetic data, the draws and the step as bench's loop runs them."""
    from echobench.data import build_tokenizer, make_loader
    from echobench.model.echo import diffusion_draws
    from echobench.train.bench import train_step

    cfg, setup = setup_of(shapes, grad_accum=grad_accum, **kw)
    model_cfg, device = cfg.model_config(), torch.device("cpu")
    loader = make_loader("synthetic", micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None), rank=0, world_size=1,
                         seed=0, skip_bad_samples=False)
    generator, losses = torch.Generator(device), []
    try:
        for _ in range(steps):
            micro_batches = []
            for _ in range(grad_accum):
                batch = next(loader)
                micro_batches.append((batch, diffusion_draws(cfg.seed, batch.index.tolist(), cfg.audio_frames,
                                                             model_cfg.latent_dim, model_cfg.cfg_dropout, device,
                                                             generator)))
            losses.append(train_step(setup, micro_batches, device.type, dp_size=1).item())
    finally:
        loader.close()
    return losses, setup.info


def test_bf16_compute_keeps_loss_parity_with_the_fp32_master_reference():
    """20 steps of 2 micro-batches: both bf16 recipes follow the fp32 run's losses step by step. The
    bf16-compute run rounds its weights to bf16 where autocast rounds copies of fp32 ones, and sums
    its two micro-batches' gradients in bf16: its losses stay within 1% of fp32's, and its largest
    step gap within twice autocast's."""
    fp32, info = train_losses(20, 2, precision="fp32")
    assert info["master_weights"] == "fp32"
    autocast, info = train_losses(20, 2, precision="bf16", master_weights="fp32-autocast")
    assert info["master_weights"] == "fp32-autocast"
    fp32, autocast = np.array(fp32), np.array(autocast)
    autocast_gap = np.abs(autocast / fp32 - 1).max()
    for accum in ("bf16", "fp32"):
        lean, info = train_losses(20, 2, precision="bf16", master_weights="bf16-compute", grad_accum_dtype=accum)
        assert info["master_weights"] == "bf16-compute" and "fp32 master" in info["master_weights_recipe"]
        assert info["grad_accum_dtype"] == accum
        lean = np.array(lean)
        lean_gap = np.abs(lean / fp32 - 1).max()
        assert lean_gap < 0.01 and lean_gap <= 2 * autocast_gap + 1e-3, (accum, lean_gap, autocast_gap)
        assert lean[-5:].mean() < lean[:5].mean()  # and it trains


class WeightCasts(TorchDispatchMode):
    """Counts the dtype casts (aten._to_copy) that read a weight matrix's storage (the norms' vectors
    are cast up to float32 in RMSNorm, a few thousand elements: not what the recipe is about)."""

    def __init__(self, params):
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in params if p.dim() >= 2}
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor) \
                and args[0].untyped_storage().data_ptr() in self.storages:
            self.casts += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("recipe", ["fp32-autocast", "bf16-compute"])
def test_bf16_compute_casts_no_weight_in_the_forward(recipe):
    """Under bf16 autocast, fp32 weights are cast to bf16 in every forward (one cast per weight a
    matmul reads); bf16-compute's weights are bf16 already: not one cast reads a weight matrix."""
    from echobench.data import build_tokenizer, make_loader
    from echobench.model.echo import diffusion_draws

    cfg, setup = setup_of(precision="bf16", master_weights=recipe)
    model_cfg = cfg.model_config()
    loader = make_loader("synthetic", micro_batch=2, audio_frames=24, text_tokens=12, speaker_frames=20,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None), rank=0, world_size=1,
                         seed=0, skip_bad_samples=False)
    try:
        batch = next(loader)
    finally:
        loader.close()
    draws = diffusion_draws(0, batch.index.tolist(), 24, 128, model_cfg.cfg_dropout, torch.device("cpu"))
    params = setup.model.trainable_parameters()
    with WeightCasts(params) as casts, torch.autocast("cpu", dtype=torch.bfloat16):
        setup.model(batch, draws=draws, reduction="sum")
    linears = sum(isinstance(m, torch.nn.Linear) and m.weight.requires_grad for m in setup.model.modules())
    if recipe == "bf16-compute":
        assert casts.casts == 0 and all(p.dtype == torch.bfloat16 for p in params)
    else:
        assert casts.casts >= linears > 0


def test_bf16_compute_updates_the_fp32_masters_and_copies_them_back():
    from echobench.backends.master import MasterWeights

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    before = layer.weight.detach().clone()
    master = MasterWeights(list(layer.parameters()), lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert layer.weight.dtype == torch.bfloat16 and master.masters[0].dtype == torch.float32
    assert torch.equal(master.masters[0], before)  # the master keeps every fp32 bit
    layer(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    grad = layer.weight.grad.float()
    master.step()
    assert torch.equal(master.masters[0], before - 0.1 * grad)
    assert torch.equal(layer.weight, (before - 0.1 * grad).bfloat16()) and layer.weight.grad is None


@pytest.mark.parametrize("accumulate_fp32", [False, True])
def test_micro_batch_gradients_are_summed_in_the_chosen_dtype(accumulate_fp32):
    """Two micro-batches' bf16 gradients: summed in bf16 and cast once (bf16), or each cast and
    added in fp32 as backward writes it (fp32, the bf16 gradient freed at once); the update reads that
    sum, and a second step starts from zero."""
    from echobench.backends.master import MasterWeights

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32, bias=False)
    master = MasterWeights(list(layer.parameters()), lambda ps: torch.optim.SGD(ps, lr=1.0), accumulate_fp32)
    inputs = [torch.randn(8, 64, dtype=torch.bfloat16) for _ in range(2)]
    grads = []
    for x in inputs:
        layer(x).pow(2).sum().backward()
        grads.append(master.masters[0].grad.clone() if accumulate_fp32 else layer.weight.grad.clone())
        assert (layer.weight.grad is None) == accumulate_fp32
    expected = grads[1] if accumulate_fp32 else grads[1].float()  # fp32: the running sum; bf16: the bf16 sum
    if accumulate_fp32:
        first = grads[0]
        assert first.dtype == torch.float32 and torch.equal(grads[1] - first, (grads[1] - first).bfloat16().float())
    before = master.masters[0].detach().clone()
    master.step()
    assert torch.equal(master.masters[0], before - expected)
    master.zero_grad()  # the next step sums from zero
    layer(inputs[0]).pow(2).sum().backward()
    (gw,) = torch.autograd.grad(layer(inputs[0]).pow(2).sum(), layer.weight)
    assert torch.equal(master.load_grads()[0].grad, gw.float())


def test_fp32_sums_keep_what_bf16_sums_round_away():
    """Many micro-batches: the fp32 sum is the exact sum of the bf16 gradients (fp32 holds it), the bf16
    sum is off by bf16's rounding: the reason to choose fp32."""
    from echobench.backends.master import MasterWeights

    sums = {}
    for fp32 in (False, True):
        torch.manual_seed(0)
        layer = torch.nn.Linear(16, 8, bias=False)
        master = MasterWeights(list(layer.parameters()), lambda ps: torch.optim.SGD(ps, lr=1.0), fp32)
        torch.manual_seed(1)
        each = []
        for _ in range(16):
            x = torch.randn(4, 16, dtype=torch.bfloat16)
            (gw,) = torch.autograd.grad(layer(x).sum(), layer.weight)
            each.append(gw.float())
            layer(x).sum().backward()
        sums[fp32] = master.load_grads()[0].grad.clone()
    exact = torch.stack(each).sum(0)
    assert (sums[True] - exact).abs().max() < 1e-5 * exact.abs().max()
    assert (sums[False] - exact).abs().max() > (sums[True] - exact).abs().max()


def test_grad_accum_dtype_resolves_per_recipe():
    def on(device, **kw):
        return RunConfig(scale="tiny", **kw).grad_accum_dtype_on(device)

    assert on("cuda") == "fp32" and on("cuda", grad_accum_dtype="bf16") == "bf16"
    assert on("cuda", parallelism="ddp", gpus_per_node=2, grad_reduce_dtype="bf16") == "bf16"
    assert on("cuda", parallelism="fsdp2", gpus_per_node=2) == "fp32"
    assert on("cuda", parallelism="fsdp2", gpus_per_node=2, grad_reduce_dtype="bf16") == "bf16"
    assert on("cpu") == "fp32" and on("cpu", precision="bf16") == "fp32"  # fp32 parameters
    assert on("cuda", framework="megatron", parallelism="tp1") is None


def test_master_weights_resolves_per_layout_and_device():
    def on(device, **kw):
        return RunConfig(scale="tiny", **kw).master_weights_on(device)

    assert on("cuda") == "bf16-compute" and on("cpu") == "fp32"  # precision auto: bf16 on a GPU, fp32 on a CPU
    assert on("cpu", precision="bf16") == "fp32-autocast"
    assert on("cuda", precision="fp8") == "fp32-autocast"
    assert on("cuda", parallelism="ddp", gpus_per_node=2) == "fp32-autocast"  # DDP reduces bf16 grads in bf16 only
    assert on("cuda", parallelism="ddp", gpus_per_node=2, grad_reduce_dtype="bf16") == "bf16-compute"
    assert on("cuda", parallelism="fsdp2", gpus_per_node=2) == "fsdp2"
    assert on("cuda", master_weights="fp32-autocast") == "fp32-autocast"
    assert on("cuda", framework="megatron", parallelism="tp1") == "megatron"


@pytest.mark.parametrize("settings, problem", [
    (dict(master_weights="bf16-compute", parallelism="fsdp2", gpus_per_node=2), "use master_weights auto"),
    (dict(master_weights="bf16-compute", precision="fp8"), "fp8 runs keep fp32 weights"),
    (dict(master_weights="bf16-compute", parallelism="ddp", gpus_per_node=2), "add --grad-reduce-dtype bf16"),
    (dict(grad_accum_dtype="fp32", parallelism="ddp", gpus_per_node=2, grad_reduce_dtype="bf16"),
     "DDP sums the bf16 gradients"),
    (dict(grad_accum_dtype="bf16", parallelism="fsdp2", gpus_per_node=2), "set grad_reduce_dtype"),
    (dict(grad_accum_dtype="bf16", master_weights="fp32-autocast"), "fp32 parameters have fp32 gradients"),
])
def test_a_master_weights_setting_that_cannot_run_is_refused(settings, problem):
    assert problem in parallelism_problem(RunConfig(scale="tiny", **settings))


def test_ddp_with_bf16_compute_follows_one_process(tmp_path):
    """2 DDP ranks x micro-batch 1 x 2 accumulated against one process x micro-batch 2 x 2, both
    bf16-compute: the same samples and draws; DDP reduces the bf16 gradients in bf16 (no compression
    hook: they are bf16 already), so the losses agree to bf16's rounding, not bit for bit."""
    from conftest import ONE_THREAD, record, run_cli

    shape = ["--scale", "tiny", "--audio-frames", "48", "--text-tokens", "16", "--speaker-frames", "32",
             "--peak-tflops", "1", "--steps", "3", "--warmup-steps", "0", "--precision", "bf16", "--device", "cpu",
             "--master-weights", "bf16-compute", "--grad-accum", "2"]
    runs = {}
    for name, args in (("one", ["--micro-batch", "2", "--grad-accum-dtype", "bf16"]),  # DDP sums in bf16 too
                       ("ddp", ["--micro-batch", "1", "--nproc", "2", "--parallelism", "ddp",
                                "--grad-reduce-dtype", "bf16"])):
        out = tmp_path / name
        proc = run_cli("run", *shape, *args, "--out", out, tmp_path=tmp_path, timeout=600, env=ONE_THREAD)
        runs[name] = record(out)
        assert proc.returncode == 0, runs[name]["error"] + proc.stderr[-3000:]
        assert runs[name]["backend"]["master_weights"] == "bf16-compute"
        assert "bf16-compute" in proc.stdout  # the run's printed record says which recipe ran
    assert "bfloat16 gradient all-reduce" in runs["ddp"]["backend"]["sharding"]
    assert runs["ddp"]["losses"] == pytest.approx(runs["one"]["losses"], rel=2e-3, abs=0)
    assert runs["one"]["losses"][0] != runs["one"]["losses"][1]
