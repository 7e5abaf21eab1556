"""What `echobench calibrate --comm` measures on this process group, and the alpha-beta fit of
its collectives (echobench.calibrate.commcalibrate runs it all and assembles the hardware profile,
echobench.hardware.profile).

Collectives: all_reduce, all_gather (all_gather_into_tensor) and reduce_scatter
(reduce_scatter_tensor) of float32 messages from 1 KiB up to max_bytes (doubling; bounded by free
memory and a time budget), on the world and its sub-groups (plan_groups: intra-node groups of 2,
4, ... ranks of node 0; inter-node groups of one rank per node; the whole world when it spans
nodes). Each point is the mean of back-to-back calls after a warm-up, timed on the host around
device synchronisations, the slowest rank's (a collective ends when its last rank does), median of
REPEATS. Per link class, op and kind of group (ranks per node: one-rank-per-node groups apart from
the world's), fit_links fits time = alpha + bus_bytes / bus_bandwidth (fit_alpha_beta).

Compute, on every rank at once (training runs them at once: shared memory bandwidth, power) and
reported for the slowest rank: every GEMM shape of the runs' steps (gemm_work: the shapes
echobench.predict prices, forward and both backward GEMMs, in the runs' layouts; a card run's as
predict_card prices its card), their operands rotated through a working set as large as the
model's weights (not warm in the cache unless the model fits there), attention forward + backward
at the runs' lengths (the model's own SDPA call: a card's causal at its seq; FLOPs as
echobench.model.flops counts them), element-wise bandwidth (add, copy), AdamW steps over the
model's own parameter shapes (a card's decoder's), and the host's cost of a step's ops
(measure_host: tiny training steps whose device work is negligible, their ops counted).
"""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from echobench.backends import build_training, parallelism_problem
from echobench.backends.torchtitan import build_optimizer
from echobench.train.bench import train_step
from echobench.hardware.commfit import fit_alpha_beta, fit_links  # noqa: F401 - re-exported: callers fit from here
from echobench.hardware.traffic import param_units
from echobench.records.config import RunConfig
from echobench.records.layout import Layout
from echobench.data import build_tokenizer, make_loader
from echobench.model.flops import param_counts, speaker_patches
from echobench.hardware.device import GemmShape, precision_name, time_gemm
from echobench.hardware.profile import (
    OPS,
    AttentionPoint,
    CommPoint,
    GemmPoint,
    HostPoint,
    MemoryPoint,
)
from echobench.model.components import attention
from echobench.model.decoder import Decoder, decoder_attention
from echobench.model.echo import diffusion_draws
from echobench.predict import ADAMW_BYTES, rank_params, step_work

MIN_BYTES = 1024
REPEATS = 3  # timed repeats per point; the point is their median, the spread kept
TARGET_S = 0.02  # each repeat's back-to-back calls take about this long (at least MIN_ITERS calls)
MIN_ITERS, MAX_ITERS = 2, 50


# ---- groups ----

@dataclass(frozen=True)
class GroupPlan:
    ranks: tuple[int, ...]
    link: str  # intra: one node; inter: spans nodes
    per_node: int = 1  # the group's ranks on one node (its kind: one per node, or every rank of the nodes)


def _sizes_up_to(n: int) -> list[int]:
    """2, 4, 8, ... below n, and n itself (n >= 2)."""
    sizes, g = [], 2
    while g < n:
        sizes.append(g)
        g *= 2
    return sizes + ([n] if n >= 2 else [])


def plan_groups(node_of: Sequence[int]) -> list[GroupPlan]:
    """The groups to measure, from each rank's node index: intra-node groups of 2, 4, ... up to all
    of node 0's ranks; inter-node groups of the first rank of 2, 4, ... up to all nodes (one rank
    per node: the inter-node link alone); and the whole world when it spans nodes and nodes hold
    several ranks (how a data-parallel group of every rank runs). The world group is always the
    default group; sub-groups are new ones."""
    nodes = sorted(set(node_of))
    by_node = {n: [r for r, k in enumerate(node_of) if k == n] for n in nodes}
    first = by_node[nodes[0]]
    plans = [GroupPlan(tuple(first[:g]), "intra", g) for g in _sizes_up_to(len(first))]
    leaders = [by_node[n][0] for n in nodes]
    plans += [GroupPlan(tuple(leaders[:g]), "inter", 1) for g in _sizes_up_to(len(leaders))]
    if len(nodes) > 1 and len(node_of) > len(nodes):
        plans.append(GroupPlan(tuple(range(len(node_of))), "inter", max(len(r) for r in by_node.values())))
    return list(dict.fromkeys(plans))


