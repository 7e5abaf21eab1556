"""The dashboard's Tune section (echobench.report.tune_section), from a tune.json written by
echobench.tune.output.write_outputs after a tune on measurements the test sets (nothing runs):
what the figure draws, the table and the facts, escaping, a corrupt tune.json, and the page in
headless Chromium."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from echobench.records.atomic import write_json_atomic
from echobench.report import load_report_input, render_dashboard
from echobench.report.browser import layout_problems
from echobench.report.tune_section import tune_figure
from echobench.tune.loop import Measured, run_tune
from echobench.records.paths import TUNE_FILE
from echobench.tune.output import write_outputs
from echobench.tune.space import build_problem
from test_report import ARTIFACTS, XSS, assert_clean, browser_or_skip
from test_tune import GPU, spec

HOSTILE_ID = "<img src=x onerror=alert(2)>"


def write_tune(tune_dir: Path) -> dict:
    """A tune of 800M on one node (top 2 and each family's best, as in test_tune's family-pick test):
    DDP measures 3x its prediction and wins; the second-ranked candidate fails with a script tag as
    its error. Then, as data a hand or a bug could leave in tune.json, a measured run's id and the
    stop reason get markup. Returns tune.json's content."""
    s = spec(top_k=2, max_rounds=2)
    problem = build_problem(s, "800M", 1, GPU)
    failing = problem.ranked[1].run_id

    def measure(candidates):
        return {c.run_id: Measured(c.run_id, "error", error=XSS) if c.run_id == failing else
                Measured(c.run_id, "ok", c.prediction.samples_per_s * (3 if c.family == "ddp" else 1), 1.0)
                for c in candidates}

    tune_dir.mkdir(parents=True, exist_ok=True)
    doc = write_outputs(s, tune_dir / "t.yaml", run_tune(s, [problem], GPU, measure, tune_dir), tune_dir)
    p = doc["problems"][0]
    other = next(c for c in p["candidates"] if c["measured"] and c["measured"]["status"] == "ok"
                 and c["run_id"] != p["winner"])
    other["run_id"] += HOSTILE_ID
    p["stop"] = "<b>stopped</b> & done"
    write_json_atomic(tune_dir / TUNE_FILE, doc)
    return doc


def measured_ok(problem: dict) -> list[dict]:
    return [c for c in problem["candidates"] if c["measured"] and c["measured"]["status"] == "ok"]


