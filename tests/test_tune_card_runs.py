"""`echobench tune` of a model card with real runs: a tiny decoder card (2 blocks of width 64, 64
tokens) on 2 CPU processes through the local executor, ranked on a profile the test writes. The
tune's picks of the card's layouts run as card runs in its sweep, and what tune.json and report.md
say of them is their records' figures against predict_card's prices (on the profile the tune ends
on); a layout echobench cannot run as a card run here (the distributed optimizer on a CPU) is ranked
only."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import run_cli
from echobench.hardware.profile import load_profile, save_profile
from echobench.predict.cards.model import predict_card
from echobench.records.results import load_records
from echobench.tune.cards import card_problems
from echobench.tune.space import load_tune_file, picks
from test_predict import profile

CARD = {"model": {"layers": 2, "hidden": 64, "ffn": 128, "activation": "swiglu", "heads": 4, "kv_heads": 2,
                  "vocab": 512, "tied_embeddings": True, "positions": "rotary", "bias": False, "causal": True,
                  "norm": "rmsnorm"},
        "run": {"seq": 64, "micro_batch": 2, "grad_accum": 1, "global_batch": 4, "layout": "ddp", "ac": "none",
                "compile": False, "precision": "fp32"},
        "hardware": {"profile": "h100-hgx-ib", "gpus": 2, "gpus_per_node": 2}}
TUNE = {"name": "t-card", "executor": "local", "local": {"time": "00:05:00"},
        # peak_tflops set: no GEMM calibration before the runs
        "defaults": {"steps": 3, "warmup_steps": 1, "device": "cpu", "peak_tflops": 1.0},
        "card": "card.yaml", "nodes": [1], "gpus_per_node": 2, "search": {"micro_batch": [2], "ac": ["none"]},
        "top_k": 2, "max_rounds": 1}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune-card")
    (root / "card.yaml").write_text(yaml.safe_dump(CARD))
    (root / "tune.yaml").write_text(yaml.safe_dump(TUNE))
    # A synthetic GPU's rates: the CPU runs far slower than predicted, every residual on one side, so
    # the tune recalibrates the profile to them.
    save_profile(profile(device="CPU synthetic", gpus_per_node=2), root / "cpu.yaml")
    proc = run_cli("tune", root / "tune.yaml", "--out", root / "out", "--profile", root / "cpu.yaml", tmp_path=root,
                   timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, proc


def test_the_card_picks_run_as_card_runs_and_the_report_holds_their_records(tuned):
    root, proc = tuned
    out = root / "out"
    doc = json.loads((out / "tune.json").read_text())
    assert doc["problems"] == [] and len(doc["cards"]) == 1
    entry = doc["cards"][0]
    records, problems = load_records([out / "sweep"])
    assert not problems and records and all(r.status == "ok" and r.card for r in records)
    by_id = {r.run_id: r for r in records}

    # What ran is the picks of the card's measurable layouts on the shipped profile: its top 2 first.
    spec = load_tune_file(root / "tune.yaml")
    (shipped,) = card_problems(spec, load_profile(root / "cpu.yaml"))
    chosen = picks(shipped.measurable, 2)
    assert len(chosen) >= 2 and set(by_id) == {c.run_id for c in chosen}
    assert [c.run_id for c in chosen[:2]] == [c.run_id for c in shipped.measurable[:2]] or \
        len({c.family for c in shipped.measurable[:2]}) == 1  # the second of a tied pair skipped

    # TP with sequence parallelism (tp2 on 2 processes) is measurable; with the distributed optimizer
    # (GPU only) it is ranked only, with its reason.
    tp2 = {c["name"]: c for c in entry["candidates"] if c["name"].startswith("megatron-tp2")}
    sp, dopt = tp2["megatron-tp2-n1x2-mb2-ga2-acnone"], tp2["megatron-tp2-dopt-n1x2-mb2-ga2-acnone"]
    assert sp["unmeasured"] is None and sp["settings"]["sequence_parallel"] is True
    assert dopt["run_id"] is None and dopt["measured"] is None
    assert dopt["unmeasured"].startswith("distributed_optimizer runs on a GPU only")

    # Every measured layout: its record's figures, exactly, against predict_card on the final profile.
    assert doc["profile"]["fit_note"] and doc["profile"]["final"].endswith("-tuned")
    final = load_profile(out / "profile-tuned.yaml")
    assert sorted(final.in_step.fitted_on) == sorted(by_id)  # the card runs recalibrated the profile
    layouts = {c.name: c for c in shipped.ranked}
    measured = [c for c in entry["candidates"] if c["measured"] is not None]
    assert {c["run_id"] for c in measured} == set(by_id)
    for c in measured:
        r = by_id[c["run_id"]]
        assert c["measured"]["step_time_s"] == r.step_time_s and c["measured"]["samples_per_s"] == r.samples_per_s
        assert c["round"] == 1 and c["settings"]["card"] == r.card["source"] == str((root / "card.yaml").resolve())
        priced = predict_card(shipped.card, layouts[c["name"]].layout, final)
        assert c["step_time_s"] == pytest.approx(priced.step_time_s, rel=1e-9)
        assert c["samples_per_s"] == pytest.approx(layouts[c["name"]].layout.global_batch / priced.step_time_s, rel=1e-9)
        assert c["residual"] == pytest.approx(r.samples_per_s / c["samples_per_s"] - 1, rel=1e-9)
        assert c["shipped_samples_per_s"] == pytest.approx(layouts[c["name"]].samples_per_s, rel=1e-12)

    # The measured winner is the best record; the report names it with the record's figures.
    best = max(records, key=lambda r: r.samples_per_s)
    winner = next(c for c in measured if c["run_id"] == best.run_id)
    assert entry["winner"] == winner["name"] and entry["kendall_tau"]["runs"] == len(records)
    assert entry["predicted_winner"] == entry["candidates"][0]["name"]
    report = (out / "report.md").read_text()
    assert f"**Measured winner:** {winner['name']} (run {best.run_id}): {best.samples_per_s:.4g} samples/s measured " \
           f"(step {best.step_time_s:.4g} s)" in report
    for c in measured:
        r = by_id[c["run_id"]]
        assert f"| {c['name']} |" in report and f"{r.samples_per_s:.4g} ({r.step_time_s:.4g})" in report