def node_indices(world: int) -> list[int]:
    """Each rank's node: torchrun numbers ranks node by node, LOCAL_WORLD_SIZE per node (GROUP_RANK is
    the node's rank), so rank // LOCAL_WORLD_SIZE; without torchrun's variables, by hostname."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return [r // int(local) for r in range(world)]
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    order = list(dict.fromkeys(hosts))
    return [order.index(h) for h in hosts]


# ---- timing ----

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _buffers(op: str, nbytes: int, n: int, device: torch.device):
    # all_gather_into_tensor / reduce_scatter_tensor: newer torch names them *_single and warns;
    # torch 2.6 has only these names.
    """(the call, its actual message bytes): float32 buffers of the nccl-tests layout, the message
    rounded down to a multiple of n elements (all-gather / reduce-scatter split it in n)."""
    count = max(n, nbytes // 4 // n * n)
    full = torch.ones(count, device=device)
    if op == "all_reduce":
        return (lambda g: dist.all_reduce(full, group=g)), count * 4
    part = torch.ones(count // n, device=device)
    if op == "all_gather":
        return (lambda g: _quiet(dist.all_gather_into_tensor, full, part, group=g)), count * 4
    return (lambda g: _quiet(dist.reduce_scatter_tensor, part, full, group=g)), count * 4


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return fn(*args, **kwargs)


def time_collective(op: str, nbytes: int, group, device: torch.device) -> CommPoint:
    """One point: REPEATS repeats of back-to-back calls (as many as fill TARGET_S, from a timed
    warm-up call, the same on every rank), the mean per call of each repeat the slowest rank's.
    Call on every rank of `group`."""
    n = dist.get_world_size(group)
    call, actual = _buffers(op, nbytes, n, device)

    def timed(iters: int) -> float:
        dist.barrier(group=group)
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            call(group)
        _sync(device)
        spent = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX, group=group)  # ends when its slowest rank does
        return float(spent) / iters

    call(group)  # connection set-up and first-call costs stay out of the figures
    iters = int(min(MAX_ITERS, max(MIN_ITERS, TARGET_S / max(timed(2), 1e-7))))
    reps = [timed(iters) for _ in range(REPEATS)]
    return CommPoint(nbytes=actual, group_size=n, seconds=statistics.median(reps), seconds_min=min(reps),
                     seconds_max=max(reps), iters=iters)


def agree(value: float, device: torch.device, op=dist.ReduceOp.MAX) -> float:
    """The same number on every rank (the max unless `op` says otherwise), so that every rank takes
    the same branch and no collective waits for a rank that left."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


def free_bytes(device: torch.device) -> int:
    """Memory this process may take: the GPU's free memory, or MemAvailable shared among this node's
    processes on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    except OSError:
        pass
    return 2**31


def message_sizes(max_bytes: int, min_bytes: int = MIN_BYTES) -> list[int]:
    """min_bytes, doubling, up to max_bytes."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


def measure_collectives(plans: Sequence[GroupPlan], device: torch.device, max_bytes: int,
                        budget_s: float) -> dict[tuple[str, str, int], list[CommPoint]]:
    """Points per (link, op, ranks per node): every group of `plans` (all ranks call this; each sub-group is made
    on every rank, as new_group requires), each op, sizes ascending. Each (group, op) gets an equal
    share of what is left of budget_s; a sweep stops once its share is spent on any rank (all ranks
    stop together)."""
    rank = dist.get_rank()
    groups = [(p, dist.new_group(list(p.ranks)) if len(p.ranks) < dist.get_world_size() else None) for p in plans]
    sizes = message_sizes(max_bytes)
    points: dict[tuple[str, str, int], list[CommPoint]] = {}
    start, pairs = time.perf_counter(), [(g, op) for g in groups for op in OPS]
    for i, ((plan, group), op) in enumerate(pairs):
        share = (budget_s - (time.perf_counter() - start)) / (len(pairs) - i)
        began = time.perf_counter()
        for size in sizes:
            if rank in plan.ranks:
                point = time_collective(op, size, group, device).model_copy(update={"per_node": plan.per_node})
                points.setdefault((plan.link, op, plan.per_node), []).append(point)
            # Each rank's own clock says whether to go on; any rank that says stop stops them all.
            if agree(float(time.perf_counter() - began > share), device) > 0:
                break
    return points


