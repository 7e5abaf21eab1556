"""Echo runs and card runs in one matrix, one sweep directory: the matrix expands to both kinds (a
card's file taken from the matrix's folder, a card that cannot run skipped with why), one local
sweep runs both, `results` and the dashboard list both, and `explain SWEEP` and the dashboard's
Reference workloads put each reference beside Echo's MFU on the same device.

The card is a row of tests/test_reproduce.py's tiny test rows (TEST DATA: its published 5% MFU is
made up). Nothing asserts a speed: each sentence is held to the records it comes from.
"""

import json
import shutil

import markupsafe
import pytest
import yaml
from typer.testing import CliRunner

from conftest import ONE_THREAD, run_cli
from echobench.cli import app
from echobench.predict.reference import NEAR, ReferenceRow, best_echo, pct, reference_row
from echobench.records.results import Record
from echobench.sweep.matrix import expand, load_matrix
from test_reproduce import rows_file, tiny_row

ECHO = {"scale": "tiny", "micro_batch": 2, "audio_frames": 50, "text_tokens": 16, "speaker_frames": 40}


def write_matrix(folder, include: list[dict]):
    """A matrix of Echo's tiny preset (its axis) and `include` (card runs), 2 steps each on the CPU."""
    path = folder / "mix.yaml"
    path.write_text(yaml.safe_dump({"name": "mix", "local": {"time": "00:05:00"}, "hardware": {"peak_tflops": 1},
                                    "defaults": {**ECHO, "steps": 2, "warmup_steps": 1, "device": "cpu"},
                                    "axes": {"parallelism": ["single"]}, "include": include}))
    return path


def invoke(*args):
    result = CliRunner().invoke(app, list(map(str, args)), env={"COLUMNS": "250"})
    return result.exit_code, result.stdout, result.stderr


def test_a_matrix_expands_to_echo_and_card_runs(tmp_path):
    rows_file(tmp_path / "rows.yaml", [tiny_row("tiny-single", 1)])
    path = write_matrix(tmp_path, [{"card": "rows.yaml#tiny-single"}, {"card": "rows.yaml#no-such-row"},
                                   {"card": "missing.yaml", "seed": 1}])
    plan = expand(load_matrix(path), "local")
    echo, card = plan.runs
    assert (echo.cfg.card, echo.cfg.scale, echo.cfg.workload) == (None, "tiny", "tiny")
    # relative to the matrix's folder, whatever folder the sweep starts in (its runs start there)
    assert card.cfg.card == f"{tmp_path.resolve()}/rows.yaml#tiny-single" and card.cfg.workload == "tiny-single"
    assert card.id.startswith("tiny-single-torchtitan-single-n1x1-mb2-")
    reasons = sorted(s.reason for s in plan.skipped)  # before any job: the card's own one-line error
    assert reasons[0].startswith(f"{tmp_path.resolve()}/missing.yaml: cannot read the model card"), reasons
    assert reasons[1].startswith(f"{tmp_path.resolve()}/rows.yaml: no row 'no-such-row'"), reasons


