"""The torchtitan backend: DDP / FSDP2 / HSDP over 2 gloo processes, compile, AC, float8, failures.

The multi-process tests run `echobench run` as a user does (torchrun underneath) on the tiny
model with short lengths; each takes tens of seconds on a loaded 2-core machine.
"""

import json
import math
from functools import lru_cache
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import ONE_THREAD, TINY_CARD, cli_env, counted_model_flops, record, run_cli, two_launchers
from test_window import first_masked_after_warmup
from echobench.backends import parallelism_problem
from echobench.backends import BACKENDS
from echobench.backends.torchtitan import ECHO_PARTS, ac_mode, apply_ac, apply_float8, float8_plan, linear_inputs
from echobench.records.config import RunConfig
from echobench.data import SyntheticSource
from echobench.model.flops import LAYER_SELECTIVE, hardware_flops, model_flops, recompute_flops
from echobench.model.config import PRESETS
from echobench.model.echo import EchoTTS, diffusion_draws

SHAPE = ["--scale", "tiny", "--audio-frames", "50", "--text-tokens", "16", "--speaker-frames", "40",
         "--peak-tflops", "1"]
EQUIV = [*SHAPE, "--steps", "3", "--warmup-steps", "0"]
# Losses of a 2-rank run against the 1-rank run over 3 steps, in fp32. Both see the same samples
# and draws; only the order of floating-point reductions differs (per-rank error sums, the
# gradient all-reduce, a different number of threads per process), which moves the losses by
# ~1e-7 relative (measured). Skipping the gradient all-reduce for one step moves the next loss by
# ~2e-4 relative (measured), so 5e-6 separates the two by more than 10x either way.
RTOL = 5e-6
# bf16 (autocast) runs, FSDP2 against one process: FSDP2 computes with its bf16 parameter copies
# where one process casts under autocast (the same values, but the norms then read bf16 weights)
# and reduces in another order; measured 1e-4 relative over 3 steps. A bf16 ulp is 2^-8 = 3.9e-3.
BF16_RTOL = 2e-3

