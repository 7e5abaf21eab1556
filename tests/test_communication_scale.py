"""The terms that grow with the cluster, at their limits: a collective's latency by its algorithm's
step count (ring 2(n-1) / n-1, tree 2 log2 nodes) and a measured per-step network latency; that
latency negligible beside a large message; the straggler term (the expected maximum of N ranks'
Gaussian step jitter: 0 at one rank, growing as sqrt(2 ln N)); fabric contention only where the
profile's topology says links are shared; none of the cross-node terms touches a one-node row."""

from __future__ import annotations

import math

import pytest
import yaml

from conftest import ROOT
from echobench.calibrate.commbench import step_jitter
from echobench.hardware import nccltuning as nt
from echobench.hardware.profile import (
    StepJitter,
    collective_cost,
    expected_max_normal,
    link_share,
    load_profile,
    shipped_profiles,
    straggler_share,
)
from echobench.predict.cards.card import model_card, run_layout
from echobench.predict.cards.model import predict_card

GIB = 2**30
ROWS = yaml.safe_load((ROOT / "validation" / "published-runs.yaml").read_text())


def h100():
    return load_profile(shipped_profiles()["h100-hgx-ib"])


def with_topology(profile, **fields):
    return profile.model_copy(update={"topology": profile.topology.model_copy(update=fields)})


# ---- the step count and the latency per step ----

@pytest.mark.parametrize("protocol", nt.PROTOCOLS)
def test_a_rings_latency_is_its_base_and_one_hop_per_step_2_n_minus_1_for_all_reduce(protocol):
    """Within a node: all-reduce 2(n-1) NVLink steps, all-gather and reduce-scatter n-1; across nodes
    2(nodes-1) of the all-reduce's steps (nodes-1 of the others') cross the network."""
    base, hop = nt.BASE_LATENCY_US["ring"][protocol], nt.HOP_LATENCY_US["nvlink"]["ring"][protocol]
    for n in (2, 4, 8):
        assert nt.latency_us("all_reduce", "ring", protocol, n, 1) == pytest.approx(base + 2 * (n - 1) * hop)
        assert nt.latency_us("all_gather", "ring", protocol, n, 1) == pytest.approx(base + (n - 1) * hop)
    net = nt.HOP_LATENCY_US["net"]["ring"][protocol]
    intra = max(hop, nt.NET_OVERHEAD_US * (3 if protocol == "Simple" else 1))
    ranks, nodes = 64, 8
    assert nt.latency_us("all_reduce", "ring", protocol, ranks, nodes) == pytest.approx(
        base + (2 * (ranks - 1) - 2 * (nodes - 1)) * intra + 2 * (nodes - 1) * net)


@pytest.mark.parametrize("nodes", [2, 4, 16, 64, 1024])
def test_a_trees_latency_grows_with_log2_of_the_nodes(nodes):
    """Tree all-reduce: 2 x ((ranks per node - 1) NVLink hops + floor(log2 nodes) network hops)."""
    p = "LL"
    expected = nt.BASE_LATENCY_US["tree"][p] + 2 * (7 * nt.HOP_LATENCY_US["nvlink"]["tree"][p]
                                                    + int(math.log2(nodes)) * nt.HOP_LATENCY_US["net"]["tree"][p])
    assert nt.latency_us("all_reduce", "tree", p, 8 * nodes, nodes) == pytest.approx(expected)


def test_a_measured_network_step_latency_replaces_nccls_per_step_figure():
    """A profile's topology.net_step_latency_s is what each network step costs (every protocol): the
    ring's latency moves by (its network steps) x the difference; within a node nothing moves."""
    assert nt.latency_us("all_gather", "ring", "LL", 64, 8, net_us=10.0) - nt.latency_us("all_gather", "ring", "LL", 64, 8) \
        == pytest.approx(7 * (10.0 - nt.HOP_LATENCY_US["net"]["ring"]["LL"]))
    base, slow = h100(), with_topology(h100(), net_step_latency_s=50e-6)
    small = [collective_cost(p, "all_gather", 4096, 512, "inter", 8) for p in (base, slow)]
    assert small[1].seconds > small[0].seconds + 30 * 50e-6  # 63 network steps, each slower
    assert collective_cost(slow, "all_gather", 4096, 8, "intra").seconds == \
        collective_cost(base, "all_gather", 4096, 8, "intra").seconds


