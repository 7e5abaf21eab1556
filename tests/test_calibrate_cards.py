"""calibrate --comm at a card run's own shapes: a matrix's card runs (setting `card`) give the GEMMs
predict_card prices for them, their decoder's causal attention at the card's seq and their
decoder's parameters, not Echo's preset's; an Echo run keeps its shapes. Tiny cards, CPU."""

import json
import math
from pathlib import Path

import pytest
import torch

from echobench.calibrate import commbench as cb
from echobench.calibrate.commcalibrate import calibrate_command, comm_runs, shapes_note
from echobench.hardware.profile import find_profile, load_profile
from echobench.predict import pricing, step_work
from echobench.predict.cards.model import predict_card
from echobench.predict.cards.run import measured_layout, run_card
from echobench.records.config import RunConfig
from echobench.sweep.executors import comm_command
from echobench.sweep.matrix import load_matrix

# 2 layers, hidden 64 (4 heads of 16 over 2 key / value heads), seq 64: a few milliseconds a step.
CARD = {"model": {"layers": 2, "hidden": 64, "ffn": 256, "activation": "swiglu", "heads": 4, "kv_heads": 2,
                  "vocab": 512, "tied_embeddings": True, "positions": "rotary", "bias": False, "causal": True,
                  "norm": "rmsnorm"},
        "run": {"seq": 64, "micro_batch": 2, "grad_accum": 1, "global_batch": 2, "layout": "ddp", "tp": 1, "pp": 1,
                "ac": "none", "compile": False, "precision": "fp32"},
        "hardware": {"profile": "h100-hgx-ib", "gpus": 1, "gpus_per_node": 1}}
SEQ, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16


def write_card_matrix(folder: Path, include: list[dict]) -> Path:
    """folder/cards/m.yaml naming its card by a path relative to itself (tinycard.yaml beside it)."""
    (folder / "cards").mkdir(parents=True, exist_ok=True)
    (folder / "cards" / "tinycard.yaml").write_text(json.dumps(CARD))
    matrix = folder / "cards" / "m.yaml"
    matrix.write_text(json.dumps({"name": "cards", "executor": "local", "local": {"gpus_per_node": 2},
                                  "defaults": {"card": "tinycard.yaml", "device": "cpu", "micro_batch": 2, "steps": 2,
                                               "warmup_steps": 1, "peak_tflops": 1},
                                  "include": include,
                                  "hardware": {"calibrate_comm": True,
                                               "comm_limits": {"budget_s": 0.5, "comm_budget_s": 1}}}))
    return matrix


def card_runs(tmp_path: Path, include: list[dict]) -> list[RunConfig]:
    runs, _ = comm_runs("cpu", None, write_card_matrix(tmp_path, include), {})
    return runs


SINGLE = {"parallelism": "single"}
TP2 = {"framework": "megatron", "parallelism": "tp2", "gpus_per_node": 2}


def priced_gemms(run: RunConfig, monkeypatch) -> set[tuple[int, int, int]]:
    """The (m, n, k) of every GEMM predict_card prices for a measured card run (validate measured's
    card_prediction: the card and measured_layout), read off the pricing's own calls."""
    seen = set()
    real = pricing.Rates.gemm_tflops

    def spy(self, m, n, k, precision="bf16"):
        seen.add((m, n, k))
        return real(self, m, n, k, precision)

    monkeypatch.setattr(pricing.Rates, "gemm_tflops", spy)
    workload = run_card(run.card)
    predict_card(workload.card, measured_layout(run, workload.seq, "bf16", False),
                 load_profile(find_profile("h200-hgx-ib")))
    monkeypatch.undo()
    return seen


def test_a_card_runs_gemms_are_those_predict_card_prices_and_an_echo_runs_are_unchanged(tmp_path, monkeypatch):
    single, tp2 = card_runs(tmp_path, [SINGLE, TP2])
    assert (single.tp, tp2.tp) == (1, 2) and single.card == tp2.card and Path(single.card).is_file()
    listed = {run.parallelism: {(s.m, s.n, s.k) for s in cb.gemm_work([run], 2)} for run in (single, tp2)}
    for run in (single, tp2):
        assert listed[run.parallelism] == priced_gemms(run, monkeypatch), run.parallelism
    assert listed["tp2"] != listed["single"]  # TP splits the linears: other shapes
    both = {(s.m, s.n, s.k) for s in cb.gemm_work([single, tp2], 2)}
    assert both == listed["single"] | listed["tp2"]
    # an Echo run: its layouts' shapes as before (own, torchtitan, megatron TP 1 and 2); beside cards, the union
    echo = RunConfig(scale="tiny", micro_batch=2, audio_frames=100, text_tokens=32, speaker_frames=80)
    today = set()
    for framework, tp in (("torchtitan", 1), ("megatron", 1), ("megatron", 2)):  # gemm_layouts of a 2-rank node
        mm, _ = step_work(echo.model_config(), framework, tp, echo.micro_batch, echo.audio_frames, echo.text_tokens,
                          echo.speaker_frames, echo.ac)
        today |= {(w.m, w.n, w.k) for w in mm}
    assert {(s.m, s.n, s.k) for s in cb.gemm_work([echo], 2)} == today
    assert {(s.m, s.n, s.k) for s in cb.gemm_work([echo, single, tp2], 2)} == today | both