WORKING_SET_CAP = 256 * 2**20  # bytes: beyond every last-level cache (H200 L2 50 MB; EPYC L3 32 MB per CCD)


def as_runs(runs) -> list:
    """One RunConfig or several: always a list."""
    return [runs] if hasattr(runs, "model_config") else list(runs)


@lru_cache(maxsize=32)
def _card_workload(spec: str):
    from echobench.predict.cards.run import run_card  # lazy: start-up time of `echobench --help`

    return run_card(spec)


def card_of(run):
    """A card run's (ModelCard, the Layout predict_card prices it at): its `card` read as `echobench
    run` reads it (cards.run.run_card) and its settings as validate measured lays a measured card run
    out (cards.run.measured_layout, the precision and compile the run takes on its device); None for
    an Echo run. PredictError for a card that is not there or not valid."""
    if getattr(run, "card", None) is None:
        return None
    from echobench.predict.cards.run import measured_layout  # lazy: as _card_workload

    workload = _card_workload(run.card)
    device = torch.device("cpu" if run.device == "cpu" else "cuda")
    return workload.card, measured_layout(run, workload.seq, precision_name(run.precision, device),
                                          run.compiled_on(device.type))


def card_matmuls(run) -> list:
    """The GEMMs (predict.work.Matmul) predict_card prices for one step of a card run at its own layout
    (card_work: the card's linears as torchtitan lays them out, TP splits, forward, both backward
    GEMMs and re-runs, the LM head)."""
    from echobench.predict.cards.work import card_work  # lazy: as _card_workload
    from echobench.predict.frameworks import framework

    card, layout = card_of(run)
    return list(card_work(card, layout, framework(layout.framework, layout.compile)).matmuls)


def gemm_layouts(run, local: int) -> list[tuple[str, int]]:
    """(framework, tp) whose GEMM shapes calibrate --comm times for `run`: its own layout, the
    torchtitan one (tp 1) and megatron at TP 1 and at the node's width (`local` ranks) where the
    heads divide, so that one profile prices every layout of the run's shapes on this node. A card
    run: its own layout alone (card_matmuls), the one predict prices it at."""
    if card_of(run) is not None:
        return [(run.framework, run.tp)]
    heads = run.model_config().heads
    layouts = [(run.framework, run.tp), ("torchtitan", 1), ("megatron", 1)]
    if local > 1 and heads % local == 0:
        layouts.append(("megatron", local))
    return list(dict.fromkeys(layouts))


def gemm_work(runs, local: int) -> list:
    """The distinct GEMMs (hardware.GemmShape, m x k @ (n x k)^T) of one training step of each run,
    forward, backward and recompute, as echobench.predict.step_work lists what it prices: every
    linear of the DiT, the speaker and text encoders and the conditioning, in each gemm_layouts
    layout; a card run's as predict_card prices them (card_matmuls). Named after the part and phase
    of their first appearance."""
    seen: dict[tuple[int, int, int], GemmShape] = {}
    for run in as_runs(runs):
        if card_of(run) is not None:
            for w in card_matmuls(run):
                seen.setdefault((w.m, w.n, w.k), GemmShape(f"{run.workload} {w.part} {w.phase} (tp{run.tp})",
                                                           w.m, w.n, w.k))
            continue
        for framework, tp in gemm_layouts(run, local):
            mm, _ = step_work(run.model_config(), framework, tp, run.micro_batch, run.audio_frames, run.text_tokens,
                              run.speaker_frames, run.ac)
            for w in mm:
                seen.setdefault((w.m, w.n, w.k), GemmShape(f"{w.part} {w.phase} ({framework} tp{tp})", w.m, w.n, w.k))
    return list(seen.values())


def run_params(run) -> float:
    """The parameters one rank of the run holds (predict's rank_params; a card run's at its layout)."""
    if hit := card_of(run):
        from echobench.predict.cards.card import rank_params as card_rank_params  # lazy: as _card_workload

        return card_rank_params(*hit)
    return rank_params(run)


