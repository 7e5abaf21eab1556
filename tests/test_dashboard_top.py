"""The dashboard's top: best MFU per scale and node count, MFU by configuration and node count, the
layouts' bars; flagged values with their reasons; provenance folded; the runs table's key columns
and its CSV; predictions from the profile of the records' device."""

import csv
import html
import io
from urllib.parse import unquote

import pytest

from echobench.report import load_report_input, render_dashboard
from echobench.report.checks import SUPERLINEAR_TOLERANCE, run_flags, value_flags
from echobench.report.dashboard import best_rows, mfu_table
from test_report import XSS, assert_clean, browser_or_skip, layout_problems, record, write

CSV_PREFIX = "data:text/csv;charset=utf-8,"
HOSTILE_ID = "run<script>alert(5)</script>"
HOSTILE_SOURCE = "calibrated:<img src=x onerror=alert(6)>"


def steps(mfu: float, n: int = 10, spread: float = 0.01) -> dict:
    """A run's measured steps as its MFU makes them: each 1 / MFU seconds, within +-spread."""
    return {"step_times_s": [(1 + spread * ((i * 7) % 5 - 2) / 2) / mfu for i in range(n)]}


def top_records() -> list:
    """Records whose answers are known: at each scale and node count a set winner (its steps
    significantly faster); a configuration that failed (oom) where the others ran; a scale and node
    count where every run failed; an MFU of 350%; a configuration scaling to 150% per GPU; hostile
    text in a run id, an error and a peak source."""
    return [
        record("800m-fsdp2-n1", mfu=0.40, samples_per_s=100.0, **steps(0.40)),
        record("800m-ddp-n1", parallelism="ddp", mfu=0.35, samples_per_s=90.0, **steps(0.35)),
        record("800m-fsdp2-compile-n1", compile=True, mfu=0.45, samples_per_s=110.0, **steps(0.45)),
        record("800m-ddp-acfull-n1", parallelism="ddp", ac="full", status="oom", error=XSS),
        record("800m-fsdp2-n2", nodes=2, mfu=0.38, samples_per_s=190.0, **steps(0.38)),
        record("800m-ddp-n2", parallelism="ddp", nodes=2, mfu=0.33, samples_per_s=170.0, **steps(0.33)),
        record(HOSTILE_ID, nodes=2, compile=True, mfu=0.39, samples_per_s=200.0, peak_source=HOSTILE_SOURCE,
               **steps(0.39)),
        record("3b-fsdp2-n1", scale="3B", mfu=0.41, samples_per_s=20.0, **steps(0.41)),
        record("3b-fsdp2-n2", scale="3B", nodes=2, status="timeout", error="time limit"),
        record("8b-ddp-n1", scale="8B", parallelism="ddp", mfu=3.5, samples_per_s=10.0, **steps(3.5)),  # 350%
        record("8b-fsdp2-n1", scale="8B", mfu=0.30, samples_per_s=10.0, **steps(0.30)),
        record("8b-fsdp2-n2", scale="8B", nodes=2, mfu=0.45, samples_per_s=30.0, **steps(0.45)),  # 150% per GPU
    ]


def tie_records() -> list:
    """At 800M on 1 node, two single runs 0.05 points apart whose steps overlap (no significant
    difference); at 3B, a 10-point lead measured over 3 steps (too few to tell); at 8B, a lead the
    steps bear out."""
    return [
        record("800m-fsdp2-n1", mfu=0.4000, samples_per_s=100.0, **steps(0.4000, spread=0.05)),
        record("800m-ddp-n1", parallelism="ddp", mfu=0.4005, samples_per_s=100.1, **steps(0.4005, spread=0.05)),
        record("3b-fsdp2-n1", scale="3B", mfu=0.40, samples_per_s=20.0, **steps(0.40, n=3)),
        record("3b-ddp-n1", scale="3B", parallelism="ddp", mfu=0.30, samples_per_s=15.0, **steps(0.30, n=3)),
        record("8b-fsdp2-n1", scale="8B", mfu=0.40, samples_per_s=10.0, **steps(0.40)),
        record("8b-ddp-n1", scale="8B", parallelism="ddp", mfu=0.38, samples_per_s=9.5, **steps(0.38)),
    ]