@pytest.mark.parametrize("n", [16, 128, 512, 4096])
def test_the_latency_is_negligible_beside_a_large_message_and_most_of_a_small_one(n):
    """At 256 MiB per rank (what a ring step moves) the steps' latency is under 1% of the call;
    at 1 KiB it is nearly all of it; in between its share falls as the message grows."""
    shares = [(c := collective_cost(h100(), "all_gather", size, n, "inter", 8)).alpha_s / c.seconds
              for size in (1024, 2**20, n * 2**28)]
    assert shares[0] > 0.95 and shares[-1] < 0.01 and shares == sorted(shares, reverse=True)


# ---- stragglers ----

def test_the_expected_maximum_of_n_gaussian_draws_is_0_at_one_and_grows_as_sqrt_2_ln_n():
    """Known values: E[max of 2] = 1 / sqrt(pi), of 10 = 1.5388, of 100 = 2.5076; increasing; and its
    ratio to sqrt(2 ln n) rising toward 1 (the asymptote is approached from below)."""
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-4)
    assert expected_max_normal(10) == pytest.approx(1.5388, abs=1e-3)
    assert expected_max_normal(100) == pytest.approx(2.5076, abs=1e-3)
    ns = [2, 8, 64, 512, 4096, 16384]
    values = [expected_max_normal(n) for n in ns]
    assert values == sorted(values)
    ratios = [v / math.sqrt(2 * math.log(n)) for v, n in zip(values, ns)]
    assert ratios == sorted(ratios) and 0.45 < ratios[0] and ratios[-1] < 1


def test_the_straggler_share_is_the_profiles_jitter_times_the_expected_maximum_and_0_without_one():
    base = h100()
    assert base.jitter is None and straggler_share(base, 512) == 0.0
    jittery = base.model_copy(update={"jitter": StepJitter(cv=0.01, source="set")})
    assert straggler_share(jittery, 1) == 0.0
    assert straggler_share(jittery, 512) == pytest.approx(0.01 * expected_max_normal(512))
    row = next(r for r in ROWS if r["id"] == "lf-mpt-7b-512gpu")
    card, layout = model_card(row["model"]), run_layout(row["run"], row["hardware"])
    plain, slowed = predict_card(card, layout, base), predict_card(card, layout, jittery)
    assert slowed.device_s == pytest.approx(plain.device_s * (1 + 0.01 * expected_max_normal(512)))
    assert slowed.parts["straggler"] == pytest.approx(slowed.device_s - plain.device_s) and plain.parts["straggler"] == 0


def test_calibrate_measures_the_jitter_as_each_ranks_spread_about_its_own_median():
    """A rank slower throughout is not jitter; the spread is pooled over ranks; under two steps: none."""
    assert step_jitter([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]) == 0.0
    assert step_jitter([[0.9, 1.0, 1.1]]) == pytest.approx(math.sqrt((0.01 + 0 + 0.01) / 3))
    assert step_jitter([[0.9, 1.0, 1.1], [1.8, 2.0, 2.2]]) == pytest.approx(step_jitter([[0.9, 1.0, 1.1]]))
    assert step_jitter([[1.0], []]) is None


# ---- contention ----

