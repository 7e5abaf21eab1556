"""The report: dashboard (in real headless Chromium), publication tables, reference CSV, compare."""

import json
import math
import os
import random
import shutil
import statistics
from pathlib import Path

import pytest

from conftest import FIXTURES, ROOT, run_cli
from echobench.records.atomic import write_json_atomic
from echobench.train.bench_record import start_record
from echobench.report import load_report_input, read_reference, render_table
from echobench.report.browser import layout_problems
from echobench.report.tables import ReferenceError, publication_table
from echobench.report.compare import compare_records
from echobench.records.results import PLAN_FILE, Env, Record

ARTIFACTS = ROOT / "test-artifacts"
XSS = "<script>alert(1)</script>"
TINY_RUN = ["--scale", "tiny", "--steps", "2", "--warmup-steps", "1", "--micro-batch", "1", "--audio-frames", "50", "--text-tokens", "16",
            "--speaker-frames", "40", "--peak-tflops", "1"]


# ---- records ----

def record(run_id, scale="800M", framework="torchtitan", parallelism="fsdp2", nodes=1, gpus_per_node=4,
           micro_batch=8, mfu=0.4, samples_per_s=100.0, tflops_per_gpu=None, status="ok", error="",
           step_time_s=1.0, peak_mem_gib=40.0, time="2026-11-01T00:00:00+00:00", **extra):
    """A hand-built record with round numbers (no `config`: its settings are its top-level fields),
    for tests that check computed values; `extra` sets further fields."""
    world = nodes * gpus_per_node
    ok = status == "ok"
    rec = Record(
        run_id=run_id, status=status, error=error, scale=scale, framework=framework, parallelism=parallelism, tp=1,
        dp=world, nodes=nodes, gpus_per_node=gpus_per_node, world_size=world, micro_batch=micro_batch,
        global_batch=micro_batch * world, audio_frames=750, text_tokens=256, speaker_frames=750, precision="bf16",
        compile=False, ac="none", steps=30, warmup_steps=10, peak_tflops=990.0, peak_source="datasheet:GH200",
        model_flops_per_sample=1e13, flops_breakdown={}, peak_mem_gib=peak_mem_gib, data_wait_frac=0.0,
        env=Env(device_name="NVIDIA GH200 120GB", hostname="nid001", time=time))
    if ok:
        rec.update(step_time_s=step_time_s, step_time_p10_s=step_time_s * 0.9, step_time_p90_s=step_time_s * 1.1,
                   samples_per_s=samples_per_s, audio_seconds_per_s=samples_per_s * 30, mfu=mfu, hfu=mfu,
                   tflops_per_gpu=tflops_per_gpu if tflops_per_gpu is not None else mfu * 990)
    return rec.update(**extra)


def write(root: Path, rec: Record, name: str | None = None, memory_estimate_gib: float | None = None) -> Path:
    """Saves rec into root/NAME (its run id by default), with a sweep's plan.json beside it when
    an estimate is given."""
    path = rec.save(root / (name or rec.run_id))
    if memory_estimate_gib is not None:
        write_json_atomic(path.with_name(PLAN_FILE), {"run_id": rec.run_id, "memory_estimate_gib": memory_estimate_gib})
    return path


def tiny_run(cli, out: Path, *extra) -> Record:
    proc = cli("run", "--out", out, *TINY_RUN, *extra)
    assert (out / "result.json").exists(), proc.stderr[-2000:]
    return Record.load(out / "result.json")


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory, smoke_sweep):
    """Records of the real smoke sweep (matrices/smoke.yaml on the local executor), one real run
    with an injected failure, and a copy of it whose error text is a script tag."""
    root = tmp_path_factory.mktemp("real-sweep")
    sweep, proc, _ = smoke_sweep
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shutil.copytree(sweep, root / "smoke")

    def cli(*args):
        return run_cli(*args, tmp_path=root)

    failed = tiny_run(cli, root / "failed", "--fail-at-step", "1")
    assert failed.status == "error"
    xss = failed.model_copy(deep=True).update(run_id="xss-" + failed.run_id, error=XSS)
    xss.env.hostname = "<b>host</b>"
    write(root, xss)
    (root / "skipped.json").write_text(json.dumps(
        [{"run_id": "tiny-megatron-tp4-n1x1", "scale": "tiny", "framework": "megatron", "parallelism": "tp4",
          "nodes": 1, "reason": "tp4 needs 4 GPUs per node, have 1"}]))
    return root


def synthetic_multinode(real: Record, out: Path) -> list[Record]:
    """SYNTHETIC layout fixture: copies of one real record with node counts, scales and figures made
    up, so the multi-node panels have lines to draw. Used for layout tests only, never reported."""
    records = []
    for scale, params, base_mfu in (("800M", 757e6, 0.30), ("3B", 3.16e9, 0.40)):
        for config, factor, drop in (("fsdp2", 1.0, 0.05), ("ddp", 0.8, 0.08)):
            for nodes in (1, 2, 4):
                rec = real.model_copy(deep=True)
                world = nodes * 4
                mfu = base_mfu * factor * (1 - drop * (nodes - 1))
                settings = dict(scale=scale, parallelism=config, nodes=nodes, gpus_per_node=4)
                rec.update(run_id=f"synthetic-{scale}-{config}-n{nodes}", **settings, world_size=world, dp=world,
                           global_batch=real.micro_batch * world, mfu=mfu, hfu=mfu,
                           tflops_per_gpu=mfu * 990, peak_tflops=990.0, peak_source="synthetic",
                           samples_per_s=mfu * 990e12 * world / 1e13, audio_seconds_per_s=mfu * 990e12 * world / 1e13 * 30,
                           peak_mem_gib=20.0 * nodes ** -0.5,
                           config={**rec.config, **settings},  # what the configuration is read from
                           per_rank=[{"rank": 0, "memory": {"device_total_gib": 94.5}}],
                           env=rec.env.model_copy(update={"hostname": "synthetic-fixture",
                                                          "device_name": "SYNTHETIC GH200"}))
                rec.flops_breakdown["params"]["trainable"] = params
                write(out, rec, memory_estimate_gib=22.0 * nodes ** -0.5)
                records.append(rec)
    return records


# ---- the browser ----

