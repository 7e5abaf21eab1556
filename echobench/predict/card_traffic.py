"""The collectives of one training step of a model card (card.py) on one rank, as
commvolume.Traffic (nccl-tests' message sizes, per_node filled), split into those every micro-batch
repeats and those once per step, and their placement (place_card: communication.place, then what the
card's frameworks overlap differently).

- FSDP (torch FSDP v1 through composer, llm-foundry's rows): a unit per block plus the root
  (embedding, positions, final norm). full_shard: each block's parameters all-gathered in the compute
  dtype in forward and again in backward, the root once (FSDP v1 does not reshard the root after
  forward); shard_grad_op: every unit gathered once, kept through backward; gradients reduce-scattered
  per unit in grad_reduce_dtype. All of it every micro-batch: composer's ddp_sync_context returns at
  once for a model that is not DistributedDataParallel (mosaicml/composer
  composer/distributed/dist_strategy.py, ddp_sync_context), so FSDP syncs every micro-batch. HSDP adds
  each unit's gradient shard all-reduced across the replicas (one rank a node). Once per step: the
  gradient norm's all-reduce (clipping).
- DDP (torch DDP): the gradients all-reduced in 25 MiB buckets (torch's bucket_cap_mb default) once
  per step (composer's SINGLE_AUTO_SYNC: no_sync but on the last micro-batch).
- Megatron-LM TP (a group within a node): without sequence parallelism, per layer the all-reduce of the
  two row-parallel outputs in forward and of the two column-parallel inputs' gradients in backward;
  with it, per layer 2 all-gathers and 2 reduce-scatters in forward, 4 all-gathers (2 of them the
  inputs re-gathered for the weight gradients) and 2 reduce-scatters in backward; the
  vocabulary-parallel embedding and LM head likewise; full AC repeats the forward's. Every micro-batch.
- Megatron-LM DP, once per step (forward_backward_no_pipelining runs all micro-batches but the last
  under no_sync: megatron/core/pipeline_parallel/schedules.py): the distributed optimizer's gradient
  reduce-scatter (fp32: --accumulate-allreduce-grads-in-fp32) and parameter all-gather (compute
  dtype) over buckets of max(40M, 1M x dp) parameters (training.py's default bucket_size with
  overlap_grad_reduce; one bucket without), else DDP's all-reduce of the gradients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from echobench.predict.card import (
    PRECISION_BYTES,
    Layout,
    ModelCard,
    card_params,
    layer_params,
    root_params,
    tp_split_params,
)
from echobench.predict.communication import Collective, place
from echobench.predict.pricing import Rates

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
TORCH_DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel bucket_cap_mb=25
FP32 = 4


@dataclass(frozen=True)
class StepTraffic:
    """A card step's collectives: `per_micro` repeat every micro-batch, `per_step` run once."""

    per_micro: tuple
    per_step: tuple
    bucket_caps: tuple[int, int]  # DDP's bucket caps in bytes (communication.place)


def _traffic(*args, **kwargs):
    from echobench.commvolume import Traffic  # imports torch: start-up time of `predict`

    return Traffic(*args, **kwargs)


def megatron_bucket_params(layout: Layout) -> int:
    """Megatron's DDP bucket with overlap_grad_reduce: max(40M, 1M x dp) parameters (megatron/training/
    training.py's default for DistributedDataParallelConfig.bucket_size; without overlap, one bucket)."""
    return max(40_000_000, 1_000_000 * layout.dp)


def _fsdp(card: ModelCard, layout: Layout) -> StepTraffic:
    hsdp = layout.layout == "hsdp"
    shard = layout.gpus_per_node if hsdp else layout.gpus
    link = "inter" if shard > layout.gpus_per_node else "intra"
    per_node = min(shard, layout.gpus_per_node)
    e, dtype = layout.compute_bytes, DTYPES[layout.precision]
    r, rdtype = PRECISION_BYTES[layout.grad_reduce_dtype], DTYPES[layout.grad_reduce_dtype]
    total = card_params(card, layout.seq)
    root, block = root_params(card, layout.seq), layer_params(card)
    L, twice = card.layers, layout.sharding == "full_shard"
    per_micro = [
        _traffic("all_gather", "dp_shard", shard, (2 if twice else 1) * L, (2 if twice else 1) * L * block * e,
                 dtype, link, "parameters of each block" + (", forward and backward" if twice else
                                                              ", gathered in forward, kept through backward"), per_node),
        _traffic("all_gather", "dp_shard", shard, 1, root * e, dtype, link,
                 "parameters of the root (embedding, final norm): once, kept from forward to backward", per_node),
        _traffic("reduce_scatter", "dp_shard", shard, L + 1, total * r, rdtype, link, "gradients of each unit",
                 per_node)]
    if hsdp and layout.nodes > 1:
        per_micro.append(_traffic("all_reduce", "dp_replicate", layout.nodes, L + 1, total * r // shard, rdtype,
                                  "inter", "gradient shards of each unit across the replicas", 1))
    per_step = [_traffic("all_reduce", "dp_shard", shard, 1, FP32, "float32", link,
                         "gradient norm (clipping)", per_node)]
    return StepTraffic(tuple(per_micro), tuple(per_step), (TORCH_DDP_BUCKET_BYTES, TORCH_DDP_BUCKET_BYTES))