def test_contention_slows_only_groups_that_cross_a_shared_spine():
    """nodes_per_leaf 4, oversubscription 2: a group over 4 nodes keeps its bandwidth, over 8 it has
    half; a topology that says nothing is shared (the shipped profiles) prices no contention."""
    shared = with_topology(h100(), nodes_per_leaf=4, oversubscription=2.0)
    for nodes, ratio in ((2, 1.0), (4, 1.0), (8, 0.5), (64, 0.5)):
        assert link_share(shared, "inter", 8 * nodes, 8) / link_share(h100(), "inter", 8 * nodes, 8) == ratio
    a, b = (collective_cost(p, "all_gather", 4 * GIB, 64, "inter", 8) for p in (h100(), shared))
    assert b.bus_gbps / a.bus_gbps == pytest.approx(0.5, rel=1e-6) and b.seconds > 1.8 * a.seconds
    for path in shipped_profiles().values():
        top = load_profile(path).topology
        assert top is None or top.oversubscription == 1.0 or top.nodes_per_leaf is None


def test_the_cross_node_terms_leave_every_one_node_row_as_it_was():
    """A network step latency and a shared spine price only traffic between nodes: every committed
    row of one node is priced the same with them as without."""
    base = h100()
    changed = with_topology(base, net_step_latency_s=100e-6, nodes_per_leaf=1, oversubscription=4.0)
    one_node = [r for r in ROWS if r["hardware"]["profile"] == "h100-hgx-ib"
                and r["hardware"]["gpus"] <= r["hardware"]["gpus_per_node"]]
    assert len(one_node) >= 5
    for r in one_node:
        card, layout = model_card(r["model"]), run_layout(r["run"], r["hardware"])
        assert predict_card(card, layout, changed).step_time_s == predict_card(card, layout, base).step_time_s, r["id"]


def test_calibrate_writes_the_jitter_of_each_ranks_own_steps_into_the_profile(tmp_path, monkeypatch):
    """`calibrate --comm --nproc 1` (commcalibrate.calibrate_command, in this process) with the host
    steps stood in for: the single layout's step times become the profile's jitter (step_jitter's cv,
    its source saying it was measured); without timed steps the profile carries none."""
    import torch

    from echobench.calibrate import commbench as cb
    from echobench.calibrate.commcalibrate import calibrate_command
    from test_calibrate_cards import SINGLE, write_card_matrix

    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    matrix = write_card_matrix(tmp_path, [SINGLE])
    for steps in ([1.0, 1.1, 0.9, 1.0], None):
        def fake_host(info, dtype, budget_s, local, seconds_out=None, steps=steps):
            if steps and seconds_out is not None:
                seconds_out["single"] = steps
            return []

        monkeypatch.setattr(cb, "measure_host", fake_host)
        out = tmp_path / f"profile-{bool(steps)}.yaml"
        calibrate_command(torch.device("cpu"), "auto", None, (None, matrix, {}), 0.5, 1, out, None, 1.0, (1, 0, None, 29500))
        jitter = load_profile(out).jitter
        if steps:
            assert jitter.cv == pytest.approx(step_jitter([steps])) and jitter.source.startswith("measured")
        else:
            assert jitter is None


def test_an_echo_runs_straggler_part_is_its_device_time_share_and_idle_in_the_breakdown():
    """Echo's prediction on a profile with a jitter: the straggler part is the synchronous device time
    x cv x E[max of the run's ranks]; held against a profiled breakdown it lands in other (waiting on
    the slowest rank is idle), so the predicted shares still sum to the step."""
    from echobench import predict as pr
    from test_predict import cfg, measured_record, profile

    c = cfg(nodes=2)
    plain = profile()
    jittery = plain.model_copy(update={"jitter": StepJitter(cv=0.02, source="set")})
    a, b = pr.predict(c, plain), pr.predict(c, jittery)
    assert a.parts["straggler"] == 0
    assert b.parts["straggler"] == pytest.approx(a.device_s * 0.02 * expected_max_normal(c.world_size))
    fractions = {"gemm": 0.4, "attention": 0.1, "optimizer": 0.05, "other_compute": 0.2, "memcpy": 0.05,
                 "communication": 0.1, "data_wait": 0.0, "idle": 0.1}
    rec = measured_record(c, 1.0, breakdown={"fractions": fractions, "step_time_s": 1.0})
    parts = pr.against(rec, [jittery]).parts
    assert sum(v["predicted"] for v in parts.values()) == pytest.approx(1.0)