def plotly_data(page: str, div_id: str) -> list[dict]:
    """The traces plotly.newPlot is given for a div of the page (figure_html's embedded JSON)."""
    match = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*(\[.*?\]),\s*\{', page, re.S)
    assert match, f"no plot {div_id} in the page"
    return json.loads(match.group(1))


def test_tune_section_draws_every_candidate_and_the_measured_and_escapes(tmp_path):
    doc = write_tune(tmp_path / "tune")
    p = doc["problems"][0]
    data = load_report_input([tmp_path / "tune"])  # the tune directory itself: no records in it
    assert data.problems == [] and len(data.tunes) == 1
    page = render_dashboard(data)
    assert '<section id="tune">' in page and "No result records found" in page
    # the figure: every ranked candidate's prediction (grey, with its interval), one coloured marker
    # per candidate that ran ok (by family; the winner a star of its own); the failed one not drawn
    traces = plotly_data(page, "fig-tune-0-0")
    predicted, measured = traces[0], traces[1:]
    assert len(predicted["x"]) == len(p["candidates"]) and predicted["x"] == [c["rank"] for c in p["candidates"]]
    assert len(predicted["error_y"]["array"]) == len(p["candidates"])
    ok = measured_ok(p)
    assert 2 <= len(ok) < len(p["candidates"]) and sum(len(t["x"]) for t in measured) == len(ok)
    assert sorted(x for t in measured for x in t["x"]) == sorted(c["rank"] for c in ok)
    star = [t for t in measured if t["marker"].get("symbol") == "star"]
    winner = next(c for c in ok if c["run_id"] == p["winner"])
    assert len(star) == 1 and star[0]["x"] == [winner["rank"]] and f"<b>{p['winner']}</b> (measured winner)" in star[0]["text"][0]
    assert star[0]["y"] == [pytest.approx(winner["measured"]["samples_per_s"])]
    families = {t["name"] for t in measured} - {star[0]["name"]}
    assert families == {f"measured: {c['family']}" for c in ok if c["run_id"] != p["winner"]}
    # the same figure built straight from the checked doc
    fig = tune_figure(data.tunes[0].problems[0])
    assert [len(t.x) for t in fig.data] == [len(predicted["x"])] + [len(t["x"]) for t in measured]
    # the facts and the table: winner, predicted winner, tau over the runs that ran ok, every measured row
    section = page[page.index('<section id="tune">'):page.index("</section>", page.index('<section id="tune">'))]
    assert f"Measured winner: {p['winner']} (rank {winner['rank']}" in section
    assert f"Predicted winner: {p['predicted_winner']}" in section
    assert f"over {len(ok)} measured run(s)" in section and f"Ranked on {doc['profile']['shipped']}" in section
    assert section.count("<tr") == 1 + sum(1 for c in p["candidates"] if c["measured"])
    assert section.count('class="winner"') == 1 and "error: &lt;script&gt;alert(1)&lt;/script&gt;" in section
    pruned = sum(p["pruned_counts"].values())
    assert pruned and all(f"{n} by {kind}" in section for kind, n in p["pruned_counts"].items())
    # tune.json's text is data: escaped in the table, the facts and the hover text alike
    for raw in (XSS, "<img src=x", "<b>stopped</b>"):
        assert raw not in page
    assert "&lt;b&gt;stopped&lt;/b&gt; &amp; done" in section
    assert any("&lt;img src=x onerror=alert(2)&gt;" in text for t in measured for text in t["text"])


def test_a_corrupt_tune_json_is_one_problem_line_and_the_page_renders(tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / TUNE_FILE).write_text('{"schema": 1, "problems": [')
    (tmp_path / "wrong").mkdir()  # valid JSON, not a tune's: a problem without its candidates
    (tmp_path / "wrong" / TUNE_FILE).write_text(json.dumps({"profile": {"shipped": "a", "final": "a"},
                                                            "problems": [{"key": "<i>x</i>"}]}))
    data = load_report_input([tmp_path])  # tune directories at the path's top level
    assert data.tunes == [] and len(data.problems) == 2
    assert all(TUNE_FILE in line and "unreadable tune file" in line and "\n" not in line for line in data.problems)
    page = render_dashboard(data)
    assert '<section id="tune">' not in page and "unreadable tune file" in page
    # a good tune beside the corrupt one is still shown
    write_tune(tmp_path / "good")
    data = load_report_input([tmp_path])
    assert len(data.tunes) == 1 and len(data.problems) == 2 and '<section id="tune">' in render_dashboard(data)


@pytest.mark.browser
def test_tune_section_in_chromium(tmp_path):
    doc = write_tune(tmp_path / "tune")
    p = doc["problems"][0]
    out = tmp_path / "page.html"
    out.write_text(render_dashboard(load_report_input([tmp_path / "tune"])), encoding="utf-8")
    with browser_or_skip() as page:
        page.open(out)
        assert_clean(page)  # no alert from the hostile strings, no console error, nothing fetched
        counts = page.evaluate("document.getElementById('fig-tune-0-0').data.map(t => t.x.length)")
        assert counts[0] == len(p["candidates"]) and sum(counts[1:]) == len(measured_ok(p))
        # tune.json's markup is text on the page (the section's one script is plotly's, drawing the figure)
        assert page.evaluate("document.querySelectorAll('#tune table *, #tune ul *').length") > 0
        assert page.evaluate("document.querySelectorAll('#tune table :is(script, img, b), #tune ul b').length") == 0
        text = page.evaluate("document.getElementById('tune').textContent")
        assert XSS in text and HOSTILE_ID in text and "<b>stopped</b> & done" in text
        assert page.evaluate("document.querySelectorAll('#tune table tr').length") == \
            1 + sum(1 for c in p["candidates"] if c["measured"])
        checked, problems = layout_problems(page)
        assert checked == 1 and problems == [], problems
        shot = page.screenshot(ARTIFACTS / "dashboard-tune.png", selector="#tune")
    assert shot.stat().st_size > 10_000


def test_the_tune_section_names_the_ties_with_the_winner(tmp_path):
    (tmp_path / "tune").mkdir()
    doc = {"schema": 1, "name": "t", "tune_file": "t.yaml", "date": "d", "executor": "local", "device_hours": 0.1,
           "interrupted": False, "profile": {"shipped": "p", "final": "p", "fit_note": None},
           "problems": [{"key": "tiny@1x2", "scale": "tiny", "nodes": 1, "gpus_per_node": 2, "winner": "a",
                         "predicted_winner": "a", "stop": "s", "kendall_tau": {"shipped": 1.0, "final": 1.0, "runs": 2},
                         "pruned_counts": {}, "ties": [{"run_id": "b<i>", "p": 0.5}],
                         "candidates": [cand("a", 1, 10.0, 11.0), cand("b<i>", 2, 9.0, 10.9)]}]}
    (tmp_path / "tune" / TUNE_FILE).write_text(json.dumps(doc))
    page = render_dashboard(load_report_input([tmp_path / "tune"]))
    assert "Within measurement noise of the winner" in page and "b&lt;i&gt; (p = 0.50)" in page


def cand(rid, rank, predicted, measured):
    settings = {"framework": "torchtitan", "parallelism": "ddp", "micro_batch": 2, "grad_accum": 1, "ac": "none",
                "compile": False, "reshard_after_forward": True, "precision": "fp32"}
    return {"run_id": rid, "family": "ddp", "rank": rank, "settings": settings,
            "predicted": {"samples_per_s": predicted, "samples_per_s_low": predicted / 2,
                          "samples_per_s_high": predicted * 2},
            "measured": {"status": "ok", "samples_per_s": measured, "error": ""}, "residual": measured / predicted - 1,
            "round": 1}