def working_set_bytes(runs, dtype: torch.dtype) -> int:
    """The bytes a step streams between two uses of one weight (forward, then its backward): the
    largest run's weights on one rank (at the compute dtype), at most WORKING_SET_CAP. A small model
    stays in the cache between its matmuls, a large one does not."""
    elem = torch.empty((), dtype=dtype).element_size()
    return int(min(WORKING_SET_CAP, max(run_params(r) for r in as_runs(runs)) * elem))


def measure_gemms(device: torch.device, dtype: torch.dtype, runs, budget_s: float, local: int = 1) -> list[GemmPoint]:
    """Every GEMM shape of the runs' steps (gemm_work), smallest first, each timed with
    hardware.time_gemm within its share of the budget, rotating through operand sets as large as
    the step's weights (working_set_bytes: the operands are not warm in the cache unless the model
    fits there)."""
    gpu = device.type == "cuda"
    order = sorted(gemm_work(runs, local), key=lambda s: s.flops)
    working_set = working_set_bytes(runs, dtype)
    start, out = time.perf_counter(), []
    for i, s in enumerate(order):
        left = (budget_s - (time.perf_counter() - start)) / (len(order) - i)
        # CPU: 15 timed (within the budget): on a shared machine a median of 5 still moves by tens of percent
        rates = time_gemm(device, dtype, s, 50 if gpu else 15, 10 if gpu else 1, time_left_s=max(left, 1e-3),
                          working_set_bytes=working_set)
        out.append(GemmPoint(m=s.m, n=s.n, k=s.k, tflops=statistics.median(rates), tflops_min=min(rates),
                             tflops_max=max(rates), iters=len(rates), name=s.name, source=""))
    return out


class AttentionShape(NamedTuple):
    """One attention calibrate --comm times: batch x heads queries of head_dim, seq_q against seq_k
    keys; causal, and kv_heads: a card decoder's key / value heads (GQA), timed through its call
    (model.decoder.decoder_attention); 0: Echo's attention (model.components.attention)."""

    name: str
    batch: int
    heads: int
    head_dim: int
    seq_q: int
    seq_k: int
    causal: bool = False
    kv_heads: int = 0


