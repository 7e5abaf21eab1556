"""echobench.predict.stepcount: one training step counted on FakeTensors (tiny preset; nothing is timed)."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from echobench.predict import stepcount as sc
from echobench.predict import stepcount_ops
from echobench.backends.torchtitan import build_model
from echobench.records.config import RunConfig
from echobench.model.flops import attention_flops, hardware_flops, model_flops, param_counts
from echobench.model.config import masked_share
from echobench.model.echo import diffusion_draws

LENGTHS = {"audio_frames": 24, "text_tokens": 12, "speaker_frames": 18}  # 18 frames: 5 patches, one partial


def tiny(micro_batch: int) -> RunConfig:
    return RunConfig(scale="tiny", micro_batch=micro_batch, precision="bf16", **LENGTHS)


@pytest.fixture(scope="module")
def counts():
    return {b: sc.count_step(tiny(b)) for b in (2, 3, 4)}


def test_every_matmul_is_counted_as_the_flop_model_counts_it(counts):
    cfg, count = tiny(2), counts[2]
    counted = count.total(kind="gemm").flops + count.total(kind="attention").flops
    assert counted == model_flops(cfg.model_config(), **LENGTHS).total * 2
    assert count.total(kind="memory").flops == count.total(kind="view").flops == 0
    assert {(phase, part) for phase, part, _ in count.tallies} <= set(count.rows())  # every tally in the table
    # a backward op belongs to the part whose forward made it: every block matmul's input needs a
    # gradient, so the blocks' backward is exactly twice their forward
    for part in ("dit_blocks", "speaker_blocks"):
        for kind in ("gemm", "attention"):
            assert count.total("backward", part, kind).flops == 2 * count.total("forward", part, kind).flops > 0
    assert count.total("backward", "text_encoder").ops == 0  # frozen: no backward
    # every attention call ran the kernel a GPU would run (none escaped to the CPU's)
    assert count.attention and set(count.attention) <= {"flash", "efficient"}


def test_activation_checkpointing_recomputes_the_blocks_in_their_backward():
    cfg = RunConfig(scale="tiny", micro_batch=2, precision="bf16", ac="full", **LENGTHS)
    count = sc.count_step(cfg)
    flops = model_flops(cfg.model_config(), **LENGTHS)
    assert count.total(kind="gemm").flops + count.total(kind="attention").flops == \
        2 * hardware_flops(cfg.model_config(), flops, "full")
    for kind in ("gemm", "attention"):  # a DiT block's backward: its forward again, then 2x
        assert count.total("backward", "dit_blocks", kind).flops == 3 * count.total("forward", "dit_blocks", kind).flops


def test_parts_are_named_by_their_root_module():
    assert sc.part_root("dit.blocks.3._checkpoint_wrapped_module") == "dit_blocks"
    assert sc.part_root("dit.blocks.3.attn") is None
    assert sc.part_of("speaker_encoder.blocks.1.mlp.up") == "speaker_blocks"
    assert sc.part_of("text_encoder.encoder.layers.0") == "text_encoder"
    assert sc.part_of("dit.out_proj") == sc.part_of("") == "top"


def test_memory_bound_bytes_are_affine_in_the_micro_batch_and_kernels_do_not_depend_on_it(counts):
    """A kernel moves parameter-sized tensors (the same at any micro-batch) and activations with a
    batch dimension (B times one sample's), so bytes(B) = a + b * B exactly: the second difference
    over B = 2, 3, 4 is zero (at B = 1 a permuted tensor can be contiguous and skip a copy). The same
    kernels run whatever B."""
    for phase in ("forward", "backward"):
        b2, b3, b4 = (counts[b].total(phase, kind="memory").bytes for b in (2, 3, 4))
        assert b2 - 2 * b3 + b4 == 0 and b2 < b3 < b4
        assert counts[2].total(phase).kernels == counts[3].total(phase).kernels == counts[4].total(phase).kernels
    assert counts[2].total("optimizer") == counts[4].total("optimizer")


def test_the_optimizer_moves_what_fused_adamw_and_clipping_move_over_the_trainable_parameters(counts):
    cfg = tiny(2)
    params = param_counts(cfg.model_config()).trainable
    tensors = len(build_model(cfg, torch.device("meta"), torch.bfloat16).trainable_parameters())
    # fused AdamW reads p, g, m, v and writes p, m, v; clipping reads g for the norm and hands its
    # coefficient to AdamW's kernel (grad_scale): 8 fp32 passes. Per tensor, a few scalars more (its
    # step counter, its norm).
    moved = counts[2].total("optimizer").bytes
    assert 32 * params <= moved <= 32 * params + 32 * tensors + 64
    assert counts[2].total("optimizer").kernels == counts[2].total("optimizer", kind="memory").kernels > 0


def counted(fn) -> sc.StepCounter:
    with FakeTensorMode():
        x = torch.empty(4, 8)
        with sc.StepCounter() as counter:
            fn(x)
    return counter


def test_a_view_counts_no_kernel_and_no_bytes_and_an_add_its_operands():
    views = counted(lambda x: (x.view(8, 4).t(), x.transpose(0, 1), x.expand(2, 4, 8), x.detach(), x[1:]))
    assert {key[2] for key in views.tallies} == {"view"}
    assert sum(t.bytes + t.kernels for t in views.tallies.values()) == 0
    add = counted(lambda x: x + x[0].expand(4, 8))  # reads 32 + the 8 distinct elements broadcast, writes 32
    assert add.tallies["forward", "top", "memory", None] == stepcount_ops.Tally(ops=1, kernels=1, bytes=(32 + 8 + 32) * 4)


def attention_calls(mask: bool, prefer_cudnn: bool = False) -> sc.StepCounter:
    def run(_):
        q = torch.empty(2, 4, 10, 16, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 4, 20, 16, dtype=torch.bfloat16, requires_grad=True)
        keep = torch.ones(2, 1, 1, 20, dtype=torch.bool) if mask else None
        stepcount_ops.gpu_attention(prefer_cudnn)(q, k, k, attn_mask=keep).sum().backward()
    return counted(run)


@pytest.mark.parametrize("mask, prefer_cudnn, kernel", [(False, False, "flash"), (True, False, "efficient"),
                                                         (True, True, "cudnn")])
def test_attention_runs_the_kernel_a_gpu_picks_with_flops_as_the_flop_model_counts(mask, prefer_cudnn, kernel):
    calls = attention_calls(mask, prefer_cudnn)
    assert set(calls.attention) == {kernel}
    forward = 2 * 2 * 10 * 20 * 16 * 4 * 2  # q.k and p.v, per head and sample; backward twice that
    assert calls.attention[kernel] == stepcount_ops.Tally(ops=2, kernels=2, bytes=calls.attention[kernel].bytes,
                                               flops=3 * forward)
    assert calls.tallies["backward", "top", "attention", None].flops == 2 * forward


def test_the_efficient_kernels_bias_is_padded_to_aligned_strides_not_expanded_in_memory():
    memory = attention_calls(mask=True).tallies["forward", "top", "memory", None]
    # the bias (2, 1, 1, 20) bool -> bf16 (where), padded to 24 keys (pad): (B, H, Tq, Tk) never materialised
    assert memory.bytes < 2 * 4 * 10 * 20 * 2


def test_multi_tensor_apply_launches():
    assert stepcount_ops.multi_tensor_launches([1] * 100, depth=4) == 3  # 36 tensors per launch with 4 lists
    assert stepcount_ops.multi_tensor_launches([stepcount_ops.CHUNK * stepcount_ops.MAX_BLOCKS + 1], depth=1) == 2  # 320 chunks per launch
    assert stepcount_ops.multi_tensor_launches([0, 5], depth=1) == 1


def test_inductor_nodes_are_kernels_or_extern_calls_by_kind():
    from torch._inductor.scheduler import NopKernelSchedulerNode

    def node(extern: bool, name: str | None = None, nbytes: int = 100, wraps=()):
        return SimpleNamespace(is_extern=lambda: extern, get_read_write_buffers_sizes=lambda: nbytes,
                               node=SimpleNamespace(python_kernel_name=name, constant_args=wraps))

    nop = NopKernelSchedulerNode.__new__(NopKernelSchedulerNode)
    nodes = [node(False), node(False, nbytes=50), node(True, "extern_kernels.mm"), node(True, "extern_kernels.addmm"),
             node(True, "torch.ops.aten._scaled_dot_product_efficient_attention.default"),
             node(True, "torch.ops.higher_order.run_with_rng_state",
                  wraps=(torch.ops.aten._scaled_dot_product_efficient_attention.default, True)),
             node(True, "torch.ops.aten.embedding.default", 7), node(True, None), nop]
    figures = sc.graph_figures(nodes)
    assert (figures.kernels, figures.bytes) == (2, 150)
    assert figures.extern == {"gemm": 2, "attention": 2, "memory": 1} and figures.extern_bytes["memory"] == 7


@pytest.fixture(scope="module")
def masked_count():
    return sc.count_step(tiny(2), masked=True)


def test_a_masked_micro_batch_attends_through_flex_as_the_flop_model_counts_it(counts, masked_count):
    """A micro-batch whose samples drop their conditioning runs the DiT's attention as FlexAttention (one
    kernel forward, one backward per block), every score counted: the DiT's attention FLOPs as
    flops.attention_flops counts them, the other attentions as before."""
    cfg, unmasked = tiny(2), counts[2]
    assert "flex" in masked_count.attention and "flex" not in unmasked.attention
    dit = attention_flops(cfg.model_config(), **LENGTHS)["dit"] * cfg.micro_batch
    assert masked_count.attention["flex"].flops == dit and masked_count.attention["flex"].kernels == 2 * 2
    assert masked_count.total(kind="attention").flops == unmasked.total(kind="attention").flops
    assert masked_count.settings["masked"] and not unmasked.settings["masked"]


def test_the_masked_share_is_the_share_of_micro_batches_the_draws_drop_from():
    """model.echo.masked_share against diffusion_draws themselves: of 4,000 micro-batches of 8 samples,
    the share in which some sample drops its conditioning."""
    dropped = [not diffusion_draws(0, range(s * 8, s * 8 + 8), 1, 1, 0.1, torch.device("cpu")).keep.all()
               for s in range(4000)]
    assert sum(dropped) / len(dropped) == pytest.approx(masked_share(8, 0.1), abs=0.02)
    assert masked_share(8, 0.1, "null") == 0 and masked_share(8, 0.1, padded=True) == 1


def synthetic_count(gemms: dict, micro_batch: int = 8) -> sc.StepCount:
    """A count of only these GEMMs ((phase, m, n, k, precision) -> FLOPs), one kernel each, no bytes."""
    tallies = {key: stepcount_ops.Tally(1, 1, 0, flops) for key, flops in gemms.items()}
    rows = {("forward", "dit_blocks", "gemm"): stepcount_ops.Tally(len(gemms), len(gemms), 0, sum(gemms.values()))}
    settings = {"micro_batch": micro_batch, "model_flops_per_sample": sum(gemms.values()) / micro_batch,
                "compiled": True}
    return sc.StepCount(settings, rows, {}, [], tallies, {})


def test_each_gemm_is_priced_at_its_shape_s_rate_and_float8_at_float8_s():
    from echobench.hardware.profile import find_profile, load_profile
    from echobench.predict.stepcount_project import project

    profile = load_profile(find_profile("h200-hgx-ib"))
    flops = 2 * 6000 * 2560 * 2560
    big = project([(synthetic_count({("forward", 6000, 2560, 2560, "bf16"): flops}), 1.0)], profile)
    skinny = project([(synthetic_count({("forward", 8, 2560, 2560, "bf16"): flops}), 1.0)], profile)
    fp8 = project([(synthetic_count({("forward", 6000, 2560, 2560, "fp8"): flops}), 1.0)], profile)
    assert skinny["gemm_ms"] > 10 * big["gemm_ms"]  # 8 rows fill few tiles: far below the best rate
    assert fp8["gemm_ms"] < 0.75 * big["gemm_ms"]  # the float8 rate, at the same shape
    best = max(p.tflops for p in profile.gemm if (p.dtype or profile.dtype) == "bfloat16")
    assert big["gemm_ms"] >= flops / (best * 1e12) * 1e3  # never above the best point's rate


def test_the_step_grows_with_the_kernel_gap_and_its_model_flops_do_not(counts, masked_count):
    """The same counts priced at a kernel gap of 0, 10 and 20 us: no gap, no gap time; each kernel
    waits once, so the step is affine in the gap (equal steps for equal increments) and grows with
    it; the model's FLOPs do not depend on the device's speed, so MFU x step time stays put."""
    from echobench.hardware.profile import find_profile, load_profile
    from echobench.predict.stepcount_project import project

    profile = load_profile(find_profile("h200-hgx-ib"))

    def at(gap: float) -> dict:
        p = profile.model_copy(update={"kernel_gap": profile.kernel_gap.model_copy(update={"seconds": gap})})
        return project([(counts[2], 0.5), (masked_count, 0.5)], p, grad_accum=2)

    none, one, two = at(0.0), at(1e-5), at(2e-5)
    assert none["gaps_ms"] == 0 and none["step_ms"] < one["step_ms"] < two["step_ms"]
    assert two["step_ms"] - one["step_ms"] == pytest.approx(one["step_ms"] - none["step_ms"], rel=1e-9)
    assert none["mfu"] * none["step_ms"] == pytest.approx(two["mfu"] * two["step_ms"], rel=1e-12)
    with pytest.raises(ValueError, match="must be >= 0 and sum to 1"):
        project([(counts[2], 0.5), (masked_count, 0.6)], profile)


def test_a_stored_count_prices_as_the_count(counts, masked_count):
    from echobench.hardware.profile import find_profile, load_profile
    from echobench.predict.stepcount_project import project

    profile = load_profile(find_profile("h200-hgx-ib"))
    back = [sc.StepCount.from_dict(json.loads(json.dumps(c.as_dict()))) for c in (counts[2], masked_count)]
    assert project([(back[0], 0.8), (back[1], 0.2)], profile) == project([(counts[2], 0.8), (masked_count, 0.2)],
                                                                          profile)


def test_a_float8_run_s_converted_linears_count_as_float8_gemms():
    """torchao's float8 linears run their GEMMs below the counting mode (_scaled_mm inside the float8
    tensors' dispatch): each converted linear's forward is one float8 GEMM, its shapes multiples of
    16; the linears the plan leaves in bf16 stay bf16."""
    from echobench.backends.torchtitan import float8_plan

    cfg = RunConfig(scale="tiny", micro_batch=2, precision="fp8", audio_frames=48, text_tokens=16, speaker_frames=32)
    count = sc.count_step(cfg)
    fp8 = {key: t for key, t in count.gemms.items() if key[4] == "fp8"}
    assert sum(t.ops for (phase, *_), t in fp8.items() if phase == "forward") == len(float8_plan(cfg).convert)
    assert all(m % 16 == 0 and n % 16 == 0 and k % 16 == 0 for _, m, n, k, _ in fp8)
    assert any(key[4] == "bf16" for key in count.gemms)  # AdaLN, timestep MLP, latent in / out
