"""NCCL's own cost model of a collective, as its tuner prices every call to pick an algorithm and a
protocol (src/graph/tuning.cc of github.com/NVIDIA/nccl at commit
5067397c2676d5aed50042fc39e5c8ee96eb0027, 2026-06-11: ncclTunerConstantsDefaults,
ncclTopoTuneModel, ncclTopoGetAlgoTime):

- latency (us) = baseLat[algorithm][protocol] + the steps' hardware latencies: a ring takes
  2(n-1) steps for all-reduce and n-1 for all-gather / reduce-scatter, 2(nodes-1) (all-reduce) or
  nodes-1 of them across the network (hwLat NET, the rest hwLat NVLINK, at least the network
  overhead per step once the ring leaves the node); a tree (all-reduce only) 2 x ((ranks per node
  - 1) NVLink hops + floor(log2 nodes) network hops). One rank per node: the network hop takes
  the tree's network latency whatever the algorithm (NCCL: "latencies are fully exposed").
- bandwidth: the bus bandwidth of the link, times per-protocol factors (ring LL 0.5, capped by
  llMaxBw; LL128 0.92; tree 0.92, LL 1/3.8, LL128 120/128 across nodes, 7/9 within one); a ring
  moves the nccl-tests bus bytes, a tree twice the message (algorithm bandwidth = busBw x 0.5).

ncclTopoGetAlgoTime's refinements are in: the tree's per-size bandwidth correction
(treeCorrectionFactor) and the ring's 1.4x latency plateau for multi-node Simple all-reduces of at
least 64 bytes per channel and rank (the channel count: RING_CHANNELS, assumed). NVLink SHARP
(NVLS) all-reduce within one NVSwitch node: latency hwLat NVLINK NVLS (25 us, no base), at the
link's bus bandwidth. Left out, so slightly optimistic where they bite: per-channel bandwidth caps
(perChMax*), NVLS across nodes (NVLS tree), CollNet, PAT (one-rank-per-node all-gathers), and the
pipelining of several calls in one group (each call pays its latency).
"""

from __future__ import annotations

from dataclasses import dataclass

PROTOCOLS = ("LL", "LL128", "Simple")
# baseLatencies (us)
BASE_LATENCY_US = {"tree": {"LL": 6.8, "LL128": 14.0, "Simple": 8.4},
                   "ring": {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}, "nvls": {"Simple": 0.0}}
# hwLatencies (us per step), NVLINK and NET rows
HOP_LATENCY_US = {"nvlink": {"tree": {"LL": 0.6, "LL128": 1.25, "Simple": 4.0},
                             "ring": {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}, "nvls": {"Simple": 25.0}},
                  "net": {"tree": {"LL": 5.0, "LL128": 8.5, "Simple": 14.0},
                          "ring": {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}}}
# getNetOverhead: 1.0 us on Intel and non-x86 (Grace) hosts (AMD: 2.0), x3 under Simple; the
# network plugin's own latency (graph latencyInter) is 0 for NCCL's IB and socket transports.
NET_OVERHEAD_US = 1.0
# llMaxBws (GB/s): one node, Hopper: 141; across nodes (Intel and other CPUs): 39 on 2 nodes, 20.4 beyond
LL_MAX_GBPS = {1: 141.0, 2: 39.0, 3: 20.4}
# treeCorrectionFactor[protocol][log2(bytes / 64)], 64 B .. 256 MiB (tree all-reduce bandwidth)
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
}
RING_PLATEAU = 1.4  # the ring's Simple latency factor for multi-node all-reduce (compute capability >= 8.0)
RING_CHANNELS = 32  # assumed: the channels a multi-node ring runs on (NCCL takes 16-32 on 8-NIC nodes; MAXCHANNELS 64)


@dataclass(frozen=True)
class Choice:
    """One call as NCCL's tuner would run it: `algorithm` and `protocol`, its latency and the bus
    bandwidth (nccl-tests' bus bytes per second / 1e9) the message moves at."""

    algorithm: str
    protocol: str
    latency_s: float
    bus_gbps: float
    seconds: float


def _log2i(n: int) -> int:
    return max(0, n.bit_length() - 1)