def _ddp(card: ModelCard, layout: Layout) -> StepTraffic:
    r, rdtype = PRECISION_BYTES[layout.grad_reduce_dtype], DTYPES[layout.grad_reduce_dtype]
    grads = card_params(card, layout.seq) * r
    link = "inter" if layout.nodes > 1 else "intra"
    calls = max(1, math.ceil(grads / TORCH_DDP_BUCKET_BYTES))
    step = (_traffic("all_reduce", "dp", layout.gpus, calls, grads, rdtype, link, "gradient buckets",
                     min(layout.gpus, layout.gpus_per_node)),)
    return StepTraffic((), step, (TORCH_DDP_BUCKET_BYTES, TORCH_DDP_BUCKET_BYTES))


def _tp(card: ModelCard, layout: Layout) -> list:
    """Megatron's TP collectives of one micro-batch (the module docstring)."""
    tp, L = layout.tp, card.layers
    act = layout.micro_batch * layout.seq * card.hidden * layout.compute_bytes
    dtype = DTYPES[layout.precision]
    again = 2 if layout.ac == "full" else 1  # full AC re-runs the forward's collectives in backward

    def t(op: str, calls: int, what: str):
        return _traffic(op, "tp", tp, calls, calls * act, dtype, "intra", what, tp)

    if layout.sp:
        out = [t("all_gather", 2 * L * again + 1, "forward: sequence-parallel inputs of QKV, MLP up and the LM head"),
               t("reduce_scatter", 2 * L * again + 1, "forward: row-parallel outputs and the embedding"),
               t("all_gather", 4 * L + 2, "backward: output gradients, and the inputs re-gathered for weight gradients"),
               t("reduce_scatter", 2 * L + 1, "backward: column-parallel input gradients")]
    else:
        out = [t("all_reduce", 2 * L * again + 1, "forward: row-parallel outputs and the embedding"),
               t("all_reduce", 2 * L + 1, "backward: column-parallel input gradients")]
    tokens = layout.micro_batch * layout.seq
    out.append(_traffic("all_reduce", "tp", tp, 3, 3 * tokens * FP32, "float32", "intra",
                        "forward: vocabulary-parallel cross-entropy (max, sum, target logit)", tp))
    return out


def _megatron(card: ModelCard, layout: Layout) -> StepTraffic:
    per_micro = _tp(card, layout) if layout.tp > 1 else []
    n = card_params(card, layout.seq)
    split = tp_split_params(card)
    mine = n - split + split / layout.tp  # one TP rank's parameters
    r, rdtype = PRECISION_BYTES[layout.grad_reduce_dtype], DTYPES[layout.grad_reduce_dtype]
    link = "inter" if layout.nodes > 1 else "intra"
    per_node = max(1, min(layout.dp, layout.gpus_per_node // layout.tp))
    bucket = megatron_bucket_params(layout) if layout.overlap_grad_reduce else math.ceil(mine)  # else one bucket
    calls = max(1, math.ceil(mine / bucket))
    if layout.distributed_optimizer:
        step = [_traffic("reduce_scatter", "dp", layout.dp, calls, int(mine * r), rdtype, link,
                         "gradient buckets (distributed optimizer)", per_node),
                _traffic("all_gather", "dp", layout.dp, calls, int(mine * layout.compute_bytes),
                         DTYPES[layout.precision], link, "updated parameters (distributed optimizer)", per_node)]
    else:
        step = [_traffic("all_reduce", "dp", layout.dp, calls, int(mine * r), rdtype, link, "gradient buckets",
                         per_node)]
    return StepTraffic(tuple(per_micro), tuple(step), (bucket * r, bucket * r))


def card_traffic(card: ModelCard, layout: Layout) -> StepTraffic:
    """The step's collectives for the layout (groups of one rank included: place leaves them out)."""
    if layout.layout in ("fsdp", "hsdp") and layout.sharding != "no_shard":
        return _fsdp(card, layout)
    if layout.layout == "megatron":
        return _megatron(card, layout)
    return _ddp(card, layout)


def place_card(traffic, rates: Rates, layout: Layout, bucket_caps: tuple[int, int]) -> list[Collective]:
    """communication.place, then the overlaps the card's frameworks have that Echo's do not:
    shard_grad_op's block gathers all in forward (prefetched, the first exposed); Megatron's
    --tp-comm-overlap hides TP collectives behind the GEMMs of their phase (one call exposed, assumed);
    --overlap-param-gather prefetches the parameter all-gather in the forward (its first bucket
    exposed), without it the all-gather and, without --overlap-grad-reduce, the gradient reduction are
    on the critical path."""
    out = []
    for c in place(traffic, rates, bucket_caps):
        one = c.seconds / c.calls if c.calls else 0.0
        if "kept through backward" in c.what:
            c = replace(c, overlaps="forward", floor_s=one if c.overlaps == "backward" else 0.0)
        elif c.group == "tp" and layout.tp_comm_overlap:
            c = replace(c, overlaps="backward" if c.what.startswith("backward") else "forward", floor_s=one)
        elif c.group == "dp" and layout.layout == "megatron":
            overlap = layout.overlap_param_gather if c.op == "all_gather" else layout.overlap_grad_reduce
            phase = "forward" if c.op == "all_gather" else "backward"
            c = replace(c, overlaps=phase, floor_s=one if c.overlaps == "backward" else 0.0) \
                if overlap else replace(c, overlaps="none", floor_s=c.seconds)
        out.append(c)
    return out