def winners(records) -> dict:
    """(scale, nodes) -> run id of the highest MFU among the successful records (one run each here)."""
    best = {}
    for r in records:
        if r.status == "ok" and (key := (r.scale, r.nodes)) and (key not in best or r.mfu > best[key].mfu):
            best[key] = r
    return {k: r.run_id for k, r in best.items()}


def test_value_flags_say_what_is_wrong_and_why():
    assert value_flags({"mfu": 0.4, "step_time_s": 1.0, "samples_per_s": 10, "peak_mem_gib": 40,
                        "device_memory_gib": 94.5}, efficiency=1.05) == []
    (flag,) = value_flags({"mfu": 3.5})
    assert flag.column == "mfu" and "MFU 350% is above 100%" in flag.reason and "peak" in flag.reason
    assert [f.column for f in value_flags({"mfu": 0.0, "step_time_s": -1.0, "samples_per_s": 0})] == [
        "mfu", "step_time_s", "samples_per_s"]
    (memory,) = value_flags({"peak_mem_gib": 120.0, "device_memory_gib": 94.5})
    assert memory.column == "peak_mem_gib" and "above the device's 94.5 GiB" in memory.reason
    assert value_flags({"peak_mem_gib": 120.0}) == []  # the device's memory unknown (a CPU run): no judgement
    (superlinear,) = value_flags({"world_size": 8}, efficiency=1.5, base_gpus=4)
    assert superlinear.column == "efficiency" and "150% at 8 GPUs" in superlinear.reason
    assert "Superlinear" in superlinear.reason and "of 4 GPUs" in superlinear.reason
    assert value_flags({}, efficiency=SUPERLINEAR_TOLERANCE) == []  # the tolerance itself is noise


def test_run_flags_find_the_impossible_mfu_and_the_superlinear_run(tmp_path):
    for rec in top_records():
        write(tmp_path, rec, name=rec.run_id.replace("<", "_").replace(">", "_").replace("/", "_"))
    data = load_report_input([tmp_path])
    flags = run_flags(data.ok, data.configurations)
    by_run = {data.frame.at[i, "run_id"]: [f.column for f in fs] for i, fs in flags.items()}
    # 8B fsdp2 on 2 nodes: 30 samples/s on 8 GPUs against 10 on 4: 3.75 vs 2.5 per GPU, 150%
    assert by_run == {"8b-ddp-n1": ["mfu"], "8b-fsdp2-n2": ["efficiency"]}


def test_best_rows_and_the_mfu_table_crown_the_highest_mfu_and_show_failures(tmp_path):
    records = top_records()
    for rec in records:
        write(tmp_path, rec, name=rec.run_id.replace("<", "_").replace(">", "_").replace("/", "_"))
    data = load_report_input([tmp_path])
    scales = ["800M", "3B", "8B"]
    rows = best_rows(data.configurations, scales, failed=data.failed)
    expected = winners(records)
    assert {(r["scale"], r["nodes"]): r["run_id"] for r in rows if not r["failed_only"]} == expected
    (lost,) = [r for r in rows if r["failed_only"]]
    assert (lost["scale"], lost["nodes"]) == ("3B", 2) and lost["failed"] == "no successful run: 1 failed (1 timeout)"
    table = mfu_table(data, scales, {})
    assert table["settings"] == ["compile", "ac"] and table["nodes"] == ["1 node", "2 nodes"]
    cells = {(r["scale"], r["framework"], r["parallelism"], *r["settings"]): r["cells"] for r in table["rows"]}
    starred = {(key[0], n + 1) for key, row in cells.items() for n, c in enumerate(row) if c.get("winner")}
    assert starred == set(expected)
    assert cells[("800M", "torchtitan", "ddp", "off", "full")][0] == {"text": "oom", "failed": True, "title": XSS}
    assert cells[("3B", "torchtitan", "fsdp2", "off", "none")][1]["text"] == "timeout"  # a status, not 0
    assert cells[("800M", "torchtitan", "fsdp2", "on", "none")][0]["text"] == "45.0"