validate = BACKENDS["torchtitan"].validate  # the registry's check of a run of its layouts


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The reference: one process, micro-batch 2 (the global batch of 2 ranks x micro-batch 1)."""
    out = tmp_path_factory.mktemp("single")
    run_cli("run", *EQUIV, "--micro-batch", "2", "--out", out, tmp_path=out, check=True, timeout=600, env=ONE_THREAD)
    return record(out)


def assert_same_losses(r, ref):
    assert r["status"] == "ok", r["error"]
    assert r["world_size"] == 2 and r["global_batch"] == 2 and r["micro_batch"] == 1
    assert [p["rank"] for p in r["per_rank"]] == [0, 1]
    assert all(p["median_step_time_s"] > 0 and p["peak_mem_gib"] > 0 for p in r["per_rank"])
    assert r["slowest_rank"] in (0, 1)
    # The ranks saw different samples; their mean is the step's loss.
    assert r["per_rank"][0]["losses"][0] != r["per_rank"][1]["losses"][0]
    assert len(r["losses"]) == len(ref["losses"]) == 3
    assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=0)
    assert ref["losses"][1] != ref["losses"][0]  # it trains


# DDP and FSDP2 of 2 launched ranks against one process, with their mesh, trace and breakdown:
# tests/test_layouts_on_shards.py (on variable-length shards, which also catch a rank reading
# another's samples); here, accumulation and HSDP against the synthetic single run.


def test_accumulated_micro_batches_train_as_one_large_batch(cli, tmp_path, single_run):
    """grad_accum 2 of micro-batch 1 sees the samples of micro-batch 2 in one step and follows its
    losses; 2 DDP ranks accumulating 2 micro-batches each follow one process accumulating 2 of 2."""
    out = tmp_path / "accum"
    proc = cli("run", *EQUIV, "--micro-batch", "1", "--grad-accum", "2", "--out", out, timeout=600, env=ONE_THREAD)
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["grad_accum"] == 2 and r["global_batch"] == 2 and r["measured_samples"] == 2 * 3
    assert r["losses"] == pytest.approx(single_run["losses"], rel=RTOL, abs=0)

    runs = {}
    for name, args in (("one", ["--micro-batch", "2"]), ("ddp", ["--micro-batch", "1", "--nproc", "2",
                                                                 "--parallelism", "ddp"])):
        out = tmp_path / name
        proc = cli("run", *EQUIV, *args, "--grad-accum", "2", "--out", out, timeout=600, env=ONE_THREAD)
        runs[name] = record(out)
        assert proc.returncode == 0, runs[name]["error"] + proc.stderr[-3000:]
    assert runs["one"]["global_batch"] == runs["ddp"]["global_batch"] == 4
    assert runs["ddp"]["losses"] == pytest.approx(runs["one"]["losses"], rel=RTOL, abs=0)


def test_a_step_syncs_gradients_on_its_last_micro_batch_only():
    """train_step over 3 micro-batches: the backend's gradient sync off, off, on; the step's loss is
    the sum of each micro-batch's error over the step's frames (the whole step's mean)."""
    from echobench.backends import TrainSetup
    from echobench.train.bench import train_step

    torch.manual_seed(0)
    model = EchoTTS(PRESETS["tiny"])
    calls = []
    setup = TrainSetup(model=model, optimizer=torch.optim.SGD(model.trainable_parameters(), lr=0.0),
                       clip_grad=lambda: None, autocast_dtype=None, gradient_sync=calls.append)
    micro = [(tiny_batch("cpu", b=1), diffusion_draws(0, [k], 12, 128, 0.1, torch.device("cpu"))) for k in range(3)]
    loss = train_step(setup, micro, "cpu", 1)
    assert calls == [False, False, True]
    frames = sum(b.latent_mask.sum() * 128 for b, _ in micro)
    with torch.no_grad():
        expected = sum(model(b, draws=d, reduction="sum") for b, d in micro) / frames
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


def _bf16_worker(rank: int, world: int, store: str, settings: dict, out_dir: str) -> None:
    """One rank of a bf16 run through bench.run_loop; records the dtype of the RoPE table that
    every attention inside a block receives (after FSDP2's pre-forward casts, if any). The ranks
    meet through a file store (no port to race for)."""
    import os

    from echobench.train.bench import EchoWorkload, run_loop
    from echobench.train.distributed import dist_info, shutdown
    from echobench.model.components import SelfAttention
    from echobench.model.dit import JointAttention

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    freqs_dtypes = set()

    def hook(module, args):
        if isinstance(module, (JointAttention, SelfAttention)):  # forward(x, ..., freqs, mask)
            freqs_dtypes.add(str(args[-2].dtype))

    torch.nn.modules.module.register_module_forward_pre_hook(hook)
    info = dist_info("cpu")
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = RunConfig(**settings, gpus_per_node=world)
    mine = run_loop(cfg, info, out_dir, EchoWorkload(cfg))
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"losses": mine["losses"], "freqs": sorted(freqs_dtypes)}, f)
    shutdown()


