"""Peak memory as the allocator allocated it and as it reserved it (its cache included), and which one
the plan's memory estimate is compared with. CUDA is not needed: the memory stats are given."""

import pytest

from test_figures import measured_rank, summarized
from echobench.records.results import Record, peak_mem_for_estimate
from echobench.records.run_figures import peak_mem_figures

GPU = {"peak_allocated_gib": 1.0, "peak_reserved_gib": 2.0, "device_total_gib": 80.0, "num_alloc_retries": 0,
       "num_ooms": 0}


def test_a_gpu_record_keeps_both_peaks_and_the_estimate_meets_the_allocated_one():
    r = summarized([measured_rank([0.1] * 3, memory=dict(GPU))])
    assert (r.peak_mem_allocated_gib, r.peak_mem_reserved_gib) == (1.0, 2.0)
    assert r.peak_mem_gib == 2.0  # as before: the reserved peak
    assert peak_mem_for_estimate(r) == 1.0
    # saved and read back, the figures stay, and so does the comparison
    back = Record.parse(r.model_dump())
    assert (back.peak_mem_allocated_gib, back.peak_mem_reserved_gib, peak_mem_for_estimate(back)) == (1.0, 2.0, 1.0)
    assert {"peak_mem_allocated_gib", "peak_mem_reserved_gib"} <= set(Record.columns())  # results.csv has them


def test_each_peak_is_the_max_over_ranks():
    other = {**GPU, "peak_allocated_gib": 1.5, "peak_reserved_gib": 1.8}
    assert peak_mem_figures([GPU, other]) == {"peak_mem_gib": 2.0, "peak_mem_allocated_gib": 1.5,
                                              "peak_mem_reserved_gib": 2.0}
    r = summarized([measured_rank([0.1] * 3, memory=dict(GPU), rank=0),
                    measured_rank([0.1] * 3, memory=dict(other), rank=1)])
    assert (r.peak_mem_gib, r.peak_mem_allocated_gib, r.peak_mem_reserved_gib) == (2.0, 1.5, 2.0)
    assert peak_mem_for_estimate(r) == 1.5


def test_on_cpu_only_the_rss_peak_and_the_estimate_meets_it():
    r = summarized([measured_rank([0.1] * 3, memory={"peak_rss_gib": 3.0})])
    assert (r.peak_mem_gib, r.peak_mem_allocated_gib, r.peak_mem_reserved_gib) == (3.0, None, None)
    assert peak_mem_for_estimate(r) == 3.0


def test_a_failed_run_keeps_both_peaks_of_its_ranks():
    r = summarized([measured_rank([0.1] * 3)])
    r.fail([{"rank": 0, "status": "oom", "error": "CUDA out of memory", "memory": dict(GPU)}])
    assert (r.status, r.peak_mem_gib, r.peak_mem_allocated_gib, r.peak_mem_reserved_gib) == ("oom", 2.0, 1.0, 2.0)


def test_a_record_written_before_the_fields_compares_its_ranks_allocated_peak():
    """Schema 2 records before peak_mem_allocated_gib kept every rank's memory stats in per_rank."""
    r = summarized([measured_rank([0.1] * 3, memory=dict(GPU))])
    old = {k: v for k, v in r.model_dump().items() if k not in ("peak_mem_allocated_gib", "peak_mem_reserved_gib")}
    back = Record.parse(old)
    assert back.peak_mem_allocated_gib is None and back.peak_mem_gib == 2.0
    assert peak_mem_for_estimate(back) == pytest.approx(1.0)


def test_the_report_frame_compares_the_estimate_with_the_allocated_peak(tmp_path):
    from echobench.report.data import report_frame

    gpu = summarized([measured_rank([0.1] * 3, memory=dict(GPU))])
    cpu = summarized([measured_rank([0.1] * 3, memory={"peak_rss_gib": 3.0})])
    frame = report_frame([gpu, cpu])
    assert list(frame["memory_vs_estimate_gib"]) == [1.0, 3.0]
    assert list(frame["peak_mem_gib"]) == [2.0, 3.0]