def test_the_best_is_crowned_only_where_its_steps_are_significantly_faster_else_a_tie(tmp_path):
    """compare's test decides: a 0.05-point lead of overlapping steps is a tie, as is a lead of 3
    steps a side; only the 8B lead gets the star (best_rows, the MFU table, the layouts' bars)."""
    for rec in tie_records():
        write(tmp_path, rec)
    data = load_report_input([tmp_path])
    marks = {(data.configurations.at[i, "scale"], data.configurations.at[i, "parallelism"]): c.mark
             for i, c in data.crowns.items()}
    assert marks == {("800M", "fsdp2"): "tie", ("800M", "ddp"): "tie", ("3B", "fsdp2"): "tie", ("3B", "ddp"): "tie",
                     ("8B", "fsdp2"): "best"}
    rows = {r["scale"]: r for r in best_rows(data.configurations, ["800M", "3B", "8B"], crowns=data.crowns)}
    assert rows["800M"]["run_id"] == "800m-ddp-n1" and "not significantly behind (p=" in rows["800M"]["tie"][0]
    assert "too few steps stored to tell (3 / 3, need 5 a side)" in rows["3B"]["tie"][0]
    assert rows["8B"]["tie"] == []
    table = mfu_table(data, ["800M", "3B", "8B"], {})
    cells = {(r["scale"], r["parallelism"]): r["cells"][0] for r in table["rows"]}
    assert [k for k, c in cells.items() if c["winner"]] == [("8B", "fsdp2")]
    assert {k for k, c in cells.items() if c["tie"]} == {("800M", "fsdp2"), ("800M", "ddp"), ("3B", "fsdp2"),
                                                         ("3B", "ddp")}
    page = render_dashboard(data)
    assert page.count("&#9733; 40.0") == 1 and page.count("&#8776; 40.0") == 2  # 8B's star; 800M's and 3B's tie


