"""How a step's collectives are priced and placed: traffic.step_bytes of the run, each priced
by its group's size and kind (Rates.collective_cost: the fit of the group's ranks per node, the
links it can use, NCCL's latency at its size) and placed where it can hide (Collective:
forward, backward or on the critical path, with its unhideable floor); exposed, the part compute
cannot cover; link_bytes and hide_gbps, the traffic per link class and the bandwidth that hides it.
The placement rules are in echobench.predict's docstring."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from echobench.records.config import RunConfig
from echobench.hardware.profile import bus_factor
from echobench.hardware.traffic import TORCHTITAN_DDP_BUCKET_BYTES, megatron_ddp_bucket_bytes, step_bytes
from echobench.predict.pricing import Rates, is_cpu


@dataclass(frozen=True)
class Collective:
    """One kind of collective of the step, priced: where it can hide (forward, backward or nowhere)
    and how much of it cannot (`floor_s`: a first all-gather, a last bucket or reduce-scatter)."""

    what: str
    op: str
    group: str
    group_size: int
    link: str
    calls: int
    nbytes: int
    bus_bytes: float
    alpha_s: float  # the latency per call at this group (the fit's fixed part + NCCL's hops)
    bus_gbps: float  # the bus bandwidth it moves at (the fit's, scaled to the links the group can use)
    seconds: float
    overlaps: str  # forward, backward, none
    floor_s: float
    per_node: int = 1  # the group's ranks on one node
    algorithm: str = "alpha-beta"  # ring / tree as NCCL's tuner picks (hwprofile.CollectiveCost)
    once: bool = False  # once per optimizer step (traffic.Traffic.once), not per micro-batch


def _bucket_caps(cfg: RunConfig) -> tuple[int, int]:
    """The byte caps of DDP's first and further buckets in the run's backend (hardware.traffic's)."""
    return megatron_ddp_bucket_bytes(cfg) if cfg.framework == "megatron" else TORCHTITAN_DDP_BUCKET_BYTES


def _last_bucket(total: int, calls: int, first_cap: int, cap: int) -> int:
    """The bytes of DDP's last bucket: what is left after the first and the full ones
    (traffic.ddp_buckets fills them in the order the gradients become ready)."""
    if calls <= 1:
        return total
    left = total - first_cap - (calls - 2) * cap
    return left if 0 < left <= cap else cap


@lru_cache(maxsize=4096)
def _traffic(cfg_key: tuple, device: str):
    return tuple(step_bytes(RunConfig(**dict(cfg_key)), device))


def collectives(cfg: RunConfig, rates: Rates) -> list[Collective]:
    """traffic.step_bytes of an Echo run, priced and placed (place)."""
    key = tuple(sorted((k, v) for k, v in cfg.to_dict().items() if k not in ("repeat", "seed", "steps", "warmup_steps")))
    return place(_traffic(key, "cpu" if is_cpu(rates.profile) else "cuda"), rates, _bucket_caps(cfg))


def place(traffic, rates: Rates, bucket_caps: tuple[int, int]) -> list[Collective]:
    """A step's collectives (traffic.Traffic, groups of one rank left out), whatever model they
    are of, priced and placed (echobench.predict's docstring); `bucket_caps`: DDP's first and further
    bucket caps in bytes."""
    out = []
    for t in traffic:
        if t.group_size <= 1 or t.nbytes <= 0:
            continue
        cost = rates.collective_cost(t.op, t.nbytes / t.calls, t.group_size, t.link, t.per_node)
        one = cost.seconds
        if t.group == "tp" or (t.op == "all_reduce" and t.group == "dp_shard"):
            parts = [(t.calls, "none", t.calls * one)]  # TP activations, the gradient norm: on the critical path
        elif t.dtype == "int64":
            parts = [(t.calls, "forward", 0.0)]  # the frame count: started before the forward, waited after it
        elif t.op == "all_gather" and "once" in t.what:
            parts = [(t.calls, "forward", t.calls * one)]  # the root's: gathered before anything can run
        elif t.op == "all_gather":  # each block's, prefetched: in forward (the root's goes first) and in backward
            parts = [(t.calls // 2, "forward", 0.0), (t.calls - t.calls // 2, "backward", one)]
        elif t.op == "all_reduce" and t.group == "dp":  # DDP's buckets: the last one waits for the backward's end
            last = _last_bucket(t.nbytes, t.calls, *bucket_caps)
            parts = [(t.calls, "backward", rates.collective_seconds(t.op, last, t.group_size, t.link, t.per_node))]
        else:  # FSDP2's reduce-scatters, HSDP's replica all-reduce: the last unit's waits
            parts = [(t.calls, "backward", one)]
        for calls, overlaps, floor in parts:
            nbytes = t.nbytes * calls // t.calls
            out.append(Collective(t.what, t.op, t.group, t.group_size, t.link, calls, nbytes,
                                  bus_factor(t.op, t.group_size) * nbytes, cost.alpha_s, cost.bus_gbps, calls * one,
                                  overlaps, min(floor, calls * one), t.per_node, cost.algorithm, t.once))
    return out


def exposed(comm: Sequence[Collective], windows: dict[str, float]) -> dict[str, float]:
    """Exposed seconds per overlap class: the critical-path collectives whole; per phase, the
    unhideable floors plus whatever of the rest the phase's compute (windows[phase]) cannot cover."""
    out = {"none": sum(c.seconds for c in comm if c.overlaps == "none")}
    for phase in ("forward", "backward"):
        mine = [c for c in comm if c.overlaps == phase]
        floors = sum(c.floor_s for c in mine)
        out[phase] = floors + max(0.0, sum(c.seconds for c in mine) - floors - windows[phase])
    return out


def accumulated(comm: Sequence[Collective], micro_batches: int) -> list[Collective]:
    """A step of `micro_batches` micro-batches: the collectives of each micro-batch that many times
    (activations, FSDP2's gathers, the frame count), those once per step (Collective.once: the
    gradients' reductions, the norms) once."""
    n = micro_batches
    return [c if c.once or n == 1 else replace(c, calls=c.calls * n, nbytes=c.nbytes * n, bus_bytes=c.bus_bytes * n,
                                                seconds=c.seconds * n, floor_s=c.floor_s * n) for c in comm]


def exposed_accumulated(comm: Sequence[Collective], windows: dict[str, float], micro_batches: int) -> dict[str, float]:
    """exposed() of a step of `micro_batches` micro-batches (`comm` and `windows` of one): each
    micro-batch's collectives against its own phases, that many times; the once-per-step ones against
    the last micro-batch's (gradient accumulation syncs the gradients in the last backward only)."""
    if micro_batches == 1:
        return exposed(comm, windows)
    every = exposed([c for c in comm if not c.once], windows)
    last = exposed([c for c in comm if c.once], windows)
    return {k: micro_batches * every[k] + last[k] for k in every}


def link_bytes(comm: Sequence[Collective]) -> dict[str, dict[str, float]]:
    """Per link class: the message bytes (nccl-tests' sizes) and bus bytes one rank's collectives move per step."""
    out: dict[str, dict[str, float]] = {}
    for c in comm:
        row = out.setdefault(c.link, {"bytes": 0.0, "bus_bytes": 0.0})
        row["bytes"] += c.nbytes
        row["bus_bytes"] += c.bus_bytes
    return out


def hide_gbps(comm: Sequence[Collective], windows: dict[str, float]) -> dict[str, float | None]:
    """Per link class, the bus bandwidth (GB/s) at which its overlappable collectives take no longer
    than the compute they overlap: the largest over the phases of bus bytes / (the phase's compute -
    their latencies). None: nothing on that link can overlap (TP, the gradient norm); inf: the
    latencies alone exceed the compute."""
    out: dict[str, float | None] = {}
    for link in dict.fromkeys(c.link for c in comm):
        need = None
        for phase, window in windows.items():
            mine = [c for c in comm if c.link == link and c.overlaps == phase and c.bus_bytes > 0]
            if not mine:
                continue
            left = window - sum(c.calls * c.alpha_s for c in mine)
            rate = math.inf if left <= 0 else sum(c.bus_bytes for c in mine) / left / 1e9
            need = rate if need is None else max(need, rate)
        out[link] = need
    return out
