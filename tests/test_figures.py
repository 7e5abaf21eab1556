"""A record's figures: throughput over the whole window, the peak table, fp8 MFU, older records."""

import ast
import json
import statistics

import pytest
import torch

from conftest import FIXTURES, ROOT
from echobench.train.bench_record import start_record, summarize
from echobench.records.config import RunConfig
from echobench.hardware.device import resolve_peak
from echobench.records.peaks import table_peak
from echobench.records.atomic import write_json_atomic
from echobench.records.results import SCHEMA_VERSION, load_records, peak_notes

def measured_rank(step_times, samples_per_step=2, flops_per_sample=1e9, rank=0, memory=None):
    """One rank's measurements in the shape run_loop returns them (the numbers chosen here)."""
    n = len(step_times)
    return {"rank": rank, "hostname": "h", "step_times_s": step_times,
            "median_step_time_s": statistics.median(step_times), "data_wait_s": [0.0] * n, "data_wait_frac": 0.0,
            "data_wait_clock": "host", "breakdown": None,
            "samples": samples_per_step * n, "model_flops": int(flops_per_sample * samples_per_step * n),
            "hardware_flops": int(flops_per_sample * samples_per_step * n), "audio_frames": 50 * samples_per_step * n,
            "padded_flops": int(flops_per_sample * samples_per_step * n),  # every sample at the padded lengths
            "tokens": {s: [k * samples_per_step * n] * 2 for s, k in (("latent", 50), ("text", 16), ("speaker", 10))},
            "losses": [1.0] * n, "skipped_samples": 0, "memory": memory or {"peak_rss_gib": 1.0},
            "backend_info": {}, "trace": None, "compiles_in_window": 0, "window_restarts": [], "warmup_variants": [],
            "compiles": {}}


def summarized(ranks, precision="auto", peak=1.0, **peaks):
    cfg = RunConfig(scale="tiny", steps=len(ranks[0]["step_times_s"]), warmup_steps=0, micro_batch=2,
                    precision=precision, peak_tflops=peak, gpus_per_node=len(ranks),
                    parallelism="single" if len(ranks) == 1 else "ddp")
    record = start_record(cfg, torch.device("cpu")).update(**peaks)
    return summarize(cfg, record, ranks)


def test_a_stall_costs_the_window_figure_not_the_median():
    steady = summarized([measured_rank([0.1] * 10)])
    # the same run with one step stalled (a GC pause, a data hiccup) for a whole second
    stalled = summarized([measured_rank([0.1] * 9 + [1.1])])
    assert stalled.step_time_s == steady.step_time_s == pytest.approx(0.1)  # the median does not see it
    assert stalled.samples_per_s == pytest.approx(20 / 2.0) and steady.samples_per_s == pytest.approx(20 / 1.0)
    assert stalled.mfu == pytest.approx(steady.mfu / 2)  # the window pays for the stall
    assert stalled.step_time_mean_vs_median == pytest.approx(1.0)  # mean 0.2 s, median 0.1 s


def test_each_step_counts_at_its_slowest_rank():
    r = summarized([measured_rank([0.1, 0.3, 0.1], rank=0), measured_rank([0.2, 0.1, 0.1], rank=1)])
    assert r.step_times_s == [0.2, 0.3, 0.1] and r.measured_time_s == pytest.approx(0.6)
    assert r.samples_per_s == pytest.approx(12 / 0.6)
    assert r.mfu == r.measured_model_flops / (r.measured_time_s * 2 * 1.0 * 1e12)


def test_fp8_runs_report_mfu_against_both_peaks_labelled():
    r = summarized([measured_rank([0.1] * 5, flops_per_sample=1e13)], precision="fp8", peak=989.5,
                   peak_precision="bf16", peak_fp8_tflops=1979.0)
    assert r.mfu == pytest.approx(r.tflops_per_gpu / 989.5)
    assert r.mfu_fp8_peak == pytest.approx(r.tflops_per_gpu / 1979.0)
    assert any("fp8 run: MFU is against the bf16 peak" in n for n in peak_notes(r))
    # an fp32 run against a bf16 peak says so; a bf16 one against it needs no note
    fp32 = summarized([measured_rank([0.1] * 3)], precision="fp32")
    assert (fp32.peak_precision, fp32.peak_source) == ("bf16", "flag")
    assert peak_notes(fp32) == ["fp32 run measured against the bf16 peak"]
    assert peak_notes(fp32.update(precision="bf16", peak_source="datasheet:H200")) == []


def test_allocator_counters_sum_over_ranks_and_stay_none_on_cpu():
    gpu = {"peak_reserved_gib": 1.0, "num_alloc_retries": 3, "num_ooms": 0}
    r = summarized([measured_rank([0.1] * 3, memory=gpu, rank=0), measured_rank([0.1] * 3, memory=dict(gpu), rank=1)])
    assert r.num_alloc_retries == 6 and r.num_ooms == 0
    assert summarized([measured_rank([0.1] * 3)]).num_alloc_retries is None


# ---- the datasheet table ----