@pytest.mark.browser
def test_dashboard_top_in_chromium(tmp_path, cli):
    records = top_records()
    for rec in records:
        write(tmp_path / "runs", rec, name=rec.run_id.replace("<", "_").replace(">", "_").replace("/", "_"))
    out = tmp_path / "report.html"
    proc = cli("report", tmp_path / "runs", "-o", out, check=True)
    assert "No hardware profile matches" not in proc.stderr  # GH200 records: a shipped profile matches
    expected = winners(records)
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)  # no alert from the hostile run id, error or peak source
        # the answers first: best MFU, the MFU table and the layouts' bars, then notes and provenance (folded)
        order = page.evaluate("['best', 'mfu-table', 'layouts', 'summary', 'provenance', 'all-runs'].map(id => "
                              "document.getElementById(id).getBoundingClientRect().top)")
        assert order == sorted(order), order
        assert page.evaluate("document.getElementById('provenance').open") is False
        assert page.evaluate("document.querySelector('#provenance dl').checkVisibility()") is False
        assert page.evaluate("document.getElementById('best-table').checkVisibility()") is True
        # the winner of each scale and node count: the best table's run, the MFU table's star
        best = page.evaluate("Array.from(document.querySelectorAll('#best-table tr')).slice(1).map(tr => "
                             "Array.from(tr.cells).map(c => c.textContent.trim()))")
        header = page.evaluate("Array.from(document.querySelectorAll('#best-table th')).map(th => th.textContent)")
        rows = [dict(zip(header, r)) for r in best if len(r) == len(header)]
        assert {(r["scale"], int(r["nodes"])): r["run"] for r in rows} == expected
        assert ["3B", "2", "", "no successful run: 1 failed (1 timeout)"] in best
        starred = page.evaluate("Array.from(document.querySelectorAll('#mfu-matrix td.winner')).map(td => "
                                "[td.parentElement.cells[0].textContent, td.cellIndex])")
        assert len(starred) == len(expected)
        # the bars: per scale, the outlined bar at each node count is the winner's configuration
        for i, scale in enumerate(["800M", "3B", "8B"]):
            bars = page.evaluate(f"document.getElementById('fig-layouts-{i}')._fullData.map(t => [t.name, "
                                 "Array.from(t.x), [].concat(t.marker.line.width), Array.from(t.text)])")
            outlined = {x: name for name, xs, widths, texts in bars for x, w, text in zip(xs, widths, texts)
                        if w == 3 and text.startswith("\u2605")}
            configs = load_report_input([tmp_path / "runs"]).frame.set_index("run_id")["config"]
            assert outlined == {f"{n} node{'s' if n > 1 else ''}": configs[rid] for (s, n), rid in expected.items()
                                if s == scale}
        failed_text = page.evaluate("document.getElementById('fig-layouts-1')._fullData.flatMap(t => Array.from(t.text))")
        assert "failed: timeout" in failed_text  # 3B on 2 nodes: the status, no bar of 0
        checked, problems = layout_problems(page)
        assert problems == [] and checked >= 3 * 5, problems
        # the runs table: MFU within the first columns, on screen at 1400 px; the rest behind a box
        mfu_th = page.evaluate("(() => { const th = Array.from(document.querySelectorAll('#runs th'))"
                               ".find(th => th.textContent === 'MFU (%)'); const r = th.getBoundingClientRect();"
                               " return [th.cellIndex, r.right, r.width]; })()")
        assert mfu_th[0] <= 6 and 0 < mfu_th[1] <= 1400 and mfu_th[2] > 0
        shown = "Array.from(document.querySelectorAll('#runs th')).filter(th => th.offsetParent !== null).length"
        total = page.evaluate("document.querySelectorAll('#runs th').length")
        assert page.evaluate(shown) < total / 2
        page.evaluate("document.getElementById('all-columns').click()")
        assert page.evaluate(shown) == total
        # flags: a visible marker with its reason as title, in the table and the list under it
        flags = page.evaluate("Array.from(document.querySelectorAll('#runs tbody tr')).filter(tr => "
                              "tr.querySelector('.flag.suspicious')).map(tr => [tr.cells[0].textContent.trim(), "
                              "Array.from(tr.querySelectorAll('.flag.suspicious[title]')).map(f => f.title).join(' | ')])")
        flags = dict(flags)
        assert set(flags) == {"8b-ddp-n1", "8b-fsdp2-n2"}
        assert "MFU 350% is above 100%" in flags["8b-ddp-n1"] and "Superlinear" in flags["8b-fsdp2-n2"]
        listed = page.evaluate("document.getElementById('run-flags').textContent")
        assert "8b-ddp-n1: MFU 350% is above 100%" in listed and "8b-fsdp2-n2: scaling efficiency 150%" in listed
        assert "MFU 350% is above 100%" in page.evaluate("document.getElementById('config-flags').textContent")
        mfu_8b = page.evaluate("document.getElementById('fig-mfu-2')._fullData.filter(t => t.name.includes('flagged'))"
                               ".map(t => Array.from(t.y))")
        assert mfu_8b == [[pytest.approx(350.0)]]  # ringed where the value is plotted
        # the CSV: a data: link whose text parses back to every run with its MFU
        href = page.evaluate("document.getElementById('runs-csv').getAttribute('href')")
        assert href.startswith(CSV_PREFIX)
        table = list(csv.DictReader(io.StringIO(unquote(href[len(CSV_PREFIX):]))))
        with page.page.expect_download() as download:
            page.evaluate("document.getElementById('runs-csv').click()")
        downloaded = open(download.value.path(), encoding="utf-8").read()
        assert list(csv.DictReader(io.StringIO(downloaded))) == table
        assert sorted(r["run_id"] for r in table) == sorted(r.run_id for r in records)
        for rec in records:
            (row,) = [r for r in table if r["run_id"] == rec.run_id]
            assert row["status"] == rec.status
            assert (float(row["mfu"]) if row["mfu"] else None) == rec.mfu
        assert (tmp_path / "report.runs.csv").read_text(encoding="utf-8") == downloaded
        # hostile text is text: in the tables, nothing it names was made an element
        assert page.evaluate("document.querySelectorAll('#best img, #mfu-table img, #all-runs img, #all-runs script, "
                             "#mfu-table script').length") == 0
        assert HOSTILE_ID in page.evaluate("document.getElementById('runs').textContent")
        assert XSS in page.evaluate("Array.from(document.querySelectorAll('#mfu-matrix td.failed-cell')).map(td => "
                                    "td.title).join(' ')")
        page.screenshot(tmp_path / "top.png", full_page=False)
        assert_clean(page)


