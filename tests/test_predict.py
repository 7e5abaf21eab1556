"""The performance model (echobench.predict): its properties on synthetic profiles with set figures,
its counted constants against a real tiny step, the CLI (predict, validate measured, plan) and the predicted
markers of the dashboard in headless Chromium. Nothing here depends on how fast the machine is."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from echobench import predict as pr
from echobench.hardware.traffic import step_bytes
from echobench.records.config import RunConfig, run_id
from echobench.model.flops import hardware_flops, model_flops
from echobench.hardware.profile import (
    ATTENTION_KERNELS,
    OPS,
    AlphaBeta,
    AttentionPoint,
    CommPoint,
    GemmPoint,
    HardwareProfile,
    MemoryPoint,
    collective_seconds,
    save_profile,
)
from echobench.sweep.matrix import expand, load_matrix
from echobench.predict.intervals import interval
from echobench.predict.pricing import (FORWARD_OVER_MIX, TILED_ATTENTION, attention_kernel, attention_phase_factor,
                                       work_seconds)
from echobench.predict.work import AttentionWork
from echobench.predict.memory import activation_elements_per_sample
from echobench.records.results import Env, Record

GEMM_TFLOPS, ATTENTION_TFLOPS, GBPS = 400.0, 200.0, 2000.0


def profile(links=("intra", "inter"), alpha=20e-6, bus_gbps=100.0, gemm=GEMM_TFLOPS, device="SYNTHETIC GPU",
            gpus_per_node=4, **extra) -> HardwareProfile:
    """A profile with one rate of each kind, no spread (set figures)."""
    return HardwareProfile(
        name="synthetic", device=device, dtype="bfloat16", measured=False, gpus_per_node=gpus_per_node, date="2026-12-01",
        gemm=[GemmPoint(m=1024, n=1024, k=1024, tflops=gemm, source="set")],
        attention=[AttentionPoint(batch=1, heads=8, head_dim=64, seq_q=512, seq_k=512, tflops=ATTENTION_TFLOPS,
                                  source="set")],
        memory=[MemoryPoint(op="add", nbytes=2**30, gbps=GBPS, source="set")],
        links={link: {op: AlphaBeta(alpha_s=alpha, bus_gbps=bus_gbps, source="set") for op in OPS} for link in links},
        **extra)


def cfg(**settings) -> RunConfig:
    base = dict(scale="800M", device="cuda", precision="bf16", micro_batch=4, audio_frames=300, text_tokens=64,
                speaker_frames=200, peak_tflops=1000.0, gpus_per_node=4, parallelism="ddp")
    return RunConfig(**{**base, **settings})


# ---- compute ----

@pytest.mark.parametrize("settings", [dict(parallelism="single", gpus_per_node=1), dict(ac="full"),
                                      dict(ac="selective"), dict(frozen_encoder=False)])
def test_the_step_work_is_the_flop_models_and_compute_is_flops_over_the_rate(settings):
    """The GEMMs and attentions of a step add up to flops.py's hardware FLOPs (AC recompute included)
    x the micro-batch, and with one rate each the compute parts are exactly FLOPs / rate."""
    c = cfg(**settings)
    mm, att = pr.step_work(c.model_config(), c.framework, c.tp, c.micro_batch, c.audio_frames, c.text_tokens,
                           c.speaker_frames, c.ac)
    m = c.model_config()
    f = model_flops(m, c.audio_frames, c.text_tokens, c.speaker_frames)
    assert sum(w.flops for w in mm) + sum(a.flops for a in att) == hardware_flops(m, f, c.ac) * c.micro_batch
    p = pr.predict(c, profile())
    assert p.parts["gemm"] == pytest.approx(sum(w.flops for w in mm) / (GEMM_TFLOPS * 1e12), rel=1e-12)
    factor = {a.phase: attention_phase_factor(attention_kernel(c), a.phase) for a in att}
    seconds = sum(a.flops / factor[a.phase] for a in att) / (ATTENTION_TFLOPS * 1e12)
    assert p.parts["attention"] == pytest.approx(seconds, rel=1e-12)


def test_a_tiled_kernels_forward_runs_faster_than_its_mix_and_a_step_without_recompute_keeps_the_points_rate():
    """A point's rate is forward + backward: a tiled kernel's forward and recompute run at
    FORWARD_OVER_MIX x it and its backward (twice the forward's FLOPs) at the rate that keeps the two
    at the point's; standard attention (math) and an unnamed kernel are not split."""
    fwd, bwd, again = (attention_phase_factor("flash2", ph) for ph in ("forward", "backward", "recompute"))
    assert fwd == again == FORWARD_OVER_MIX > 1 > bwd
    assert 1 / fwd + 2 / bwd == pytest.approx(3)  # forward + backward FLOPs (1 + 2) at the point's rate
    phases = ("forward", "backward", "recompute")
    assert {attention_phase_factor(k, ph) for k in ("math", None) for ph in phases} == {1.0}
    assert TILED_ATTENTION < set(ATTENTION_KERNELS) and "math" not in TILED_ATTENTION
    rates, f = pr.Rates(profile()), 10**12

    def seconds(kernel: str, *phases: tuple[str, int]) -> float:
        att = [AttentionWork("a", ph, 512, 512, flops, 1, 64) for ph, flops in phases]
        out = work_seconds([], att, (0.0, 0.0), 0.0, rates, kernel)
        return (out["attention_forward"] + out["attention_backward"]) / rates.compute_factor

    at_point = 3 * f / (rates.attention_tflops(512, 512, 64, False, "flash2") * 1e12)
    assert seconds("flash2", ("forward", f), ("backward", 2 * f)) == pytest.approx(at_point)
    assert seconds("flash2", ("forward", f), ("backward", 2 * f), ("recompute", f)) == \
        pytest.approx(at_point * (1 + 1 / (3 * FORWARD_OVER_MIX)))
    assert seconds("math", ("forward", f), ("backward", 2 * f), ("recompute", f)) == pytest.approx(at_point * 4 / 3)


def test_tensor_parallelism_splits_the_dit_and_replicates_the_rest():
    plain, tp = cfg(framework="megatron", parallelism="tp1", gpus_per_node=1), cfg(framework="megatron",
                                                                                   parallelism="tp4")
    work = {c.tp: pr.step_work(c.model_config(), c.framework, c.tp, c.micro_batch, c.audio_frames, c.text_tokens,
                               c.speaker_frames, c.ac) for c in (plain, tp)}

    def by_part(mm, att):
        out = {}
        for w in (*mm, *att):
            out[w.part] = out.get(w.part, 0) + w.flops
        return out

    one, four = by_part(*work[1]), by_part(*work[4])
    assert four["dit_attention"] * 4 == one["dit_attention"] and four["dit_mlp"] * 4 == one["dit_mlp"]
    for part in ("dit_conditioning", "dit_io", "speaker_encoder", "text_projection", "text_encoder"):
        assert four[part] == one[part]


def test_elementwise_and_optimizer_are_their_bytes_over_the_bandwidth():
    from echobench.predict.pricing import merge_bytes, split_share

    c = cfg()
    p = pr.predict(c, profile())
    saved = activation_elements_per_sample(c)[0] * c.micro_batch * 2  # bf16
    assert pr.priced(p.cfg, profile().device).compile is True  # compile: auto on a GPU profile
    priced = pr.priced(p.cfg, profile().device)
    merge = split_share(priced) * sum(merge_bytes(priced, 2))  # split's log-sum-exp merge (default cfg_drop_attention)
    assert merge > 0
    assert p.parts["elementwise"] == pytest.approx((sum(pr.ELEMENTWISE["compiled"]) * saved + merge) / (GBPS * 1e9))
    assert p.parts["optimizer"] == pytest.approx((pr.ADAMW_BYTES["fused"] + pr.CLIP_BYTES) * pr.rank_params(c)
                                                 / (GBPS * 1e9))
    sharded = pr.predict(cfg(parallelism="fsdp2"), profile())
    assert sharded.parts["optimizer"] == pytest.approx(p.parts["optimizer"] / 4)
    # a measured AdamW rate prices the optimizer's bytes; clipping stays at the add bandwidth
    measured = profile()
    measured.memory.append(MemoryPoint(op="adamw", nbytes=2**26, gbps=GBPS / 4, source="set"))
    assert pr.predict(c, measured).parts["optimizer"] == pytest.approx(
        pr.rank_params(c) * (pr.ADAMW_BYTES["fused"] / (GBPS / 4 * 1e9) + pr.CLIP_BYTES / (GBPS * 1e9)))


# ---- communication ----

@pytest.mark.parametrize("settings", [dict(), dict(parallelism="fsdp2"), dict(parallelism="hsdp", nodes=2),
                                      dict(framework="megatron", parallelism="tp2", nodes=2), dict(nodes=4)])
def test_communication_is_collective_seconds_of_commvolumes_bytes(settings):
    c, prof = cfg(**settings), profile(alpha=35e-6, bus_gbps=80.0)
    p = pr.predict(c, prof)
    # sequence parallelism (auto: on for megatron tp > 1 on a GPU) is priced as the layout without it
    traffic = [t for t in step_bytes(replace(c, sequence_parallel=False), "cuda") if t.group_size > 1]
    expected = sum(t.calls * collective_seconds(prof, t.op, t.nbytes / t.calls, t.group_size, t.link) for t in traffic)
    assert p.communication_s == pytest.approx(expected, rel=1e-12)
    assert sum(v["bytes"] for v in p.link_bytes.values()) == pytest.approx(sum(t.nbytes for t in traffic), rel=1e-9)
    assert sum(v["bus_bytes"] for v in p.link_bytes.values()) == pytest.approx(sum(t.bus_bytes for t in traffic),
                                                                               rel=1e-9)


def collective(seconds, floor, overlaps="backward") -> pr.Collective:
    return pr.Collective("x", "all_reduce", "dp", 2, "intra", 1, 1000, 1000.0, 0.0, 1.0, seconds, overlaps, floor)


def test_exposed_is_the_floor_when_compute_is_long_and_comm_minus_overlap_when_short():
    comm = [collective(3.0, 0.5), collective(1.0, 0.0), collective(2.0, 2.0, "none")]
    long_, short, none = (pr.exposed(comm, {"forward": 0.0, "backward": w}) for w in (10.0, 1.5, 0.0))
    assert long_ == {"none": 2.0, "forward": 0.0, "backward": 0.5}
    assert short["backward"] == pytest.approx(0.5 + (4.0 - 0.5 - 1.5))  # floor + what the window cannot cover
    assert none["backward"] == pytest.approx(4.0)  # no compute: all of it
    assert pr.exposed([collective(3.0, 0.0)], {"forward": 0.0, "backward": 5.0})["backward"] == 0.0


def test_ddp_exposes_its_last_bucket_behind_a_long_backward_and_everything_behind_none():
    c = cfg(scale="3B", nodes=2)  # 3B float32 gradients: many 100 MiB buckets
    slow = pr.predict(c, profile(gemm=1.0))  # compute far longer than the all-reduce
    buckets = next(x for x in slow.collectives if x.group == "dp" and x.op == "all_reduce" and x.nbytes > 8)
    assert buckets.calls > 2 and 0 < buckets.floor_s < buckets.seconds
    assert slow.exposed_communication_s == pytest.approx(buckets.floor_s, rel=1e-9)
    cpu = pr.predict(c, profile(gemm=1.0, device="CPU test"))  # a CPU: collectives hide behind nothing
    assert cpu.exposed_communication_s == pytest.approx(cpu.communication_s, rel=1e-9)


def test_ddp_step_time_follows_the_ring_as_nodes_grow():
    """Compute that hides nothing (a CPU profile), one link for all: the step is compute + the
    all-reduce's calls x alpha + 2 (W - 1) / W x bytes / bandwidth, W the world."""
    prof = profile(device="CPU synthetic", alpha=1e-5, bus_gbps=50.0)
    steps = {}
    for nodes in (2, 4, 16, 64, 1024):
        p = pr.predict(cfg(nodes=nodes), prof)
        grads = next(x for x in p.collectives if x.group == "dp" and x.nbytes > 8)
        world = nodes * 4
        ring = grads.calls * 1e-5 + 2 * (world - 1) / world * grads.nbytes / 50e9
        assert grads.seconds == pytest.approx(ring, rel=1e-12)
        steps[nodes] = p
    compute = {n: p.step_time_s - p.exposed_communication_s for n, p in steps.items()}
    assert len({round(v, 12) for v in compute.values()}) == 1  # compute does not change with nodes
    times = [p.step_time_s for p in steps.values()]
    assert times == sorted(times)
    # samples/s per GPU falls as 1 / step time
    assert all(p.samples_per_s / (n * 4) == pytest.approx(p.cfg.micro_batch / p.step_time_s) for n, p in steps.items())


def test_a_profile_missing_a_link_class_is_one_line_naming_the_fix():
    with pytest.raises(pr.PredictError) as err:
        pr.predict(cfg(nodes=2), profile(links=("intra",)))
    message = str(err.value)
    assert "\n" not in message and "inter" in message and "echobench calibrate --comm" in message
    # in a plan's predictions it stays that run's error, the others are predicted
    items = pr.predict_runs([cfg(), cfg(nodes=2)], [profile(links=("intra",))])
    assert isinstance(items[0], pr.Prediction) and isinstance(items[1], pr.PredictError)


# ---- MFU, interval, profile choice ----

def test_mfu_and_hfu_follow_the_records_convention():
    c = cfg(ac="full", nodes=2)
    p = pr.predict(c, profile())
    m = c.model_config()
    f = model_flops(m, c.audio_frames, c.text_tokens, c.speaker_frames)
    assert p.peak_tflops == 1000.0 and p.peak_source == "flag"
    assert p.mfu == pytest.approx(f.total * c.global_batch / (p.step_time_s * c.world_size * 1000e12))
    assert p.hfu == pytest.approx(hardware_flops(m, f, "full") * c.global_batch / (p.step_time_s * c.world_size * 1000e12))
    assert p.samples_per_s == pytest.approx(c.global_batch / p.step_time_s)
    # without the run's own peak: the datasheet entry of the profile's device, else its best GEMM rate
    assert pr.predict(replace(c, peak_tflops=None), profile(device="NVIDIA H100 80GB HBM3")).peak_tflops == 989.5
    assert pr.predict(replace(c, peak_tflops=None), profile()).peak_source.startswith("calibrated")


def test_the_interval_spans_the_calibrations_spread():
    flat = pr.predict(cfg(nodes=2), profile())
    # set figures have no spread: the interval is the model's cross-validated error alone, never zero
    assert (flat.step_time_low_s, flat.step_time_high_s) == pytest.approx(interval(flat.step_time_s))
    assert flat.step_time_low_s < flat.step_time_s < flat.step_time_high_s
    spread = profile()
    spread.gemm[0].tflops_min, spread.gemm[0].tflops_max = GEMM_TFLOPS / 2, GEMM_TFLOPS * 1.1
    for ops in spread.links.values():
        for fit in ops.values():
            fit.rel_rms = 0.2
    p = pr.predict(cfg(nodes=2), spread)
    assert p.step_time_low_s < p.step_time_s < p.step_time_high_s
    assert p.step_time_s == pytest.approx(flat.step_time_s)


def test_each_run_takes_the_profile_measured_most_like_it():
    one = profile(links=(), gpus_per_node=1)
    two = profile(links=("intra",), gpus_per_node=2)
    nodes = profile(links=("inter",), gpus_per_node=1)
    for p, name in ((one, "one"), (two, "two"), (nodes, "nodes")):
        p.name = name
        for ops in p.links.values():  # measured on 2 processes
            for fit in ops.values():
                fit.points = [CommPoint(nbytes=1024, group_size=2, seconds=1e-5)]
    given = [nodes, two, one]
    assert pr.choose_profile(cfg(parallelism="single", gpus_per_node=1), given).name == "one"
    assert pr.choose_profile(cfg(gpus_per_node=2), given).name == "two"
    assert pr.choose_profile(cfg(gpus_per_node=1, nodes=2), given).name == "nodes"


# ---- counted constants against a real tiny step ----

TINY = dict(scale="tiny", device="cpu", micro_batch=3, audio_frames=150, text_tokens=24, speaker_frames=60)


@pytest.mark.slow
@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_host_op_table_matches_a_real_tiny_step(ac):
    import torch

    from echobench.calibrate.commbench import host_steps
    from echobench.train.distributed import DistInfo

    c = RunConfig(**TINY, ac=ac, parallelism="single")
    _, ops = host_steps(c, DistInfo(), torch.float32, 1, 1, 60.0)
    assert sum(pr.host_ops(pr.priced(c, "CPU")).values()) == pytest.approx(ops, rel=0.02)


@pytest.mark.slow
def test_the_elementwise_factors_hold_at_other_shapes():
    """Bytes read + written by the non-matmul, non-view ATen ops of a real tiny step's forward and
    backward, over the saved-activation estimate, at a shape the factors were not counted at."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from echobench.backends import build_training
    from echobench.data import build_tokenizer, make_loader
    from echobench.train.distributed import DistInfo
    from echobench.model.echo import diffusion_draws

    def tensors(v):
        return [v] if isinstance(v, torch.Tensor) else [t for x in v for t in tensors(x)] \
            if isinstance(v, (list, tuple)) else []

    class Bytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            view = any(r.alias_info is not None for r in func._schema.returns) and not func._schema.is_mutable
            if not view and name not in ("mm", "addmm", "bmm") and "attention" not in name:
                self.total += sum(t.numel() * t.element_size() for t in tensors([*args, out]))
            return out

    c = RunConfig(**TINY)
    setup = build_training(c, DistInfo(), torch.float32)
    m = c.model_config()
    loader = make_loader("synthetic", micro_batch=c.micro_batch, audio_frames=c.audio_frames,
                         text_tokens=c.text_tokens, speaker_frames=c.speaker_frames,
                         tokenizer=build_tokenizer(m.text_encoder.vocab, None), rank=0, world_size=1, seed=0,
                         skip_bad_samples=False)
    try:
        batch = next(loader)
        draws = diffusion_draws(0, batch.index.tolist(), c.audio_frames, m.latent_dim, m.cfg_dropout,
                                torch.device("cpu"))
        with Bytes() as fwd:
            err = setup.model(batch, draws=draws, reduction="sum")
        with Bytes() as bwd:
            err.backward()
    finally:
        loader.close()
    saved = activation_elements_per_sample(c)[0] * c.micro_batch * 4
    forward, backward = pr.ELEMENTWISE["eager"]
    assert fwd.total / saved == pytest.approx(forward, rel=0.25)
    assert bwd.total / saved == pytest.approx(backward, rel=0.25)


# ---- the command line ----

def test_predict_json_has_one_object_per_run_of_the_matrix(cli):
    path = ROOT / "matrices" / "gh200-published.yaml"
    out = json.loads(cli("predict", path, "--json", check=True).stdout)
    ids = [r.id for r in expand(load_matrix(path)).runs]
    assert sorted(o["run_id"] for o in out) == sorted(ids)
    for o in out:
        assert o["step_time_s"] > 0 and 0 < o["mfu"] < 1 and o["profile"] == "gh200-quad-ib"  # fabric: infiniband
        assert o["step_time_low_s"] <= o["step_time_s"] <= o["step_time_high_s"] and o["rank"] >= 1
    # at node counts the matrix does not have: every configuration at each (single stays on one node)
    many = json.loads(cli("predict", path, "--json", "--nodes", "1,64,1024", check=True).stdout)
    # 5 configurations x 3 node counts, but HSDP on 1 node (it needs 2: a line of its own, not an object)
    assert len(many) == 5 * 3 - 1 and {o["settings"]["nodes"] for o in many} == {1, 64, 1024}


def test_predict_refuses_bad_node_counts_and_a_matrix_without_a_profile(cli, tmp_path):
    path = ROOT / "matrices" / "gh200-published.yaml"
    proc = cli("predict", path, "--nodes", "0,4")
    assert proc.returncode == 2 and "between 1 and 1024" in proc.stderr
    proc = cli("predict", ROOT / "matrices" / "smoke.yaml")
    assert proc.returncode == 2 and "--profile" in proc.stderr and "echobench calibrate --comm" in proc.stderr


def test_node_counts_with_an_empty_entry_are_refused():
    assert pr.parse_nodes("1,4,4,16") == [1, 4, 16]
    for text in ("1,,2", ",4", "", " "):
        with pytest.raises(pr.PredictError, match="give node counts separated by commas"):
            pr.parse_nodes(text)


def test_a_profile_without_gemm_points_is_a_line_per_run_and_exit_1(cli, tmp_path):
    save_profile(profile().model_copy(update={"gemm": []}), tmp_path / "p.yaml")
    proc = cli("predict", ROOT / "matrices" / "h200-single.yaml", "--profile", tmp_path / "p.yaml")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("not predicted:")]
    assert lines and all("has no GEMM points: measure them with `echobench calibrate --comm`" in ln for ln in lines)
    assert "no run of" in proc.stderr


def test_a_matrix_without_hardware_device_takes_this_machines_calibrated_profile(cli, tmp_path, monkeypatch):
    from echobench.hardware.profile import calibrated_profile_path

    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))  # the cache the command's env names too
    assert cli("predict", ROOT / "matrices" / "smoke.yaml").returncode == 2  # none measured yet
    here = pr.machine_device([cfg(device="cpu")])
    mine = profile(device=here, gpus_per_node=2).model_copy(update={"name": "mine"})
    save_profile(mine, calibrated_profile_path(here, "float32"))  # where calibrate --comm leaves it
    out = json.loads(cli("predict", ROOT / "matrices" / "smoke.yaml", "--json", check=True).stdout)
    assert out and all(o["profile"] == "mine" for o in out)


def test_against_refuses_node_counts_and_warns_of_a_profile_of_another_device(cli, tmp_path):
    c = cfg()
    rec = measured_record(c, 1.0)
    rec.save(tmp_path / "runs" / rec.run_id)
    save_profile(profile(device="OTHER GPU"), tmp_path / "p.yaml")
    proc = cli("validate", "measured", tmp_path / "runs", "--nodes", "4")  # each record at the node count it ran on
    assert proc.returncode == 2 and "No such option: --nodes" in proc.stderr
    proc = cli("validate", "measured", tmp_path / "runs", "--profile", tmp_path / "p.yaml", check=True)
    assert "warning: 1 run(s) measured on 'SYNTHETIC GPU', predicted from a profile of another device " \
           "(OTHER GPU)" in " ".join(proc.stderr.split())
    save_profile(profile(), tmp_path / "same.yaml")
    proc = cli("validate", "measured", tmp_path / "runs", "--profile", tmp_path / "same.yaml", check=True)
    assert "another device" not in proc.stderr


def measured_record(c: RunConfig, step_s: float, **extra) -> Record:
    """A successful record of c's settings with a set step time (and MFU, by the record's convention)."""
    m = c.model_config()
    flops = model_flops(m, c.audio_frames, c.text_tokens, c.speaker_frames).total
    mfu = flops * c.global_batch / (step_s * c.world_size * c.peak_tflops * 1e12)
    rec = Record.of_settings(c, status="ok", precision=c.precision, peak_tflops=c.peak_tflops, peak_source="flag",
                             env=Env(device_name="SYNTHETIC GPU", time="2026-12-01T00:00:00+00:00"))
    return rec.update(step_time_s=step_s, step_time_p10_s=step_s, step_time_p90_s=step_s, step_time_mean_s=step_s,
                      step_time_mean_vs_median=0.0, model_flops_per_sample=flops, mfu=mfu, hfu=mfu,
                      samples_per_s=c.global_batch / step_s, audio_seconds_per_s=c.global_batch / step_s * 12,
                      tflops_per_gpu=mfu * c.peak_tflops, peak_mem_gib=10.0, **extra)


def test_against_error_is_predicted_minus_measured_over_measured(cli, tmp_path):
    c = cfg(nodes=2)
    prof = profile()
    predicted = pr.predict(c, prof).step_time_s
    rec = measured_record(c, 2 * predicted)
    comparison = pr.against(rec, [prof])
    assert comparison.error == pytest.approx(-0.5) and comparison.measured_step_time_s == 2 * predicted
    assert comparison.prediction.mfu == pytest.approx(2 * rec.mfu)
    rec.save(tmp_path / "runs" / rec.run_id)
    save_profile(prof, tmp_path / "p.yaml")
    out = json.loads(cli("validate", "measured", tmp_path / "runs", "--profile", tmp_path / "p.yaml", "--json",
                         check=True).stdout)
    assert len(out) == 1 and out[0]["run_id"] == rec.run_id
    assert out[0]["error"] == pytest.approx(-0.5) and out[0]["measured_step_time_s"] == pytest.approx(2 * predicted)
    assert out[0]["measured_mfu"] == pytest.approx(rec.mfu) and out[0]["step_time_s"] == pytest.approx(predicted)
    # measured runs are held at the committed fit, named in the output: never refitted on them
    committed = json.loads((ROOT / "validation" / "fit.json").read_text())
    assert out[0]["fit"]["fit"] == "committed" and out[0]["fit"]["clock"] == committed["clock"]
    assert out[0]["fit"]["fitted_on"] == len(committed["fitted_on"]) and not out[0]["fit"]["in_sample"]
    table = cli("validate", "measured", tmp_path / "runs", "--profile", tmp_path / "p.yaml", check=True).stdout
    assert "-50.0%" in table and "mean |error| 50.0%, max 50.0% over 1 runs" in table
    assert "the committed fit validation/fit.json" in " ".join(table.split())


def test_against_holds_each_part_against_a_profiled_breakdown():
    c = cfg(nodes=2)
    prof = profile()
    fractions = {"gemm": 0.4, "attention": 0.1, "optimizer": 0.05, "other_compute": 0.2, "memcpy": 0.05,
                 "communication": 0.1, "data_wait": 0.0, "idle": 0.1}
    rec = measured_record(c, 1.0, breakdown={"fractions": fractions, "step_time_s": 1.0})
    parts = pr.against(rec, [prof]).parts
    assert {k: v["measured"] for k, v in parts.items()} == pytest.approx(
        {"gemm": 0.4, "attention": 0.1, "optimizer": 0.05, "communication": 0.1, "other": 0.35})
    assert sum(v["predicted"] for v in parts.values()) == pytest.approx(1.0)


def test_plan_shows_the_predicted_columns(cli, tmp_path):
    path = ROOT / "matrices" / "gh200-published.yaml"
    rows = json.loads(cli("plan", path, "--json", check=True).stdout)["runs"]
    predicted = {o["run_id"]: o for o in json.loads(cli("predict", path, "--json", check=True).stdout)}
    for row in rows:
        assert row["predicted_step_time_s"] == pytest.approx(predicted[row["run_id"]]["step_time_s"])
        assert row["predicted_mfu"] == pytest.approx(predicted[row["run_id"]]["mfu"])
        # a range from the prediction's interval, never zero width, MFU as 1 / step time
        lo, hi = row["predicted_step_time_range_s"]
        assert [lo, hi] == pytest.approx([predicted[row["run_id"]]["step_time_low_s"],
                                          predicted[row["run_id"]]["step_time_high_s"]])
        assert lo < row["predicted_step_time_s"] < hi
        assert row["predicted_mfu_range"] == pytest.approx([row["predicted_mfu"] * row["predicted_step_time_s"] / t
                                                            for t in (hi, lo)])
        assert row["gpu_hours_estimate_range"][0] < row["gpu_hours_estimate"] < row["gpu_hours_estimate_range"][1]
    # GPU-hours from the prediction where there is one, not from the assumed 40% MFU beside it
    from echobench.sweep.estimate import startup_parts

    matrix = load_matrix(path)
    by_id = {r.id: r for r in expand(matrix, "slurm").runs}
    for row in rows:
        cfg = by_id[row["run_id"]].cfg
        assert row["gpu_hours_basis"] == "predicted"
        seconds = sum(startup_parts(matrix, cfg.may_compile()).values()) \
            + (cfg.steps + cfg.warmup_steps) * row["predicted_step_time_s"]
        assert row["gpu_hours_estimate"] == pytest.approx(seconds * cfg.world_size / 3600)
    text = " ".join(cli("plan", path, check=True).stdout.split())
    assert "pred s / MFU (range)" in text and f"({len(rows)} run(s) at their predicted step time, " in text, text
    low = sum(r["gpu_hours_estimate_range"][0] for r in rows)
    assert f"{low:.2f}-" in text and "over the model's cross-validated error" in text
    smoke = json.loads(cli("plan", ROOT / "matrices" / "smoke.yaml", "--json", check=True).stdout)["runs"]
    assert all(r["predicted_mfu"] is None for r in smoke)  # a CPU matrix: no profile unless --profile


def test_every_shipped_matrix_predicts():
    """Every run of every matrices/*.yaml gets a prediction: on the shipped profile of its device, or
    (CPU matrices) a synthetic CPU profile with both link classes. How fast: reports/predict-cpu-*.md."""
    cpu = profile(device="CPU synthetic", gpus_per_node=2)
    for path in sorted((ROOT / "matrices").glob("*.yaml")):
        matrix = load_matrix(path)
        found = pr.profile_for_device(matrix.spec.hardware.device)
        cfgs = [r.cfg for r in expand(matrix, "slurm").runs]
        items = pr.predict_runs(cfgs, [found or cpu])
        assert cfgs and all(isinstance(p, pr.Prediction) and math.isfinite(p.step_time_s) and p.step_time_s > 0
                            for p in items), (path, items)


# ---- the dashboard ----

def dashboard_records(root: Path, prof: HardwareProfile) -> dict[str, tuple[Record, float]]:
    """800M records with set step times against their predictions on `prof`: ddp on 1 and 2 nodes at
    1.1 x and 2 x the predicted step (the second flagged at a 15% margin), fsdp2 on 1 node at 0.7 x.
    Returns run id -> (record, predicted step)."""
    out = {}
    for settings, factor in ((dict(nodes=1), 1.1), (dict(nodes=2), 2.0), (dict(parallelism="fsdp2"), 0.7)):
        c = cfg(scale="800M", **settings)
        predicted = pr.predict(c, prof).step_time_s
        rec = measured_record(c, factor * predicted)
        rec.save(root / rec.run_id)
        out[rec.run_id] = (rec, predicted)
    return out


def test_report_puts_predictions_beside_measurements_only_with_a_profile(cli, tmp_path):
    from echobench.report import load_report_input
    from echobench.report.data import flagged, with_predictions

    prof = profile()
    records = dashboard_records(tmp_path / "runs", prof)
    plain = load_report_input([tmp_path / "runs"])
    assert plain.frame["predicted_mfu"].isna().all()
    data = with_predictions(load_report_input([tmp_path / "runs"]), [prof], 0.15)
    frame = data.frame.set_index("run_id")
    for rid, (rec, predicted) in records.items():
        assert frame.loc[rid, "predicted_step_time_s"] == pytest.approx(predicted)
        assert frame.loc[rid, "prediction_error"] == pytest.approx((predicted - rec.step_time_s) / rec.step_time_s)
    assert sorted(frame.index[frame["below_prediction"].map(flagged)]) == \
        [rid for rid, (rec, p) in records.items() if rec.step_time_s > p / 0.85]


@pytest.mark.browser
def test_dashboard_draws_predicted_markers_and_flags_runs_below_prediction_in_chromium(cli, tmp_path):
    from echobench.report.browser import layout_problems
    from echobench.report.tables import fmt_number
    from test_report import assert_clean, browser_or_skip

    prof = profile()
    records = dashboard_records(tmp_path / "runs", prof)
    save_profile(prof, tmp_path / "p.yaml")
    out = tmp_path / "report.html"
    cli("report", tmp_path / "runs", "-o", out, "--profile", tmp_path / "p.yaml", "--margin", "15", check=True)
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        traces = page.evaluate("document.getElementById('fig-mfu-0')._fullData.map(t => [t.name, Array.from(t.y), "
                               "t.marker.symbol, t.showlegend])")
        predicted = {name: (y, symbol, legend) for name, y, symbol, legend in traces if name.startswith("predicted")}
        # one trace per configuration, open circles, one legend entry for all
        assert len(predicted) == 2 and all(s == "circle-open" for _, s, _ in predicted.values())
        assert sum(legend for _, _, legend in predicted.values()) == 1
        expected = sorted(round(100 * pr.against(rec, [prof]).prediction.mfu, 9) for rec, _ in records.values())
        assert sorted(round(v, 9) for y, _, _ in predicted.values() for v in y) == expected
        # the runs table: the predicted step, the residual, the flag on the run 2x slower than predicted
        rows = page.evaluate("(() => { const h = Array.from(document.querySelectorAll('#runs th')).map(th => "
                             "th.textContent); return Array.from(document.querySelectorAll('#runs tbody tr')).map(tr "
                             "=> [tr.cells[0].textContent.trim(), tr.cells[h.indexOf('vs prediction (%)')].textContent"
                             ".trim(), tr.dataset.below || '']); })()")
        by_id = {rid: (cell, below) for rid, cell, below in rows}
        for rid, (rec, p) in records.items():
            cell, below = by_id[rid]
            assert cell.startswith(fmt_number((p - rec.step_time_s) / rec.step_time_s, percent=True))
            assert (below == "1") == (rec.step_time_s > p / 0.85) and ("below prediction" in cell) == (below == "1")
        assert "1 run(s) more than 15% below their predicted throughput" in page.evaluate(
            "document.getElementById('notes').textContent")
        assert layout_problems(page)[1] == []
        assert_clean(page)


def test_the_yaml_of_a_profile_with_host_steps_reads_back(tmp_path):
    from echobench.hardware.profile import HostPoint, load_profile

    prof = profile(host_steps=[HostPoint(scale="tiny", micro_batch=1, audio_frames=16, text_tokens=8, speaker_frames=16,
                                         ops=2200, step_s=0.011, source="set")])
    path = save_profile(prof, tmp_path / "p.yaml")
    assert load_profile(path).host_steps == prof.host_steps
    assert yaml.safe_load(path.read_text())["host_steps"][0]["ops"] == 2200
    # on a GPU the tiny step hides its device work: the host costs its step over its ops per op
    p = pr.predict(cfg(parallelism="single", gpus_per_node=1), prof)
    assert p.host_s == pytest.approx(sum(pr.host_ops(pr.priced(p.cfg, prof.device)).values()) * 0.011 / 2200)
    assert run_id(p.cfg) == p.run_id


# ---- the in-situ factor (CPU) ----

def _cpu_profile_with_host_steps(factor: float, per_op: float) -> HardwareProfile:
    """A CPU profile with set rates and the two single host steps calibrate --comm measures there,
    their times made of `factor` x their compute at those rates + their optimizer + per_op x ops."""
    from echobench.calibrate.commbench import HOST_RUN, REFERENCE_RUN
    from echobench.hardware.profile import HostPoint

    prof = profile(device="CPU SYNTHETIC (2 cores)", gpus_per_node=1)
    prof = prof.model_copy(update={"dtype": "float32"})
    rates = pr.Rates(prof)
    rates._factor = 1.0  # the compute as timed alone
    points = []
    for shape, ops in ((HOST_RUN, 2200), (REFERENCE_RUN, 2230)):
        run = RunConfig(**shape)
        dev = pr.device_seconds(run, rates, pr.compute_bytes(run, prof))
        compute = sum(v for k, v in dev.items() if k != "optimizer")
        step = factor * compute + dev["optimizer"] + per_op * ops
        points.append(HostPoint(**shape, ops=ops, step_s=step, source="set"))
    return prof.model_copy(update={"host_steps": points})


def test_a_cpu_steps_compute_is_its_measured_rates_and_its_element_wise_bytes_counted_at_dram_bandwidth():
    """Two host steps give the host's cost per op, not a factor on the compute (issue 42: the factor
    they fitted took the model's error on the reference step for the CPU's); the step's element-wise
    bytes are counted (stepcount) and priced at the DRAM point even where its tensors would fit the
    cache-sized one: each op writes a fresh allocation (a traced tiny step ran them at DRAM's rate)."""
    from echobench.predict.elementwise import echo_elementwise

    prof = _cpu_profile_with_host_steps(1.4, 3e-6)
    rates = pr.Rates(prof)
    assert rates.compute_factor == 1.0 and "in-situ" not in pr.profile_lines([prof])[0]
    run = RunConfig(scale="tiny", micro_batch=4, audio_frames=200, text_tokens=64, speaker_frames=160, device="cpu")
    assert pr.predict(run, prof).parts["gemm"] == pytest.approx(pr.predict(run, prof.model_copy(
        update={"host_steps": prof.host_steps[:1]})).parts["gemm"], rel=1e-9)
    dram = MemoryPoint(op="add", nbytes=64 * 2**20, gbps=10.0, source="set")
    cache = MemoryPoint(op="add", nbytes=2**20, gbps=40.0, source="set")
    two = prof.model_copy(update={"memory": [dram, cache]})
    one = prof.model_copy(update={"memory": [dram]})
    ew = lambda p: pr.predict(run, p).parts["elementwise"]  # noqa: E731
    (fwd, bwd), how = echo_elementwise(pr.priced(run, prof.device), 4)
    assert "COUNTED" in how and fwd > 0 and bwd > 0
    assert ew(two) == pytest.approx(ew(one), rel=1e-9) == pytest.approx((fwd + bwd) / 10e9, rel=1e-9)


def test_the_dits_attention_is_priced_at_the_runs_mix_of_masked_micro_batches():
    """A synthetic run's micro-batches in which a sample drops its conditioning (cfg_drop mask) attend
    over a key mask (FlexAttention): their share of the DiT's attention is priced at FlexAttention's
    rate, slower than FlashAttention-2's; null conditioning attends unmasked throughout."""
    from echobench.hardware.profile import find_profile, load_profile
    from echobench.model.config import masked_share
    from echobench.predict.pricing import dit_attention_mix

    profile = load_profile(find_profile("h200-hgx-ib"))
    runs = {drop: RunConfig(scale="3B", micro_batch=8, device="cuda", compile=True, cfg_drop=drop,
                            cfg_drop_attention="masked") for drop in ("mask", "null")}
    mix = dit_attention_mix(runs["mask"])
    assert mix == pytest.approx({"flash2": 1 - masked_share(8, 0.1), "flex": masked_share(8, 0.1)})
    assert dit_attention_mix(runs["null"]) == {"flash2": 1.0}
    assert dit_attention_mix(replace(runs["mask"], data="/shards")) == {"flex": 1.0}
    p = {drop: pr.predict(cfg, profile) for drop, cfg in runs.items()}
    attention = {drop: q.parts["attention"] for drop, q in p.items()}
    assert attention["mask"] > attention["null"]
    assert any("57% flex" in n for n in p["mask"].notes) and not any("flex" in n for n in p["null"].notes)


def test_split_prices_the_dropped_micro_batches_as_two_unmasked_calls_and_their_merge():
    """cfg_drop_attention split (the default): the micro-batches that drop a sample's conditioning
    attend through two unmasked flash calls (latent keys, conditioning keys) merged by their
    log-sum-exp: their attention at FlashAttention-2's rates at those shapes, cheaper than
    FlexAttention's masked call here, the merge's bytes added to the element-wise time; masked is
    priced as before, and so is a run where split cannot run (fp32, another pinned backend)."""
    from echobench.hardware.profile import find_profile, load_profile
    from echobench.model.config import masked_share
    from echobench.predict.pricing import Rates, device_seconds, dit_attention_mix, merge_bytes, split_share
    from echobench.predict.work import run_work

    profile = load_profile(find_profile("h200-hgx-ib"))
    rates = Rates(profile)
    masked = RunConfig(scale="3B", micro_batch=8, device="cuda", compile=True, cfg_drop_attention="masked")
    split = replace(masked, cfg_drop_attention="split")
    share = masked_share(8, 0.1)
    assert split_share(split) == pytest.approx(share) and split_share(masked) == 0
    assert dit_attention_mix(split) == {"flash2": 1.0}
    assert split_share(replace(split, precision="fp32")) == split_share(replace(split, sdpa_backend="cudnn")) == 0
    s, m = device_seconds(split, rates, 2), device_seconds(masked, rates, 2)
    att = lambda d: d["attention_forward"] + d["attention_backward"]  # noqa: E731
    assert att(s) < att(m)  # the profile's flex points are slower than flash2's
    # the split share priced call by call at flash2's rate at (latent, latent) and (latent, conditioning)
    dit = [a for a in run_work(split)[1] if a.part == "dit_attention"]
    unmasked = replace(masked, cfg_drop="null")
    base = device_seconds(unmasked, rates, 2)
    seconds = lambda a, seq_k, flops: flops / (rates.attention_tflops(a.seq_q, seq_k, a.head_dim, False,  # noqa: E731
                                                                      "flash2") * 1e12) * rates.compute_factor
    joint = sum(seconds(a, a.seq_k, a.flops) for a in dit)
    calls = sum(seconds(a, k, a.flops * k / a.seq_k) for a in dit for k in (a.seq_q, a.seq_k - a.seq_q))
    assert att(s) == pytest.approx(att(base) + share * (calls - joint), rel=1e-9)
    fwd, bwd = merge_bytes(split, 2)
    assert fwd > 0 and bwd > 0
    ew = lambda d: d["elementwise_forward"] + d["elementwise_backward"]  # noqa: E731
    assert ew(s) > ew(base)
    assert merge_bytes(replace(split, compile=False), 2)[0] > fwd  # eager: each op its own pass


def test_a_record_older_than_cfg_drop_attention_is_read_as_it_ran():
    """Settings stored before cfg_drop_attention and master_weights existed ran masked and
    fp32-autocast: as_ran reads them so (validate measured), while their configuration id stays."""
    from echobench.records.config import as_ran, configuration_id

    old = RunConfig(scale="3B", micro_batch=8).to_dict()
    del old["cfg_drop_attention"], old["master_weights"]
    ran = RunConfig.from_dict(as_ran(old))
    assert ran.cfg_drop_attention == "masked" and ran.master_weights == "fp32-autocast"
    new = RunConfig(scale="3B", micro_batch=8).to_dict()
    assert RunConfig.from_dict(as_ran(new)).cfg_drop_attention == "split"
    assert configuration_id(old) == configuration_id(new)


def test_predict_counts_its_assumptions_and_lists_them_with_notes(cli):
    path = ROOT / "matrices" / "gh200-published.yaml"
    notes = {n for o in json.loads(cli("predict", path, "--json", check=True).stdout) for n in o["notes"]}
    assert notes  # the shipped GH200 profile is not measured: at least that is assumed
    plain = cli("predict", path, check=True).stdout
    assert "\nnote: " not in plain and f"{len(notes)} assumption(s) behind these predictions: --notes" in plain
    listed = cli("predict", path, "--notes", check=True).stdout
    assert len([line for line in listed.splitlines() if line.startswith("note: ")]) == len(notes)