def test_fsdp2_keeps_rope_tables_float32_and_matches_single_in_bf16(tmp_path):
    """bf16 (autocast) on 2 gloo ranks: FSDP2 must not cast the float32 RoPE table that enters each
    block (a forward input, not an activation) to bf16; the losses then agree with one process."""
    import torch.multiprocessing as mp

    settings = dict(scale="tiny", precision="bf16", device="cpu", steps=3, warmup_steps=0, audio_frames=50,
                    text_tokens=16, speaker_frames=40, peak_tflops=1.0)
    runs = {}
    for name, world, extra in (("single", 1, dict(micro_batch=2)),
                               ("fsdp2", 2, dict(micro_batch=1, parallelism="fsdp2"))):
        out = tmp_path / name
        out.mkdir()
        mp.spawn(_bf16_worker, args=(world, str(tmp_path / f"store-{name}"), {**settings, **extra}, str(out)),
                 nprocs=world, join=True)
        runs[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for name, ranks in runs.items():
        assert all(r["freqs"] == ["torch.float32"] for r in ranks), (name, ranks)
    single = runs["single"][0]["losses"]
    fsdp2 = [sum(r["losses"][i] for r in runs["fsdp2"]) / 2 for i in range(len(single))]
    assert single[1] != single[0]  # it trains
    assert fsdp2 == pytest.approx(single, rel=BF16_RTOL)


def test_hsdp_on_two_nodes_matches_single_process(tmp_path, single_run):
    """Two launchers on this machine stand in for two nodes: a 2x1 (replicate x shard) mesh."""
    out = tmp_path / "hsdp"
    codes, logs = two_launchers([*EQUIV, "--micro-batch", "1", "--parallelism", "hsdp", "--out", out],
                                cli_env(tmp_path) | ONE_THREAD)
    r = record(out)
    assert codes[0] == 0, r["error"] + logs[0][-3000:]
    assert_same_losses(r, single_run)
    assert r["nodes"] == 2 and r["gpus_per_node"] == 1
    assert r["backend"]["mesh"] == {"dp_replicate": 2, "dp_shard": 1}


def test_injected_oom_on_one_rank_ends_the_run_quickly(cli, tmp_path):
    # A collective timeout far beyond the bound below (and the command's own 900 s): the run must
    # end because the failed rank exits and torchrun stops the others, not because rank 0 times
    # out waiting for it. How long start-up takes on a loaded machine is not bounded here. The
    # launcher's, whatever is trained: a model card's tiny decoder.
    config = tmp_path / "run.yaml"
    config.write_text("collective_timeout_s: 3600\n")
    out = tmp_path / "oom"
    proc = cli("run", "--config", config, "--card", TINY_CARD, "--peak-tflops", "1", "--steps", "3", "--warmup-steps", "1",
               "--micro-batch", "1", "--nproc", "2", "--parallelism", "ddp", "--fail-at-step", "2", "--fail-rank", "1",
               "--fail-kind", "oom", "--out", out, timeout=900)
    assert proc.returncode == 1
    r = record(out)
    assert r["status"] == "oom" and "rank 1" in r["error"] and "step 2" in r["error"]
    assert r["world_size"] == 2 and r["peak_mem_gib"] > 0 and r["traceback_tail"]
    assert 1 in r["failed_ranks"]
    failed_at = (out / "ranks" / "rank-1.json").stat().st_mtime
    recorded_at = (out / "result.json").stat().st_mtime
    assert recorded_at - failed_at < 600, f"record {recorded_at - failed_at:.0f} s after the failure"


def test_compiled_tiny_run_compiles_nothing_inside_the_measured_window(tmp_path, monkeypatch):
    """--compile: a run in this process (as `echobench run` without --nproc), so that dynamo's own
    counters show each block kind was captured as a graph, not only that the flag was set. Its seed
    makes the first masked micro-batch (a sample drops its conditioning) the first measured one:
    warm-up ran both of the DiT's paths before, so nothing compiles inside the window, and the window
    was measured once. What is held is dynamo's (capture, graphs, recompiles): torch.compile's backend
    is aot_eager here, without inductor's code generation on a CPU; a launched run compiles with
    inductor in tests/test_megatron.py::test_tp_run_with_recompute_and_compile_trains_as_without."""
    import functools

    from torch._dynamo.utils import counters

    from echobench.train.bench import run_benchmark

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))

    seed = first_masked_after_warmup(1, 2, PRESETS["tiny"].cfg_dropout)
    cfg = RunConfig(scale="tiny", audio_frames=50, text_tokens=16, speaker_frames=40, peak_tflops=1, steps=3,
                    warmup_steps=1, micro_batch=2, compile=True, device="cpu", seed=seed)
    torch._dynamo.reset()
    counters.clear()
    try:
        r = run_benchmark(cfg, tmp_path)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert r.status == "ok", r.error
    assert r.compiles_in_window == 0 and r.window_restarts == [] and r.compiles["dynamo"] == graphs
    assert r.warmup_variants == ["50 frames: dit none, speaker_encoder none, text_encoder none",
                                 "50 frames: dit split, speaker_encoder none, text_encoder none"]
    assert r.backend["cfg_drop_attention"] == "split"
    # the measured micro-batches' paths are the draws': split (dropped conditioning, no mask: nothing
    # is padded) where a sample dropped its conditioning
    masked = [not diffusion_draws(seed, range(s * 2, s * 2 + 2), 1, 1, PRESETS["tiny"].cfg_dropout,
                                  torch.device("cpu")).keep.all() for s in (1, 2, 3)]
    assert masked[0] and r.attention_paths["dit"] == {p: n for p, n in (("split", sum(masked)),
                                                                        ("none", 3 - sum(masked))) if n}
    shares = r.attention_flop_shares
    assert sum(v for part in shares.values() for v in part.values()) == pytest.approx(1, rel=1e-12)
    if "none" in shares["dit"]:  # every micro-batch has the same shapes: the DiT's shares split as its counts
        assert shares["dit"]["split"] / shares["dit"]["none"] == pytest.approx(sum(masked) / (3 - sum(masked)))
    assert r.compile is True and r.mfu > 0
    # One graph per block kind (text-encoder layer, speaker-encoder block, DiT block: the blocks
    # of a kind share it; more would mean a recompile per block) and per top-level function
    # (EchoDiT.embed / head, EchoTTS.noised / squared_error); the DiT block once more for its
    # split path (merged_attention traced whole), and not one graph break.
    assert graphs == 3 + 4 + 1, dict(counters["stats"])
    assert r.compile_graphs == graphs and r.compile_graph_breaks == 0


