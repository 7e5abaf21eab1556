"""The performance model held against the first GPU runs (reports/h200-2026-12-04.md): the H200
device check's records (Echo 3B / 800M eager and compiled, megatron TP=1, two published rows'
1-GPU slices as card runs), each predicted by `echobench validate measured` at the layout it ran,
on the shipped H200 profile and on the profile measured in the same pass. The limits are the errors
of 2026-12-04 with a margin: a change that prices these runs worse fails here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.device import summary as device_summary

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "reports" / "h200-2026-12-04"


@pytest.fixture(scope="module")
def h200_runs(tmp_path_factory):
    runs = tmp_path_factory.mktemp("h200") / "runs"
    for name in ("records-call1.jsonl", "records-call2.jsonl"):
        device_summary.main(["unpack", str(RECORDS / name), str(runs)])
    return runs


def against(runs: Path, profile: str) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", "echobench", "validate", "measured", str(runs), "--profile", profile,
                           "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("profile, mean_limit, max_limit", [
    ("h200-hgx-ib", 0.15, 0.25),  # 2026-12-04: 22.8% / 51.0%; later that day (one GPU without the in-step clock,
                                  # the SDPA backend the record names, compiled element-wise counted): 19.6% / 39.5%;
                                  # with the eager add measured there in the profile: 12.0% / 20.6%
    (str(RECORDS / "profile-h200-measured.yaml"), 0.25, 0.40),  # 2026-12-04: 22.0% / 36.5%
])
def test_predicted_step_times_of_the_h200_runs_hold_their_limits(h200_runs, profile, mean_limit, max_limit):
    rows = against(h200_runs, profile)
    assert len(rows) == 7 and sum("mpt" in r["run_id"] for r in rows) == 2  # both card runs priced as cards
    assert all(r["memory_gib"] > 0 for r in rows)  # card runs' too (cards.memory), as Echo's
    for r in rows:  # the error is the record's step time against the prediction, not a copy of either
        assert r["error"] == pytest.approx(r["step_time_s"] / r["measured_step_time_s"] - 1)
    errors = [abs(r["error"]) for r in rows]
    assert sum(errors) / len(errors) <= mean_limit, errors
    assert max(errors) <= max_limit, errors


def test_an_echo_gpu_run_left_to_torchs_sdpa_choice_is_priced_at_the_backend_its_record_names(h200_runs):
    """torch 2.11 chose cuDNN for the DiT's unmasked attention on the H200 (each Echo record's
    sdpa_backends_predicted): validate measured prices that kernel, not the flash2 of a run's settings;
    the same record with no name, or read as a CPU's, keeps the settings' kernel."""
    import dataclasses

    from echobench.hardware.profile import find_profile, load_profile
    from echobench.predict import predict
    from echobench.predict.measured import against as against_record
    from echobench.records.config import RunConfig, as_ran
    from echobench.records.results import Record, record_settings

    h200 = load_profile(find_profile("h200-hgx-ib"))
    record = Record.load(h200_runs / "3b-compile-mb8" / "result.json")
    assert record.sdpa_backends_predicted["dit"] == "CUDNN_ATTENTION" and record.config["sdpa_backend"] == "auto"
    cfg = RunConfig.from_dict({**as_ran(record_settings(record)), "repeat": 0})
    assert "cfg_drop_attention" not in record.config and cfg.cfg_drop_attention == "masked"  # it ran before split
    peak = (record.peak_tflops, record.peak_source)
    cudnn = predict(dataclasses.replace(cfg, sdpa_backend="cudnn"), h200, peak=peak,
                    model_flops_per_sample=record.model_flops_per_sample)
    auto = predict(cfg, h200, peak=peak, model_flops_per_sample=record.model_flops_per_sample)
    assert cudnn.parts["attention"] != pytest.approx(auto.parts["attention"])  # the kernel matters here
    assert against_record(record, [h200]).prediction.parts["attention"] == pytest.approx(cudnn.parts["attention"])
    unnamed = record.model_copy(update={"sdpa_backends_predicted": None})
    assert against_record(unnamed, [h200]).prediction.parts["attention"] == pytest.approx(auto.parts["attention"])


def test_a_card_runs_predicted_memory_is_its_measured_peak(h200_runs):
    """cards.memory with echobench's autocast terms (bf16 weight copies, float32 norm inputs, the loss's
    float32 logits) against the two card runs' allocated peaks on the H200 (77.0 and 112.6 GiB; the
    formula without them gave 62.7 and 96.4)."""
    rows = against(h200_runs, "h200-hgx-ib")
    cards = [r for r in rows if "mpt" in r["run_id"]]
    assert len(cards) == 2
    for r in cards:
        measured = json.loads(Path(r["path"]).read_text())["peak_mem_allocated_gib"]
        assert r["memory_gib"] == pytest.approx(measured, rel=0.03), r["run_id"]


def test_a_run_that_attended_split_with_torch_choosing_cudnn_is_priced_as_it_ran(h200_runs):
    """A record of cfg_drop_attention split (its DiT's dropped-conditioning micro-batches counted
    under "split" in attention_paths) whose unmasked calls torch served with cuDNN: validate measured
    prices the unmasked calls at cuDNN and the split ones as flash's two calls, not the dropped
    micro-batches as masked (FlexAttention, slower) as it did when the record's choice replaced
    the run's sdpa_backend setting."""
    import dataclasses

    from echobench.hardware.profile import find_profile, load_profile
    from echobench.predict import predict
    from echobench.predict.measured import against as against_record
    from echobench.records.config import RunConfig, as_ran
    from echobench.records.results import Record, record_settings

    h200 = load_profile(find_profile("h200-hgx-ib"))
    ran = Record.load(h200_runs / "3b-compile-mb8" / "result.json")
    record = ran.model_copy(update={"config": {**ran.config, "cfg_drop_attention": "split"},
                                    "attention_paths": {**ran.attention_paths, "dit": {"none": 6, "split": 14}}})
    assert record.sdpa_backends_predicted["dit"] == "CUDNN_ATTENTION"
    cfg = RunConfig.from_dict({**as_ran(record_settings(record)), "repeat": 0})
    assert cfg.cfg_drop_attention == "split" and cfg.sdpa_backend == "auto"
    peak = (record.peak_tflops, record.peak_source)
    as_if_masked = predict(dataclasses.replace(cfg, sdpa_backend="cudnn"), h200, peak=peak,
                           model_flops_per_sample=record.model_flops_per_sample)
    settings = predict(cfg, h200, peak=peak, model_flops_per_sample=record.model_flops_per_sample)
    got = against_record(record, [h200]).prediction
    assert any("flex" in n for n in as_if_masked.notes) and not any("flex" in n for n in got.notes)
    assert any("two unmasked flash2 calls" in n for n in got.notes)
    assert any("cudnn kernel its record names" in n for n in got.notes)
    assert got.parts["attention"] < as_if_masked.parts["attention"]
    assert got.parts["attention"] != pytest.approx(settings.parts["attention"])  # the unmasked calls at cuDNN