def test_the_estimates_error_against_the_peak_is_shown_and_a_cpu_run_says_why_it_is_off(tmp_path):
    """A GPU run: the estimate's tensors (1.1 GiB) against the allocated peak (1.0): +10%. A CPU run:
    its total (1.51 GiB, a GPU's 1.5 GiB context and workspaces in it, as for the smoke runs) against
    the resident set (0.46 GiB): +228%, outside the stated +-30%, in a note that says why."""
    from echobench.records.atomic import write_json_atomic
    from echobench.records.results import PLAN_FILE
    from echobench.report import load_report_input, render_dashboard

    gpu = summarized([measured_rank([0.1] * 3, memory=dict(GPU))])
    cpu = summarized([measured_rank([0.1] * 3, memory={"peak_rss_gib": 0.46})])
    for name, rec, plan in (("gpu", gpu, {"memory_estimate_gib": 2.7, "memory_estimate": {"tensors": 1.1}}),
                            ("cpu", cpu, {"memory_estimate_gib": 1.51, "memory_estimate": {"tensors": 0.01}})):
        rec.run_id = name
        path = rec.save(tmp_path / name)
        write_json_atomic(path.with_name(PLAN_FILE), {"run_id": name, **plan})
    data = load_report_input([tmp_path])
    frame = data.frame.set_index("run_id")
    assert frame.loc["gpu", "memory_estimate_held_gib"] == 1.1 and frame.loc["cpu", "memory_estimate_held_gib"] == 1.51
    assert frame.loc["gpu", "memory_estimate_error"] == pytest.approx(0.10)
    assert frame.loc["cpu", "memory_estimate_error"] == pytest.approx(1.51 / 0.46 - 1)
    page = " ".join(render_dashboard(data).split())
    assert ("memory estimate is off the measured peak by more than its stated +-30% for 1 of 2 run(s) (furthest: "
            "cpu, 1.51 GiB estimated against 0.46 GiB measured, +228%); 1 of them on a CPU, where a CPU run&#39;s "
            "measured peak is its process&#39;s resident set") in page


def test_a_cpu_runs_estimate_is_held_with_its_measured_baseline(tmp_path):
    """A CPU record whose ranks measured their resident baseline (baseline_rss_gib, the largest: 0.40
    GiB) is held at the plan's tensors, their 10% fragmentation and that baseline: 0.01 * 1.1 + 0.40 =
    0.411 GiB against a 0.45 GiB peak, -9%, within the stated +-30%, with no note; a record without a
    baseline (older) is held against the plan's total as before."""
    from echobench.records.atomic import write_json_atomic
    from echobench.records.results import PLAN_FILE
    from echobench.report import load_report_input, render_dashboard

    measured = summarized([measured_rank([0.1] * 3, memory={"peak_rss_gib": 0.45, "baseline_rss_gib": 0.40}, rank=0),
                           measured_rank([0.1] * 3, memory={"peak_rss_gib": 0.44, "baseline_rss_gib": 0.39}, rank=1)])
    older = summarized([measured_rank([0.1] * 3, memory={"peak_rss_gib": 0.45})])
    for name, rec in (("measured", measured), ("older", older)):
        rec.run_id = name
        path = rec.save(tmp_path / name)
        write_json_atomic(path.with_name(PLAN_FILE), {"run_id": name, "memory_estimate_gib": 0.011,
                                                      "memory_estimate": {"tensors": 0.01}})
    data = load_report_input([tmp_path / "measured"])
    frame = data.frame.set_index("run_id")
    assert frame.loc["measured", "memory_baseline_gib"] == 0.40
    assert frame.loc["measured", "memory_estimate_held_gib"] == pytest.approx(0.411)
    assert frame.loc["measured", "memory_estimate_error"] == pytest.approx(0.411 / 0.45 - 1)
    assert "memory estimate is off" not in render_dashboard(data)
    frame = load_report_input([tmp_path / "older"]).frame.set_index("run_id")
    assert frame.loc["older", "memory_estimate_held_gib"] == 0.011