# fp8 shapes the float8 rule admits on the tiny model: rows 2 x 48 audio frames, 2 x 16 text
# tokens, 2 x 8 speaker patches (32 frames), all multiples of 16.
FP8_SHAPE = ["--scale", "tiny", "--audio-frames", "48", "--text-tokens", "16", "--speaker-frames", "32",
             "--peak-tflops", "1"]


def test_fp8_emulated_tiny_run_completes(cli, tmp_path):
    out = tmp_path / "fp8"
    proc = cli("run", *FP8_SHAPE, "--steps", "2", "--warmup-steps", "1", "--micro-batch", "2", "--precision", "fp8",
               "--out", out, timeout=600)
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["precision"] == "fp8" and r["backend"]["float8"] == "emulated"
    skipped = r["backend"]["float8_skipped"]
    # The tiny DiT's MLP (hidden 172) is not a multiple of 16: those linears stay in high precision;
    # so do the per-sample linears (AdaLN, timestep MLP).
    assert "dit.blocks.0.mlp.gate_up" in skipped and "multiples of 16" in skipped["dit.blocks.0.mlp.gate_up"]
    assert "no token axis" in skipped["dit.blocks.0.adaln.down"] and "dit.time_embed.fc1" in skipped
    # Per DiT block: q+k+v+gate, text k+v, speaker k+v, out; per speaker block: q+k+v, out, gate+up,
    # down; and the text and patch projections (the latent in / out, K or N of 128, stay high precision).
    assert r["backend"]["float8_linears"] == 2 * 4 + 2 * 4 + 2
    assert all(math.isfinite(x) for x in r["losses"])
    # its MFU is labelled as a float8 run's (against the bf16 peak), beside its MFU against the fp8 peak
    assert "float8 run, vs the bf16 peak" in proc.stdout and "MFU vs fp8 peak" in proc.stdout
    assert r["backend"]["master_weights"] == "fp32-autocast"


