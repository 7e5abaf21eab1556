"""`echobench tune` (echobench.tune): the search space pruned by memory and by the backends' rules,
ranked by the performance model, the picks (top K and each layout family's best), the loop that
measures, recalibrates and stops (on measurements given by the test: deterministic), and bad input.
The real runs through the local executor are tests/test_tune_runs.py."""

from __future__ import annotations

import math

import pytest
import yaml

from echobench import predict as pr
from echobench.hardware.profile import load_profile
from echobench.predict.memory import estimate_memory
from echobench.tune.loop import Measured, fit_profile, residuals, run_tune, scaled
from echobench.tune.output import interval, write_outputs
from echobench.tune.space import TuneError, TuneFile, build_problem, load_tune_file, picks
from test_predict import cfg as predict_cfg
from test_predict import profile


def spec(**fields) -> TuneFile:
    base = dict(name="t", scale="800M", nodes=[1], gpus_per_node=8, executor="slurm", hardware={"memory_gib": 141},
                defaults={"device": "cuda", "audio_frames": 300, "text_tokens": 64, "speaker_frames": 200,
                          "peak_tflops": 1000.0},
                search={"compile": [True]})
    return TuneFile.model_validate({**base, **fields})


GPU = profile(gpus_per_node=8)


# ---- pruning ----

def test_memory_prunes_exactly_what_the_estimate_with_its_margin_does_not_fit():
    s = spec(hardware={"memory_gib": 30}, memory_margin=0.2)
    problem = build_problem(s, "800M", 1, GPU)
    by_memory = [c for c in problem.pruned if c.pruned.startswith("memory")]
    assert by_memory and problem.ranked
    for c in by_memory:
        assert estimate_memory(c.cfg).total_gib * 1.2 > 30
    for c in problem.ranked:
        assert estimate_memory(c.cfg).total_gib * 1.2 <= 30
    # a bigger device keeps more of the same space
    assert len(build_problem(spec(hardware={"memory_gib": 60}, memory_margin=0.2), "800M", 1, GPU).ranked) > \
        len(problem.ranked)


def test_rules_prune_tp_over_heads_and_hsdp_on_one_node():
    problem = build_problem(spec(), "800M", 1, GPU)  # 800M has 10 heads
    reasons = {c.cfg.parallelism: c.pruned for c in problem.pruned if c.cfg is not None}
    assert "does not divide the 10 attention heads" in reasons["tp4"] and "tp8" in reasons
    assert {c.cfg.parallelism for c in problem.ranked} == {"ddp", "fsdp2", "tp2"}
    s = spec(search={"compile": [True], "parallelism": ["hsdp", "fsdp2"]})
    assert any("hsdp" in c.pruned and "nodes >= 2" in c.pruned for c in build_problem(s, "800M", 1, GPU).pruned)


def test_a_held_global_batch_sets_accumulation_and_prunes_what_cannot_make_it():
    problem = build_problem(spec(global_batch=64), "800M", 1, GPU)
    assert {c.cfg.global_batch for c in problem.ranked} == {64}
    assert {c.cfg.grad_accum for c in problem.ranked} >= {1, 2, 4}
    # micro-batch 16 and 32 on 8 data-parallel ranks overshoot 64: pruned as batch
    assert any(c.pruned.startswith("batch") and c.cfg.micro_batch == 16 and c.cfg.dp == 8 for c in problem.pruned)


# ---- ranking and picks ----

def test_the_ranking_is_the_models_samples_per_second_of_the_whole_job():
    problem = build_problem(spec(), "800M", 1, GPU)
    rates = [c.prediction.samples_per_s for c in problem.ranked]
    assert all(a >= b * (1 - 1e-12) for a, b in zip(rates, rates[1:]))
    for c in problem.ranked[:5]:
        assert c.prediction.samples_per_s == pytest.approx(pr.predict(c.cfg, GPU).samples_per_s)
    # The whole job's, not one GPU's: DDP's 8 replicas each step as one GPU alone would, plus the
    # gradient all-reduce, so the job does more than one GPU and at most 8 of them.
    ddp = [c for c in problem.ranked if c.cfg.parallelism == "ddp"][:3]
    assert ddp
    for c in ddp:
        alone = pr.predict(c.cfg.__class__(**{**c.cfg.to_dict(), "parallelism": "single", "gpus_per_node": 1}), GPU)
        assert alone.samples_per_s < c.prediction.samples_per_s <= 8 * alone.samples_per_s * (1 + 1e-9)


