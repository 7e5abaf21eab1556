"""Communication: the alpha-beta fit, hardware profiles (shipped and calibrated), and the bytes a real
training step's collectives move against the formulas a performance model uses (commvolume).

The byte tests count one real step (after two warm-up steps) of each layout on 2 gloo processes,
the tiny model at short lengths, micro-batch 1, fp32 on the CPU.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
import yaml

from conftest import run_cli
from echobench.calibrate.commbench import fit_alpha_beta, plan_groups
from echobench.hardware.traffic import FRAME_COUNT_BYTES, ddp_bytes, fsdp_bytes, param_units, totals, tp_bytes
from echobench.train.commvolume import CollectiveCall, step_collectives
from echobench.records.config import RunConfig
from echobench.model.flops import param_counts
from echobench.hardware.profile import (
    CommPoint,
    ProfileError,
    bus_factor,
    collective_cost,
    collective_seconds,
    load_profile,
    shipped_profiles,
)

SHAPE = dict(scale="tiny", device="cpu", audio_frames=50, text_tokens=16, speaker_frames=40, micro_batch=1,
             gpus_per_node=2)
LAYOUTS = {"ddp": dict(parallelism="ddp"), "fsdp2": dict(parallelism="fsdp2"),
           "tp2": dict(framework="megatron", parallelism="tp2", te="off")}


# ---- the fit and the cost model ----

def synthetic(alpha: float, gbps: float, op: str, noise: float = 0.0) -> list[CommPoint]:
    rng = random.Random(0)
    points = []
    for n in (2, 4, 8):
        for size in (2**e for e in range(10, 31, 2)):
            t = alpha + bus_factor(op, n) * size / (gbps * 1e9)
            points.append(CommPoint(nbytes=size, group_size=n, seconds=t * (1 + rng.uniform(-noise, noise))))
    return points


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_fit_recovers_alpha_and_bus_bandwidth(op):
    alpha, gbps, rms = fit_alpha_beta(synthetic(25e-6, 180.0, op), op)
    assert alpha == pytest.approx(25e-6, rel=1e-6) and gbps == pytest.approx(180.0, rel=1e-6) and rms < 1e-9
    # +-5% noise on every time: both parameters within 10%, and the fit says how far off its points are
    alpha, gbps, rms = fit_alpha_beta(synthetic(25e-6, 180.0, op, noise=0.05), op)
    assert alpha == pytest.approx(25e-6, rel=0.1) and gbps == pytest.approx(180.0, rel=0.1) and 0 < rms < 0.05


def test_fit_without_measurable_latency_is_bandwidth_alone():
    points = [CommPoint(nbytes=s, group_size=2, seconds=s / 1e9 * (0.9 if i % 2 else 1.1))
              for i, s in enumerate(2**e for e in range(20, 28))]
    alpha, gbps, _ = fit_alpha_beta(points, "all_gather")
    assert alpha >= 0 and gbps > 0


def test_collective_seconds_follows_nccl_tests_bus_bytes():
    """At the group a fit was taken on (8 ranks of a node): the bus bytes at the fit's bandwidth plus
    a latency of at least its alpha (NCCL's protocol for large messages has more per-hop latency
    than the one for small: within 50 us); a message of a few bytes costs the fit's alpha."""
    profile = load_profile(shipped_profiles()["h100-hgx-ib"])
    nbytes = 2**30
    for op, factor in (("all_gather", 7 / 8), ("all_reduce", 2 * 7 / 8)):
        fit = profile.links["intra"][op]
        cost = collective_cost(profile, op, nbytes, 8, "intra")
        assert cost.seconds - cost.alpha_s == pytest.approx(factor * nbytes / (fit.bus_gbps * 1e9))
        assert fit.alpha_s <= cost.alpha_s < fit.alpha_s + 50e-6
        assert collective_seconds(profile, op, 64, 8, "intra") == pytest.approx(fit.alpha_s, rel=1e-3)
    assert collective_seconds(profile, "all_reduce", nbytes, 1, "intra") == 0.0