def test_fp8_shape_that_cannot_run_is_refused_before_launch(cli, tmp_path):
    proc = cli("run", *SHAPE, "--micro-batch", "2", "--precision", "fp8", "--out", tmp_path / "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    # 2 x 10 speaker patches (and 2 x 50 frames): rows a multiple of 16 need micro_batch 8k.
    assert "fp8: speaker_encoder.patch_embed has input (2, 10, 512), 20 rows" in proc.stderr
    assert "multiple of 8" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_matrix_lists_fp8_shapes_that_cannot_run_as_skipped():
    from echobench.sweep.matrix import expand, parse_matrix

    p = expand(parse_matrix("name: t\ndefaults: {scale: 800M, precision: fp8}\naxes: {micro_batch: [4, 8]}\n", "m.yaml"))
    assert [r.cfg.micro_batch for r in p.runs] == [8]
    # the first linear float8 converts that sees 4 x 750 rows (the latent in / out projections stay bf16)
    assert [s.reason.split("), ")[0] for s in p.skipped] == ["fp8: dit.blocks.0.attn.in_proj has input (4, 750, 1280"]


@lru_cache(maxsize=None)
def float8_gemms_run(rows: int, fan_in: int, fan_out: int) -> str | None:
    """torchao's real (not emulated) Float8Linear, forward and backward, on the meta device; None or the error.

    torch's meta kernel of _scaled_mm applies CUDA's checks (a meta tensor counts as CUDA there),
    so this runs the three GEMMs exactly as an H100 / H200 would accept or reject them.
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    with torch.device("meta"):
        layer = torch.nn.Sequential(torch.nn.Linear(fan_in, fan_out, bias=False))
        x = torch.empty(rows, fan_in, requires_grad=True)
    convert_to_float8_training(layer, config=Float8LinearConfig(emulate=False))
    assert type(layer[0]).__name__ == "Float8Linear"
    try:
        layer(x).sum().backward()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


@pytest.mark.parametrize("scale", ["800M", "3B", "8B"])
def test_float8_plan_admits_only_shapes_whose_gemms_run(scale):
    """At the presets' lengths (750 / 256 / 750) and micro-batches 1-16: a run the plan admits has
    every converted linear's forward, grad-input and grad-weight GEMM valid; a refused one has one
    that is not, and its refusal is one line naming the layer and its input shape."""
    admitted = []
    for mb in range(1, 17):
        cfg = RunConfig(scale=scale, micro_batch=mb, precision="fp8")
        plan = float8_plan(cfg)
        shapes = {name: ((mb, *shape[1:]), fan_in, fan_out) for name, shape, fan_in, fan_out in
                  linear_inputs(cfg.model_config(), 750, 256, 750)}
        # Per-sample linears (AdaLN, timestep MLP, final AdaLN) are never converted.
        assert {n for n, (shape, _, _) in shapes.items() if len(shape) == 2} <= set(plan.skipped)
        assert any("adaln" in n for n in plan.skipped) and "dit.time_embed.fc2" in plan.skipped
        errors = {name: float8_gemms_run(math.prod(shapes[name][0][:-1]), *shapes[name][1:]) for name in plan.convert}
        failing = {name: e for name, e in errors.items() if e}
        assert validate(cfg) == plan.problem
        if plan.problem is None:
            admitted.append(mb)
            assert failing == {}
        else:
            assert failing, f"mb={mb}: refused, yet every GEMM runs"
            assert "\n" not in plan.problem
            name = plan.problem.split()[1]
            assert name in failing and str(shapes[name][0]) in plan.problem
    assert admitted == [8, 16]  # 750 frames need micro_batch % 8 == 0 (188 speaker patches: % 4)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_converted_800m_trains_on_meta_with_real_float8_gemms(recipe):
    """The whole 800M model at micro-batch 8, converted as the backend converts it (each recipe: one
    scale per tensor, or per row of each operand), runs forward and backward with real float8 GEMMs
    under CUDA's shape checks (meta device); and every linear sees 8x the rows of one sample, as the
    plan assumes."""
    from torchao.float8.config import ScalingGranularity

    cfg = RunConfig(scale="800M", micro_batch=8, precision="fp8", float8_recipe=recipe)
    with torch.device("meta"):
        model = EchoTTS(cfg.model_config())
    per_sample = {name: shape for name, shape, _, _ in linear_inputs(cfg.model_config(), 750, 256, 750)}
    info = apply_float8(model, float8_plan(cfg), emulate=False, fsdp=True, compiled=True, recipe=recipe)
    # per DiT block: q+k+v+gate, text k+v, speaker k+v, out, gate+up, down; per speaker block: q+k+v,
    # out, gate+up, down; the text and patch projections. The latent in / out (K or N 128) stay bf16.
    m = cfg.model_config()
    assert info["float8"] == recipe and info["float8_linears"] == 6 * m.layers + 4 * m.speaker_layers + 2
    assert info["float8_all_gather"] == (recipe == "tensorwise")  # torchao gathers rowwise weights in bf16
    granularity = {ScalingGranularity.TENSORWISE: "tensorwise", ScalingGranularity.AXISWISE: "rowwise"}
    assert {granularity[mod.config.cast_config_input.scaling_granularity]
            for mod in model.modules() if type(mod).__name__ == "Float8Linear"} == {recipe}
    assert "K or N of 128 (the latent's channels)" in float8_plan(cfg).skipped["dit.in_proj"]
    seen = {}
    for name, module in model.named_modules():
        if name in per_sample:
            module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, tuple(args[0].shape)))
    model(tiny_batch("meta", b=8, la=750, lt=256, ls=750)).backward()
    assert seen == {name: (8, *shape[1:]) for name, shape in per_sample.items()}


def test_validate_names_the_problem():
    assert validate(RunConfig(parallelism="fsdp2", gpus_per_node=2)) is None
    assert "at least 2 processes" in validate(RunConfig(parallelism="ddp"))
    assert "nodes >= 2" in validate(RunConfig(parallelism="hsdp", gpus_per_node=4))
    assert validate(RunConfig(parallelism="hsdp", nodes=2, gpus_per_node=4)) is None
    assert "runs on one process" in validate(RunConfig(parallelism="single", gpus_per_node=2))
    assert "no parallelism" in parallelism_problem(RunConfig(parallelism="tp2", gpus_per_node=2))


def test_samples_and_draws_do_not_depend_on_the_split():
    """2 ranks x micro-batch B see exactly the samples and draws of 1 rank x micro-batch 2B."""
    def keys(rank, world, mb, n):
        it = iter(SyntheticSource(10, 4, 8, distinct=7, rank=rank, world_size=world, micro_batch=mb))
        return [next(it)["key"] for _ in range(n)]

    one = keys(0, 1, 4, 12)
    r0, r1 = keys(0, 2, 2, 6), keys(1, 2, 2, 6)
    assert one == [k for s in range(3) for k in r0[2 * s:2 * s + 2] + r1[2 * s:2 * s + 2]]
    cpu = torch.device("cpu")
    whole = diffusion_draws(3, range(8, 12), 10, 128, 0.5, cpu)
    halves = [diffusion_draws(3, range(a, a + 2), 10, 128, 0.5, cpu) for a in (8, 10)]
    for name in ("t", "noise"):
        assert torch.equal(getattr(whole, name), torch.cat([getattr(h, name) for h in halves]))
    assert (whole.keep == np.concatenate([h.keep for h in halves])).all()  # on the host
    assert not torch.equal(whole.noise[0], whole.noise[1])
    assert not torch.equal(whole.noise, diffusion_draws(4, range(8, 12), 10, 128, 0.5, cpu).noise)


def tiny_batch(device, b=2, la=12, lt=6, ls=8):
    with torch.device(device):
        g = torch.Generator(device).manual_seed(0) if device != "meta" else None
        return SimpleNamespace(
            latent=torch.randn(b, la, 128, generator=g), latent_mask=torch.ones(b, la, dtype=torch.bool),
            ref=torch.randn(b, ls, 128, generator=g), ref_mask=torch.ones(b, ls, dtype=torch.bool),
            text_ids=torch.zeros(b, lt, dtype=torch.long), text_mask=torch.ones(b, lt, dtype=torch.bool),
        )


@pytest.mark.parametrize("ac", ["full", "selective", LAYER_SELECTIVE])
def test_activation_checkpointing_flops_match_the_hfu_model(ac):
    """FlopCounterMode on the checkpointed model sees exactly flops.hardware_flops(ac)."""
    with torch.device("meta"):
        model = EchoTTS(PRESETS["tiny"])
    apply_ac(model, ECHO_PARTS, ac)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tiny_batch("meta", b=1, la=60, lt=20, ls=40)).backward()
    cfg = PRESETS["tiny"]
    f = model_flops(cfg, 60, 20, 40)
    assert counted_model_flops(counter) == hardware_flops(cfg, f, ac)
    assert (hardware_flops(cfg, f, ac) > f.total) == (ac != "selective")
    if ac == LAYER_SELECTIVE:  # one of the two blocks of each stack
        assert 2 * recompute_flops(cfg, f, ac) == recompute_flops(cfg, f, "full")


def test_selective_checkpointing_is_op_level_compiled_and_layer_level_eager():
    assert ac_mode("selective", compiled=True) == "selective"
    assert ac_mode("selective", compiled=False) == LAYER_SELECTIVE
    assert ac_mode("full", compiled=False) == "full" and ac_mode("none", compiled=True) == "none"
    with torch.device("meta"):
        model = EchoTTS(PRESETS["tiny"])
    apply_ac(model, ECHO_PARTS, LAYER_SELECTIVE)
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in model.dit.blocks]
    assert wrapped == [False, True]


@pytest.mark.parametrize("ac", ["full", "selective", LAYER_SELECTIVE])
def test_activation_checkpointing_keeps_loss_and_gradients(ac):
    def loss_and_grads(mode):
        torch.manual_seed(0)
        model = EchoTTS(PRESETS["tiny"])
        apply_ac(model, ECHO_PARTS, mode)
        draws = diffusion_draws(0, [0, 1], 12, 128, 0.1, torch.device("cpu"))
        loss = model(tiny_batch("cpu"), draws=draws)
        loss.backward()
        return loss, [p.grad for p in model.trainable_parameters()]

    ref_loss, ref_grads = loss_and_grads("none")
    loss, grads = loss_and_grads(ac)
    assert torch.equal(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_clipping_through_the_fused_optimizer_s_grad_scale_equals_clipping_the_gradients():
    """With a fused AdamW, clipping hands its coefficient to the optimizer's kernel (grad_scale)
    instead of scaling every gradient first: the same update, one pass over the gradients less."""
    from echobench.backends.torchtitan import clip_grad_norm_

    def updated(via_optimizer: bool):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        for p in params:
            p.grad = torch.randn_like(p) * 10  # a norm well over max_norm: clipping bites
        opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        norm = clip_grad_norm_(params, 1.0, opt if via_optimizer else None)
        assert norm > 1.0
        opt.step()
        # Adam's first update hardly depends on the gradients' scale; its moments do
        return [t.detach().clone() for p in params for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"])]

    for a, b in zip(updated(True), updated(False)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_selective_checkpointing_saves_flex_attention(ac, monkeypatch):
    """Op-level selective AC saves FlexAttention's output: a masked micro-batch's backward runs no
    attention forward again (full AC does: the test sees a recompute where there is one). FlexAttention
    has no CPU backward in torch: its device check is lifted here, so that its dense reference (the
    computation itself, counted) runs forward and backward on the CPU."""
    import importlib

    import torch.nn.attention.flex_attention as flex_api

    flex_hop = importlib.import_module("torch._higher_order_ops.flex_attention")  # the module, not its HOP

    monkeypatch.setattr(flex_api, "_validate_device", lambda *tensors: None)
    calls = {"n": 0}
    math_attention = flex_hop.math_attention

    def counted(*args, **kwargs):
        calls["n"] += 1
        return math_attention(*args, **kwargs)

    monkeypatch.setattr(flex_hop, "math_attention", counted)

    def backward_attention_forwards(mode):
        torch.manual_seed(0)
        model = EchoTTS(PRESETS["tiny"], key_masking="flex")
        apply_ac(model, ECHO_PARTS, mode)
        batch = tiny_batch("cpu", la=16, lt=8, ls=8)
        batch.padding = SimpleNamespace(latent=False, text=True, speaker=False)  # the DiT attends over a block mask
        batch.text_mask[0, 5:] = False
        loss = model(batch, draws=diffusion_draws(0, [0, 1], 16, 128, 0.0, torch.device("cpu")))
        forward = calls["n"]
        loss.backward()
        return calls["n"] - forward, forward

    plain, forwards = backward_attention_forwards("none")
    assert forwards == PRESETS["tiny"].layers  # one FlexAttention call per DiT block
    recomputed = backward_attention_forwards(ac)[0] - plain
    assert recomputed == (0 if ac == "selective" else PRESETS["tiny"].layers)
