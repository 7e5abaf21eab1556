"""The collectives of one training step of a model card (card.py) on one rank, as
hardware.traffic.Traffic (nccl-tests' message sizes, per_node filled), split into those every micro-batch
repeats and those once per step, and their placement (place_card: communication.place, then what the
card's frameworks overlap differently). Options come resolved (frameworks.resolved).

- FSDP (FSDP v1 through composer, FSDP2 in torchtitan): a unit per block plus the root (embedding,
  positions, final norm) on each model-parallel rank's share. full_shard: each block's parameters
  all-gathered in the compute dtype (float8 where fp8_all_gather) in forward and again in backward,
  the root once; shard_grad_op: once, kept through backward; gradients reduce-scattered per unit in
  the reduce dtype. Every micro-batch: composer's ddp_sync_context returns at once for a model that
  is not DistributedDataParallel (mosaicml/composer composer/distributed/dist_strategy.py), and FSDP2
  reduces each backward; once a step where the run reduces once (fsdp_reduce_once: gradient sync
  off but on the last micro-batch, against its backward; under PP after the schedule's last
  backward, exposed: torch.distributed.pipelining's REDUCE_GRAD). HSDP adds each unit's gradient
  shard all-reduced across the replicas, as often. Once per step: the gradient norm's all-reduce
  (clipping).
- DDP (torch DDP): the gradients all-reduced in 25 MiB buckets once per step.
- Tensor parallelism (Megatron's, torchtitan's 2D; a group within a node): without sequence
  parallelism, per layer the all-reduce of the two row-parallel outputs in forward and of the two
  column-parallel inputs' gradients in backward; with it, per layer 2 all-gathers and 2
  reduce-scatters in forward, 4 all-gathers (2 of them the inputs re-gathered for the weight
  gradients) and 2 reduce-scatters in backward; the vocabulary-parallel embedding and LM head
  likewise; a recompute policy that re-runs the block repeats the forward's (under torch's
  non-reentrant checkpoint all but the reduction after the block's last linear: recompute.py's early
  stop). Every micro-batch.
- Context parallelism (cp > 1): each layer's K and V all-gathered over the cp ranks in forward and
  again in backward, their gradients reduce-scattered (TransformerEngine's ring exchanges the same
  bytes, overlapped with the attention of the chunk in hand).
- Megatron DP, once per step (all micro-batches but the last under no_sync): over the dp x cp ranks,
  the distributed optimizer's gradient reduce-scatter and parameter all-gather, over buckets of
  max(40M, 1M x dp) parameters (training.py's default with overlap_grad_reduce; one bucket
  without), else DDP's all-reduce of the gradients. Pipeline stages: their own share; interleaved,
  each chunk's reduction starts after its last backward (cards.model, pipeline.interleaved_grad_exposed).
- Pipeline point-to-point (pipeline.py): activations forward and gradients back per micro-batch and
  chunk, each a message between two ranks of adjacent stages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from echobench.hardware.traffic import Traffic
from echobench.predict.cards.card import (
    REDUCE_BYTES,
    Layout,
    ModelCard,
    _layer_split,
    layer_params,
    model_parallel_params,
    stage_blocks,
)
from echobench.predict.communication import Collective, place
from echobench.predict.pipeline import p2p_messages
from echobench.predict.pricing import Rates
from echobench.predict.recompute import POLICIES, WHOLE_BLOCK

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
TORCH_DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25
FP32 = 4
AFTER_SCHEDULE = ", once a step, after the pipeline schedule's last backward"  # FSDP reducing once under PP


@dataclass(frozen=True)
class StepTraffic:
    """A card step's collectives: `per_micro` repeat every micro-batch, `per_step` run once."""

    per_micro: tuple
    per_step: tuple
    bucket_caps: tuple[int, int]  # DDP's bucket caps in bytes (communication.place)


def _traffic(*args, **kwargs):
    return Traffic(*args, **kwargs)