def test_plan_groups_splits_intra_and_inter_node():
    plans = plan_groups([0, 0, 0, 0, 1, 1, 1, 1])  # 2 nodes x 4 ranks
    assert [(p.ranks, p.link) for p in plans] == [
        ((0, 1), "intra"), ((0, 1, 2, 3), "intra"), ((0, 4), "inter"), (tuple(range(8)), "inter")]
    assert [(p.ranks, p.link) for p in plan_groups([0, 0])] == [((0, 1), "intra")]
    assert [(p.ranks, p.link) for p in plan_groups([0, 1])] == [((0, 1), "inter")]


# ---- profiles ----

def test_shipped_profiles_load_and_cite_every_number():
    shipped = shipped_profiles()
    assert {"gh200-quad-slingshot", "h100-hgx-ib", "h200-hgx-ib"} <= set(shipped)
    for name, path in shipped.items():
        p = load_profile(path)
        assert p.measured is False and "NOT MEASURED HERE" in p.note, name
        assert {"intra", "inter"} == set(p.links) and all(set(ops) == {"all_reduce", "all_gather", "reduce_scatter"}
                                                        for ops in p.links.values()), name
        for item in [*p.gemm, *p.attention, *p.memory, *(f for ops in p.links.values() for f in ops.values())]:
            assert item.source.strip(), (name, item)
        # a fit with points is what fit_alpha_beta makes of them (reproducible from the cited figures)
        for link, ops in p.links.items():
            for op, fit in ops.items():
                if fit.points:
                    alpha, gbps, _ = fit_alpha_beta(fit.points, op)
                    assert (fit.alpha_s, fit.bus_gbps) == (pytest.approx(alpha, rel=1e-3), pytest.approx(gbps, rel=1e-3))


def test_profile_of_another_schema_version_is_refused_in_one_line(tmp_path):
    data = yaml.safe_load(shipped_profiles()["h200-hgx-ib"].read_text())
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({**data, "schema_version": 99}))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert "\n" not in message and str(path) in message and "schema_version 99" in message
    assert "echobench calibrate --comm" in message
    path.write_text(yaml.safe_dump({**data, "links": {"intra": {"all_reduce": {"alpha_s": -1}}}}))
    with pytest.raises(ProfileError, match="invalid hardware profile"):
        load_profile(path)
    path.write_text(yaml.safe_dump({**data, "gpus_per_node": -2}))
    with pytest.raises(ProfileError, match="gpus_per_node"):
        load_profile(path)