def algorithms(op: str, nvls: bool = False) -> tuple[str, ...]:
    """The algorithms modelled for `op`: ring, and for all-reduce tree and (`nvls`: within one
    NVSwitch node) NVLink SHARP."""
    if op != "all_reduce":
        return ("ring",)
    return ("ring", "tree", "nvls") if nvls else ("ring", "tree")


def protocols(algorithm: str) -> tuple[str, ...]:
    return ("Simple",) if algorithm == "nvls" else PROTOCOLS


def latency_us(op: str, algorithm: str, protocol: str, ranks: int, nodes: int, net_us: float | None = None) -> float:
    """NCCL's latency (us) of one call of `op` on `ranks` ranks over `nodes` nodes; `net_us`: the
    latency of a step across the network where measured (a profile's topology), else NCCL's."""
    ppn = max(1, ranks // nodes)
    intra = HOP_LATENCY_US["nvlink"][algorithm][protocol]
    if algorithm == "nvls":  # one node: NCCL's latency is the NVLink hop alone (no base)
        return intra
    inter = net_us if net_us is not None else HOP_LATENCY_US["net"]["tree" if ppn == 1 else algorithm][protocol]
    base = BASE_LATENCY_US[algorithm][protocol]
    if algorithm == "tree":
        return base + 2 * ((ppn - 1) * intra + _log2i(nodes) * inter)
    steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
    inter_steps = 0 if nodes == 1 else 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
    return base + (steps - inter_steps) * intra + inter_steps * inter


def protocol_gbps(algorithm: str, protocol: str, bus_gbps: float, nodes: int) -> float:
    """The bus bandwidth a protocol reaches of the link's `bus_gbps` (Simple's, what nccl-tests
    measure at large messages)."""
    cap = LL_MAX_GBPS[min(nodes, 3)]
    if algorithm == "nvls":  # assumed: the link's fit is NVLS's own (the HGX profiles' intra all-reduce)
        return bus_gbps
    if algorithm == "ring":
        return {"LL": min(cap, bus_gbps * 0.5), "LL128": bus_gbps * 0.92, "Simple": bus_gbps}[protocol]
    tree = bus_gbps * 0.92
    return {"LL": min(tree / 3.8, cap), "LL128": tree * (7 / 9 if nodes == 1 else 120 / 128), "Simple": tree}[protocol]


def cheapest(op: str, nbytes: float, ranks: int, nodes: int, bus_gbps: float, bus_bytes: float,
             nvls: bool = False, net_us: float | None = None) -> Choice:
    """The algorithm and protocol NCCL's tuner would take for a message of `nbytes` (bus_bytes:
    nccl-tests' bus bytes of it on `ranks` ranks), each priced latency + bytes / bandwidth; `nvls`:
    NVLink SHARP is there (one NVSwitch node); `net_us`: latency_us'."""
    best = None
    log_size = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    plateau = op == "all_reduce" and nodes > 1 and nbytes / (RING_CHANNELS * ranks) >= 64
    for algorithm in algorithms(op, nvls):
        moved = 2 * nbytes if algorithm == "tree" else bus_bytes  # a tree: algorithm bandwidth = bus x 0.5
        for protocol in protocols(algorithm):
            gbps = protocol_gbps(algorithm, protocol, bus_gbps, nodes)
            lat = latency_us(op, algorithm, protocol, ranks, nodes, net_us) * 1e-6
            if algorithm == "tree" and 0 <= log_size < 23:
                gbps *= TREE_CORRECTION[protocol][log_size]
            if algorithm == "ring" and protocol == "Simple" and plateau:
                lat *= RING_PLATEAU
            seconds = lat + moved / (gbps * 1e9)
            if best is None or seconds < best.seconds:
                best = Choice(algorithm, protocol, lat, bus_bytes / (moved / gbps) if moved else gbps, seconds)
    return best


def least_latency_s(op: str, ranks: int, nodes: int, nvls: bool = False, net_us: float | None = None) -> float:
    """NCCL's smallest latency of a call (a message of no bytes takes its cheapest algorithm and protocol)."""
    return min(latency_us(op, a, p, ranks, nodes, net_us) for a in algorithms(op, nvls) for p in protocols(a)) * 1e-6