def test_picks_are_the_top_k_and_the_best_of_every_family_not_among_them():
    ranked = build_problem(spec(), "800M", 1, GPU).ranked
    chosen = picks(ranked, 2)
    assert chosen[:2] == ranked[:2]
    families = {c.family for c in ranked}
    assert {c.family for c in chosen} == families
    for c in chosen[2:]:  # each the best-ranked of its family
        assert c is next(d for d in ranked if d.family == c.family)
        assert c.family not in {d.family for d in ranked[:2]}


# ---- the loop, on measurements the test sets ----

def fake_measure(truth):
    """A measure function whose samples/s are truth(candidate), recording what it was asked."""
    asked = []

    def measure(candidates):
        asked.append([c.run_id for c in candidates])
        return {c.run_id: Measured(c.run_id, "ok", truth(c), 1.0) for c in candidates}

    return measure, asked


def test_a_mis_ranked_profile_still_finds_the_measured_winner_through_the_family_pick(tmp_path):
    """The profile ranks every DDP candidate below the top K; the truth makes DDP 3x faster than
    predicted. The family pick measures DDP's best in round 1, and it wins."""
    s = spec(top_k=2, max_rounds=2)
    problem = build_problem(s, "800M", 1, GPU)
    ddp_best = next(c for c in problem.ranked if c.family == "ddp")
    assert ddp_best not in problem.ranked[:2]  # the top K alone would never measure it
    measure, asked = fake_measure(lambda c: c.prediction.samples_per_s * (3 if c.family == "ddp" else 1))
    result = run_tune(s, [problem], GPU, measure, tmp_path)
    assert ddp_best.run_id in asked[0]
    doc = write_outputs(s, tmp_path / "t.yaml", result, tmp_path)
    measured = {c["run_id"]: c["measured"]["samples_per_s"] for c in doc["problems"][0]["candidates"] if c["measured"]}
    assert doc["problems"][0]["winner"] == max(measured, key=measured.get)
    assert doc["problems"][0]["winner"].startswith("800M-torchtitan-ddp")


def test_a_shared_bias_recalibrates_the_profile_and_the_ranking_agrees(tmp_path):
    """Measured runs all at half the predicted samples/s: the compute factor is refitted (FITTED,
    kept beside the shipped profile), the residuals shrink, and the tune stops on agreement."""
    s = spec(top_k=2, max_rounds=3)
    problem = build_problem(s, "800M", 1, GPU)
    truth = {c.run_id: c.prediction.samples_per_s * 0.5 for c in problem.ranked}
    measure, _ = fake_measure(lambda c: truth[c.run_id])
    before = dict(residuals([problem], {}))
    assert not before
    result = run_tune(s, [problem], GPU, measure, tmp_path)
    fitted = load_profile(tmp_path / "profile-tuned.yaml")
    assert fitted.in_step.factor > 1 and "FITTED" in fitted.in_step.source and fitted.name.endswith("-tuned")
    shipped_err = [math.log(truth[rid] / pr.predict(problem_cfg(problem, rid), GPU).samples_per_s) ** 2
                   for rid in result.measured]
    fitted_err = [math.log(truth[rid] / pr.predict(problem_cfg(problem, rid), fitted).samples_per_s) ** 2
                  for rid in result.measured]
    assert sum(fitted_err) < 0.2 * sum(shipped_err)
    assert result.stops[problem.key] == "the measured winner is the predicted winner"


def problem_cfg(problem, rid):
    return next(c.cfg for c in problem.ranked if c.run_id == rid)