def test_a_card_runs_planned_memory_is_its_cards(tmp_path):
    """plan's memory column and fit check for a card run: predict.cards.memory at the layout the run is
    priced with (fp32 on the CPU: no autocast), the Echo estimate's overhead beside it; not the Echo
    preset's estimate of the same settings."""
    from dataclasses import replace

    from echobench.predict.memory import estimate_memory, on_gpu, overhead_bytes
    from echobench.predict.cards.memory import card_memory_parts
    from echobench.predict.cards.run import measured_layout, run_card

    rows_file(tmp_path / "rows.yaml", [tiny_row("tiny-single", 1)])
    plan = expand(load_matrix(write_matrix(tmp_path, [{"card": "rows.yaml#tiny-single"}])), "local")
    echo, card = plan.runs
    workload = run_card(card.cfg.card)
    layout = measured_layout(card.cfg, workload.seq, "fp32", False)
    assert not layout.autocast
    tensors = sum(card_memory_parts(workload.card, layout).values())
    assert card.memory.total == pytest.approx(tensors + overhead_bytes(tensors, on_gpu(card.cfg)))
    assert card.memory.total != pytest.approx(estimate_memory(replace(card.cfg, card=None)).total)
    assert echo.memory.total == pytest.approx(estimate_memory(echo.cfg).total)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """One local sweep of Echo's tiny preset and a tiny card row, started from the checkout's root
    (not the matrix's folder)."""
    tmp = tmp_path_factory.mktemp("mix")
    rows_file(tmp / "rows.yaml", [tiny_row("tiny-single", 1)])
    sweep = tmp / "sweep"
    proc = run_cli("sweep", write_matrix(tmp, [{"card": "rows.yaml#tiny-single"}]), "--out", sweep, tmp_path=tmp,
                   timeout=600, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [Record.load(p) for p in sweep.glob("*/result.json")]
    echo = next(r for r in records if not r.card)
    card = next(r for r in records if r.card)
    return tmp, sweep, echo, card


def test_one_sweep_runs_both_and_results_lists_both(mixed):
    _, sweep, echo, card = mixed
    assert (echo.status, echo.scale, card.status, card.scale) == ("ok", "tiny", "ok", "tiny-single"), (echo.error, card.error)
    assert card.card["published"]["mfu"] == 0.05 and echo.card is None
    code, out, err = invoke("results", sweep, "--json")
    assert code == 0, out + err
    rows = {r["run_id"]: r for r in json.loads(out)}
    assert set(rows) == {echo.run_id, card.run_id}
    for r in (echo, card):
        assert (rows[r.run_id]["status"], rows[r.run_id]["mfu"]) == ("ok", pytest.approx(r.mfu))


def expected_sentence(echo: Record, card: Record) -> str:
    """The sentence, from the records: Echo's MFU, then the reference's against its published 5%."""
    ref = reference_row(card)
    assert best_echo([echo, card], card.env.device_name) is echo and ref.ratio == pytest.approx(card.card["row_mfu"] / 0.05)
    head = f"Echo tiny reaches {pct(echo.mfu)} MFU here (torchtitan single, 1 x 1: the best Echo run on "
    reach = f"; the reference tiny-single reaches {pct(card.card['row_mfu'])} MFU of its published 5% ({ref.ratio:.0%} of it), "
    verdict = ("the cluster and the stack are fine, the gap is the model's" if ref.verdict == "within" or ref.ratio >= NEAR
               else "look at the cluster first")
    sentence = ref.beside(echo)
    assert sentence.startswith(head) and reach in sentence and sentence.endswith(f": {verdict}"), sentence
    return sentence


def test_explain_puts_the_reference_beside_echo(mixed):
    _, sweep, echo, card = mixed
    code, out, err = invoke("explain", sweep)
    assert code == 0, out + err
    assert out.strip() == expected_sentence(echo, card)
    code, out, _ = invoke("explain", sweep, "--json")
    (line,) = json.loads(out)
    assert (line["reference"], line["echo"], line["echo_mfu"], line["mfu"]) == (card.run_id, echo.run_id, echo.mfu,
                                                                                 card.card["row_mfu"])


def test_explain_prints_a_record_s_text_as_text(mixed, tmp_path):
    """A label from a record is data: rich markup in it is printed as written."""
    _, sweep, _, card = mixed
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy)
    path = copy / card.run_id / "result.json"
    data = json.loads(path.read_text())
    data["card"]["label"] = "[red]x[/red]"
    path.write_text(json.dumps(data))
    code, out, err = invoke("explain", copy)
    assert code == 0 and "the reference [red]x[/red] reaches " in out, out + err


def test_the_dashboard_lists_both_and_says_the_sentence(mixed):
    tmp, sweep, echo, card = mixed
    page = tmp / "report.html"
    code, out, err = invoke("report", sweep, "-o", page)
    assert code == 0, out + err
    html = page.read_text()
    runs = html[html.index('<table id="runs"'):]
    assert echo.run_id in runs and card.run_id in runs
    section = html[html.index('<section id="reference-workloads">'):]
    section = section[:section.index("</section>")]
    assert f"<li>{markupsafe.escape(expected_sentence(echo, card))}</li>" in section


@pytest.mark.parametrize("mfu,spread,verdict", [
    (0.044, (0.0435, 0.0438), "the cluster and the stack are fine, the gap is the model's"),  # 96%, beyond its spread
    (0.02, (0.015, 0.05), "the cluster and the stack are fine, the gap is the model's"),  # 43%, but within it
    (0.02, (0.019, 0.021), "look at the cluster first")])  # 43%, beyond it
def test_the_verdict_follows_the_published_figure(mixed, mfu, spread, verdict):
    _, _, echo, _ = mixed
    ref = ReferenceRow("r", "lf-mpt-1b", "rows.yaml#lf-mpt-1b", "torchtitan fsdp2, 1 x 8", 8, "ok", None, steps=30,
                       mfu=mfu, mfu_spread=spread, published={"mfu": 0.046, "gpus": 8})
    assert ref.beside(echo).endswith(f"of its published 4.6% ({mfu / 0.046:.0%} of it), "
                                     f"{'within' if spread[0] <= 0.046 <= spread[1] else 'beyond'} the run's spread "
                                     f"({pct(spread[0])}-{pct(spread[1])} at its 30 steps' p90 .. p10 step time): {verdict}")
    assert ref.beside(None).startswith("no Echo run on its device beside it; the reference lf-mpt-1b reaches ")