def test_a_profile_that_is_not_yaml_is_named_with_line_and_column(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\n  device: [a\n")
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}: not valid YAML: line 3, column 9:")


@pytest.mark.slow
def test_calibrate_comm_on_two_gloo_processes_writes_a_profile(tmp_path):
    out = tmp_path / "profile.yaml"
    # As in a pyxis container: its hooks set RANK / LOCAL_RANK / WORLD_SIZE for the one task. Only torchrun's
    # own variable says a process is a worker: this one is the launcher, and measures 2 processes.
    pyxis = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    proc = run_cli("calibrate", "--comm", "--device", "cpu", "--out", out, "--max-bytes", 2**20,
                   "--comm-budget-s", 6, "--budget-s", 1, "--micro-batch", 1, "--audio-frames", 50,
                   "--text-tokens", 16, "--speaker-frames", 40, tmp_path=tmp_path, timeout=300, env=pyxis)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    p = load_profile(out)
    assert p.measured is True and p.backend == "gloo" and p.gpus_per_node == 2 and p.device.startswith("CPU")
    assert set(p.links) == {"intra"} and set(p.links["intra"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    for op, fit in p.links["intra"].items():
        assert fit.alpha_s >= 0 and fit.bus_gbps > 0 and len(fit.points) >= 2, op
        assert all(pt.group_size == 2 and pt.seconds > 0 and 1024 <= pt.nbytes <= 2**20 for pt in fit.points), op
    assert p.gemm and all(g.tflops > 0 for g in p.gemm)
    # every GEMM the model prices for this run's layouts on 2 ranks, measured; AdamW over the model's parameters
    from echobench.calibrate.commbench import HOST_RUN, REFERENCE_RUN, gemm_work

    run = RunConfig(scale="tiny", micro_batch=1, audio_frames=50, text_tokens=16, speaker_frames=40)
    priced = [run, RunConfig(**HOST_RUN), RunConfig(**REFERENCE_RUN)]  # CPU: the host steps' shapes too
    assert {(g.m, g.n, g.k) for g in p.gemm} == {(s.m, s.n, s.k) for s in gemm_work(priced, 2)}
    assert {a.name for a in p.attention} == {"dit joint attention", "speaker self-attention"}
    assert {m.op for m in p.memory} == {"add", "copy", "adamw"} and all(m.gbps > 0 for m in p.memory)
    adamw = next(m for m in p.memory if m.op == "adamw")
    assert adamw.nbytes == 4 * param_counts(run.model_config()).trainable
    # the host's cost per op of each layout the 2 ranks can form (megatron TP where it imports)
    assert [h.parallelism for h in p.host_steps][:3] == ["single", "ddp", "fsdp2"]
    # CPU: the reference step beside them (a mostly-compute step, commbench.REFERENCE_RUN)
    reference = p.host_steps[-1]
    assert (reference.parallelism, reference.micro_batch, reference.audio_frames) == \
        ("single", REFERENCE_RUN["micro_batch"], REFERENCE_RUN["audio_frames"])
    assert all(h.ops > 1000 and h.step_s > 0 for h in p.host_steps)
    # the same profile in echobench's cache (ECHOBENCH_CACHE), where predict finds this machine's
    cached = list((tmp_path / "cache" / "profiles").glob("*.yaml"))
    assert len(cached) == 1 and load_profile(cached[0]) == p


# ---- bytes of real steps ----

@pytest.fixture(scope="module")
def counted():
    """One counted step of each layout (ddp, fsdp2, and megatron tp2 where megatron-core imports)."""
    names = [n for n in LAYOUTS if n != "tp2" or _has_megatron()]
    cfgs = [RunConfig(**SHAPE, **LAYOUTS[n]) for n in names]
    return {n: (cfg, logs) for n, cfg, logs in zip(names, cfgs, step_collectives(cfgs))}


def _has_megatron() -> bool:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        return False
    return True


def calls(logs) -> Counter:
    return Counter((c.op, c.nbytes, c.group_size, c.dtype) for c in logs.calls)


def expected_calls(traffic) -> Counter:
    """Each Traffic as its calls (equal sizes within one, as the formulas list them)."""
    out = Counter()
    for t in traffic:
        assert t.nbytes % t.calls == 0
        out[(t.op, t.nbytes // t.calls, t.group_size, t.dtype)] += t.calls
    return out


@pytest.mark.slow
def test_ddp_step_all_reduces_every_trainable_gradient_once(counted):
    cfg, ranks = counted["ddp"]
    trainable_bytes = param_counts(cfg.model_config()).trainable * 4  # float32 gradients
    for log in ranks:
        floats = [c for c in log.calls if c.op == "all_reduce" and c.dtype == "float32"]
        assert sum(c.nbytes for c in floats) == trainable_bytes  # the gradient buckets
        assert [c for c in log.calls if c not in floats] == [CollectiveCall("all_reduce", FRAME_COUNT_BYTES, 2, "int64")]
        assert log.by_op() == totals(ddp_bytes(cfg))


@pytest.mark.slow
def test_fsdp2_step_moves_the_sharded_parameters(counted):
    cfg, ranks = counted["fsdp2"]
    units = param_units(cfg.model_config())
    shard_bytes = {u.shard_numel(2) * 4 for u in units}  # one rank's float32 shard of each unit
    for log in ranks:
        gathers = [c for c in log.calls if c.op == "all_gather"]
        scatters = [c for c in log.calls if c.op == "reduce_scatter"]
        # each all-gather's input (output / 2) and each reduce-scatter's output (input / 2) is a unit's shard
        assert {c.nbytes // 2 for c in gathers} == shard_bytes == {c.nbytes // 2 for c in scatters}
        # every unit's gradients reduce-scattered once: the whole model's; blocks gathered twice, but
        # the last (backward finds it gathered) and the root once
        assert sum(c.nbytes for c in scatters) == param_counts(cfg.model_config()).trainable * 4
        assert len(gathers) == 2 * (len(units) - 2) + 2
        assert calls(log) == expected_calls(fsdp_bytes(cfg))
        assert log.by_op() == totals(fsdp_bytes(cfg))


@pytest.mark.slow
def test_tp2_step_matches_the_megatron_layer_structure(counted):
    if "tp2" not in counted:
        pytest.skip("megatron-core is not installed")
    cfg, ranks = counted["tp2"]
    m = cfg.model_config()
    latent = cfg.audio_frames * m.width * 4  # micro-batch 1, float32 activations
    for log in ranks:
        # 2 row-parallel outputs forward + 2 column-parallel input gradients backward per block
        assert Counter(c.nbytes for c in log.calls)[latent] == 4 * m.layers
        assert calls(log) == expected_calls(tp_bytes(cfg))
        assert log.by_op() == totals(tp_bytes(cfg))
    assert ranks[0].calls == ranks[1].calls


def test_param_units_are_the_models_fsdp_units():
    """param_units, built from the model's parts, against the whole model as the backend shards it."""
    import torch

    from echobench.backends.torchtitan import ECHO_PARTS, each_layer
    from echobench.model.echo import EchoTTS

    cfg = RunConfig(**SHAPE, parallelism="fsdp2").model_config()
    with torch.device("meta"):
        model = EchoTTS(cfg)
    units = param_units(cfg)
    expected = [tuple(tuple(p.shape) for p in c[i].parameters()) for c, i in each_layer(ECHO_PARTS.blocks(model))]
    assert [u.shapes for u in units if u.kind != "root"] == expected
    in_blocks = {id(p) for c, i in each_layer(ECHO_PARTS.blocks(model)) for p in c[i].parameters()}
    root = [tuple(p.shape) for p in model.trainable_parameters() if id(p) not in in_blocks]
    assert sorted(units[-1].shapes) == sorted(root)
    assert sum(u.numel for u in units) == param_counts(cfg).trainable
    assert units[0].shard_numel(3) == sum(math.ceil(s[0] / 3) * math.prod(s[1:]) for s in units[0].shapes)


def test_tp_sharded_names_match_the_state_dict_adapter():
    pytest.importorskip("megatron.core")
    from echobench.hardware.traffic import TP_SHARDED
    from echobench.model.megatron import TPStateDictAdapter

    assert sorted(TP_SHARDED) == sorted(plain for plain, _, _ in TPStateDictAdapter.SHARDED.values())


def test_formulas_scale_with_the_layout():
    """Derived volumes at sizes no test machine runs: FSDP2 in bf16 gathers each block in half the
    bytes it reduce-scatters (twice: about as many bytes in all), HSDP adds the replicas' all-reduce
    of the shards, and at 8 ranks the bus bytes carry nccl-tests' 2(n-1)/n."""
    gpu = dict(scale="800M", device="cuda", audio_frames=750, text_tokens=256, speaker_frames=750, micro_batch=8)
    cfg = RunConfig(**gpu, parallelism="fsdp2", gpus_per_node=8)
    fsdp = totals(fsdp_bytes(cfg))
    # blocks: 2 gathers x bf16 = one fp32 reduce-scatter; the last block and the root gather once
    units = param_units(cfg.model_config())
    once = [units[-2], units[-1]]
    assert [u.kind for u in once] == ["dit block", "root"]
    assert fsdp["all_gather"].bytes == fsdp["reduce_scatter"].bytes - sum(2 * 8 * u.shard_numel(8) for u in once)
    hsdp = fsdp_bytes(RunConfig(**gpu, parallelism="hsdp", nodes=2, gpus_per_node=8))
    replicas = [t for t in hsdp if t.group == "dp_replicate"]
    assert replicas and all(t.link == "inter" and t.group_size == 2 for t in replicas)
    assert sum(t.nbytes for t in replicas) * 8 == sum(t.nbytes for t in hsdp if t.op == "reduce_scatter")
    ddp = ddp_bytes(RunConfig(**gpu, parallelism="ddp", gpus_per_node=8))
    assert ddp[0].nbytes == param_counts(RunConfig(**gpu).model_config()).trainable * 4
    assert ddp[0].bus_bytes == pytest.approx(2 * 7 / 8 * ddp[0].nbytes)
    assert 1 <= ddp[0].calls <= math.ceil(ddp[0].nbytes / (100 * 2**20))  # buckets of at least 100 MiB, the last less


# ---- what calibrate --comm measures for predict ----

@pytest.mark.parametrize("settings", [
    {"scale": "tiny", "micro_batch": 2, "audio_frames": 100, "text_tokens": 32, "speaker_frames": 80},
    {"scale": "tiny", "framework": "megatron", "parallelism": "tp2", "gpus_per_node": 2, "ac": "full"},
    {"scale": "800M", "micro_batch": 1, "audio_frames": 50, "text_tokens": 16, "speaker_frames": 40},
])
def test_calibration_times_every_gemm_shape_predict_prices(settings):
    """gemm_work lists every (m, n, k) predict.step_work prices for the run, in its own layout and
    the others of a 2-rank node (torchtitan, megatron TP 1 and 2): each is then a measured point."""
    from echobench.calibrate.commbench import gemm_layouts, gemm_work
    from echobench.predict import step_work

    run = RunConfig(**settings)
    measured = {(s.m, s.n, s.k) for s in gemm_work([run], 2)}
    assert ("torchtitan", 1) in gemm_layouts(run, 2) and ("megatron", 2) in gemm_layouts(run, 2)
    for framework, tp in (("torchtitan", 1), ("megatron", 1), ("megatron", 2), (run.framework, run.tp)):
        mm, _ = step_work(run.model_config(), framework, tp, run.micro_batch, run.audio_frames, run.text_tokens,
                          run.speaker_frames, run.ac)
        assert {(w.m, w.n, w.k) for w in mm} <= measured, (framework, tp)
    # two runs: the union of their shapes
    other = RunConfig(**{**settings, "micro_batch": 3})
    both = {(s.m, s.n, s.k) for s in gemm_work([run, other], 2)}
    assert measured < both and {(s.m, s.n, s.k) for s in gemm_work([other], 2)} <= both


def test_gemm_operands_rotate_through_the_model_weights_working_set():
    """A model whose weights fit in a cache is timed warm (one operand set); a large one through as
    many sets as its weights (at most GEMM_SETS), so its GEMMs do not find their operands cached."""
    from echobench.calibrate.commbench import WORKING_SET_CAP, working_set_bytes
    from echobench.hardware.device import GEMM_SETS, GemmShape, operand_sets
    from echobench.predict import rank_params

    tiny, big = RunConfig(scale="tiny"), RunConfig(scale="8B")
    assert working_set_bytes([tiny], torch.float32) == int(rank_params(tiny) * 4) < 4 * 2**20
    assert working_set_bytes([tiny, big], torch.bfloat16) == WORKING_SET_CAP
    small = GemmShape("s", 16, 64, 64)  # 20 KiB a set
    assert operand_sets(small, 4, 0) == 1 and operand_sets(small, 4, 40 * 1024) == 2
    assert operand_sets(small, 4, WORKING_SET_CAP) == GEMM_SETS
    assert operand_sets(GemmShape("l", 8192, 8192, 8192), 2, WORKING_SET_CAP) == 1


def test_adamw_is_measured_over_the_models_own_parameters(monkeypatch):
    """The optimizer point steps AdamW over the run's trainable parameter shapes (all of them where
    memory allows, a prefix where not), every step on fresh gradients; its bytes are 4 x numel."""
    from echobench.calibrate import commbench
    from echobench.hardware.traffic import param_units

    run = RunConfig(scale="tiny")
    shapes = [s for u in param_units(run.model_config()) for s in u.shapes]
    cpu = torch.device("cpu")
    assert commbench.adamw_shapes([run], cpu) == shapes
    assert commbench.adamw_shapes([run, RunConfig(scale="800M")], cpu)[:3] != shapes[:3]  # the larger model's
    monkeypatch.setattr(commbench, "free_bytes", lambda device: 1000 * commbench.ADAMW_STATE_BYTES)
    few = commbench.adamw_shapes([run], cpu)
    assert 1 <= len(few) < len(shapes) and few == shapes[:len(few)]
    assert sum(math.prod(s) for s in few[:-1]) <= 1000 or len(few) == 1
    point = commbench.measure_adamw(cpu, shapes, 0.5)
    assert point.op == "adamw" and point.nbytes == 4 * sum(math.prod(s) for s in shapes)
    assert point.iters >= 1 and point.gbps > 0