def test_the_budget_stops_measuring(tmp_path):
    s = spec(top_k=1, max_rounds=3, budget_gpu_hours=0.001)
    problem = build_problem(s, "800M", 1, GPU)
    measure, asked = fake_measure(lambda c: c.prediction.samples_per_s * (2 if c.family == "megatron-tp" else 1))
    info = {"wall_s": 3600.0, "exit_code": 0}  # the first round holds 8 GPUs for an hour
    result = run_tune(s, [problem], GPU, measure, tmp_path, info)
    assert len(asked) == 1 and "budget spent" in result.stops[problem.key]


def test_fit_profile_recovers_the_factors_the_runs_were_made_with(tmp_path):
    """Runs 'measured' as the model predicts them with compute x 1.3 and collectives at a quarter of
    the bandwidth: the fit finds both, and says so (FITTED) in the profile it keeps."""
    truth = scaled(GPU, 1.3, 0.25)
    cfgs = {pr.run_id(c): c for c in (predict_cfg(), predict_cfg(parallelism="fsdp2", micro_batch=2),
                                      predict_cfg(framework="megatron", parallelism="tp2", micro_batch=1),
                                      predict_cfg(micro_batch=16))}
    measured = {rid: Measured(rid, "ok", pr.predict(c, truth).samples_per_s) for rid, c in cfgs.items()}
    fitted, note = fit_profile(GPU, cfgs, measured, tmp_path)
    assert fitted.in_step.factor == pytest.approx(1.3, rel=0.02)
    assert fitted.links["intra"]["all_reduce"].bus_gbps == pytest.approx(0.25 * GPU.links["intra"]["all_reduce"].bus_gbps,
                                                                         rel=0.05)
    kept = load_profile(tmp_path / "profile-tuned.yaml")
    assert kept.in_step.factor == fitted.in_step.factor and "FITTED" in kept.in_step.source and "FITTED" in note
    assert sorted(kept.in_step.fitted_on) == sorted(cfgs)


# ---- bad input ----