def megatron_bucket_params(layout: Layout) -> int:
    """Megatron's DDP bucket with overlap_grad_reduce: max(40M, 1M x dp) parameters (megatron/training/
    training.py's default for DistributedDataParallelConfig.bucket_size; without overlap, one bucket)."""
    return max(40_000_000, 1_000_000 * layout.data_parallel)


def _group(layout: Layout, size: int, inner: int) -> tuple[str, int]:
    """The link a group of `size` ranks, `inner` model-parallel ranks apart, takes and its ranks per node."""
    per_node = max(1, min(size, layout.gpus_per_node // inner))
    return ("intra" if size <= per_node else "inter"), per_node


def _fsdp(card: ModelCard, layout: Layout, opts: dict) -> StepTraffic:
    hsdp = layout.hybrid
    shard = layout.shard_size
    link, per_node = _group(layout, shard, layout.tp)
    gather = 1 if layout.fp8_all_gather else layout.compute_bytes
    e, dtype = layout.compute_bytes, DTYPES[layout.precision]
    r = REDUCE_BYTES[opts["grad_reduce_dtype"]]
    rdtype = DTYPES[opts["grad_reduce_dtype"]]
    mine = model_parallel_params(card, layout)
    L, twice = stage_blocks(card, layout)[0], layout.sharding == "full_shard"
    block = layer_params(card) - _layer_split(card) * (1 - 1 / layout.tp)
    root = mine - L * block
    per_micro = [
        _traffic("all_gather", "dp_shard", shard, (2 if twice else 1) * L, int((2 if twice else 1) * L * block * gather),
                 dtype, link, "parameters of each block" + (", forward and backward" if twice else
                                                              ", gathered in forward, kept through backward"), per_node),
        _traffic("all_gather", "dp_shard", shard, 1, int(root * e), dtype, link,
                 "parameters of the root (embedding, final norm): once, kept from forward to backward", per_node)]
    once = opts["fsdp_reduce_once"] and layout.grad_accum > 1
    when = (AFTER_SCHEDULE if layout.pp > 1 else ", once a step") if once else ""
    grads = [_traffic("reduce_scatter", "dp_shard", shard, L + 1, int(mine * r), rdtype, link,
                      "gradients of each unit" + when, per_node)]
    replicas = layout.data_parallel // shard
    if hsdp and replicas > 1:
        grads.append(_traffic("all_reduce", "dp_replicate", replicas, L + 1, int(mine * r // shard), rdtype,
                              "inter", "gradient shards of each unit across the replicas" + when, 1))
    per_step = [_traffic("all_reduce", "dp_shard", shard, 1, FP32, "float32", link, "gradient norm (clipping)", per_node)]
    if once:
        per_step = grads + per_step
    else:
        per_micro += grads
    per_micro += _tp(card, layout, opts["ac_early_stop"])
    return StepTraffic(tuple(per_micro), tuple(per_step), (TORCH_DDP_BUCKET_BYTES, TORCH_DDP_BUCKET_BYTES))


def _ddp(card: ModelCard, layout: Layout, opts: dict) -> StepTraffic:
    r, rdtype = REDUCE_BYTES[opts["grad_reduce_dtype"]], DTYPES[opts["grad_reduce_dtype"]]
    grads = int(model_parallel_params(card, layout) * r)
    link, per_node = _group(layout, layout.data_parallel, layout.tp)
    calls = max(1, math.ceil(grads / TORCH_DDP_BUCKET_BYTES))
    step = (_traffic("all_reduce", "dp", layout.data_parallel, calls, grads, rdtype, link, "gradient buckets", per_node),)
    return StepTraffic((), step, (TORCH_DDP_BUCKET_BYTES, TORCH_DDP_BUCKET_BYTES))


def _tp(card: ModelCard, layout: Layout, early_stop: bool = False) -> list:
    """The TP collectives of one micro-batch on a stage (the module docstring); `early_stop`: a
    re-run block stops before its last linear (recompute.py), so the reduction after it is not re-run."""
    if layout.tp == 1:
        return []
    tp, L = layout.tp, stage_blocks(card, layout)[0]
    act = layout.tokens * card.hidden * layout.compute_bytes
    dtype = DTYPES[layout.precision]
    pol = POLICIES[layout.ac]
    again = 1 + (pol.layers if pol.collectives else 0)  # a re-run block repeats the forward's collectives
    # the row-parallel reductions a block's forward runs (after the output projection and MLP down), re-runs counted
    reduce = 2 * L + (2 - (early_stop and layout.ac in WHOLE_BLOCK)) * L * (again - 1)

    def t(op: str, calls: float, what: str):
        calls = max(1, round(calls))
        return _traffic(op, "tp", tp, calls, calls * act, dtype, "intra", what, tp)

    if layout.sp:
        out = [t("all_gather", 2 * L * again + 1, "forward: sequence-parallel inputs of QKV, MLP up and the LM head"),
               t("reduce_scatter", reduce + 1, "forward: row-parallel outputs and the embedding"),
               t("all_gather", 4 * L + 2, "backward: output gradients, and the inputs re-gathered for weight gradients"),
               t("reduce_scatter", 2 * L + 1, "backward: column-parallel input gradients")]
    else:
        out = [t("all_reduce", reduce + 1, "forward: row-parallel outputs and the embedding"),
               t("all_reduce", 2 * L + 1, "backward: column-parallel input gradients")]
    out.append(_traffic("all_reduce", "tp", tp, 3, 3 * layout.tokens * FP32, "float32", "intra",
                        "forward: vocabulary-parallel cross-entropy (max, sum, target logit)", tp))
    return out


def _cp(card: ModelCard, layout: Layout) -> list:
    """Context parallelism's K and V exchange of one micro-batch on a stage."""
    if layout.cp == 1:
        return []
    L = stage_blocks(card, layout)[0]
    kv = 2 * layout.micro_batch * layout.seq * card.kv_width // layout.tp * layout.compute_bytes  # gathered K and V
    link, per_node = _group(layout, layout.cp, layout.tp)
    dtype = DTYPES[layout.precision]
    return [_traffic("all_gather", "cp", layout.cp, 2 * L, 2 * L * kv, dtype, link,
                     "context parallel: each layer's K and V, forward and backward", per_node),
            _traffic("reduce_scatter", "cp", layout.cp, L, L * kv, dtype, link,
                     "context parallel: each layer's K and V gradients", per_node)]


def _megatron(card: ModelCard, layout: Layout, opts: dict) -> StepTraffic:
    per_micro = _tp(card, layout, opts["ac_early_stop"]) + _cp(card, layout)
    mine = model_parallel_params(card, layout)
    r, rdtype = REDUCE_BYTES[opts["grad_reduce_dtype"]], DTYPES[opts["grad_reduce_dtype"]]
    group = layout.data_parallel * layout.cp
    link, per_node = _group(layout, group, layout.tp)
    bucket = megatron_bucket_params(layout) if opts["overlap_grad_reduce"] else math.ceil(mine)  # else one bucket
    calls = max(1, math.ceil(mine / bucket))
    if layout.distributed_optimizer:
        step = [_traffic("reduce_scatter", "dp", group, calls, int(mine * r), rdtype, link,
                         "gradient buckets (distributed optimizer)", per_node),
                _traffic("all_gather", "dp", group, calls, int(mine * layout.compute_bytes),
                         DTYPES[layout.precision], link, "updated parameters (distributed optimizer)", per_node)]
    else:
        step = [_traffic("all_reduce", "dp", group, calls, int(mine * r), rdtype, link, "gradient buckets", per_node)]
    return StepTraffic(tuple(per_micro), tuple(step), (bucket * r, bucket * r))


def card_traffic(card: ModelCard, layout: Layout, opts: dict) -> StepTraffic:
    """The step's collectives for the layout (groups of one rank included: place leaves them out);
    `opts`: the resolved options (frameworks.resolved)."""
    if layout.shards_parameters:
        t = _fsdp(card, layout, opts)
    elif layout.layout == "megatron":
        t = _megatron(card, layout, opts)
    else:
        t = _ddp(card, layout, opts)
    if layout.cp > 1 and layout.layout != "megatron":
        t = replace(t, per_micro=t.per_micro + tuple(_cp(card, layout)))
    return t


def p2p_seconds(card: ModelCard, layout: Layout, rates: Rates, scatter_gather: bool = False) -> tuple[float, float]:
    """Pipeline point-to-point per step on one rank: (the sends' seconds, one send's), each message
    priced as a 2-rank exchange on the link adjacent stages share (another node where the
    model-parallel group fills its node). With sequence parallelism each TP rank sends its own
    1 / tp of the activations; without it, `scatter_gather` (Megatron-LM's scatter/gather
    optimisation, Narayanan et al. 2021 section 4.1) sends 1 / tp from each TP rank too, then
    all-gathers the whole message over the receiving stage's TP ranks."""
    if layout.pp == 1:
        return 0.0, 0.0
    whole = layout.tokens * card.hidden * layout.compute_bytes
    split = layout.tp > 1 and (layout.sp or scatter_gather)
    msg = whole / (layout.tp if split else 1)
    link = "inter" if layout.tp * layout.cp * layout.pp > layout.gpus_per_node else "intra"
    one = rates.collective_seconds("all_gather", 2 * msg, 2, link, 1 if link == "inter" else 2)
    if split and not layout.sp:
        one += rates.collective_seconds("all_gather", whole, layout.tp, "intra", layout.tp)
    return 2 * p2p_messages(layout.pp, layout.vp, layout.grad_accum) * one, one


def place_card(traffic, rates: Rates, layout: Layout, bucket_caps: tuple[int, int], opts: dict) -> list[Collective]:
    """communication.place, then the overlaps the card's frameworks have that Echo's do not:
    shard_grad_op's block gathers all in forward (prefetched, the first exposed); TP overlap
    (Megatron's --tp-comm-overlap, NeMo's userbuffers) hides TP collectives behind the GEMMs of their
    phase (one call exposed, assumed); FSDP's gradients reduced once under PP run after the
    schedule, exposed; context parallelism's exchange overlaps the attention (its
    first call exposed); --overlap-param-gather prefetches the parameter all-gather in the forward
    (its first bucket exposed), without it the all-gather and, without --overlap-grad-reduce, the
    gradient reduction are on the critical path."""
    out = []
    for c in place(traffic, rates, bucket_caps):
        one = c.seconds / c.calls if c.calls else 0.0
        if c.what.endswith(AFTER_SCHEDULE):
            c = replace(c, overlaps="none", floor_s=c.seconds)
        elif "kept through backward" in c.what:
            c = replace(c, overlaps="forward", floor_s=one if c.overlaps == "backward" else 0.0)
        elif c.group == "tp" and opts["tp_comm_overlap"]:
            c = replace(c, overlaps="backward" if c.what.startswith("backward") else "forward", floor_s=one)
        elif c.group == "cp":
            c = replace(c, overlaps="backward" if c.op == "reduce_scatter" else "forward", floor_s=one)
        elif c.group == "dp" and layout.layout == "megatron":
            overlap = opts["overlap_param_gather"] if c.op == "all_gather" else opts["overlap_grad_reduce"]
            phase = "forward" if c.op == "all_gather" else "backward"
            c = replace(c, overlaps=phase, floor_s=one if c.overlaps == "backward" else 0.0) \
                if overlap else replace(c, overlaps="none", floor_s=c.seconds)
        out.append(c)
    return out
