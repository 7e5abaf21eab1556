"""TransformerEngine's paths decided and counted on the CPU, where TE cannot import: its TP
communication overlap only where its userbuffers fit every batch, sequence parallelism only with
buckets it can split, and op-level selective AC counting the TE GEMMs and fused attention it re-runs
(stand-ins: custom ops the selective policy cannot save, as TE's kernels are not ATen ops)."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from conftest import counted_model_flops
from echobench.backends import BACKENDS
from echobench.backends.megatron import te_ac_mode, tp_comm_overlap_problem
from echobench.backends.torchtitan import ECHO_PARTS, apply_ac
from echobench.records.config import RunConfig
from echobench.model.flops import TE_SELECTIVE, hardware_flops, model_flops, recompute_flops
from echobench.model.config import PRESETS
from echobench.model.echo import EchoTTS

validate = BACKENDS["megatron"].validate  # the registry's check of a run of its layouts


def test_te_overlap_runs_only_where_its_userbuffers_hold_every_batch():
    pad = RunConfig(framework="megatron", parallelism="tp2", gpus_per_node=2, audio_frames=64)
    assert tp_comm_overlap_problem(pad, te=True, gpu=True, sequence_parallel=True) is None
    bucket = RunConfig(framework="megatron", parallelism="tp2", gpus_per_node=2, audio_frames=64, data="/shards",
                       batching="bucket", sequence_parallel=True)
    why = tp_comm_overlap_problem(bucket, te=True, gpu=True, sequence_parallel=True)
    assert why.startswith("off: batching bucket gives batches of several shapes") and "use batching pad" in why
    for te, gpu, sp in ((False, True, True), (True, False, True), (True, True, False)):
        assert tp_comm_overlap_problem(pad, te=te, gpu=gpu, sequence_parallel=sp).startswith("off: needs")


def test_sequence_parallel_buckets_must_split_over_tp():
    cfg = RunConfig(framework="megatron", parallelism="tp4", gpus_per_node=4, audio_frames=64, data="/shards",
                    batching="bucket", buckets="30,48", sequence_parallel=True)
    assert validate(cfg) == ("sequence parallelism splits each bucket's frames over tp=4: buckets 30 are not "
                             "divisible by it; give boundaries that are (the default quantile boundaries are "
                             "multiples of 8)")
    assert validate(RunConfig(**{**cfg.to_dict(), "buckets": "32,48"})) is None


@torch.library.custom_op("echobench_te_standin::linear", mutates_args=())
def te_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


@te_linear.register_fake
def _(x, w):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _linear_backward(ctx, grad):
    x, w = ctx.saved_tensors
    return grad @ w, grad.flatten(0, -2).t() @ x.flatten(0, -2)  # ATen GEMMs: counted as they run


te_linear.register_autograd(_linear_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@torch.library.custom_op("echobench_te_standin::attention", mutates_args=())
def te_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


@te_attention.register_fake
def _(q, k, v):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("echobench_te_standin::attention_backward", mutates_args=())
def te_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("counted on the meta device only")


@te_attention_backward.register_fake
def _(q, k, v, grad):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


te_attention.register_autograd(
    lambda ctx, grad: torch.ops.echobench_te_standin.attention_backward(*ctx.saved_tensors, grad),
    setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@register_flop_formula(torch.ops.echobench_te_standin.linear)
def _linear_flops(x_shape, w_shape, *args, **kwargs):
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


@register_flop_formula(torch.ops.echobench_te_standin.attention)
def _attention_flops(q_shape, k_shape, v_shape, *args, **kwargs):
    return 4 * math.prod(q_shape[:-1]) * k_shape[-2] * q_shape[-1]  # scores and weighted values, every key


@register_flop_formula(torch.ops.echobench_te_standin.attention_backward)
def _attention_backward_flops(q_shape, k_shape, v_shape, grad_shape, *args, **kwargs):
    return 2 * _attention_flops(q_shape, k_shape, v_shape)  # echobench's convention: backward 2x forward


def te_like_dit(model: EchoTTS) -> None:
    """The DiT blocks' linears and core attention as TE's (the TP model's TE layer spec), here opaque
    custom ops; everything else as it is (the AdaLN's plain linears, norms, RoPE)."""
    for block in model.dit.blocks:
        attn, mlp = block.attn, block.mlp
        for linear in (attn.in_proj, attn.wkv_text, attn.wkv_speaker, attn.wo, mlp.gate_up, mlp.down):
            linear.forward = lambda x, linear=linear: te_linear(x, linear.weight)
        attn.attend = lambda q, k, v, key_mask: te_attention(q, k, v)


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_selective_ac_with_te_layers_counts_their_recompute_in_hfu(ac):
    """FlopCounterMode on the checkpointed model sees flops.hardware_flops of the mode the megatron
    backend runs with TE: op-level selective re-runs the DiT's TE GEMMs and attention in backward."""
    mode = te_ac_mode(ac, te=True)
    assert mode == (TE_SELECTIVE if ac == "selective" else "none") and te_ac_mode(ac, te=False) == ac
    cfg = PRESETS["tiny"]
    with torch.device("meta"):
        model = EchoTTS(cfg)
        te_like_dit(model)
        batch = SimpleNamespace(latent=torch.randn(1, 60, 128), latent_mask=torch.ones(1, 60, dtype=torch.bool),
                                ref=torch.randn(1, 40, 128), ref_mask=torch.ones(1, 40, dtype=torch.bool),
                                text_ids=torch.zeros(1, 20, dtype=torch.long),
                                text_mask=torch.ones(1, 20, dtype=torch.bool))
    apply_ac(model, ECHO_PARTS, mode)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(batch).backward()
    f = model_flops(cfg, 60, 20, 40)
    assert counted_model_flops(counter) == hardware_flops(cfg, f, mode)
    assert (recompute_flops(cfg, f, mode) > 0) == (ac == "selective")
