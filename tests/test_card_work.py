"""A plain decoder as a model card: its work (predict.cards.work) against counts made independently
of it (6N + the attention term from a published row's parameter count, TP's split, a recompute
policy's re-run, an eager block's element-wise bytes and host ops counted on real steps), its
collectives' bytes against the parameters they move (predict.cards.traffic), and the pipeline's
schedule arithmetic. Nothing here depends on the pricing's figures."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from conftest import ROOT
from echobench.calibrate.commbench import count_ops
from echobench.hardware.profile import find_profile, load_profile
from echobench.predict.cards.card import (
    Layout,
    card_params,
    layer_params,
    model_card,
    rank_blocks,
    rank_params,
    run_layout,
    stage_blocks,
)
from echobench.predict.cards.model import predict_card
from echobench.predict.cards.traffic import card_traffic
from echobench.predict.cards.work import ELEMENTWISE_EAGER, HOST_OPS_FIXED, HOST_OPS_PER_LAYER, card_work
from echobench.predict.errors import PredictError
from echobench.predict.frameworks import EAGER_KERNELS, framework, resolved
from echobench.predict.pipeline import (
    bubble_fraction,
    in_flight,
    interleaved_grad_exposed,
    p2p_messages,
    pipeline_seconds,
)
from echobench.predict.recompute import recomputed_linears

ROWS = yaml.safe_load((ROOT / "validation" / "published-runs.yaml").read_text())
BY_ID = {r["id"]: r for r in ROWS}


def card_of(row_id: str, **run):
    row = BY_ID[row_id]
    return model_card(row["model"]), run_layout({**row["run"], **run}, row["hardware"])


def work(card, layout, fw: str | None = None):
    return card_work(card, layout, framework(layout.framework if fw is None else fw, layout.compile))


def traffic(card, layout):
    return card_traffic(card, layout, resolved(layout, framework(layout.framework, layout.compile))[0])


def flops(w, phases=("forward", "backward", "recompute")) -> int:
    return sum(m.flops for m in w.matmuls if m.phase in phases) + sum(a.flops for a in w.attention if a.phase in phases)


@pytest.mark.parametrize("row_id", [r["id"] for r in ROWS if r["source"]["name"] == "llm-foundry"])
def test_a_cards_parameters_are_the_published_count(row_id):
    card, layout = card_of(row_id)
    assert card_params(card, layout.seq) == BY_ID[row_id]["model"]["params"]


@pytest.mark.parametrize("row_id", ["lf-mpt-7b-8gpu", "lf-mpt-1b-8gpu-s32768", "lf-mpt-760m-8gpu"])
def test_a_no_ac_cards_flops_per_token_are_6n_plus_attention_less_what_no_gemm_touches(row_id):
    """llm-foundry's 6N + 12 L d s counts every parameter; the GEMMs touch all but the biases and norms
    (13 d a layer), the position table (s d) and the final norm (2 d), each counted here from the shape."""
    m, run = BY_ID[row_id]["model"], BY_ID[row_id]["run"]
    card, layout = card_of(row_id)
    assert layout.ac == "none"
    w = work(card, layout)
    tokens = layout.micro_batch * layout.seq * layout.grad_accum
    L, d, s = m["layers"], m["hidden"], run["seq"]
    gemm_params = m["params"] - L * 13 * d - s * d - 2 * d
    assert flops(w) == tokens * (6 * gemm_params + 12 * L * d * s)
    assert not [a for a in w.attention if a.phase == "recompute"] and all(a.causal for a in w.attention)


def test_tensor_parallelism_splits_a_ranks_flops_by_tp_and_context_parallelism_by_cp():
    card, _ = card_of("mlm-gpt-7.1b-96gpu")
    per_rank = {}
    for tp, cp in ((1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 4)):
        layout = Layout(gpus=48 * tp * cp, gpus_per_node=8, seq=4096, micro_batch=1, grad_accum=4, global_batch=192,
                        layout="megatron", tp=tp, cp=cp, sequence_parallel=tp > 1, distributed_optimizer=True)
        per_rank[tp * cp] = flops(work(card, layout))
    assert all(per_rank[n] * n == per_rank[1] for n in per_rank)


@pytest.mark.parametrize("fw", ["llm-foundry", "torchtitan", "megatron-lm"])
def test_a_recompute_policy_re_runs_its_share_of_the_forward(fw):
    """full: the whole forward but the LM head, and under torch's non-reentrant checkpoint
    (llm-foundry, torchtitan: early stop) but the block's MLP down projection too; selective
    (Megatron's): the attention forward only; selective-layer-2: half of full's; selective-op
    (torchtitan's): the even-numbered matmuls of the block and no attention."""
    card, layout = card_of("lf-mpt-7b-8gpu", framework=fw)
    none = work(card, layout)
    fwd = flops(none, ("forward",)) - sum(m.flops for m in none.matmuls if m.part == "lm_head" and m.phase == "forward")
    down = 2 * layout.micro_batch * layout.seq * card.layers * card.ffn * card.hidden  # MLP down's forward
    attention_fwd = sum(a.flops for a in none.attention if a.phase == "forward")
    again = {ac: flops(work(card, replace(layout, ac=ac)), ("recompute",))
             for ac in ("full", "selective", "selective-layer-2", "selective-op")}
    early = fw != "megatron-lm"  # Megatron re-runs the block through its own reentrant CheckpointFunction
    assert again["full"] == fwd - (down if early else 0) and again["selective"] == attention_fwd
    assert again["selective-layer-2"] == pytest.approx(again["full"] / 2, rel=1e-9)
    assert all(flops(work(card, replace(layout, ac=ac)), ("forward", "backward")) == flops(none) for ac in again)
    d, f, L, rows = card.hidden, card.ffn, card.layers, layout.micro_batch * layout.seq
    # MPT's GELU block in torchtitan's matmul order q, k, v, out, up, down: k, out and down re-run
    assert recomputed_linears("selective-op", gated=False) == {"k", "out", "down"}
    assert again["selective-op"] == 2 * rows * L * (d * d + d * d + f * d) if fw == "torchtitan" else True


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.matmuls += str(func.overloadpacket) in ("aten.addmm", "aten.mm")  # the linears (attention: bmm)
        return func(*args, **(kwargs or {}))


class _PreNormBlock(nn.Module):
    """A GPT block as MPT writes it: LayerNorm, fused QKV, causal attention, output projection,
    residual; LayerNorm, up, GELU, down, residual (no dropout)."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.norm_1, self.qkv, self.out = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm_2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm_1(x)).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.norm_2(x))))


@pytest.mark.parametrize("early_stop", [True, False])
def test_torchs_non_reentrant_checkpoint_does_not_re_run_a_blocks_last_linear(early_stop):
    """What recompute.py's early stop rests on, held against torch itself: a pre-norm block under
    checkpoint(use_reentrant=False) re-runs, in backward, every linear's forward but the last (the
    MLP down projection saves its input before it computes, and that save is the last one the
    backward needs); with early stop off, all four. Backward's own GEMMs: two per linear."""
    block, x = _PreNormBlock(), torch.randn(2, 8, 32, requires_grad=True)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    count = _CountMatmuls()
    with count:
        y.sum().backward()
    linears = 4  # qkv, out, up, down
    rerun = len(recomputed_linears("full", gated=False, early_stop=early_stop) - {"q", "k", "gate"})  # fused qkv; no gate
    assert rerun == (linears - 1 if early_stop else linears)
    assert count.matmuls == 2 * linears + rerun


def test_early_stop_is_torchs_checkpoint_and_skips_the_last_linear_only_where_it_is_a_plain_autograd_op():
    """llm-foundry and torchtitan wrap blocks in torch's non-reentrant checkpoint, Megatron-LM in its
    own. The last linear's GEMM is not re-run where it is a plain autograd op (it saves its inputs
    before it computes); an eager float8 linear and megatron-core's parallel linears are autograd
    Functions that save after, so theirs is re-run; compiled, none is. Full AC's TP reductions: the
    re-run block's but the one after its last linear, whichever kind it is."""
    card, layout = card_of("lf-mpt-7b-8gpu", ac="full")
    assert resolved(layout, framework("llm-foundry"))[0]["ac_early_stop"]
    assert not resolved(layout, framework("megatron-lm"))[0]["ac_early_stop"]
    down = lambda lay, fw="torchtitan": [m for m in work(card, lay, fw).matmuls  # noqa: E731
                                         if m.phase == "recompute" and m.k == card.ffn // lay.tp]
    fp8 = replace(layout, framework="torchtitan", precision="fp8", fp8_recipe="delayed")
    assert not down(layout) and not down(replace(fp8, compile=True)) and down(fp8) and down(layout, "megatron-lm")
    L = card.layers
    tt = replace(layout, tp=2, gpus=16, layout="fsdp", framework="torchtitan", sequence_parallel=False)
    mc = replace(tt, layout="megatron", distributed_optimizer=False)
    assert not down(tt) and down(mc)  # DTensor's plain ops; megatron-core's autograd Functions
    for lay in (tt, mc):
        forward = {x.op: x for x in traffic(card, lay).per_micro if x.what.startswith("forward: row-parallel")}
        assert forward["all_reduce"].calls == 2 * L + L + 1  # the block's two, the re-run's one, the embedding's


def test_swiglu_adds_a_third_mlp_gemm_gqa_narrows_k_and_v_and_fp8_moves_the_block_linears_to_float8():
    card, layout = card_of("lf-mpt-7b-8gpu")
    mlp = lambda c: sum(m.flops for m in work(c, layout).matmuls if m.part == "mlp")  # noqa: E731
    assert mlp(replace(card, activation="swiglu")) * 2 == mlp(card) * 3
    assert work(replace(card, kv_heads=8), layout).matmuls[0].n == card.hidden + 2 * 8 * card.head_dim
    fp8 = work(card, replace(layout, precision="fp8", fp8_recipe="delayed"))
    assert {m.precision for m in fp8.matmuls if m.part != "lm_head"} == {"fp8"}
    assert {m.precision for m in fp8.matmuls if m.part == "lm_head"} == {"bf16"}
    assert sum(fp8.elementwise) > sum(work(card, layout).elementwise)  # the casts and transposes


def by(items, op, what=""):
    return [t for t in items if t.op == op and what in t.what]


def test_fsdp_gathers_every_parameter_twice_but_the_root_and_reduce_scatters_each_once_per_micro_batch():
    card, layout = card_of("lf-mpt-7b-8gpu-s1024")  # grad_accum 2
    n = card_params(card, layout.seq)
    root = card.vocab * card.hidden + layout.seq * card.hidden + 2 * card.hidden  # tied embedding, positions, final norm
    t = traffic(card, layout)
    assert sum(x.nbytes for x in by(t.per_micro, "all_gather")) == (2 * n - root) * 2  # bf16, forward and backward
    assert sum(x.nbytes for x in by(t.per_micro, "reduce_scatter")) == n * 4  # fp32 gradients
    assert all(x.per_node == 8 and x.link == "intra" for x in t.per_micro)
    sgo = traffic(card, replace(layout, sharding="shard_grad_op"))
    assert sum(x.nbytes for x in by(sgo.per_micro, "all_gather")) == n * 2  # gathered once, kept through backward
    many = traffic(card, replace(layout, gpus=64, global_batch=64 * 64 * 2))
    assert all(x.link == "inter" and x.per_node == 8 for x in many.per_micro)
    assert rank_params(card, layout) * 8 == n
    fp8 = traffic(card, replace(layout, precision="fp8", fp8_all_gather=True))  # torchao: float8 weights gathered
    assert sum(x.nbytes for x in by(fp8.per_micro, "all_gather", "each block")) * 2 == \
        sum(x.nbytes for x in by(t.per_micro, "all_gather", "each block"))


def test_fsdp_reducing_once_a_step_moves_1_over_n_of_the_reduce_scatter_and_torchtitan_does_so_under_pp():
    """fsdp_reduce_once: with N micro-batches the gradients' reduce-scatter runs once a step, not N
    times: the step's reduce-scatter time is 1/N of the per-micro-batch one; under PP it runs after
    the schedule, exposed (torch.distributed.pipelining). torchtitan's default: once under PP, every
    micro-batch without it (its train_step), llm-foundry's every micro-batch."""
    prof = load_profile(find_profile("h100-96gb-500w"))
    card, layout = card_of("tt-llama31-405b-h100-512gpu-pp8-1f1b")  # torchtitan FSDP + PP, 8 micro-batches
    n = layout.grad_accum
    assert n > 1 and resolved(layout, framework("torchtitan"))[0]["fsdp_reduce_once"]

    def reduce_scatter_s(p, once: bool) -> float:
        cs = [c for c in p.collectives if c.op == "reduce_scatter" and c.group == "dp_shard"]
        assert len(cs) == 1 and (cs[0].what.endswith(", once a step") or "once a step," in cs[0].what) == once
        return cs[0].seconds * (1 if once else n)

    every = predict_card(card, replace(layout, fsdp_reduce_once=False), prof)
    once = predict_card(card, layout, prof)
    assert reduce_scatter_s(once, True) == pytest.approx(reduce_scatter_s(every, False) / n, rel=1e-12)
    (after,) = [c for c in once.collectives if c.op == "reduce_scatter" and c.group == "dp_shard"]
    assert after.overlaps == "none" and after.floor_s == after.seconds  # after the schedule's last backward
    t_every, t_once = traffic(card, replace(layout, fsdp_reduce_once=False)), traffic(card, layout)
    grads = "gradients of each unit"
    assert by(t_every.per_micro, "reduce_scatter", grads) and not by(t_once.per_micro, "reduce_scatter", grads)
    assert [x.nbytes for x in by(t_once.per_step, "reduce_scatter", grads)] == \
        [x.nbytes for x in by(t_every.per_micro, "reduce_scatter", grads)]
    # without PP: torchtitan and llm-foundry reduce every micro-batch; reducing once overlaps the last backward
    flat, accum = card_of("lf-mpt-7b-8gpu-s1024")  # grad_accum 2
    for name in ("torchtitan", "llm-foundry"):
        assert not resolved(replace(accum, framework=name), framework(name))[0]["fsdp_reduce_once"]
    one = [c for c in predict_card(flat, replace(accum, fsdp_reduce_once=True), prof).collectives if c.op == "reduce_scatter"]
    assert [c.overlaps for c in one] == ["backward"] and one[0].floor_s < one[0].seconds

def test_pipeline_chunks_of_one_layer_with_an_embedding_only_and_a_head_only_chunk_are_priced():
    """Llama 3.1 405B's 126 layers on pp 8 x vp 16: 128 chunks, one layer each but the first (the
    embedding alone) and the last (the final norm and head alone). Each rank holds its chunks'
    blocks (rank 0 and 7 one fewer); the slowest runs 16 blocks and no head, as the head weighs
    less than a block here; a vocabulary heavier than a block puts the head's rank first. One
    chunk more than that is refused in one line."""
    prof = load_profile(find_profile("h100-96gb-500w"))
    card, layout = card_of("tt-llama31-405b-h100-512gpu-pp8-interleaved")
    one = replace(layout, vp=16, embedding_chunk=True, head_chunk=True)
    blocks = rank_blocks(card, one)
    assert sum(blocks) == card.layers == 126 and blocks == [15, 16, 16, 16, 16, 16, 16, 15]
    assert stage_blocks(card, one) == (16, False) and card.vocab * card.hidden < layer_params(card)
    w = work(card, one)
    assert w.layers == 16 and not w.lm_head and not [m for m in w.matmuls if m.part == "lm_head"]
    p = predict_card(card, one, prof)
    assert p.step_time_s > 0 and any("an embedding-only first chunk and a head-only last chunk" in n for n in p.notes)
    assert p.parts["bubble"] < predict_card(card, layout, prof).parts["bubble"]  # vp 16: (p - 1) / (16 m)
    heavy = replace(card, vocab=4 * layer_params(card) // card.hidden)
    assert stage_blocks(heavy, one) == (15, True)
    assert stage_blocks(card, layout) == (16, True)  # without them: ceil(126 / 8) and the head, as before
    with pytest.raises(PredictError) as err:
        work(card, replace(one, head_chunk=False, vp=17))
    assert "chunks leave 135 for the model's 126 layers" in str(err.value) and "\n" not in str(err.value)

def test_hsdp_reduces_its_shards_across_the_replicas_of_its_shard_group():
    card, layout = card_of("lf-mpt-7b-128gpu")
    n = card_params(card, layout.seq)
    for group in (8, 32):
        hsdp = traffic(card, replace(layout, layout="hsdp", shard_group=group))
        (rep,) = by(hsdp.per_micro, "all_reduce")
        assert (rep.group, rep.group_size, rep.nbytes) == ("dp_replicate", 128 // group, n * 4 // group)
        assert all(t.group_size == group for t in hsdp.per_micro if t.group == "dp_shard")
        assert all((t.link == "intra") == (group == 8) for t in hsdp.per_micro if t.group == "dp_shard")
    ddp = traffic(card, replace(layout, layout="ddp"))
    assert not ddp.per_micro and [(t.op, t.nbytes, t.group_size) for t in ddp.per_step] == [("all_reduce", n * 4, 128)]


def test_megatron_distributed_optimizer_moves_one_tp_ranks_gradients_and_parameters_once_a_step():
    card, layout = card_of("mlm-gpt-16b-192gpu")  # tp 4, sp, distributed optimizer, grad_accum 4
    t = traffic(card, layout)
    (rs,), (ag,) = by(t.per_step, "reduce_scatter"), by(t.per_step, "all_gather")
    mine = rank_params(card, layout) * layout.data_parallel  # one TP rank's parameters
    assert rs.nbytes == int(mine * 4) and ag.nbytes == int(mine * 2) and rs.group_size == 48 and rs.per_node == 2
    act = layout.micro_batch * layout.seq * card.hidden * 2
    gathers = sum(x.calls for x in by(t.per_micro, "all_gather"))
    assert gathers == 2 * card.layers + 1 + 4 * card.layers + 2 and all(x.nbytes == x.calls * act
                                                                        for x in by(t.per_micro, "all_gather"))
    plain = traffic(card, replace(layout, distributed_optimizer=False))
    assert [x.op for x in plain.per_step] == ["all_reduce"]
    cp = traffic(card, replace(layout, gpus=384, cp=2))  # CP: K and V gathered per layer, DP reduces over dp x cp
    (kv,) = by(cp.per_micro, "all_gather", "context parallel")
    assert kv.group_size == 2 and kv.calls == 2 * card.layers
    assert by(cp.per_step, "reduce_scatter")[0].group_size == 96


def test_megatron_tp_without_sequence_parallelism_all_reduces_and_full_ac_repeats_the_forwards():
    card, layout = card_of("mlm-gpt-7.1b-96gpu")
    plain = replace(layout, sequence_parallel=False, tp_comm_overlap=False)
    act = layout.micro_batch * layout.seq * card.hidden * 2
    ars = {t.what.split(":")[0]: t for t in traffic(card, plain).per_micro if t.nbytes % act == 0}
    assert (ars["forward"].calls, ars["backward"].calls) == (2 * card.layers + 1, 2 * card.layers + 1)
    full = {t.what.split(":")[0]: t for t in traffic(card, replace(plain, ac="full")).per_micro if t.nbytes % act == 0}
    assert full["forward"].calls - 1 == 2 * (ars["forward"].calls - 1) and full["backward"] == ars["backward"]


def test_pipeline_bubble_and_messages():
    """Narayanan et al. 2021: 1F1B idles (p - 1) / m of the ideal time, interleaving v chunks
    (p - 1) / (v m) and sends v times the messages; the fill and drain take (p - 1) / v micro-batches."""
    assert bubble_fraction(8, 1, 32) == 7 / 32 and bubble_fraction(8, 4, 32) == 7 / 128 and bubble_fraction(1, 1, 8) == 0
    assert pipeline_seconds(2.0, 8, 1, 32) == pytest.approx(2.0 * 32 * (1 + 7 / 32))
    assert pipeline_seconds(2.0, 8, 2, 32, mean_s=1.5) == pytest.approx(2.0 * 32 + 1.5 * 7 / 2)
    assert p2p_messages(8, 2, 32) == 64 and p2p_messages(1, 1, 32) == 0
    assert in_flight(8, 1, 32) == 8 and in_flight(8, 1, 4) == 4 and in_flight(1, 1, 4) == 1


def test_a_pipelined_row_is_priced_with_its_bubble_and_interleaving_shrinks_it():
    prof = load_profile(find_profile("h100-hgx-ib"))
    card, layout = card_of("mlm-gpt-70b-768gpu")  # pp 2, 8 micro-batches of 1
    one = predict_card(card, replace(layout, vp=1), prof)
    two = predict_card(card, replace(layout, vp=2), prof)
    assert one.parts["bubble"] > two.parts["bubble"] > 0 and one.step_time_s > two.step_time_s
    flat = predict_card(card, replace(layout, pp=1, vp=1, gpus=384, global_batch=384), prof)
    assert flat.parts["bubble"] == 0


def test_interleaving_hides_all_but_the_last_chunks_gradient_reduction():
    """Megatron-Core's interleaved schedule reduces each chunk's gradients after its last backward: the
    last chunk's 1 / v is exposed, the rest hides behind the (v - 1) / v of the last p micro-batches'
    backward still to run, and what does not fit there is exposed too."""
    assert interleaved_grad_exposed(0.8, 8, 4, 32, 1.0) == pytest.approx(0.2)  # window 6 s: only the last chunk's
    assert interleaved_grad_exposed(0.8, 8, 4, 32, 0.01) == pytest.approx(0.8 - 0.75 * 8 * 0.01)  # the link is the limit
    assert interleaved_grad_exposed(0.8, 2, 2, 1, 1.0) == pytest.approx(0.4)  # one micro-batch: min(p, m) of them
    prof = load_profile(find_profile("h100-hgx-ib"))
    card, layout = card_of("mlm-gpt-314b-3072gpu")  # tp 8, pp 8, dp 48: 20 GB of fp32 gradients a rank
    comm = {vp: predict_card(card, replace(layout, vp=vp), prof).parts["communication"] for vp in (2, 12)}
    off = predict_card(card, replace(layout, vp=12, overlap_grad_reduce=False, overlap_param_gather=False), prof)
    assert comm[2] > comm[12] and off.parts["communication"] > comm[2]


def test_grad_accumulation_repeats_a_micro_batchs_compute_and_fsdps_collectives_but_not_the_step_ones():
    """Whatever the profile's rates: two micro-batches cost twice one in GEMMs, attention, element-wise
    work and FSDP's collectives; the optimizer and the gradient norm run once."""
    prof = load_profile(find_profile("h100-hgx-ib"))
    card, two = card_of("lf-mpt-7b-8gpu-s1024")
    one = replace(two, grad_accum=1, global_batch=two.global_batch // 2)
    p2, p1 = predict_card(card, two, prof), predict_card(card, one, prof)
    for part in ("gemm", "attention", "elementwise"):
        assert p2.parts[part] == pytest.approx(2 * p1.parts[part], rel=1e-12)
    assert p2.parts["optimizer"] == p1.parts["optimizer"]
    once = sum(c.seconds for c in p1.collectives if "gradient norm" in c.what)
    assert once > 0 and 2 * p1.communication_s - p2.communication_s == pytest.approx(once, rel=1e-9)
    assert p2.step_time_s == max(p2.device_s, p2.host_s) and p2.hfu > p2.mfu > 0  # full AC: HFU counts the re-run


def test_element_wise_bytes_of_a_fused_block_follow_its_ops_and_sequence_parallelism_splits_the_norms():
    """Fused (Megatron, TransformerEngine): per token, forward: two norms (2d), two residual adds (3d),
    GELU (2f) a layer; embedding (2d), learned positions (3d), final norm (2d), cross-entropy over the
    vocabulary (2V). Backward: 3d, 3d, 3f a layer; 3d, 1d, 3d, 2V. At two bytes an element."""
    card, layout = card_of("lf-mpt-7b-8gpu", framework="")
    L, d, f, V = card.layers, card.hidden, card.ffn, card.vocab
    tokens = layout.micro_batch * layout.seq * layout.grad_accum
    fwd, bwd = work(card, layout).elementwise
    once = 2 * tokens * (2 * d + 3 * d + 2 * d + 2 * V + 3 * d + d + 3 * d + 2 * V)
    assert fwd + bwd == pytest.approx(2 * tokens * L * (2 * 2 * d + 2 * 3 * d + 2 * f + 2 * 3 * d + 2 * 3 * d + 3 * f) + once)
    mlm, tp = card_of("mlm-gpt-16b-192gpu")
    with_sp, without = sum(work(mlm, tp).elementwise), sum(work(mlm, replace(tp, sequence_parallel=False)).elementwise)
    whole = tp.micro_batch * tp.seq * tp.grad_accum * 2 * (mlm.layers * (10 + 12) * mlm.hidden + (7 + 7) * mlm.hidden)
    assert without - with_sp == pytest.approx(whole * (1 - 1 / tp.tp), rel=1e-9)


def test_an_eager_blocks_element_wise_bytes_are_those_counted_on_its_framework_code():
    """cards.work.ELEMENTWISE_EAGER: tools/count_card_blocks.py counted again (bf16 blocks on the CPU,
    the GPU's kernels' bytes by stepcount_ops.op_tally)."""
    spec = importlib.util.spec_from_file_location("count_card_blocks", ROOT / "tools" / "count_card_blocks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(EAGER_KERNELS) == set(ELEMENTWISE_EAGER)  # a layout's elementwise_kernels name a counted block
    for name, block, mha in (("mpt", module.mpt_block, True), ("llama", module.llama_block, False)):
        c = module.coefficients(block, mha)
        assert [*c["forward"], *c["backward"]] == pytest.approx([*ELEMENTWISE_EAGER[name][0], *ELEMENTWISE_EAGER[name][1]],
                                                                  abs=0.02), name
    # the torchtitan (eager) block moves several times what the fused count says; MPT's forward is the count's
    card, layout = card_of("tt-llama3-8b-h100-8gpu")
    assert sum(work(card, layout).elementwise) > 3 * sum(work(card, layout, fw="").elementwise)


def test_the_host_ops_of_a_card_are_those_counted_on_an_eager_decoder():
    """card.HOST_OPS_*: a plain pre-norm GPT block and tied-embedding decoder, written here apart from
    card.py, one step of 1 and 2 layers counted on the CPU; the per-layer and fixed ops are their
    difference and remainder."""
    class Block(nn.Module):
        def __init__(self, d=64, h=4, f=256):
            super().__init__()
            self.h, self.n1, self.n2 = h, nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, f), nn.Linear(f, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.h, d // self.h).transpose(1, 3).unbind(2)
            x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.n2(x))))

    def counted(layers: int) -> dict[str, int]:
        torch.manual_seed(0)
        wte, wpe, norm = nn.Embedding(100, 64), nn.Embedding(32, 64), nn.LayerNorm(64)
        blocks = nn.ModuleList(Block() for _ in range(layers))
        params = [*wte.parameters(), *wpe.parameters(), *norm.parameters(), *blocks.parameters()]
        opt = torch.optim.AdamW(params, foreach=True)
        idx, target = torch.randint(0, 100, (2, 32)), torch.randint(0, 100, (2, 32))
        out = {}
        for _ in range(2):  # the second step: the optimizer's state exists
            with count_ops() as c:
                x = wte(idx) + wpe(torch.arange(32))
                for block in blocks:
                    x = block(x)
                loss = F.cross_entropy(F.linear(norm(x), wte.weight).view(-1, 100), target.view(-1))
            out["forward"] = c.total
            with count_ops() as c:
                loss.backward()
            out["backward"] = c.total
            with count_ops() as c:
                opt.step()
                opt.zero_grad()
            out["optimizer"] = c.total
        return out

    one, two = counted(1), counted(2)
    assert {k: two[k] - one[k] for k in one} == HOST_OPS_PER_LAYER
    assert {k: 2 * one[k] - two[k] for k in one} == HOST_OPS_FIXED


def test_megatrons_scatter_gather_sends_a_tp_share_of_each_pipeline_message_across_nodes():
    """Narayanan et al. 2021 section 4.1: without sequence parallelism each TP rank of a stage sends
    1 / t of the activations over its own link and the receiving stage all-gathers them over NVLink;
    with sequence parallelism each rank holds its 1 / t already (nothing to gather)."""
    from echobench.predict.cards.traffic import p2p_seconds
    from echobench.predict.pricing import Rates

    prof = load_profile(find_profile("a100-sxm-80gb"))
    rates = Rates(prof, "mid")
    card, layout = card_of("kor-turing-530b-full")  # tp 8, pp 35 across nodes, no SP
    assert layout.tp == 8 and not layout.sp and framework(layout.framework).p2p_scatter_gather
    whole = layout.tokens * card.hidden * layout.compute_bytes
    _, plain = p2p_seconds(card, layout, rates)
    _, split = p2p_seconds(card, layout, rates, scatter_gather=True)
    exchange = rates.collective_seconds("all_gather", 2 * whole / 8, 2, "inter", 1)
    gather = rates.collective_seconds("all_gather", whole, 8, "intra", 8)
    assert plain == pytest.approx(rates.collective_seconds("all_gather", 2 * whole, 2, "inter", 1))
    assert split == pytest.approx(exchange + gather) and split < plain
    sp = replace(layout, sequence_parallel=True)
    assert p2p_seconds(card, sp, rates, scatter_gather=True) == p2p_seconds(card, sp, rates) == \
        pytest.approx((2 * 280 * 3 * exchange, exchange))
    # only the papers' Megatron-LM does it; later stacks run sequence parallelism with TP
    assert [n for n in ("megatron-lm", "megatron-lm-2021", "megatron-lm-2022", "nemo", "torchtitan", "llm-foundry")
            if framework(n).p2p_scatter_gather] == ["megatron-lm-2021", "megatron-lm-2022"]