def test_predictions_from_the_profile_of_the_records_device(tmp_path, cli):
    """GH200 records and no --profile: the profile of that device predicts, named on the page; a
    device no profile matches says so in one line; --profile overrides."""
    from echobench.predict import against, profile_for_device
    from test_predict import cfg, measured_record

    device = "NVIDIA GH200 120GB"
    recs = []
    for settings, step in ((dict(nodes=1), 0.5), (dict(nodes=2), 0.6)):
        rec = measured_record(cfg(**settings), step)
        rec.env.device_name = device
        rec.save(tmp_path / "gh200" / rec.run_id)
        recs.append(rec)
    shipped = profile_for_device(device)
    assert shipped is not None
    out = tmp_path / "page.html"
    proc = cli("report", tmp_path / "gh200", "-o", out, check=True)
    line = f"Predicted figures from hardware profile {shipped.name} (matched to the records' device {device})"
    assert line in proc.stderr
    page = html.unescape(out.read_text())
    assert line in page and "predicted step (s)" in page
    data = load_report_input([tmp_path / "gh200"])
    from echobench.report.data import with_device_predictions

    data = with_device_predictions(data, 0.15)
    frame = data.frame.set_index("run_id")
    for rec in recs:
        assert frame.loc[rec.run_id, "predicted_mfu"] == pytest.approx(against(rec, [shipped]).prediction.mfu)
    # a device no profile matches
    for rec in recs:
        rec.env.device_name = "SYNTHETIC XPU"
        rec.save(tmp_path / "xpu" / rec.run_id)
    proc = cli("report", tmp_path / "xpu", "-o", out, check=True)
    (said,) = [ln for ln in proc.stderr.splitlines() if "No hardware profile" in ln]
    assert "No hardware profile matches the records' device (SYNTHETIC XPU): no predicted figures" in said
    assert "predicted step (s)" not in out.read_text()
    # --profile still overrides
    proc = cli("report", tmp_path / "gh200", "-o", out, "--profile", "h100-hgx-ib", check=True)
    line = "Predicted figures from hardware profile h100-hgx-ib (given with --profile)."
    assert line in proc.stderr and line in html.unescape(out.read_text())


def test_the_page_renders_without_successful_runs_and_escapes_the_top(tmp_path):
    write(tmp_path, record("f1", status="error", error=XSS))
    page = render_dashboard(load_report_input([tmp_path]))
    assert XSS not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    matrix = page[page.index('<table id="mfu-matrix">'):page.index("</table>", page.index('<table id="mfu-matrix">'))]
    assert '<td class="failed-cell" title="&lt;script&gt;alert(1)&lt;/script&gt;">error</td>' in matrix  # not 0


@pytest.mark.browser
def test_ties_in_chromium(tmp_path, cli):
    """On the page: one star (8B), tie marks where the steps cannot tell (800M, 3B) with the reason
    in their titles, and the layouts' bars outlined only for the star."""
    for rec in tie_records():
        write(tmp_path / "runs", rec)
    out = tmp_path / "report.html"
    cli("report", tmp_path / "runs", "-o", out, check=True)
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)
        stars = page.evaluate("Array.from(document.querySelectorAll('#mfu-matrix td.winner')).map(td => "
                              "td.parentElement.cells[0].textContent)")
        ties = page.evaluate("Array.from(document.querySelectorAll('#mfu-matrix td.tie')).map(td => "
                             "[td.parentElement.cells[0].textContent, td.textContent.trim().slice(0, 1), td.title])")
        assert stars == ["8B"] and sorted(t[0] for t in ties) == ["3B", "3B", "800M", "800M"]
        assert all(mark == "\u2248" and "tied for best" in title for _, mark, title in ties), ties
        spans = page.evaluate("Array.from(document.querySelectorAll('#best-table span.tie')).map(s => "
                              "[s.checkVisibility(), s.textContent, s.title])")
        assert len(spans) == 2 and all(visible and text == "\u2248 tied with 1" for visible, text, _ in spans), spans
        assert any("too few steps stored to tell" in title for *_, title in spans)
        outlined = [page.evaluate(f"document.getElementById('fig-layouts-{i}')._fullData.flatMap(t => "
                                  "[].concat(t.marker.line.width)).filter(w => w === 3).length") for i in range(3)]
        assert outlined == [0, 0, 1]