def test_a_card_runs_attention_is_causal_at_its_seq_and_predict_card_prices_it_at_that_point(tmp_path):
    single, tp2 = card_runs(tmp_path, [SINGLE, TP2])
    (shape,) = cb.attention_shapes(single)
    assert cb.attention_shapes(tp2) == [shape]  # the card's heads whatever the TP: one point stands for both
    assert shape[1:] == (2, HEADS, HEAD_DIM, SEQ, SEQ, True, KV_HEADS)
    (point,) = cb.measure_attention(torch.device("cpu"), torch.float32, [single, tp2], 0.2)
    assert (point.batch, point.heads, point.head_dim, point.seq_q, point.seq_k, point.causal) == \
        (2, HEADS, HEAD_DIM, SEQ, SEQ, True)
    assert "decoder_attention, causal" in point.source and point.tflops > 0

    # predict_card on a profile holding that point: the point itself (no other causality or head_dim
    # standing in, nothing interpolated), for both layouts
    profile = load_profile(find_profile("h200-hgx-ib")).model_copy(
        update={"attention": [point.model_copy(update={"source": "measured"})], "measured": True})
    rates = pricing.Rates(profile)
    for run in (single, tp2):
        workload = run_card(run.card)
        layout = measured_layout(run, workload.seq, "bf16", False)
        p = predict_card(workload.card, layout, profile)
        assert not [n for n in p.notes if "attention" in n and ("non-causal" in n or "head_dim" in n)], p.notes
        assert rates.attention_tflops(SEQ, SEQ, HEAD_DIM, True, "flash2") == pytest.approx(point.tflops)
        assert p.parts["attention"] > 0
    points, factor, why = pricing.attention_points(profile, HEAD_DIM, True, "flash2")
    assert points == profile.attention and factor == 1 and "unlabelled causal points" in why and "x2" not in why
    # what Echo's shapes gave a card before: non-causal points standing in, x2
    echo = cb.measure_attention(torch.device("cpu"), torch.float32, [RunConfig(scale="tiny", micro_batch=1,
                                audio_frames=16, text_tokens=8, speaker_frames=16)], 0.1)
    _, factor, why = pricing.attention_points(profile.model_copy(update={"attention": echo}), HEAD_DIM, True, "flash2")
    assert factor == 2 and "non-causal" in why


def test_a_card_runs_optimizer_is_stepped_over_its_decoders_parameters(tmp_path):
    (single,) = card_runs(tmp_path, [SINGLE])
    shapes = cb.adamw_shapes([single], torch.device("cpu"))
    d, kv = 64, KV_HEADS * HEAD_DIM
    assert shapes[0] == (512, d)  # the (tied) embedding first, registration order
    assert (d + 2 * kv, d) in shapes and (2 * 256, d) in shapes and (d, 256) in shapes
    layers = 2 * (d * (d + 2 * kv) + d * d + d * 2 * 256 + 256 * d + 2 * d)
    assert sum(map(math.prod, shapes)) == 512 * d + layers + d
    echo = RunConfig(scale="tiny")
    assert cb.adamw_shapes([single, echo], torch.device("cpu")) == cb.adamw_shapes([echo], torch.device("cpu"))


def test_a_sweep_calibrates_at_the_matrix_file_whose_cards_resolve_beside_it(tmp_path):
    """The sweep copies its matrix into SWEEP/matrix.yaml, where tinycard.yaml is not: its calibration
    reads the matrix it was started with, whose relative card resolves beside it."""
    matrix = write_card_matrix(tmp_path, [SINGLE])
    words = comm_command(tmp_path / "sweep", load_matrix(matrix), "cpu")
    path = Path(words[words.index("--matrix") + 1])
    assert path == matrix.resolve()
    (run,) = comm_runs("cpu", None, path, {})[0]
    assert cb.card_of(run)[0].hidden == 64 and "card tinycard at micro-batch 2, seq 64" in shapes_note([run])
    copy = tmp_path / "sweep" / "matrix.yaml"  # what the sweep's copy gives: its card.yaml is not there
    copy.parent.mkdir()
    copy.write_text(matrix.read_text())
    with pytest.raises(ValueError, match="no runs to take shapes from"):
        comm_runs("cpu", None, copy, {})


def test_calibrate_comm_on_one_process_measures_a_card_matrixs_shapes(tmp_path, monkeypatch):
    """`calibrate --comm --nproc 1 --matrix M` as the command runs it (commcalibrate.calibrate_command,
    in this process), its host steps (Echo's tiny preset, commbench.measure_host: no card in them)
    left out to keep it short: the profile it writes holds the card's GEMMs, its causal attention and
    AdamW over its decoder's parameters, and its note names the card."""
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cb, "measure_host", lambda *a, **k: [])
    matrix = write_card_matrix(tmp_path, [SINGLE])
    out = tmp_path / "profile.yaml"
    _, paths = calibrate_command(torch.device("cpu"), "auto", None, (None, matrix, {}), 0.5, 1, out, None, 1.0,
                                 (1, 0, None, 29500))
    assert out in paths
    p = load_profile(out)
    (run,) = comm_runs("cpu", None, matrix, {})[0]
    card = {(s.m, s.n, s.k) for s in cb.gemm_work([run], 1)}
    assert card <= {(g.m, g.n, g.k) for g in p.gemm}
    assert any(g.name.startswith("tinycard ") for g in p.gemm)
    (att,) = [a for a in p.attention if a.causal]
    assert (att.batch, att.heads, att.head_dim, att.seq_q, att.seq_k) == (2, HEADS, HEAD_DIM, SEQ, SEQ)
    adamw = next(m for m in p.memory if m.op == "adamw")
    assert adamw.nbytes == 4 * sum(map(math.prod, cb.param_shapes(run)))
    assert "shapes of card tinycard at micro-batch 2, seq 64" in " ".join(p.note.split())
