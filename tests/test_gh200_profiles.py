"""The two shipped GH200 quad-node profiles: gh200-quad-ib (the seed's cluster: 4 InfiniBand NDR200
HCAs per node, JUPITER Booster-class) and gh200-quad-slingshot (Alps-class). They share everything but
the fabric; the IB fits are datasheet line rate x the achievable fraction h100-hgx-ib's inter fit uses.
The assertions are properties of the profiles and of what follows from their inter figures, not
measured times."""

from __future__ import annotations

import pytest

from echobench import predict as pr
from echobench.records.config import RunConfig
from echobench.hardware.profile import OPS, collective_cost, load_profile, shipped_profiles
from echobench.sweep.matrix import load_matrix
from conftest import ROOT

GIB = 2**30
NDR200_GBPS = 200 / 8  # 200 Gb/s per HCA, in GB/s (the datasheet's line rate)


def shipped(name: str):
    return load_profile(shipped_profiles()[name])


def achievable_fraction() -> float:
    """The fraction of line rate h100-hgx-ib's inter fit takes: its bus bandwidth over its NICs' line
    rate (8 x 400 Gb/s NDR)."""
    h100 = shipped("h100-hgx-ib")
    return h100.links["inter"]["all_reduce"].bus_gbps / (h100.topology.nics_per_node * 400 / 8)


def test_the_ib_profile_is_the_slingshot_one_but_for_its_fabric():
    ib, ss = shipped("gh200-quad-ib"), shipped("gh200-quad-slingshot")
    assert ib.measured is False and "NOT MEASURED" in ib.note
    for field in ("device", "dtype", "backend", "gpus_per_node", "sm_count", "gemm", "attention", "memory", "host_op"):
        assert getattr(ib, field) == getattr(ss, field), field
    assert ib.links["intra"] == ss.links["intra"]
    assert (ib.topology.nics_per_node, ib.topology.nvlink) == (ss.topology.nics_per_node, ss.topology.nvlink) == (4, "direct")
    assert ib.in_step is ss.in_step is None and ib.clock == ss.clock  # no fitted factor in a shipped profile
    for op in OPS:
        fit = ib.links["inter"][op]
        assert (fit.group_size, fit.per_node) == (8, 4)  # 2 nodes x the node's every rank (every HCA)
        assert fit.bus_gbps == pytest.approx(4 * NDR200_GBPS * achievable_fraction())
        assert fit.alpha_s == shipped("h100-hgx-ib").links["inter"][op].alpha_s  # the same assumption
        assert "assumed" in fit.source and all(s in fit.source for s in ("cx7-datasheet", "jupiter-config"))
    assert {"cx7-datasheet", "jupiter-config", "nccl-tests-252", "cscs-nccl"} <= set(ib.sources)


@pytest.mark.parametrize("op", OPS)
def test_a_one_rank_per_node_group_gets_one_hca_and_a_group_of_every_rank_all_four(op):
    """A large message (8 GiB: Simple's full bandwidth) on 16 nodes: one rank per node (HSDP's
    replica group, TP=4's data-parallel group) through its own HCA, every rank through all four."""
    ib = shipped("gh200-quad-ib")
    one_hca = NDR200_GBPS * achievable_fraction()
    assert 0 < one_hca < NDR200_GBPS  # below the HCA's line rate
    one = collective_cost(ib, op, 8 * GIB, 16, "inter", per_node=1)
    every = collective_cost(ib, op, 8 * GIB, 64, "inter", per_node=4)
    assert one.bus_gbps == pytest.approx(one_hca)
    assert every.bus_gbps == pytest.approx(4 * one_hca)


LAYOUTS = (("torchtitan", "fsdp2"), ("torchtitan", "hsdp"), ("megatron", "tp4"))  # the 8B layouts that fit 96 GB


def mfus(profile, nodes: int) -> dict[str, float]:
    out = {}
    for framework, parallelism in LAYOUTS:
        cfg = RunConfig(scale="8B", framework=framework, parallelism=parallelism, device="cuda", precision="bf16",
                        nodes=nodes, gpus_per_node=4, micro_batch=8, audio_frames=750, text_tokens=256,
                        speaker_frames=750)
        out[parallelism] = pr.predict(cfg, profile).mfu
    return out


def test_8b_at_16_nodes_every_layout_gains_on_ib_and_none_overtakes_another():
    """What follows from the two inter fits: IB's is faster in both bandwidth and latency, at the
    same kind of group (2 nodes x 4 ranks), the rest of the profiles equal. So on one node nothing
    differs, and across 16 nodes every layout's MFU is higher on IB. Where each layout's gain on IB
    (only its exposed inter-node time shrinks) is smaller than the ratio between neighbours of the
    Slingshot ranking, that ranking cannot flip on IB: on_ib[a] / on_ib[b] >= on_ss[a] / (on_ss[b] x
    gain) > 1."""
    ib, ss = shipped("gh200-quad-ib"), shipped("gh200-quad-slingshot")
    ib_ar, ss_ar = ib.links["inter"]["all_reduce"], ss.links["inter"]["all_reduce"]
    assert ib_ar.bus_gbps > ss_ar.bus_gbps and ib_ar.alpha_s < ss_ar.alpha_s
    assert (ib_ar.group_size, ib_ar.per_node) == (ss_ar.group_size, ss_ar.per_node)
    assert mfus(ib, 1) == mfus(ss, 1)
    on_ib, on_ss = mfus(ib, 16), mfus(ss, 16)
    assert all(on_ib[k] > on_ss[k] for k in on_ib)
    order = sorted(on_ss, key=on_ss.get, reverse=True)
    gain = max(on_ib[k] / on_ss[k] for k in on_ib)
    assert all(on_ss[a] / on_ss[b] > gain for a, b in zip(order, order[1:]))
    assert sorted(on_ib, key=on_ib.get, reverse=True) == order


def test_a_matrix_without_profile_takes_its_fabrics_gh200_profile():
    """`predict` / `plan` without --profile: the seed's matrix (fabric: infiniband) takes the IB
    profile, the Slingshot matrix the Slingshot one."""
    for matrix, name in (("gh200-published.yaml", "gh200-quad-ib"), ("gh200-slingshot.yaml", "gh200-quad-slingshot")):
        spec = load_matrix(ROOT / "matrices" / matrix).spec
        assert pr.profile_for_device(spec.hardware.device, fabric=spec.slurm.fabric).name == name
