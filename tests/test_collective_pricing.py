"""Collective pricing (hwprofile.collective_cost, echobench.hardware.nccltuning, commbench.fit_links): a group
priced by the links its ranks can use (a one-rank-per-node group by one NIC, a pair of pairwise-wired
GPUs by its own links), its latency grown with the group as NCCL's tuner grows it (ring hops, tree at
many nodes), and calibrate's fits kept apart by the kind of group. Figures come from the shipped
profiles or set ones; the assertions are properties, not measured times."""

from __future__ import annotations

import random

import pytest

from echobench.hardware import nccltuning as nt
from echobench import predict as pr
from echobench.hardware.commfit import fit_links
from echobench.records.config import RunConfig
from echobench.hardware.profile import (
    OPS,
    AlphaBeta,
    CommPoint,
    HardwareProfile,
    bus_factor,
    collective_cost,
    collective_seconds,
    load_profile,
    shipped_profiles,
)

GIB = 2**30


def shipped(name: str) -> HardwareProfile:
    return load_profile(shipped_profiles()[name])


# ---- the links a group can use ----

@pytest.mark.parametrize("name", ["h100-hgx-ib", "gh200-quad-slingshot"])
def test_a_one_rank_per_node_group_gets_one_nic_and_a_group_of_every_rank_the_nodes_all(name):
    """All-gather (NCCL's ring) of a large message (8 GiB: Simple's full bandwidth outweighs its
    hop latency) moves at the bus bandwidth of the NICs the group can use: all the node's for a
    group of every rank, one for a group of one rank per node."""
    profile = shipped(name)
    fit, nics = profile.links["inter"]["all_gather"], profile.topology.nics_per_node
    assert nics == profile.gpus_per_node  # one NIC per GPU on these nodes (the profiles' topology source)
    nodes = 16
    one = collective_cost(profile, "all_gather", 8 * GIB, nodes, "inter", per_node=1)
    every = collective_cost(profile, "all_gather", 8 * GIB, nodes * nics, "inter", per_node=nics)
    assert every.bus_gbps == pytest.approx(fit.bus_gbps)
    assert one.bus_gbps == pytest.approx(fit.bus_gbps / nics)
    assert one.seconds > every.seconds * nics / 2  # the same bytes per rank, through one NIC
    half = collective_cost(profile, "all_gather", 8 * GIB, nodes * nics // 2, "inter", per_node=nics // 2)
    assert half.bus_gbps == pytest.approx(fit.bus_gbps / 2)


def test_a_gh200_pair_gets_its_own_nvlink_links_not_the_whole_gpus():
    """GH200 quad nodes wire their 4 GPUs pairwise (no NVSwitch): a TP=2 pair uses one of each GPU's
    three peers' links; an HGX node's NVSwitch gives any pair the whole."""
    gh, hgx = shipped("gh200-quad-slingshot"), shipped("h100-hgx-ib")
    fit = gh.links["intra"]["all_reduce"]
    assert gh.topology.nvlink == "direct" and hgx.topology.nvlink == "switch"
    assert collective_cost(gh, "all_reduce", GIB, 2, "intra").bus_gbps == pytest.approx(fit.bus_gbps / 3)
    assert collective_cost(gh, "all_reduce", GIB, 4, "intra").bus_gbps == pytest.approx(fit.bus_gbps)
    assert collective_cost(hgx, "all_reduce", GIB, 2, "intra").bus_gbps == pytest.approx(
        hgx.links["intra"]["all_reduce"].bus_gbps)


def test_hsdp_at_64_gh200_nodes_does_not_outrank_fsdp2_by_taking_the_whole_nodes_nics():
    """8B on 64 GH200 quad nodes: HSDP's replica all-reduce runs one rank per node (4 groups at
    once, one NIC each). Priced at the whole node's NICs it would rank above FSDP2; priced by the
    NICs it can use it does not."""
    profile = shipped("gh200-quad-slingshot")
    whole = profile.model_copy(update={"topology": None})  # every group at the node's rate, as before
    run = dict(scale="8B", device="cuda", precision="bf16", nodes=64, gpus_per_node=4)
    mfu = {(p is whole, par): pr.predict(RunConfig(**run, parallelism=par), p).mfu
           for p in (profile, whole) for par in ("hsdp", "fsdp2")}
    assert mfu[(True, "hsdp")] > mfu[(True, "fsdp2")]  # the defect this guards against
    assert mfu[(False, "hsdp")] <= mfu[(False, "fsdp2")]
    replica = [c for c in pr.predict(RunConfig(**run, parallelism="hsdp"), profile).collectives
               if c.group == "dp_replicate" and c.nbytes > 2**20]
    one_nic = profile.links["inter"]["all_reduce"].bus_gbps / profile.topology.nics_per_node
    assert replica and all(c.per_node == 1 and c.bus_gbps <= one_nic * 1.0001 for c in replica)


# ---- latency that grows with the group ----

def test_ring_latency_grows_with_the_group_by_its_hops():
    """All-gather (ring only): a message of a few bytes costs the fit's fixed part + NCCL's ring
    latency, which grows by at least the cheapest hop (NVLink LL, 0.6 us) per added rank; at 64
    nodes x 8 ranks that is more than a ring of 16 by hundreds of microseconds."""
    profile = shipped("h100-hgx-ib")
    times = {nodes: collective_seconds(profile, "all_gather", 64, nodes * 8, "inter", per_node=8)
             for nodes in (2, 4, 8, 16, 32, 64)}
    sizes = sorted(times)
    for a, b in zip(sizes, sizes[1:]):
        assert times[b] - times[a] >= (b - a) * 8 * 0.6e-6
    assert times[64] - times[2] > 300e-6
    # at the fit's own group (2 nodes x 8) a tiny message costs the fit's alpha
    assert times[2] == pytest.approx(max(profile.links["inter"]["all_gather"].alpha_s,
                                         nt.least_latency_s("all_gather", 16, 2)), rel=1e-3)


def test_tree_all_reduce_is_cheaper_than_the_ring_at_many_nodes():
    """NCCL's tree all-reduce has 2 log2(nodes) network hops against the ring's 2 (ranks - 1) steps:
    a small all-reduce at 64 nodes takes the tree, and costs less than the ring's latency. A large
    one on one node: NVLink SHARP where an NVSwitch offers it (HGX H100 / H200), else the ring
    (GH200 quad: no NVSwitch; HGX A100: an NVSwitch of the generation without SHARP)."""
    profile = shipped("h100-hgx-ib")
    small = collective_cost(profile, "all_reduce", 4096, 512, "inter", per_node=8)
    ring = min(nt.latency_us("all_reduce", "ring", p, 512, 64) for p in nt.PROTOCOLS) * 1e-6
    assert small.algorithm == "tree" and small.seconds < ring
    assert collective_cost(profile, "all_reduce", GIB, 8, "intra").algorithm == "nvls"
    assert collective_cost(shipped("gh200-quad-slingshot"), "all_reduce", GIB, 4, "intra").algorithm == "ring"
    for name in ("h100-hgx-ib", "h200-hgx-ib", "a100-sxm-80gb", "a100-sxm-40gb"):
        a100 = "a100" in name
        assert shipped(name).topology.nvls is not a100
        assert (collective_cost(shipped(name), "all_reduce", GIB, 8, "intra").algorithm == "nvls") is not a100


def test_a_fit_without_a_group_size_or_of_gloo_is_priced_as_fitted():
    """A profile of before (no topology, no group size on its fits) or a gloo one: alpha + bus bytes /
    bandwidth, whatever the group (nothing to scale from)."""
    fit = AlphaBeta(alpha_s=30e-6, bus_gbps=50.0, source="set")
    links = {link: {op: fit for op in OPS} for link in ("intra", "inter")}
    for backend in (None, "gloo"):
        prof = HardwareProfile(name="old", device="SYNTHETIC GPU", dtype="bfloat16", measured=False, gpus_per_node=8,
                               date="2026-12-01", links=links, backend=backend)
        for n, per_node in ((16, 8), (1024, 8), (64, 1)):
            assert collective_seconds(prof, "all_reduce", GIB, n, "inter", per_node) == pytest.approx(
                30e-6 + bus_factor("all_reduce", n) * GIB / 50e9)


# ---- calibrate: one fit per kind of group ----

def points(alpha: float, gbps: float, op: str, groups: tuple[int, ...], per_node: int) -> list[CommPoint]:
    rng = random.Random(per_node)
    return [CommPoint(nbytes=s, group_size=n, per_node=per_node,
                      seconds=(alpha + bus_factor(op, n) * s / (gbps * 1e9)) * (1 + rng.uniform(-0.02, 0.02)))
            for n in groups for s in (2**e for e in range(10, 31, 2))]


def test_calibrate_fits_one_rank_per_node_groups_apart_from_every_rank_groups():
    """Points of one-rank-per-node groups (one NIC: 25 GB/s) and of the world (4 per node: 100 GB/s)
    give two fits, each recording its kind; predict prices a group from the fit of its kind. Intra
    groups of 2 and 4 ranks are one kind (pooled into one fit)."""
    op = "all_reduce"
    measured = {("inter", op, 1): points(20e-6, 25.0, op, (2, 4), 1),
                ("inter", op, 4): points(25e-6, 100.0, op, (16,), 4),
                ("intra", op, 2): points(10e-6, 300.0, op, (2,), 2),
                ("intra", op, 4): points(10e-6, 300.0, op, (4,), 4)}
    links, kinds = fit_links(measured, "measured: test (nccl")
    every, one = links["inter"][op], kinds["inter"][op][0]
    assert (every.per_node, every.group_size) == (4, 16) and every.bus_gbps == pytest.approx(100.0, rel=0.1)
    assert (one.per_node, one.group_size) == (1, 4) and one.bus_gbps == pytest.approx(25.0, rel=0.1)
    assert {p.per_node for p in every.points} == {4} and {p.per_node for p in one.points} == {1}
    assert "intra" not in kinds and {p.group_size for p in links["intra"][op].points} == {2, 4}
    prof = HardwareProfile(name="calibrated", device="SYNTHETIC GPU", dtype="bfloat16", measured=True, backend="nccl",
                           gpus_per_node=4, date="2026-12-01", links=links, link_kinds=kinds)
    assert collective_cost(prof, op, GIB, 8, "inter", per_node=1).fit is one
    assert collective_cost(prof, op, GIB, 32, "inter", per_node=4).fit is every
    # without a topology the fit of the kind is taken as measured: the one-per-node group at its own 25 GB/s
    assert collective_cost(prof, op, GIB, 4, "inter", per_node=1).bus_gbps == pytest.approx(one.bus_gbps)


def test_an_nccl_fit_over_several_group_sizes_takes_its_alpha_at_the_largest():
    """One-rank-per-node groups of 2, 4 and 8 nodes whose small-message time grows as NCCL's latency
    does: the fit's alpha is the 8-node group's (the smaller groups moved to it by NCCL's latency
    difference), and a profile priced from it gives a tiny message on 8 nodes that time."""
    op, fixed, gbps = "all_gather", 5e-6, 25.0
    pts = [CommPoint(nbytes=s, group_size=n, per_node=1,
                     seconds=fixed + nt.least_latency_s(op, n, n) + bus_factor(op, n) * s / (gbps * 1e9))
           for n in (2, 4, 8) for s in (2**e for e in range(10, 25, 2))]
    links, _ = fit_links({("inter", op, 1): pts}, "measured: test (nccl", nccl=True)
    fit = links["inter"][op]
    assert fit.group_size == 8 and fit.alpha_s == pytest.approx(fixed + nt.least_latency_s(op, 8, 8), rel=0.05)
    pooled, _ = fit_links({("inter", op, 1): pts}, "measured: test (gloo")  # not moved: an average of the sizes
    assert pooled["inter"][op].alpha_s < fit.alpha_s