@pytest.mark.parametrize("name, bf16, fp8, row", [
    ("NVIDIA H200 NVL", 835.5, 1670.5, "H200 NVL"),
    ("NVIDIA H200", 989.5, 1979.0, "H200"),
    ("NVIDIA GH200 480GB", 990.0, 1979.0, "GH200"),
    ("NVIDIA H800 PCIe", 756.5, 1513.0, "H800 PCIe"),
    ("NVIDIA H800", 989.5, 1979.0, "H800"),
    ("NVIDIA H100 80GB HBM3", 989.5, 1979.0, "H100"),
    ("NVIDIA H100 PCIe", 756.5, 1513.0, "H100 PCIe"),
    ("NVIDIA A100-SXM4-80GB", 312.0, None, "A100"),
    ("NVIDIA L40S", 362.05, 733.0, "L40S"),
    ("NVIDIA L40", 181.05, 362.05, "L40"),  # not L4: a row's name is a whole word of the device's
    ("NVIDIA L4", 121.0, 242.5, "L4"),
    ("AMD Instinct MI300X", 1307.4, 2614.9, "MI300X"),
    ("AMD Instinct MI300A", 980.6, 1961.2, "MI300A"),
])
def test_datasheet_peaks_take_the_most_specific_name(name, bf16, fp8, row):
    assert table_peak(name) == (bf16, f"datasheet:{row}")
    assert table_peak(name, "fp8") == (None if fp8 is None else (fp8, f"datasheet:{row}"))


@pytest.mark.parametrize("name", ["CPU AMD EPYC 9L45 (96 cores)", "NVIDIA GeForce RTX 4090", "Tesla T4", "NVIDIA L40G"])
def test_a_device_outside_the_table_has_no_datasheet_peak(name):
    assert table_peak(name) is None


def test_resolved_peak_says_its_precision(tmp_path, monkeypatch):
    monkeypatch.setenv("ECHOBENCH_CACHE", str(tmp_path))  # no calibration
    p = resolve_peak("NVIDIA H200", torch.bfloat16, precision="fp8")
    assert (p["peak_tflops"], p["peak_precision"], p["peak_fp8_tflops"]) == (989.5, "bf16", 1979.0)
    assert resolve_peak("NVIDIA H200", torch.bfloat16, precision="bf16")["peak_fp8_tflops"] is None
    assert resolve_peak("CPU x", torch.float32, flag=2.0)["peak_precision"] == "bf16"  # a given peak is a bf16 peak


# ---- records of schema version 1 ----

def test_version_1_records_load_with_window_figures(tmp_path):
    """tests/fixtures/record-v1.json: a real record written by echobench before version 2
    (`echobench run --scale tiny --steps 3 --warmup-steps 1 --micro-batch 2 --audio-frames 64
    --text-tokens 16 --speaker-frames 64 --device cpu --peak-tflops 1`)."""
    v1 = json.loads((FIXTURES / "record-v1.json").read_text())
    assert v1["schema_version"] == 1 and "peak_precision" not in v1
    write_json_atomic(tmp_path / "run" / "result.json", v1)
    (r,), problems = load_records([tmp_path])
    assert problems == [] and r.schema_version == SCHEMA_VERSION and r.migrated_from == 1
    times = v1["step_times_s"]
    # v1 kept every step's time: the window figures are recomputed from them
    samples = 3 * 2
    assert r.measured_samples == samples and r.measured_time_s == sum(times)
    assert r.samples_per_s == pytest.approx(samples / sum(times), rel=1e-12)
    assert r.mfu == pytest.approx(v1["model_flops_per_sample"] * samples / (sum(times) * 1 * 1.0 * 1e12), rel=1e-9)
    assert r.mfu < v1["mfu"]  # this run's mean step is above its median
    assert r.step_time_s == v1["step_time_s"] and r.step_time_mean_s == pytest.approx(statistics.fmean(times))
    # derived where v1 says enough, None where it does not
    assert (r.repeat, r.peak_precision) == (0, "bf16")
    assert r.num_alloc_retries is None and r.num_ooms is None and r.mfu_fp8_peak is None


def test_a_record_from_a_newer_echobench_is_reported_not_misread(tmp_path):
    write_json_atomic(tmp_path / "a" / "result.json", {"run_id": "a", "status": "ok", "schema_version": 99})
    records, problems = load_records([tmp_path])
    assert records == [] and "schema_version 99 is not one this echobench reads" in problems[0]


# ---- the MFU convention in one place ----

MFU_HOME = "echobench/records/run_figures.py"


def mfu_formulas(source: str) -> list[str]:
    """Divisions whose divisor names a peak or a ceiling (a word of an identifier, as in peak_tflops,
    row_peak_tflops, ceiling): where an MFU, or a time from one, is written out."""
    def words(node):
        for n in ast.walk(node):
            name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else ""
            yield from name.lower().split("_")

    return [ast.unparse(node) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div)
            and {"peak", "ceiling"} & set(words(node.right))]


def test_the_scan_finds_each_way_an_mfu_is_written():
    written = ["mfu = flops / (step * world * peak_tflops * 1e12)", "x = tflops / self.peak_tflops",
               "c = ceiling / profile.peak", "t = flops / (n * peak * 1e12 * hw.assumed_mfu)"]
    assert [len(mfu_formulas(line)) for line in written] == [1, 1, 1, 1]
    assert mfu_formulas("share = blocks(cfg, m.speaker_layers) / max(m.speaker_layers, 1)") == []


def test_the_mfu_formula_is_written_in_one_module():
    """Every MFU echobench measures, shows or predicts comes from records.run_figures."""
    elsewhere = {str(path.relative_to(ROOT)): found for path in sorted((ROOT / "echobench").rglob("*.py"))
                 if str(path.relative_to(ROOT)) != MFU_HOME and (found := mfu_formulas(path.read_text()))}
    assert elsewhere == {}, f"use records.run_figures (mfu_of, peak_fraction, seconds_at_mfu): {elsewhere}"
    assert len(mfu_formulas((ROOT / MFU_HOME).read_text())) >= 3  # its own: the scan reads it