def browser_or_skip(width: int = 1400):
    from echobench.report.browser import find_chromium

    missing = []
    if find_chromium() is None:
        missing.append("chromium (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        missing.append("playwright (pip install -e .[dev])")
    if missing:
        if os.environ.get("ECHOBENCH_REQUIRE_BROWSER") == "1":
            pytest.fail(f"ECHOBENCH_REQUIRE_BROWSER=1 but missing: {', '.join(missing)}")
        pytest.skip(f"missing: {', '.join(missing)}")
    from echobench.report.browser import Chromium

    return Chromium(width=width)


PLOTS_JS = """Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => ({
    id: el.id,
    traces: (el.data || []).length,
    points: el.querySelectorAll('.point').length,  // markers and bars as drawn
    visible: el.offsetParent !== null}))"""


def assert_clean(page):
    assert page.log.console_errors == [] and page.log.exceptions == []
    assert page.log.dialogs == []
    outside = [u for u in page.log.requests if not u.startswith(("file:", "data:", "about:", "blob:"))]
    assert outside == [], f"the page fetched from the network: {outside}"


@pytest.mark.browser
@pytest.mark.slow
def test_dashboard_from_real_runs_in_chromium(real_sweep, tmp_path, cli):
    out = tmp_path / "report.html"
    proc = cli("report", real_sweep, "-o", out, check=True)
    assert "wrote" in proc.stderr
    page_html = out.read_text()
    assert "<script src" not in page_html and XSS not in page_html  # nothing to fetch; no raw tag
    runs = load_report_input([real_sweep]).records
    smoke_runs = len(list((real_sweep / "smoke").glob("*/result.json")))
    assert smoke_runs >= 4 and len(runs) == smoke_runs + 2  # + the failed run and its script-tag copy
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        plots = page.evaluate(PLOTS_JS)
        # one scale (tiny): the configurations' bars at the top, MFU, throughput, step time, memory, FLOP
        # breakdown, where the time goes and the selected run's MFU waterfall (the smoke matrix profiles);
        # every configuration of the smoke sweep ran at one GPU count, so scaling efficiency says there is
        # none to show
        assert [p["id"] for p in plots] == [f"fig-{k}-0" for k in ("layouts", "mfu", "throughput", "steptime", "memory",
                                                                   "flops", "time")] + ["waterfall-plot"]
        assert "tiny: every configuration ran at one GPU count" in page.evaluate(
            "document.querySelector('#scaling .panel.empty').textContent")
        assert all(p["traces"] > 0 and p["points"] > 0 for p in plots), plots
        # what a real run measures decides where its markers fall, so no assertion here on how they
        # cover each other (the fixtures with set figures below check that); the plots' and legends'
        # boxes are drawn from names and page structure only
        checked, problems = layout_problems(page)
        assert checked == 8 and [p for p in problems if "overflows" in p or "legend" in p] == [], problems
        table_ids = page.evaluate("Array.from(document.querySelectorAll('#runs tbody tr'))"
                                  ".map(tr => tr.cells[0].textContent.trim())")
        assert sorted(table_ids) == sorted(r.run_id for r in runs)
        # the script tag from a record is text, not markup; no alert fired (checked in assert_clean)
        errors = page.evaluate("Array.from(document.querySelectorAll('#failed-table td.error'))"
                               ".map(td => td.textContent)")
        assert XSS in errors
        assert page.evaluate("document.querySelectorAll('#failed-table script, #runs script').length") == 0
        assert page.evaluate("document.querySelectorAll('#failures b').length") == 0  # the <b> hostname
        assert "tp4 needs 4 GPUs" in page.evaluate("document.getElementById('skipped-table').textContent")
        shot = page.screenshot(ARTIFACTS / "dashboard-real-runs.png")
    assert shot.stat().st_size > 10_000


def with_set_figures(real_sweep: Path, out: Path) -> list[Record]:
    """A copy of the real sweep (records, plans, breakdowns, failed runs, skipped list) whose successful
    records have their figures made up, each configuration its own, so that what the runs happened
    to measure decides nothing on the page. Returns the records changed."""
    shutil.copytree(real_sweep, out)
    changed = []
    for k, path in enumerate(sorted(out.rglob("result.json"))):
        rec = Record.load(path)
        if rec.status != "ok":
            continue
        mfu, step, samples = 0.1 + 0.05 * k, 1.0 + 0.2 * k, (10.0 + 5 * k) * rec.world_size
        rec.update(mfu=mfu, hfu=mfu, tflops_per_gpu=mfu * rec.peak_tflops, samples_per_s=samples,
                   audio_seconds_per_s=samples * 30, step_time_s=step,
                   step_time_p10_s=step * 0.9, step_time_p90_s=step * 1.1, step_time_mean_s=step * 1.05,
                   step_time_mean_vs_median=0.05, peak_mem_gib=1.0 + k)
        rec.save(path.parent)
        changed.append(rec)
    return changed


@pytest.mark.browser
@pytest.mark.slow
def test_multinode_layout_filters_and_sorting(real_sweep, tmp_path, cli):
    """Layout of the multi-node panels, on the SYNTHETIC fixture (made-up node counts and figures),
    beside the real sweep's records with their figures set (tiny)."""
    real = next(r for r in map(Record.load, sorted(real_sweep.rglob("result.json")))
                if r.status == "ok" and r.framework == "torchtitan")
    synthetic = synthetic_multinode(real, tmp_path / "synthetic")
    assert len(with_set_figures(real_sweep, tmp_path / "set")) >= 4
    out = tmp_path / "report.html"
    cli("report", tmp_path / "synthetic", tmp_path / "set", "-o", out, check=True)
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        plots = page.evaluate(PLOTS_JS)
        # three scales (tiny, 800M, 3B) of seven figures (the layouts' bars at the top), tiny without scaling
        # efficiency; where the time goes: one panel per scale and the selected run's waterfall
        assert len(plots) == 7 * 3 - 1 + 3 + 1
        assert all(p["traces"] > 0 and p["points"] > 0 for p in plots)
        assert layout_problems(page) == (24, [])
        mfu_800m = page.evaluate("document.getElementById('fig-mfu-1')._fullData.filter(t => "
                                 "!t.name.startsWith('predicted')).map(t => [t.name, t.x.length])")
        assert sorted((name.split()[:2], n) for name, n in mfu_800m) == [
            (["torchtitan", "ddp"], 3), (["torchtitan", "fsdp2"], 3)]
        # best MFU per scale and node count: 3B at 1 node is the synthetic fsdp2 run
        best = page.evaluate("Array.from(document.querySelectorAll('#best tr[data-scale=\"3B\"]'))"
                             ".map(tr => tr.textContent)")
        assert len(best) == 3 and "synthetic-3B-fsdp2-n1" in best[0]
        # the scale filter hides other scales' panels and rows
        page.evaluate("var s = document.getElementById('scale-filter'); s.value = '3B';"
                      "s.dispatchEvent(new Event('change'))")
        visible = page.evaluate(PLOTS_JS)
        assert sum(p["visible"] for p in visible) == 8 + 1
        rows = page.evaluate("Array.from(document.querySelectorAll('#runs tbody tr:not(.hidden)'))"
                             ".map(tr => tr.cells[0].textContent.trim())")
        assert sorted(rows) == sorted(r.run_id for r in synthetic if r.scale == "3B")
        # sorting by MFU (a header click) orders the rows by the number, highest last
        page.evaluate("Array.from(document.querySelectorAll('#runs th')).find(th => th.textContent === 'MFU (%)').click()")
        order = page.evaluate("Array.from(document.querySelectorAll('#runs tbody tr:not(.hidden)'))"
                              ".map(tr => tr.cells[0].textContent.trim())")
        by_mfu = sorted((r for r in synthetic if r.scale == "3B"), key=lambda r: r.mfu)
        assert order == [r.run_id for r in by_mfu]
        # the text filter
        page.evaluate("var f = document.getElementById('run-filter'); f.value = 'ddp-n4';"
                      "f.dispatchEvent(new Event('input'))")
        total = len(synthetic) + len(load_report_input([tmp_path / "set"]).records)
        assert page.evaluate("document.getElementById('run-count').textContent") == f"1 of {total} runs"
        page.evaluate("var s = document.getElementById('scale-filter'); s.value = '';"
                      "s.dispatchEvent(new Event('change')); document.getElementById('run-filter').value = '';"
                      "document.getElementById('run-filter').dispatchEvent(new Event('input'))")
        page.screenshot(ARTIFACTS / "dashboard-synthetic-multinode.png")
        assert_clean(page)


# ---- scaling: two sweeps of the same layouts, of different lengths ----

def written_record(root: Path, step_s: float, **settings) -> Record:
    """A record made by the record code (start_record, flops_report, bench.summarize, Record.save)
    for settings as a sweep launches them; only the per-rank measurements are made up: every step
    takes step_s on rank 0 and 1% longer on each further rank."""
    import torch

    from echobench.train.bench import summarize
    from echobench.records.config import RunConfig
    from echobench.model.flops import flops_report
    from test_figures import measured_rank

    cfg = RunConfig(**{"scale": "tiny", "device": "cpu", "peak_tflops": 0.05, "micro_batch": 2, "gpus_per_node": 2,
                       "audio_frames": 100, "text_tokens": 32, "speaker_frames": 80, **settings})
    record = start_record(cfg, torch.device("cpu"))
    record.flops_breakdown = flops_report(cfg.model_config(), cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames,
                                          cfg.ac)
    per_sample = record.flops_breakdown["model_flops_per_sample"]
    ranks = [measured_rank([step_s * (1 + 0.01 * r)] * cfg.steps, cfg.micro_batch, per_sample, rank=r)
             for r in range(cfg.world_size)]
    summarize(cfg, record, ranks)
    record.save(root / record.run_id)
    return record


# (layout, its step time on 1 node, how much slower its steps are on 2)
LAYOUT_STEPS = {("torchtitan", "ddp"): (0.10, 1.25), ("torchtitan", "fsdp2"): (0.12, 1.15),
                ("megatron", "tp2"): (0.15, 1.4)}


def two_sweeps(root: Path) -> tuple[Path, Path]:
    """A 5-step sweep on 1 node and a 3-step sweep on 1 and 2 nodes of the same three layouts: the
    issue's local smoke sweep and SLURM sweep."""
    short, long_ = root / "slurm-3-steps", root / "local-5-steps"
    for (framework, parallelism), (step_s, slower) in LAYOUT_STEPS.items():
        written_record(long_, step_s, framework=framework, parallelism=parallelism, nodes=1, steps=5, warmup_steps=2)
        for nodes in (1, 2):
            written_record(short, step_s * (slower if nodes == 2 else 1), framework=framework, parallelism=parallelism,
                           nodes=nodes, steps=3, warmup_steps=1, seed=nodes)
    return long_, short


def at_gpus(xs) -> list[int]:
    """The GPU counts (powers of two here) that dodged x values stand for: each is drawn within a
    fraction of an octave of its own."""
    return [2 ** round(math.log2(x)) for x in xs]


# ---- configurations whose figures coincide exactly ----

# (framework, parallelism, ac): two of one layout, told apart by ac alone
COINCIDING = (("torchtitan", "fsdp2", "none"), ("torchtitan", "fsdp2", "full"), ("torchtitan", "ddp", "none"),
              ("megatron", "tp2", "none"))
COINCIDING_NODES = {"800M": (1,), "3B": (1, 2, 4)}  # 4 GPUs a node


def coinciding(root: Path) -> list[Record]:
    """Four configurations with the same MFU, samples/s and so scaling efficiency at every GPU count:
    at one GPU count (800M) and at 1, 2 and 4 nodes (3B). Undodged, the last drawn hides the others."""
    records = []
    for framework, parallelism, ac in COINCIDING:
        for scale, nodes_list in COINCIDING_NODES.items():
            for nodes in nodes_list:
                efficiency = 1 - 0.1 * (nodes - 1)
                rec = record(f"{scale}-{framework}-{parallelism}-ac-{ac}-n{nodes}", scale=scale, framework=framework,
                             parallelism=parallelism, ac=ac, nodes=nodes, mfu=0.4 * efficiency,
                             samples_per_s=25.0 * 4 * nodes * efficiency)
                write(root, rec)
                records.append(rec)
    return records


def test_dodge_keeps_configurations_apart_and_near_their_gpu_count(tmp_path):
    from echobench.report.figures import DODGE_SPREAD, DODGE_STEP, Figures, dodge, gpu_axis

    octaves = [math.log2(dodge(i, 4, [4, 8, 16])) for i in range(4)]
    assert octaves == sorted(octaves) and sum(octaves) == pytest.approx(0)  # ordered, centred on the count
    assert [b - a for a, b in zip(octaves, octaves[1:])] == pytest.approx([DODGE_STEP] * 3)
    assert dodge(0, 1, [4]) == 1 and dodge(1, 3, [4]) == 1  # alone, or the middle one: at the count itself
    for n, gpus in ((40, [4, 8]), (5, [6, 8]), (5, [7, 8]), (3, [4])):  # many configurations; close GPU counts
        octaves = [math.log2(dodge(i, n, gpus)) for i in range(n)]
        gaps = [b - a for a, b in zip(octaves, octaves[1:])]
        assert all(g > 0 for g in gaps) and sum(octaves) == pytest.approx(0)
        nearest = min((b - a for a, b in zip(sorted(map(math.log2, gpus)), sorted(map(math.log2, gpus))[1:])),
                      default=1)
        assert octaves[-1] - octaves[0] <= min(DODGE_SPREAD, nearest / 2) + 1e-12  # nearer its own count
    # the figures: at each GPU count, the four configurations drawn at four x values about it, in
    # legend order; the hover names the real count, the ticks and the axis' range stand for real counts
    coinciding(tmp_path / "runs")
    ref = tmp_path / "published.csv"
    ref.write_text("scale,framework,parallelism,nodes,mfu,source\n3B,torchtitan,fsdp2,2,0.30,paper\n")
    data = load_report_input([tmp_path / "runs"])
    figs = Figures(data, read_reference(ref))
    group = data.configurations[data.configurations["scale"] == "3B"]
    mfu, throughput, efficiency = (figs.mfu_vs_gpus("3B", group), figs.throughput("3B", group),
                                   figs.scaling_efficiency("3B", group))
    for fig in (mfu, throughput, efficiency):
        subplots = {}
        for t in fig.data:
            if t.mode == "lines+markers":
                subplots.setdefault(t.yaxis, []).append(t)
        for traces in subplots.values():
            assert [t.name for t in traces] == sorted(t.name for t in traces) and len(traces) == 4
            for k, (gpus, nodes) in enumerate(((4, 1), (8, 2), (16, 4))):
                octaves = [math.log2(t.x[k] / gpus) for t in traces]
                assert octaves == sorted(octaves) and len(set(octaves)) == 4 and sum(octaves) == pytest.approx(0)
                assert max(map(abs, octaves)) <= DODGE_SPREAD / 2 + 1e-12
                assert all(f"{gpus} GPUs = {nodes} node(s) x 4" in t.text[k] for t in traces)
    ideal = [t for t in throughput.data if t.name.endswith(": ideal")]
    lines = {(t.name, t.yaxis): list(t.x) for t in throughput.data if t.mode == "lines+markers"}
    assert len(ideal) == 8 and all(list(t.x) == lines[(t.name.removesuffix(": ideal"), t.yaxis)] for t in ideal)
    published = next(t for t in mfu.data if t.name.startswith("published"))
    fsdp2 = next(t for t in mfu.data if t.name == "torchtitan fsdp2 ac=full")  # the layout's first, which it names
    assert list(published.x) == pytest.approx([fsdp2.x[1]]) and "ac=full: measured" in published.text[0]  # 8 GPUs
    axis = gpu_axis(group)
    assert axis["tickvals"] == [4, 8, 16] and axis["ticktext"] == ["4", "8", "16"]
    x = [v for t in mfu.data for v in t.x]
    assert 10 ** axis["range"][0] < min(x) and max(x) < 10 ** axis["range"][1]
    # one GPU count: the range spans an octave about it, not the dodge alone
    lo, hi = gpu_axis(data.configurations[data.configurations["scale"] == "800M"])["range"]
    assert (hi - lo) / math.log10(2) == pytest.approx(1.0) and 10 ** ((hi + lo) / 2) == pytest.approx(4)


@pytest.mark.browser
def test_coinciding_configurations_all_show_in_chromium(tmp_path, cli):
    """Four configurations with exactly the same figures: every one of their markers can be seen
    (layout_problems finds none hidden), each drawn at an x of its own near its GPU count, whose
    hover names the real GPU count."""
    coinciding(tmp_path / "runs")
    ref = tmp_path / "published.csv"
    ref.write_text("scale,framework,parallelism,nodes,mfu,source\n3B,torchtitan,fsdp2,2,0.30,paper\n")
    out = tmp_path / "page.html"
    cli("report", tmp_path / "runs", "--reference", ref, "-o", out, check=True)
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        ids = [p["id"] for p in page.evaluate(PLOTS_JS)]
        checked, problems = layout_problems(page)
        assert problems == [] and checked == len(ids), problems
        for scale, i in (("800M", 0), ("3B", 1)):  # scales by size
            for key in ("mfu", "throughput", "scaling"):
                if key == "scaling" and scale == "800M":  # one GPU count: no scaling to show
                    assert f"fig-scaling-{i}" not in ids
                    continue
                traces = page.evaluate(f"document.getElementById('fig-{key}-{i}')._fullData"
                                       ".filter(t => t.mode === 'lines+markers')"
                                       ".map(t => [t.name, t.yaxis, Array.from(t.x), Array.from(t.text)])")
                for axis in {a for _, a, _, _ in traces}:
                    lines = [(x, text) for _, a, x, text in traces if a == axis]
                    assert len(lines) == len(COINCIDING)
                    for k, nodes in enumerate(COINCIDING_NODES[scale]):
                        xs = [x[k] for x, _ in lines]
                        assert len(set(xs)) == len(xs), (key, scale, xs)  # apart from each other
                        assert at_gpus(xs) == [4 * nodes] * len(xs)
                        assert all(f"{4 * nodes} GPUs = {nodes} node(s) x 4" in text[k] for _, text in lines)
        shot = page.screenshot(ARTIFACTS / "dashboard-coinciding.png")
    assert shot.stat().st_size > 10_000


def test_two_sweeps_of_different_lengths_draw_one_line_per_layout(tmp_path):
    from echobench.report.figures import Figures

    long_, short = two_sweeps(tmp_path)
    data = load_report_input([long_, short])
    assert len({r.run_id for r in data.records}) == 9  # run ids still tell every run apart
    configs = data.configurations.set_index(["config", "nodes"])
    # one row per layout and node count; at 1 node the two sweeps' runs pool (median, count 2)
    assert sorted(configs.index) == [(f"{f} {p}", n) for f, p in sorted(LAYOUT_STEPS) for n in (1, 2)]
    assert configs.loc[("torchtitan ddp", 1), "repeats"] == 2
    assert sorted(configs.loc[("torchtitan ddp", 1), "run_steps"]) == [3, 5]
    figs = Figures(data)
    mfu = figs.mfu_vs_gpus("tiny", data.configurations)
    # one line per layout, across GPU counts (drawn a little aside each); labels name framework and
    # parallelism only (no steps=)
    assert {t.name: at_gpus(t.x) for t in mfu.data} == {f"{f} {p}": [2, 4] for f, p in LAYOUT_STEPS}
    assert len({t.x[0] for t in mfu.data}) == 3
    assert mfu.layout.xaxis.type == "log" and list(mfu.layout.xaxis.tickvals) == [2, 4]
    efficiency = figs.scaling_efficiency("tiny", data.configurations)
    ddp = next(t for t in efficiency.data if t.name == "torchtitan ddp")
    # per-GPU samples/s against the smallest GPU count: steps 25% slower, slowest rank 3% vs 1%
    assert list(ddp.y) == pytest.approx([100, 100 * 1.01 / (1.25 * 1.03)])
    ideal = next(t for t in efficiency.data if t.name == "ideal (linear) scaling")
    assert list(ideal.y) == [100, 100] and list(ideal.x) == [2, 4]
    throughput = figs.throughput("tiny", data.configurations)
    ideal_ddp = [t for t in throughput.data if t.name == "torchtitan ddp: ideal"]
    assert len(ideal_ddp) == 2 and all(t.y[0] == t.y[1] for t in ideal_ddp)  # flat: per-GPU rate of 2 GPUs
    # each framework + parallelism keeps one colour in every figure, and no two share one
    colours = {t.name: t.line.color for t in mfu.data}
    assert len(set(colours.values())) == 3
    for fig in (throughput, efficiency):
        assert all(t.line.color == colours[t.name] for t in fig.data if t.name in colours)
    # the table: one row per layout and node count, the settings that tell nothing apart left out
    table = publication_table(data.frame)
    assert len(table) == 6 and "steps" not in table.columns and sorted(table["repeats"]) == [1, 1, 1, 2, 2, 2]
    # compare pairs the 1-node configurations across the two sweeps' lengths
    comparison = compare_records(load_report_input([long_]).records, load_report_input([short]).records, 5)
    assert len(comparison.changes) == 3 and len(comparison.only_new) == 3


def test_configuration_ignores_how_long_we_measure_and_reads_old_records():
    from echobench.records.config import RunConfig, configuration_id, run_id
    from echobench.records.results import configuration_key

    base = RunConfig(scale="tiny")
    longer = RunConfig(scale="tiny", steps=99, warmup_steps=0, seed=3, repeat=2, trace=True, time_limit_s=9.0,
                       collective_timeout_s=5.0, tokenizer="/x", encoder_checkpoint="/y", fail_at_step=4)
    assert run_id(base) != run_id(longer)  # ids keep steps and seed: a sweep's directories stay valid
    assert configuration_id(base.to_dict()) == configuration_id(longer.to_dict())
    for other in (RunConfig(scale="tiny", micro_batch=4), RunConfig(scale="tiny", nodes=2),
                  RunConfig(scale="tiny", ac="full"), RunConfig(scale="tiny", peak_tflops=1.0)):
        assert configuration_id(other.to_dict()) != configuration_id(base.to_dict())
    # a record whose config predates keys (here repeat; te, sequence_parallel taken out) reads them
    # at their defaults
    old = Record.load(FIXTURES / "record-v1.json")
    full = dict(old.config)
    for key in ("te", "sequence_parallel"):
        del old.config[key]
    assert "repeat" not in old.config
    assert configuration_key(old) == configuration_id({**full, "repeat": 5})
    assert configuration_key(old) != configuration_id({**full, "te": "on"})
    # a record without `config` (hand-made) is read from its top-level fields
    assert configuration_key(record("a", micro_batch=4)) != configuration_key(record("b"))
    assert configuration_key(record("a", steps=3)) == configuration_key(record("b"))


@pytest.mark.browser
def test_scaling_page_with_published_figures_in_chromium_at_1400_and_800_px(tmp_path, cli):
    """The two sweeps' page with --reference: one line per layout, published MFU beside the
    measured in the MFU figure and the best-MFU table, and at both widths no plot overflowing its
    section, no legend over a plot area, every trace drawn inside its axes and not hidden."""
    long_, short = two_sweeps(tmp_path)
    measured = load_report_input([long_, short]).configurations.set_index(["config", "nodes"])["mfu"]
    ref = tmp_path / "published.csv"
    ref.write_text("scale,framework,parallelism,nodes,mfu,source\n"
                   "tiny,torchtitan,ddp,1,0.30,paper <i>table 2</i>\n"
                   "tiny,torchtitan,ddp,2,0.25,paper table 2\n"
                   "8B,megatron,tp4,16,0.35,paper table 3\n")
    out = tmp_path / "page.html"
    cli("report", long_, short, "-o", out, "--reference", ref, check=True)
    for width in (1400, 800):
        with browser_or_skip(width) as page:
            page.open(out)
            assert_clean(page)
            checked, problems = layout_problems(page)
            assert checked == 7 and problems == [], (width, problems)  # the layouts' bars and six figures
            plots = page.evaluate("Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => "
                                  "[el.id, el.getBoundingClientRect().width])")
            assert all(w <= width - 40 for _, w in plots), (width, plots)
            if width == 1400:  # one scale: every plot takes the page's width, not half of it
                assert all(w > 1200 for _, w in plots), plots
            lines = dict(page.evaluate("document.getElementById('fig-mfu-0')._fullData"
                                       ".map(t => [t.name, Array.from(t.x)])"))
            assert {name: at_gpus(x) for name, x in lines.items()} == {
                **{f"{f} {p}": [2, 4] for f, p in LAYOUT_STEPS}, "published (--reference)": [2, 4]}
            assert lines["published (--reference)"] == pytest.approx(lines["torchtitan ddp"])  # at its layout's x
            published = page.evaluate("document.getElementById('fig-mfu-0').data.find(t => t.name.startsWith("
                                      "'published')).text.join(' ')")
            diff = (measured[("torchtitan ddp", 1)] - 0.30) * 100
            assert f"measured {measured[('torchtitan ddp', 1)] * 100:.3g}%, {diff:+.1f} pp" in published
            assert "&lt;i&gt;table 2&lt;/i&gt;" in published  # a source is text, not markup
            best = page.evaluate("Array.from(document.querySelectorAll('#best-table tr')).map(tr => "
                                 "Array.from(tr.cells).map(c => c.textContent.trim()))")
            header = best[0]
            row = dict(zip(header, best[1]))  # tiny, 1 node: the best layout's own published figure or the best
            assert "published MFU (%)" in header and "diff (pp)" in header and row["published MFU (%)"].startswith("30.0")
            assert row["diff (pp)"] == f"{float(row['MFU (%)']) - 30:+.1f}"
            assert "8B megatron tp4 on 16 node(s): 35.0%" in page.evaluate(
                "document.getElementById('unplotted').textContent")
            # the check finds what it looks for: a legend moved over the data, a plot wider than its
            # panel, a line drawn exactly under another (its x and y both: the dodge keeps apart equal y)
            page.evaluate("Plotly.relayout('fig-mfu-0', {'legend.x': 0.5, 'legend.y': 0.5}).then(() => 0)")
            page.evaluate("Plotly.relayout('fig-scaling-0', {width: 2 * window.innerWidth}).then(() => 0)")
            page.evaluate("var el = document.getElementById('fig-throughput-0'), n = el.data.map(t => t.name),"
                          " ddp = el._fullData[n.indexOf('torchtitan ddp')];"
                          "Plotly.restyle(el, {x: [Array.from(ddp.x)], y: [Array.from(ddp.y)]},"
                          " [n.indexOf('megatron tp2')]).then(() => 0)")
            problems = layout_problems(page)[1]
            assert "fig-mfu-0: the legend covers the plot area" in problems
            assert (f"fig-scaling-0: the plot ({2 * width} px) overflows its panel ({round(dict(plots)['fig-scaling-0']) + 10} px)"
                    in problems)
            assert "fig-throughput-0: every marker of trace 'megatron tp2' is hidden under other traces" in problems
        # after the negative check: a fresh page for the screenshot
        with browser_or_skip(width) as page:
            page.open(out)
            page.screenshot(ARTIFACTS / f"dashboard-scaling-{width}px.png")


# ---- empty and failed input ----

def test_empty_dir_gives_a_page_and_a_table_saying_so(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "r.html"
    proc = cli("report", tmp_path / "empty", "-o", out)
    assert proc.returncode == 0 and "no result records" in proc.stderr
    text = out.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "No result records found under" in text
    proc = cli("report", tmp_path / "empty", "--table", "md")
    assert proc.returncode == 0 and "no result records" in proc.stdout and "| scale |" in proc.stdout
    proc = cli("report", tmp_path / "nope", "-o", out)
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr


def test_only_failed_runs_and_corrupt_records(tmp_path, cli):
    write(tmp_path, record("a", status="oom", error="CUDA out of memory"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "result.json").write_text("{not json")
    out = tmp_path / "r.html"
    proc = cli("report", tmp_path, "-o", out)
    assert proc.returncode == 0 and "no successful runs" in proc.stderr and "bad/result.json" in proc.stderr
    text = out.read_text()
    assert "No successful runs" in text and "CUDA out of memory" in text and "bad/result.json" in text
    proc = cli("report", tmp_path, "--table", "csv")
    assert proc.stdout.splitlines() == ["scale,framework,parallelism,nodes,world_size,global_batch,step_time_s,"
                                        "samples_per_s,tflops_per_gpu,mfu,mfu_min,mfu_max,repeats,peak_mem_gib,notes"]


def test_strings_from_records_are_escaped(tmp_path):
    from echobench.report import render_dashboard

    write(tmp_path, record("r<img src=x onerror=alert(2)>"), name="r1", memory_estimate_gib=45.0)
    rec = record("f1", status="error", error=XSS)
    rec.env.hostname = "<i>h</i>"
    write(tmp_path, rec)
    data = load_report_input([tmp_path])
    assert data.frame.set_index("run_id").loc["r<img src=x onerror=alert(2)>", "memory_estimate_gib"] == 45.0
    page = render_dashboard(data)
    for raw in (XSS, "<img src=x", "<i>h</i>"):
        assert raw not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "&lt;i&gt;h&lt;/i&gt;" in page


def test_the_software_line_names_cluster_fabric_and_driver(tmp_path):
    from echobench.report import render_dashboard

    rec = record("r1")
    rec.env.scheduler = {"cluster": "alps", "partition": "normal", "job_id": "7"}
    rec.env.comm_env = {"NCCL_NET": "AWS Libfabric", "NCCL_SOCKET_IFNAME": "<hsn>"}
    rec.env.driver = "570.86.15"
    rec.env.nccl_transport = "NET/AWS Libfabric (preflight job <7>)"  # what the sweep's preflight saw
    write(tmp_path, rec)
    page = render_dashboard(load_report_input([tmp_path]))
    assert "cluster <code>alps/normal</code>" in page and "driver <code>570.86.15</code>" in page
    assert "fabric env <code>NCCL_NET=AWS Libfabric NCCL_SOCKET_IFNAME=&lt;hsn&gt;</code>" in page
    assert "NCCL transport <code>NET/AWS Libfabric (preflight job &lt;7&gt;)</code>" in page


def profiled(fractions=None, step_time_s=1.0):
    f = fractions or {"gemm": 0.5, "attention": 0.1, "optimizer": 0.05, "other_compute": 0.15, "memcpy": 0.02,
                      "communication": 0.08, "data_wait": 0.03, "idle": 0.07}
    return {"file": "breakdown.json", "rank": 0, "timeline": "GPU streams", "profiled_steps": 3,
            "step_time_s": step_time_s, "fractions": f}


def test_time_section_links_best_rows_to_a_profiled_repeat_and_escapes(tmp_path):
    """The best-MFU row of a configuration links to the waterfall of its profiled repeat; run ids from
    records reach the page's JSON with nothing that could end its script element."""
    import re

    from echobench.report import render_dashboard

    write(tmp_path, record("cfg-a", mfu=0.42, repeat=0))  # repeat 0 was not profiled
    write(tmp_path, record("cfg-a-r1", mfu=0.40, repeat=1, breakdown=profiled()))
    xss_id = "cfg-b</script><script>alert(3)</script>"
    write(tmp_path, record(xss_id, scale="3B", mfu=0.30, breakdown=profiled()), name="b")
    write(tmp_path, record("cfg-c", scale="3B", nodes=2, mfu=0.2))  # not profiled: no link
    page = render_dashboard(load_report_input([tmp_path]))
    assert "alert(3)</script>" not in page
    payload = json.loads(re.search(r'<script type="application/json" id="waterfall-data">(.*?)</script>', page, re.S)[1])
    assert sorted(payload["runs"]) == sorted(["cfg-a-r1", xss_id])
    wf = payload["runs"]["cfg-a-r1"]["data"][0]
    assert wf["type"] == "waterfall" and wf["y"][0] == 100 and wf["y"][-1] == pytest.approx(40.0)
    assert 100 + sum(wf["y"][1:-1]) == pytest.approx(40.0)
    assert 'data-run="cfg-a-r1">waterfall</a>' in page  # the 800M row (best: cfg-a, median of its repeats)
    best_table = page[page.index('<table id="best-table">'):page.index("</table>", page.index('<table id="best-table">'))]
    best_3b = re.findall(r'<tr data-scale="3B">.*?</tr>', best_table, re.S)
    assert len(best_3b) == 2 and "waterfall-link" in best_3b[0] and "waterfall-link" not in best_3b[1]
    assert 'id="fig-time-0"' in page and 'id="fig-time-1"' in page  # stacked parts for 800M and 3B


@pytest.mark.browser
@pytest.mark.slow
def test_where_the_time_goes_in_chromium(real_sweep, tmp_path, cli):
    """The smoke sweep profiles (trace: true): every run has a breakdown, the section draws the
    parts per configuration, and the best-MFU table's link shows that run's waterfall."""
    out = tmp_path / "report.html"
    cli("report", real_sweep, "-o", out, check=True)
    ok = {r.run_id: r for r in load_report_input([real_sweep]).records if r.status == "ok"}
    assert len(ok) >= 4 and all("fractions" in (r.breakdown or {}) for r in ok.values())
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        # _fullData: the traces as drawn (plotly sends numbers as typed arrays)
        bars = page.evaluate("document.getElementById('fig-time-0')._fullData.map(t => Array.from(t.x))")
        assert len(bars) == 8 and len(bars[0]) == len(ok)  # 8 parts; one bar per configuration (no repeats here)
        for i in range(len(ok)):
            assert sum(t[i] for t in bars) == pytest.approx(100.0)  # each configuration's parts fill its step
        assert page.evaluate("document.querySelectorAll('#fig-time-0 .point').length") > 0
        options = page.evaluate("Array.from(document.querySelectorAll('#waterfall-run option')).map(o => o.value)")
        assert sorted(options) == sorted(ok)
        link = page.evaluate("document.querySelector('#best a.waterfall-link').getAttribute('data-run')")
        other = next(o for o in options if o != link)
        page.evaluate(f"var s = document.getElementById('waterfall-run'); s.value = {json.dumps(other)};"
                      "s.dispatchEvent(new Event('change'))")
        shown = "(() => { const p = document.getElementById('waterfall-plot'); return {sel: " \
                "document.getElementById('waterfall-run').value, type: p._fullData[0].type, " \
                "y: Array.from(p._fullData[0].y), " \
                "title: p.layout.title.text, bars: p.querySelectorAll('.point').length}; })()"
        assert page.evaluate(shown)["sel"] == other
        page.evaluate("document.querySelector('#best a.waterfall-link').click()")
        wf = page.evaluate(shown)
        assert wf["sel"] == link and wf["type"] == "waterfall" and link in wf["title"] and wf["bars"] == 10
        assert wf["y"][-1] == pytest.approx(100 * ok[link].mfu)
        assert 100 + sum(wf["y"][1:-1]) == pytest.approx(100 * ok[link].mfu, abs=1e-6)
        shot = page.screenshot(ARTIFACTS / "dashboard-where-the-time-goes.png", selector="#time")
        assert_clean(page)
    assert shot.stat().st_size > 10_000


def padded_record(run_id, padded_flops, hardware_flops, **extra) -> Record:
    """A profiled record (profiled(): GEMM + attention 60% of the step, no calibration) with set counts of
    padded and hardware FLOPs and set padded shares of the streams' tokens (run_figures.padding_figures)."""
    from echobench.records.run_figures import padding_figures

    return record(run_id, breakdown=profiled(), measured_hardware_flops=hardware_flops, **extra,
                  **padding_figures(padded_flops=padded_flops, hardware_flops=hardware_flops,
                                    tokens={"latent": [60, 100], "text": [30, 40], "speaker": [9, 10]}))


@pytest.mark.browser
@pytest.mark.slow
def test_dashboard_shows_padding_in_chromium(tmp_path, cli):
    """Set figures: a run whose padded FLOPs are 1.5x its hardware FLOPs spent a third of its matmul time
    (60% of the step, at the peak: C = 1) on padding, 20 points of the peak, taken out of the matmul
    shortfall; the runs table shows the padded shares. A record written before padding was counted
    (tests/fixtures/record-v2.json, a real one) still renders, its padding unknown, not 0."""
    old = Record.load(FIXTURES / "record-v2.json")
    assert old.measured_padded_flops is None
    write(tmp_path, old.update(breakdown=profiled()))
    write(tmp_path, padded_record("padded", 3 * 10**15, 2 * 10**15, mfu=0.3))
    out = tmp_path / "report.html"
    cli("report", tmp_path, "-o", out, check=True)
    shown = "(() => { const p = document.getElementById('waterfall-plot'); const d = p._fullData[0]; return {" \
            "x: Array.from(d.x), y: Array.from(d.y), text: Array.from(d.text), hover: Array.from(d.hovertext)," \
            "bars: p.querySelectorAll('.point').length}; })()"
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        page.evaluate("var s = document.getElementById('waterfall-run'); s.value = 'padded';"
                      "s.dispatchEvent(new Event('change'))")
        wf = page.evaluate(shown)
        assert wf["x"][-3:] == ["padding", "matmul shortfall / other", "achieved MFU"] and wf["bars"] == 10
        pad = wf["x"].index("padding")
        assert wf["y"][pad] == pytest.approx(-60 * (3 - 2) / 3) and wf["text"][pad] == "-20.00"
        assert wf["y"][pad + 1] == pytest.approx(-(60 * 2 / 3 - 30))  # the shortfall without the padding
        assert 100 + sum(wf["y"][1:-1]) == pytest.approx(30.0)
        page.evaluate(f"var s = document.getElementById('waterfall-run'); s.value = {json.dumps(old.run_id)};"
                      "s.dispatchEvent(new Event('change'))")
        wf = page.evaluate(shown)
        pad = wf["x"].index("padding")
        assert wf["text"][pad] == "unknown" and "unknown" in wf["hover"][pad] and wf["y"][pad] == 0
        assert 100 + sum(wf["y"][1:-1]) == pytest.approx(100 * old.mfu, abs=1e-6)
        cells = page.evaluate("(() => { const h = Array.from(document.querySelectorAll('#runs th'))"
                              ".map(th => th.textContent); return Array.from(document.querySelectorAll("
                              "'#runs tbody tr')).map(tr => [tr.cells[0].textContent.trim(), "
                              "tr.cells[h.indexOf('padded FLOPs (%)')].textContent.trim(), "
                              "tr.cells[h.indexOf('padded tokens a/t/s (%)')].textContent.trim()]); })()")
        assert sorted(cells) == sorted([["padded", "33.3", "40.0/25.0/10.0"], [old.run_id, "", ""]])
        assert_clean(page)


# ---- the publication table ----

def table_records():
    return [
        record("8b-tt-2", scale="8B", nodes=2, mfu=0.38, samples_per_s=80.0, step_time_s=3.2),
        record("800m-mg-1", scale="800M", framework="megatron", parallelism="tp2", mfu=0.45, samples_per_s=900.0),
        record("800m-tt-4", scale="800M", nodes=4, mfu=0.40, samples_per_s=120.0, tflops_per_gpu=396.0),
        record("800m-tt-1", scale="800M", nodes=1, mfu=0.42, samples_per_s=40.0),
        record("3b-tt-1", scale="3B", nodes=1, mfu=0.41, samples_per_s=20.0),
        record("3b-oom", scale="3B", nodes=1, parallelism="ddp", status="oom", error="oom"),
    ]


def test_publication_table_rows_and_order(tmp_path, cli):
    for rec in table_records():
        write(tmp_path, rec)
    table = publication_table(load_report_input([tmp_path]).frame)
    keys = list(zip(table["scale"], table["framework"], table["parallelism"], table["nodes"]))
    # scale by size, then framework, parallelism, nodes; failed runs left out
    assert keys == [("800M", "megatron", "tp2", 1), ("800M", "torchtitan", "fsdp2", 1),
                    ("800M", "torchtitan", "fsdp2", 4), ("3B", "torchtitan", "fsdp2", 1),
                    ("8B", "torchtitan", "fsdp2", 2)]
    assert list(table["world_size"]) == [4, 4, 16, 4, 8] and list(table["global_batch"]) == [32, 32, 128, 32, 64]
    md = cli("report", tmp_path, "--table", "md", check=True).stdout.splitlines()
    assert md[0] == ("| scale | framework | parallelism | nodes | GPUs | global batch | step time (s) | samples/s "
                     "| TFLOP/s per GPU | MFU (%) | MFU min (%) | MFU max (%) | repeats | memory (GiB) |")
    assert md[2] == "| 800M | megatron | tp2 | 1 | 4 | 32 | 1 | 900 | 446 | 45.0 | 45.0 | 45.0 | 1 | 40 |"
    assert md[4] == "| 800M | torchtitan | fsdp2 | 4 | 16 | 128 | 1 | 120 | 396 | 40.0 | 40.0 | 40.0 | 1 | 40 |"
    assert md[6] == "| 8B | torchtitan | fsdp2 | 2 | 8 | 64 | 3.20 | 80 | 376 | 38.0 | 38.0 | 38.0 | 1 | 40 |"
    latex = cli("report", tmp_path, "--table", "latex", check=True).stdout
    assert "\\toprule" in latex and "MFU (\\%)" in latex and latex.count("\\\\") == 6
    csv = cli("report", tmp_path, "--table", "csv", check=True).stdout.splitlines()
    assert csv[2] == "800M,torchtitan,fsdp2,1,4,32,1,40,415.8,0.42,0.42,0.42,1,40,"


def test_reference_differences(tmp_path, cli):
    for rec in table_records():
        write(tmp_path / "runs", rec)
    ref = tmp_path / "published.csv"
    ref.write_text("scale,framework,parallelism,nodes,mfu,tflops_per_gpu,samples_per_s,source\n"
                   "800M,torchtitan,fsdp2,4,0.42,400,100,paper table 2\n"
                   "8B,torchtitan,fsdp2,2,0.40,,,paper table 3\n"
                   "8B,megatron,tp4,16,0.35,,,paper table 3\n")
    table = publication_table(load_report_input([tmp_path / "runs"]).frame, read_reference(ref)).set_index(
        ["scale", "framework", "parallelism", "nodes"])
    row = table.loc[("800M", "torchtitan", "fsdp2", 4)]
    # measured 0.40 MFU, 396 TFLOP/s, 120 samples/s against published 0.42, 400, 100
    assert row["diff_mfu_pp"] == pytest.approx(-2.0)
    assert row["diff_tflops_pct"] == pytest.approx(-1.0)
    assert row["diff_samples_pct"] == pytest.approx(20.0)
    assert table.loc[("8B", "torchtitan", "fsdp2", 2), "diff_mfu_pp"] == pytest.approx(-2.0)
    published_only = table.loc[("8B", "megatron", "tp4", 16)]
    assert published_only["mfu"] != published_only["mfu"] and published_only["ref_mfu"] == 0.35  # NaN measured
    md = cli("report", tmp_path / "runs", "--table", "md", "--reference", ref, check=True).stdout
    assert ("| 800M | torchtitan | fsdp2 | 4 | 16 | 128 | 1 | 120 | 396 | 40.0 | 40.0 | 40.0 | 1 | 40 | 42.0 | -2.0 "
            "| 400 | -1.0 | 100 | +20.0 | paper table 2 |") in md
    assert md.index("| 800M | megatron") < md.index("| 3B |") < md.index("| 8B | megatron")


def test_reference_csv_errors(tmp_path, cli):
    write(tmp_path / "runs", record("a"))
    bad = tmp_path / "bad.csv"
    bad.write_text("scale,framework,parallelism,nodes,mfu\n800M,torchtitan,fsdp2,1,42\n")
    with pytest.raises(ReferenceError, match="fraction"):
        read_reference(bad)
    bad.write_text("scale,framework,nodes,mfu\n800M,torchtitan,1,0.4\n")
    proc = cli("report", tmp_path / "runs", "--table", "md", "--reference", bad)
    assert proc.returncode == 2 and "missing key column(s) parallelism" in proc.stderr
    assert render_table(load_report_input([tmp_path / "runs"]).frame, "md").count("\n") == 3


# ---- compare ----

def timed(run_id, step_times, **kw):
    """A record whose window figures follow from its stored step times (32 samples a step,
    1e13 FLOPs a sample, 4 GPUs of 990 TFLOP/s)."""
    samples_per_s = 32 * len(step_times) / sum(step_times)
    return record(run_id, samples_per_s=samples_per_s, mfu=samples_per_s * 1e13 / (4 * 990e12),
                  step_times_s=list(step_times), step_time_s=statistics.median(step_times), **kw)


def noisy_steps(rng, n=30, scale=1.0, sigma=0.3):
    return [scale * rng.lognormvariate(0, sigma) for _ in range(n)]


def test_compare_gates_on_threshold_and_significance(tmp_path, cli):
    rng = random.Random(0)
    base_a, base_b = noisy_steps(rng, sigma=0.1), noisy_steps(rng, sigma=0.1)
    # three configurations (a configuration is the settings, not the run id): micro-batch 8, 16, 4
    for run_id, steps, mb in (("a", base_a, 8), ("b", base_b, 16)):
        write(tmp_path / "old", timed(run_id, steps, micro_batch=mb))
    write(tmp_path / "new", timed("a", base_a))  # unchanged
    write(tmp_path / "new", timed("b", [t * 1.25 for t in base_b], micro_batch=16))  # every step 25% slower
    write(tmp_path / "new", record("c", micro_batch=4))  # only in NEW: listed, not a regression
    proc = cli("compare", tmp_path / "old", tmp_path / "new", "--threshold", "5")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "b: REGRESSION samples/s -20.0%, MFU -20.0% (p=" in proc.stdout and "only in NEW (1): c" in proc.stdout
    proc = cli("compare", tmp_path / "old", tmp_path / "new", "--threshold", "25")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no significant loss of more than 25%" in proc.stdout
    # a run that succeeded before and fails now is a regression whatever the threshold
    write(tmp_path / "new", record("a", status="oom", error="CUDA out of memory", time="2026-12-01T00:00:00+00:00"))
    proc = cli("compare", tmp_path / "old", tmp_path / "new", "--threshold", "50")
    assert proc.returncode == 1 and "now oom" in proc.stdout
    (tmp_path / "other").mkdir()
    write(tmp_path / "other", record("z", scale="3B"))
    proc = cli("compare", tmp_path / "old", tmp_path / "other")
    assert proc.returncode == 2 and "no configurations in common" in proc.stderr
    # two layouts are for the report, side by side: the line says so, with the command
    said = " ".join(proc.stderr.split())
    assert f"to set different layouts side by side: echobench report {tmp_path / 'old'} {tmp_path / 'other'}" in said


def test_two_samples_of_one_noisy_distribution_do_not_flag(tmp_path, cli):
    flagged, over_threshold = [], 0
    for seed in range(20):
        rng = random.Random(seed)
        old, new = timed("a", noisy_steps(rng)), timed("a", noisy_steps(rng))
        change = compare_records([old], [new], threshold_pct=5).changes[0]
        over_threshold += -change.samples_change_pct > 5  # a bare percentage gate would fail these
        flagged += [seed] if change.regressed else []
    assert flagged == [] and over_threshold >= 4
    # seed 5: samples/s 10% lower by chance, p = 0.14: reported, not a regression
    rng = random.Random(5)
    write(tmp_path / "old", timed("a", noisy_steps(rng)))
    write(tmp_path / "new", timed("a", noisy_steps(rng)))
    proc = cli("compare", tmp_path / "old", tmp_path / "new", "--threshold", "5")
    assert proc.returncode == 0, proc.stdout
    assert "a: not significant samples/s -10.3%, MFU -10.3% but not significant (p=0.14 >= 0.01)" in proc.stdout


def test_a_1_5x_slower_copy_flags_and_few_steps_are_a_weak_comparison(tmp_path, cli):
    for seed in range(20):  # a fresh draw of the same noise, 1.5x slower: flagged every time
        rng = random.Random(seed)
        old, slower = noisy_steps(rng), noisy_steps(rng, scale=1.5)
        change = compare_records([timed("a", old)], [timed("a", slower)], threshold_pct=5).changes[0]
        assert change.regressed and change.p_value < 0.01 and not change.weak, (seed, change)
    # 4 steps a side: even a 1.5x slowdown is not decided
    write(tmp_path / "old", timed("a", old[:4]))
    write(tmp_path / "new", timed("a", [t * 1.5 for t in old[:4]]))
    proc = cli("compare", tmp_path / "old", tmp_path / "new", "--threshold", "5")
    assert proc.returncode == 0 and "REGRESSION" not in proc.stdout, proc.stdout
    assert "a: weak comparison: 4 old / 4 new steps stored (need 5 a side to decide)" in proc.stdout
    assert "1 weak comparison(s)" in proc.stdout


def test_compare_pools_the_repeats_of_a_configuration():
    rng = random.Random(2)
    old = [timed("a" if k == 0 else f"a-r{k}", noisy_steps(rng, n=3, sigma=0.1), repeat=k) for k in range(3)]
    new = [timed("a" if k == 0 else f"a-r{k}", noisy_steps(rng, n=3, scale=1.5, sigma=0.1), repeat=k)
           for k in range(3)]
    comparison = compare_records(old, new, threshold_pct=5)
    (change,) = comparison.changes  # 3 steps a run would be weak; pooled over 3 repeats: 9 a side
    assert (change.old_repeats, change.new_steps) == (3, 9) and change.regressed
    assert change.old_mfu == statistics.median(r.mfu for r in old)


# ---- repeats, peaks and allocator flags in the table and the dashboard ----

def repeat_records():
    runs = [record("a" if k == 0 else f"a-r{k}", repeat=k, mfu=m, samples_per_s=s)
            for k, (m, s) in enumerate([(0.30, 90.0), (0.42, 120.0), (0.40, 100.0)])]
    return runs + [
        record("fp8", scale="3B", precision="fp8", mfu=0.30, mfu_fp8_peak=0.15, peak_precision="bf16",
               peak_fp8_tflops=1979.0),
        record("cal", scale="8B", mfu=0.50, peak_precision="bf16", peak_source="calibrated:bfloat16 GEMM 2026-11-30"),
        record("thrash", scale="8B", nodes=2, mfu=0.35, num_alloc_retries=12, num_ooms=0),
    ]


def test_repeats_report_the_median_with_min_max_and_count(tmp_path, cli):
    for rec in repeat_records():
        write(tmp_path, rec)
    table = publication_table(load_report_input([tmp_path]).frame).set_index("scale")
    row = table.loc["800M"]
    assert (row["mfu"], row["mfu_min"], row["mfu_max"], row["repeats"]) == (0.40, 0.30, 0.42, 3)
    assert row["samples_per_s"] == 100.0 and table.loc["3B", "repeats"] == 1
    md = cli("report", tmp_path, "--table", "md", check=True).stdout
    assert "| MFU (%) | MFU min (%) | MFU max (%) | MFU vs fp8 peak (%) | repeats |" in md
    assert "| 800M | torchtitan | fsdp2 | 1 | 4 | 32 | 1 | 100 | 396 | 40.0 | 30.0 | 42.0 | - | 3 | 40 |" in md


def test_calibrated_peaks_and_fp8_runs_carry_visible_notes(tmp_path, cli):
    from echobench.report import render_dashboard

    for rec in repeat_records():
        write(tmp_path, rec)
    md = cli("report", tmp_path, "--table", "md", check=True).stdout
    assert "| 3B | torchtitan | fsdp2 | 1 | 4 | 32 | 1 | 100 | 297 | 30.0 | 30.0 | 30.0 | 15.0 | 1 | 40 | [1] |" in md
    assert "_[1] fp8 run: MFU is against the bf16 peak, and against the dense fp8 peak in a figure of its own._" in md
    assert ("_[2] MFU is against a calibrated GEMM rate (bfloat16 GEMM 2026-11-30), not a datasheet peak: it reads "
            "higher than datasheet-based MFU._") in md
    latex = cli("report", tmp_path, "--table", "latex", check=True).stdout
    assert "\\noindent\\textit{[2] MFU is against a calibrated GEMM rate" in latex
    csv = cli("report", tmp_path, "--table", "csv", check=True).stdout
    assert csv.splitlines()[0].endswith(",repeats,peak_mem_gib,notes") and "calibrated GEMM rate" in csv
    page = render_dashboard(load_report_input([tmp_path]))
    notes = page[page.index('id="notes"'):page.index("</div>", page.index('id="notes"'))]
    assert "1 of 6 successful run(s) report MFU against a calibrated GEMM rate" in notes
    assert "1 fp8 run(s), marked fp8" in notes
    assert "1 run(s) had CUDA allocator retries" in notes and "thrash" in notes
    runs = page[page.index('<table id="runs"'):]
    assert runs.count('data-fp8="1"') == 1 and runs.count('data-retries="1"') == 1
    assert runs.count('class="flag calibrated"') == 1 and 'class="flag fp8"' in runs


def test_runs_of_one_configuration_against_different_peaks_are_noted(tmp_path):
    from echobench.records.config import RunConfig
    from echobench.report.dashboard import page_notes

    # two sweeps, each against its own calibration (no peak in the settings): one configuration
    for run_id, peak, steps in (("a", 0.020, 5), ("b", 0.024, 3)):
        settings = RunConfig(scale="800M", parallelism="fsdp2", gpus_per_node=4, steps=steps).to_dict()
        write(tmp_path, record(run_id, peak_tflops=peak, steps=steps, config=settings,
                               peak_source="calibrated:float32 GEMM"))
    data = load_report_input([tmp_path])
    assert list(data.configurations["repeats"]) == [2]
    assert any(n.startswith("1 configuration(s) pool runs measured against different peaks") for n in page_notes(data))


def test_runs_on_synthetic_data_are_noted_as_an_upper_bound(tmp_path):
    from echobench.records.config import RunConfig
    from echobench.report.dashboard import page_notes

    write(tmp_path, record("a", config=RunConfig(scale="800M").to_dict(), padded_flops_frac=0.0))
    write(tmp_path, record("b", config=RunConfig(scale="800M", data=str(tmp_path / "shards")).to_dict(),
                           padded_flops_frac=0.25, attention_paths={"dit": {"dense": 3, "split": 1}}))
    write(tmp_path, record("c", config=RunConfig(scale="800M", synthetic_lengths="drawn").to_dict(),
                           padded_flops_frac=0.5, attention_paths={"dit": {"flex": 4, "none": 4}}))
    notes = page_notes(load_report_input([tmp_path]))
    synthetic = [n for n in notes if "synthetic data" in n]
    assert len(synthetic) == 1 and synthetic[0].startswith("1 run(s) trained on synthetic data")
    assert "upper bound" in synthetic[0]
    (padded,) = [n for n in notes if "variable lengths" in n]
    assert padded.startswith("2 run(s)") and "25.0% to 50.0% of their matmul FLOPs" in padded
    assert "key mask in 7 of 12 measured micro-batches" in padded


def test_skipped_list_and_matrix_name_from_the_sweep_dir(tmp_path):
    write(tmp_path, record("a"))
    assert load_report_input([tmp_path]).skipped == []
    (tmp_path / "sweep.json").write_text(json.dumps({"matrix": "smoke", "runs": {}}))
    assert list(load_report_input([tmp_path]).frame["matrix"]) == ["smoke"]
    (tmp_path / "skipped.json").write_text(json.dumps({"skipped": [
        {"run": {"scale": "8B", "framework": "torchtitan", "parallelism": "ddp", "nodes": 1},
         "reason": "8B does not fit with DDP"}]}))
    data = load_report_input([tmp_path])
    assert [(s["scale"], s["parallelism"], s["reason"]) for s in data.skipped] == [
        ("8B", "ddp", "8B does not fit with DDP")]
    shutil.rmtree(tmp_path / "a")
    assert load_report_input([tmp_path]).skipped  # a skipped list alone still reads


def test_an_empty_skipped_list_is_said_as_nothing_skipped_not_as_no_list(tmp_path):
    from echobench.report import render_dashboard

    write(tmp_path, record("a"))
    assert "no <code>skipped.json</code> in the inputs" in render_dashboard(load_report_input([tmp_path]))
    (tmp_path / "skipped.json").write_text(json.dumps({"matrix": "m", "skipped": []}))
    data = load_report_input([tmp_path])
    assert data.skipped == [] and data.skipped_files == [str(tmp_path / "skipped.json")]
    page = render_dashboard(data)
    assert "no <code>skipped.json</code> in the inputs" not in page
    assert "No run skipped: the plan ran every combination (<code>skipped.json</code> empty in 1 sweep)" in page