def attention_shapes(run) -> list[AttentionShape]:
    """The run's attentions: the DiT's joint attention (audio-frame queries against audio + text +
    speaker-patch keys) and the speaker encoder's self-attention over the patches; a card run's
    decoder attention instead, as predict_card prices it (card_work: seq / cp queries against the
    card's seq keys, the card's causality and head_dim) at the run's micro-batch and the card's heads
    and kv_heads. The model's heads whatever the TP, as Echo's: predict finds a point by head_dim,
    causality and lengths, not heads, so that one point per length stands for every layout."""
    if hit := card_of(run):
        card, layout = hit
        return [AttentionShape(f"{run.workload} attention", layout.micro_batch, card.heads, card.head_dim,
                               layout.seq // layout.cp, layout.seq, card.causal, card.kv_heads)]
    m = run.model_config()
    p = speaker_patches(m, run.speaker_frames)
    return [AttentionShape("dit joint attention", run.micro_batch, m.heads, m.head_dim, run.audio_frames,
                           run.audio_frames + run.text_tokens + p),
            AttentionShape("speaker self-attention", run.micro_batch, m.speaker_heads,
                           m.speaker_width // m.speaker_heads, p, p)]


def attention_flops(batch: int, heads: int, head_dim: int, seq_q: int, seq_k: int) -> int:
    """Forward + backward FLOPs as echobench.model.flops counts them: scores and weighted values, 2 x 2 x
    seq_q x seq_k x head_dim per head forward, backward twice the forward."""
    return 3 * 2 * 2 * batch * heads * seq_q * seq_k * head_dim


def measure_attention(device: torch.device, dtype: torch.dtype, runs, budget_s: float) -> list[AttentionPoint]:
    """Forward + backward of the model's attention call at the runs' shapes (attention_shapes): Echo's
    model.components.attention (SDPA with the key-padding mask the model passes, every key valid), a
    card's model.decoder.decoder_attention (SDPA, causal where the card is, GQA)."""
    gpu = device.type == "cuda"
    out, shapes = [], list(dict.fromkeys(s for r in as_runs(runs) for s in attention_shapes(r)))
    gen = torch.Generator(device=device).manual_seed(0)
    for name, b, h, d, lq, lk, causal, kv in shapes:
        q = torch.randn(b, h, lq, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
        k, v = (torch.randn(b, kv or h, lk, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
                for _ in range(2))
        grad = torch.randn(b, h, lq, d, device=device, dtype=dtype, generator=gen)
        mask = torch.ones(b, lk, dtype=torch.bool, device=device)

        def step():
            (decoder_attention(q, k, v, causal) if kv else attention(q, k, v, mask)).backward(grad)
            q.grad = k.grad = v.grad = None

        seconds = _timed_calls(step, device, 30 if gpu else 15, 5 if gpu else 1, budget_s / len(shapes))
        rates = [attention_flops(b, h, d, lq, lk) / s / 1e12 for s in seconds]
        call = (f"model.decoder.decoder_attention, {'causal' if causal else 'non-causal'}"
                + (f", {h} query heads over {kv} key / value heads" if kv != h else "")) if kv else \
            "model.components.attention, key mask"
        out.append(AttentionPoint(batch=b, heads=h, head_dim=d, seq_q=lq, seq_k=lk, causal=causal,
                                  tflops=statistics.median(rates), tflops_min=min(rates), tflops_max=max(rates),
                                  iters=len(rates), name=name, source=call))
    return out


def _timed_calls(fn, device: torch.device, iters: int, warmup: int, budget_s: float) -> list[float]:
    """Seconds of each of up to `iters` calls of fn after `warmup` (fewer when the budget, estimated
    from the warm-up, is short; at least one): CUDA events per call on GPU, the host clock on CPU."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    _sync(device)
    if warmup:
        iters = max(1, min(iters, int(budget_s / max((time.perf_counter() - t0) / warmup, 1e-9))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in events:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        return [a.elapsed_time(b) / 1e3 for a, b in events]
    seconds = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t)
    return seconds


def measure_memory(device: torch.device, nbytes: int, budget_s: float) -> list[MemoryPoint]:
    """Element-wise bandwidth over float32 tensors of nbytes: c = a + b (3 x nbytes moved) and
    c.copy_(a) (2 x nbytes)."""
    n = nbytes // 4
    a, b, c = (torch.ones(n, device=device) for _ in range(3))
    out = []
    for op, moved, fn in (("add", 3 * n * 4, lambda: torch.add(a, b, out=c)), ("copy", 2 * n * 4, lambda: c.copy_(a))):
        seconds = _timed_calls(fn, device, 20, 3 if device.type == "cuda" else 1, budget_s / 2)
        rates = [moved / s / 1e9 for s in seconds]
        out.append(MemoryPoint(op=op, nbytes=n * 4, gbps=statistics.median(rates), gbps_min=min(rates),
                               gbps_max=max(rates), iters=len(rates), source=""))
    return out


ADAMW_STATE_BYTES = 24  # per float32 parameter while AdamW steps: p, grad, exp_avg, exp_avg_sq, foreach temporaries


def param_shapes(run) -> list[tuple[int, ...]]:
    """The run's trainable parameter shapes, registration order: Echo's (traffic.param_units), a
    card's decoder's (model.decoder.Decoder, built on the meta device: no memory, no weights)."""
    if hit := card_of(run):
        with torch.device("meta"):
            model = Decoder(hit[0], hit[1].seq)
        return [tuple(p.shape) for p in model.trainable_parameters()]
    return [s for u in param_units(run.model_config()) for s in u.shapes]


def adamw_shapes(runs, device: torch.device) -> list[tuple[int, ...]]:
    """The trainable parameter shapes of the run with the most (param_shapes: the model's own,
    registration order), the first as many as this process's free memory holds at
    ADAMW_STATE_BYTES each: all of them wherever the run's own training fits. The whole count
    matters: the rate falls with the size (a CPU's page faults of the step's fresh temporaries)."""
    def trainable(run) -> int:
        return sum(map(math.prod, param_shapes(run))) if card_of(run) else param_counts(run.model_config()).trainable

    shapes, room = [], free_bytes(device) // ADAMW_STATE_BYTES
    for shape in param_shapes(max(as_runs(runs), key=trainable)):
        room -= math.prod(shape)
        if room < 0 and shapes:
            break
        shapes.append(shape)
    return shapes


def measure_adamw(device: torch.device, shapes: Sequence[tuple[int, ...]], budget_s: float) -> MemoryPoint:
    """The optimizer's rate as a bandwidth: steps of the backends' AdamW (torchtitan.build_optimizer:
    foreach on CPU, fused on GPU) over float32 parameters of these shapes, each step's bytes those
    echobench.predict counts for it (predict.ADAMW_BYTES per parameter). As in training, every
    step meets gradients freshly allocated (backward makes new ones after zero_grad(set_to_none))
    and the first step, which allocates the state, is not timed. Its passes (lerp, addcmul, sqrt,
    div, ...) run slower than one add, and over a model's hundreds of tensors slower than over a
    few: the add's bandwidth, or a few small tensors, would understate the optimizer's time."""
    params = [torch.nn.Parameter(torch.full(shape, 0.02, device=device)) for shape in shapes]
    numel = sum(p.numel() for p in params)
    optimizer = build_optimizer(params, device)

    def step():
        for p in params:
            p.grad = torch.empty_like(p).fill_(1e-4)  # as backward leaves it: new memory, written once
        _sync(device)
        began = time.perf_counter()
        optimizer.step()
        _sync(device)
        seconds = time.perf_counter() - began
        optimizer.zero_grad(set_to_none=True)
        return seconds

    step()  # allocates exp_avg / exp_avg_sq
    seconds, began = [], time.perf_counter()
    while len(seconds) < 10 and (not seconds or time.perf_counter() - began < budget_s):
        seconds.append(step())
    per_param = ADAMW_BYTES["fused" if device.type == "cuda" else "foreach"]
    rates = [per_param * numel / s / 1e9 for s in seconds]
    return MemoryPoint(op="adamw", nbytes=numel * 4, gbps=statistics.median(rates), gbps_min=min(rates),
                       gbps_max=max(rates), iters=len(rates), source="")


# The host step: the tiny preset at the shortest lengths, where the step is (almost) all host cost.
HOST_RUN = {"scale": "tiny", "micro_batch": 1, "audio_frames": 16, "text_tokens": 8, "speaker_frames": 16}
# CPU: a reference step beside it, mostly compute: what a step of measured kernels takes, a check on
# the compute predict prices from the same profile (a check only: no factor is fitted to it).
REFERENCE_RUN = {"scale": "tiny", "micro_batch": 8, "audio_frames": 64, "text_tokens": 16, "speaker_frames": 32}


class OpCount:
    """ATen ops dispatched while a count_ops() block runs (views included), in all and per name."""

    def __init__(self):
        self.total = 0
        self.by_name: Counter = Counter()


def count_ops():
    """A dispatch mode counting every ATen op it sees (on this thread and on autograd's, which
    carries the mode): forward, backward and optimizer ops alike. Its own Python cost per op makes
    the block slower: count in a step that is not timed."""
    class _Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = OpCount()

        def __enter__(self):
            super().__enter__()
            return self.count

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not isinstance(func, torch._ops.HigherOrderOperator):
                self.count.total += 1
                self.count.by_name[func._schema.name] += 1
            return func(*args, **(kwargs or {}))

    return _Counting()


def host_steps(cfg, info, dtype: torch.dtype, warmup: int, iters: int, budget_s: float):
    """(seconds of each timed step, ops of one step on this rank) of training steps of `cfg` (a
    RunConfig whose layout fits the formed process group, `info` this rank's DistInfo): the
    backend's setup and the run's data and draws (bench.train_step), `warmup` untimed steps, up to
    `iters` timed ones within budget_s (at least one; every rank stops with the slowest), then one
    step under count_ops()."""
    setup = build_training(cfg, info, dtype)
    model_cfg = cfg.model_config()
    dp_size = max(1, cfg.world_size // cfg.tp)
    loader = make_loader("synthetic", micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None),
                         rank=info.rank // cfg.tp if cfg.world_size > 1 else 0, world_size=dp_size,
                         seed=cfg.seed, skip_bad_samples=False)
    generator = torch.Generator(device=info.device)
    setup.model.train()
    grouped = cfg.world_size > 1

    def step():
        batch = next(loader)
        ids = batch.index.tolist()
        batch = batch.to(info.device)
        draws = diffusion_draws(cfg.seed, ids, cfg.audio_frames, model_cfg.latent_dim, model_cfg.cfg_dropout,
                                info.device, generator)
        train_step(setup, [(batch, draws)], info.device.type, dp_size)

    try:
        for _ in range(warmup):
            step()
        seconds, start = [], time.perf_counter()
        while len(seconds) < iters:
            _sync(info.device)
            t = time.perf_counter()
            step()
            _sync(info.device)
            seconds.append(time.perf_counter() - t)
            over = float(time.perf_counter() - start > budget_s)
            if (agree(over, info.device) if grouped else over) > 0:
                break
        with count_ops() as count:
            step()
    finally:
        loader.close()
    return seconds, count.total


def host_layouts(world: int, local: int) -> list[tuple[str, str]]:
    """(framework, parallelism) of the layouts whose host cost calibrate --comm measures on a group of
    `world` ranks, `local` per node: single always; with several ranks DDP and FSDP2 over all of
    them, and megatron TP over a node's ranks where megatron-core imports."""
    layouts = [("torchtitan", "single")]
    if world > 1:
        layouts += [("torchtitan", "ddp"), ("torchtitan", "fsdp2")]

        if local > 1 and importlib.util.find_spec("megatron") is not None:
            for tp in dict.fromkeys(t for t in (local, 4, 2) if t <= local):  # the widest TP the tiny heads allow
                layout = Layout.tensor(tp)
                run = RunConfig(**HOST_RUN, framework=layout.framework, parallelism=layout.name, gpus_per_node=local,
                                nodes=max(1, world // local))
                if parallelism_problem(run) is None:
                    layouts.append((layout.framework, layout.name))
                    break
    return layouts


def measure_host(info, dtype: torch.dtype, budget_s: float, local: int,
                 seconds_out: dict | None = None) -> list[HostPoint]:
    """The host's cost of a step's ops per layout (host_layouts): host_steps of HOST_RUN (tiny,
    micro-batch 1, 16 audio frames) whose device work is a few matmuls of 16 rows, so that the step
    is Python, dispatch, autograd, the layout's hooks and collectives and (GPU) kernel launches;
    echobench.predict spreads what its model does not account for over the step's ops. Each point:
    this rank's steps (calibrate_comm keeps the slowest rank's); `seconds_out`, where given, gets each
    layout's timed steps by parallelism (step_jitter reads the single layout's). Call on every rank."""
    gpu = info.device.type == "cuda"
    steps = [(HOST_RUN, layout) for layout in host_layouts(info.world_size, local)]
    if not gpu:
        steps.append((REFERENCE_RUN, ("torchtitan", "single")))
    out = []
    for shape, (framework, parallelism) in steps:
        single = Layout.parse(parallelism).single
        world = 1 if single else info.world_size
        nodes = 1 if single else max(1, world // local)
        run = RunConfig(**shape, framework=framework, parallelism=parallelism, device=info.device.type,
                        nodes=nodes, gpus_per_node=world // nodes)
        seconds, ops = host_steps(run, info, dtype, 5 if gpu else 3, 30 if gpu else 15, budget_s / len(steps))
        if seconds_out is not None and shape is HOST_RUN:
            seconds_out[parallelism] = list(seconds)
        out.append(HostPoint(**shape, framework=framework, parallelism=parallelism, processes=world, ops=ops,
                             step_s=statistics.median(seconds), step_s_min=min(seconds), step_s_max=max(seconds),
                             iters=len(seconds), source=""))
    return out


def step_jitter(per_rank: Sequence[Sequence[float]]) -> float | None:
    """The relative spread of a rank's steps (hwprofile.StepJitter.cv): each rank's step times over
    their own median, less 1, pooled over the ranks, their root mean square (None: under two steps on
    every rank). Each rank's own median, so that a rank slower throughout is not counted as jitter."""
    deviations = [s / statistics.median(steps) - 1 for steps in per_rank if len(steps) >= 2 for s in steps]
    return math.sqrt(sum(d * d for d in deviations) / len(deviations)) if deviations else None


def slowest(per_rank: list[list], key: str) -> list:
    """Per point (same index on every rank), the rank whose median is lowest: the pace of a job."""
    return [min(points, key=lambda p: getattr(p, key)) for points in zip(*per_rank)]