def test_a_scale_that_fits_nowhere_names_the_smallest_node_count_that_would():
    s = spec(scale="8B", gpus_per_node=1, hardware={"memory_gib": 80})
    with pytest.raises(TuneError) as err:
        build_problem(s, "8B", 1, GPU)
    message = str(err.value)
    assert "\n" not in message and "fits nowhere" in message
    n = int(message.split("smallest node count where a candidate fits is ")[1].split(" ")[0])
    assert build_problem(s, "8B", n, GPU).ranked  # it does fit there
    if n > 2:
        with pytest.raises(TuneError):
            build_problem(s, "8B", n // 2, GPU)


@pytest.mark.parametrize("text, expected", [
    ("name: t\nscale: 9B\n", "unknown scale 9B"),
    ("name: t\nscale: tiny\nsearch: {colour: [red]}\n", "search.colour: not a searched axis"),
    ("name: t\nscale: tiny\nsearch: {ac: [sometimes]}\n", "search.ac"),
    ("name: t\nscale: tiny\ndefaults: {micro_batch: 4}\n", "defaults.micro_batch: the tune sets it"),
    ("name: t\nscale: tiny\nnodes: [2]\n", "the local executor runs on this one machine"),
    ("name: t\nscale: tiny\nglobal_batch: 8\nsearch: {grad_accum: [2]}\n", "global batch sets it"),
    ("name: t\nscale: tiny\nbogus: 1\n", "unknown key 'bogus'"),
])
def test_bad_tune_files_are_one_line(tmp_path, text, expected):
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(TuneError) as err:
        load_tune_file(path)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_the_shipped_cpu_tune_file_loads_and_ranks(tmp_path):
    from conftest import ROOT

    s = load_tune_file(ROOT / "tunes" / "cpu-tiny.yaml")
    cpu = profile(device="CPU synthetic", gpus_per_node=2)
    problem = build_problem(s, "tiny", 1, cpu)
    assert {c.family for c in problem.ranked} == {"ddp", "fsdp2", "megatron-tp"}
    assert all(c.cfg.device == "cpu" and c.cfg.compile is False for c in problem.ranked)
    assert yaml.safe_load((ROOT / "tunes" / "cpu-tiny.yaml").read_text())["name"] == "cpu-tiny"


def test_grad_accumulation_repeats_each_micro_batch_and_syncs_once():
    """On a CPU profile (nothing hides): two micro-batches cost one more micro-batch's compute and
    its per-micro-batch collectives, not another optimizer step or gradient reduction."""
    cpu = profile(device="CPU synthetic")
    one = predict_cfg(device="cpu", precision="fp32", parallelism="fsdp2", peak_tflops=1.0)
    p1, p2 = pr.predict(one, cpu), pr.predict(one.__class__(**{**one.to_dict(), "grad_accum": 2}), cpu)
    every = sum(c.seconds for c in p1.collectives if not c.once)
    assert p2.device_s == pytest.approx(p1.device_s + p1.forward_s + p1.backward_s + every)
    assert p2.samples_per_s > p1.samples_per_s  # the sync and the optimizer are spread over twice the samples
    assert {c.what for c in p1.collectives if c.once} >= {"gradient norm: one float32 per trainable parameter"}


def test_an_interrupted_tune_keeps_what_it_measured_and_says_how_to_resume(tmp_path):
    """The sweep interrupted (exit 130) in round 1: the tune stops there, its outputs say so, and
    what was measured stays in them; a second tune asks for the same picks (the sweep then runs only
    those without a record: tests/test_tune_runs.py)."""
    s = spec(top_k=2)
    problem = build_problem(s, "800M", 1, GPU)
    first = picks(problem.ranked, 2)
    measure, asked = fake_measure(lambda c: c.prediction.samples_per_s)

    def interrupted(candidates):
        return {rid: m for rid, m in measure(candidates[:1]).items()}  # one run ended before Ctrl-C

    result = run_tune(s, [problem], GPU, interrupted, tmp_path, {"wall_s": 1.0, "exit_code": 130})
    assert result.interrupted and len(result.rounds) == 1 and set(result.measured) == {first[0].run_id}
    doc = write_outputs(s, tmp_path / "t.yaml", result, tmp_path)
    assert doc["interrupted"] and "resumes" in (tmp_path / "report.md").read_text()
    again = run_tune(s, [build_problem(s, "800M", 1, GPU)], GPU, measure, tmp_path)
    assert asked[-1] == [c.run_id for c in first] and not again.interrupted


def test_a_resumed_tune_keeps_counting_its_budget(tmp_path):
    """The device-hours an earlier tune in the directory charged its runs stay charged when a second
    tune finds them measured (its own round then takes seconds), so the budget still stops it."""
    s = spec(top_k=1, max_rounds=3, budget_gpu_hours=1.0)
    problem = build_problem(s, "800M", 1, GPU)
    measure, _ = fake_measure(lambda c: c.prediction.samples_per_s * (2 if c.family == "megatron-tp" else 1))
    first = run_tune(s, [problem], GPU, measure, tmp_path, {"wall_s": 600.0, "exit_code": 0})
    write_outputs(s, tmp_path / "t.yaml", first, tmp_path)
    assert first.device_hours == pytest.approx(sum(r.device_hours for r in first.rounds))
    assert first.device_hours > 1.0
    from echobench.tune.output import prior_charges

    again = run_tune(s, [build_problem(s, "800M", 1, GPU)], GPU, measure, tmp_path, {"wall_s": 1.0, "exit_code": 0},
                     prior_charges=prior_charges(tmp_path))
    assert again.device_hours >= first.device_hours
    assert "budget spent" in again.stops[problem.key]


# ---- model cards: ranked, not measured ----

def published_rows():
    from conftest import ROOT
    from echobench.predict.cards.card import model_card, run_layout
    from echobench.predict.validate import load_rows

    for row in load_rows(ROOT / "validation" / "published-runs.yaml"):
        if row["run"].get("pp", 1) == 1:
            yield row["id"], model_card(row["model"]), run_layout(row["run"], row["hardware"])


def test_the_card_memory_estimate_fits_every_published_run_and_not_four_times_its_micro_batch():
    """Every run published as trained on 80 GB H100s fits the estimate; llm-foundry's 8-GPU runs
    without AC (their micro-batch raised to what fits) would not fit at 4x it: the estimate is
    neither vacuous nor too large."""
    from dataclasses import replace

    from echobench.predict.cards.memory import card_memory_gib

    rows = list(published_rows())
    assert len(rows) >= 20
    for rid, card, layout in rows:
        assert card_memory_gib(card, layout) <= 80e9 / 2**30, rid
        if rid.startswith("lf-") and layout.gpus == 8 and layout.ac == "none":
            bigger = replace(layout, micro_batch=4 * layout.micro_batch, global_batch=4 * layout.global_batch)
            assert card_memory_gib(card, bigger) > 80e9 / 2**30, rid


def test_under_full_recompute_more_micro_batches_in_flight_add_only_their_layer_inputs():
    """Full AC under 1F1B: each micro-batch in flight keeps its layers' inputs (2 s h each); the
    layer being re-run is one at a time, whatever is in flight (it was counted once per micro-batch)."""
    from dataclasses import replace

    from echobench.predict.cards.memory import activation_bytes
    from echobench.predict.pipeline import in_flight

    rid, card, layout = next(r for r in published_rows() if r[2].gpus % 4 == 0)
    dp = layout.gpus // 4
    two, four = (replace(layout, ac="full", pp=4, vp=1, tp=1, grad_accum=m, global_batch=layout.micro_batch * m * dp)
                 for m in (2, 8))
    assert (in_flight(4, 1, 2), in_flight(4, 1, 8)) == (2, 4)
    stage_layers = -(-card.layers // 4)
    inputs = 2 * layout.tokens * card.hidden  # one layer's checkpoint for one micro-batch
    assert activation_bytes(card, four) - activation_bytes(card, two) == pytest.approx(stage_layers * inputs * 2)


def test_a_card_tune_ranks_the_published_layout_of_its_run_near_the_top():
    """tunes/card-1b-tune.yaml: llm-foundry's MPT-1B on 8 H100s, its global batch held; the layout it
    published (FSDP full_shard, micro-batch 14, no AC) is among the model's top 3."""
    from conftest import ROOT
    from echobench.tune.cards import card_entry, card_problems

    s = load_tune_file(ROOT / "tunes" / "card-1b-tune.yaml")
    problems = card_problems(s, None)
    assert [p.key for p in problems] == ["card-1b@1x8", "card-1b@2x8"]
    one = problems[0]
    assert one.profile.name == "h100-hgx-ib"  # the card file's
    top = [c.name for c in one.ranked[:3]]
    assert "fsdp-full_shard-n1x8-mb14-ga1-acnone" in top, top
    assert all(c.layout.global_batch == 112 for c in one.ranked)
    entry = card_entry(problems[1])
    assert entry["measured"] is False and entry["pruned"]  # mb 14 cannot make 112 on 16 ranks
    assert all(p["reason"].startswith(("batch", "memory", "rule")) for p in entry["pruned"])


def test_a_card_that_fits_nowhere_names_the_smallest_node_count_that_would(tmp_path):
    from conftest import ROOT
    from echobench.tune.cards import card_problems

    card = yaml.safe_load((ROOT / "tunes" / "card-1b.yaml").read_text())
    card["model"].update(layers=96, hidden=8192, ffn=32768, heads=64, kv_heads=64)  # ~77B parameters
    card["run"].update(global_batch=256, micro_batch=1, grad_accum=32)
    (tmp_path / "big.yaml").write_text(yaml.safe_dump(card))
    (tmp_path / "tune.yaml").write_text("name: big\ncard: big.yaml\ngpus_per_node: 8\nsearch: {micro_batch: [1]}\n")
    s = load_tune_file(tmp_path / "tune.yaml")
    with pytest.raises(TuneError) as err:
        card_problems(s, None)
    message = str(err.value)
    assert "\n" not in message and "no layout fits" in message
    n = int(message.split("the smallest node count where a layout fits is ")[1].split(":")[0])
    assert card_problems(s.model_copy(update={"nodes": [n]}), None)[0].ranked


def test_candidates_the_measurements_cannot_tell_from_the_winner_are_named_as_ties(tmp_path):
    """Step times per sample: a candidate whose steps overlap the winner's ties with it; one clearly
    slower does not (one-sided Mann-Whitney U)."""
    s = spec(top_k=2, max_rounds=1)
    problem = build_problem(s, "800M", 1, GPU)
    chosen = picks(problem.ranked, 2)
    steps = {chosen[0].run_id: [1.00, 1.02, 0.99, 1.01, 1.00, 1.03],  # the winner
             chosen[1].run_id: [1.01, 0.99, 1.02, 1.00, 1.04, 1.00]}  # overlaps it

    def measure(candidates):
        out = {}
        for c in candidates:
            times = [t * c.cfg.global_batch for t in steps.get(c.run_id, [3.0, 3.1, 2.9, 3.0, 3.05, 2.95])]
            out[c.run_id] = Measured(c.run_id, "ok", c.cfg.global_batch * len(times) / sum(times), step_times_s=times)
        return out

    result = run_tune(s, [problem], GPU, measure, tmp_path)
    doc = write_outputs(s, tmp_path / "t.yaml", result, tmp_path)["problems"][0]
    assert doc["winner"] == chosen[0].run_id
    assert [t["run_id"] for t in doc["ties"]] == [chosen[1].run_id]
    assert "Within measurement noise" in (tmp_path / "report.md").read_text()


def test_a_slurm_tune_whose_runs_may_share_nodes_is_warned():
    from echobench.tune.space import sharing_warning

    assert "slurm.exclusive" in sharing_warning(spec())
    assert sharing_warning(spec(slurm={"exclusive": True})) is None
    assert sharing_warning(spec(slurm={"max_submitted": 1})) is None
    assert sharing_warning(spec(executor="local")) is None


def test_the_h200_tune_file_ranks_on_the_shipped_h200_profile():
    """tunes/h200-800m.yaml (for a lent GPU): single-GPU layouts of both families, fp8 beside bf16,
    pruned by the H200's 141 GB and the fp8 shape rule, the rest ranked."""
    from conftest import ROOT

    s = load_tune_file(ROOT / "tunes" / "h200-800m.yaml")
    h200 = pr.load_profiles(["h200-hgx-ib"])[0]
    problem = build_problem(s, "800M", 1, h200)
    assert {c.family for c in problem.ranked} == {"single", "megatron-tp"}
    assert {c.cfg.precision for c in problem.ranked} == {"bf16", "fp8"}
    assert all(c.cfg.device == "cuda" and c.cfg.compile is True for c in problem.ranked)
    assert problem.capacity_gib == pytest.approx(141, abs=2)
    # float8 priced as float8: each fp8 candidate's GEMMs at the H200's float8 rate, its casts on top
    for c in problem.ranked:
        if c.cfg.precision == "fp8" and c.family == "single":
            twin = next(b for b in problem.ranked if b.run_id != c.run_id and b.family == c.family and
                        b.cfg.precision == "bf16" and (b.cfg.micro_batch, b.cfg.ac) == (c.cfg.micro_batch, c.cfg.ac))
            assert c.prediction.parts["gemm"] < 0.8 * twin.prediction.parts["gemm"]
            assert c.prediction.parts["elementwise"] > twin.prediction.parts["elementwise"]
            assert c.prediction.samples_per_s != pytest.approx(twin.prediction.samples_per_s, rel=0.01)
    low, high = interval(problem.ranked[0])
    assert low < problem.ranked[0].prediction.samples_per_s < high  # never a zero-width range


def test_every_shipped_tune_file_loads():
    """tunes/: each tune file (a `name` at the top; the others are the model cards they name) loads."""
    from conftest import ROOT

    files = [f for f in sorted((ROOT / "tunes").glob("*.yaml")) if "name" in yaml.safe_load(f.read_text())]
    assert len(files) >= 4
    for f in files:
        s = load_tune_file(f)
        assert s.scale or s.card is not None, f
