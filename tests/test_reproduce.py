"""`echobench reproduce`: published rows as a matrix of card runs (their layout mapped to echobench's,
refusals one line per row, --scale-down's arithmetic and what it says changed), a local reproduce of
two tiny rows end to end (measured vs published vs predicted), the dashboard's Reference workloads
and `validate measured` on the card runs it measured.

The tiny rows (rows_file) are TEST DATA shaped like validation/published-runs.yaml: their published
figures are made up for these tests and come from no source. Nothing here asserts a measured speed
(the machine is a loaded CPU): the figures printed are held to the records and predictions they
come from.
"""

import json
import re

import pytest
import yaml
from typer.testing import CliRunner

from conftest import ONE_THREAD, ROOT, run_cli
from echobench.cli import app
from echobench.predict.cards.model import predict_card
from echobench.predict.cards.run import measured_card, measured_layout
from echobench.predict.reference import pct
from echobench.hardware.profile import load_profile
from echobench.records.config import RunConfig
from echobench.records.results import Record, record_settings
from echobench.sweep.matrix import expand, load_matrix

PUBLISHED = ROOT / "validation/published-runs.yaml"
MODEL = {"layers": 2, "hidden": 64, "ffn": 128, "activation": "swiglu", "heads": 4, "kv_heads": 2, "vocab": 512,
         "tied_embeddings": True, "positions": "rotary", "bias": False, "causal": True, "norm": "rmsnorm"}
# made-up published figures (test data): 5% MFU and 5000 tokens/s per GPU against a peak of 1 TFLOP/s
FIGURES = {"mfu": 0.05, "tokens_per_s_per_gpu": 5000, "convention": "6N + 12 L d s per token (TEST DATA), peak 1"}


def tiny_row(rid: str, gpus: int, **run) -> dict:
    return {"id": rid, "source": {"name": "test", "repo": "none/none", "commit": "0"},
            "hardware": {"profile": "h100-hgx-ib", "gpus": gpus, "gpus_per_node": 2},
            "model": dict(MODEL), "run": {"seq": 32, "micro_batch": 2, "grad_accum": 1, "global_batch": 2 * gpus,
                                          "layout": "ddp", "precision": "fp32", "framework": "torchtitan", **run},
            "published": dict(FIGURES)}


def rows_file(path, rows: list[dict]):
    path.write_text("# TEST DATA: published figures made up for tests/test_reproduce.py\n" + yaml.safe_dump(rows))
    return path


def invoke(*args):
    result = CliRunner().invoke(app, ["reproduce", *map(str, args)], env={"COLUMNS": "250"})
    return result.exit_code, result.stdout, result.stderr


# ---- the matrix ----

def test_published_rows_become_a_matrix_scaled_down_with_what_changed(tmp_path):
    """Real rows of validation/published-runs.yaml on 2 nodes of 4 GPUs (a --site file's): FSDP
    shard_grad_op, FSDP full_shard and Megatron TP1 mapped, each at its micro-batch and accumulation;
    what echobench cannot run refused in one line naming the row."""
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"name": "site", "slurm": {"gpus_per_node": 4, "fabric": "infiniband",
                                                              "partition": "gpu"}}))
    ids = ["lf-mpt-1b-512gpu", "lf-mpt-7b-8gpu", "mlm-gpt-1.7b-48gpu", "nemo-llama2-13b-16gpu",
           "tt-llama3-70b-h100-256gpu-tp8", "kor-megatron-22b-full", "lf-mpt-3b-h100-fp8-8gpu-s2048",
           "mlm-gpt-7.1b-96gpu"]
    code, out, err = invoke(PUBLISHED, "--rows", ",".join(ids), "--executor", "slurm", "--scale-down", 2,
                            "--site", site, "--device", "cuda", "--out", tmp_path / "sw", "--dry-run")
    assert code == 0, out + err
    refused = err.strip().splitlines()
    assert refused == [
        "refused: row nemo-llama2-13b-16gpu (tp1 pp4x10 dp4 zero1 fp8): pipeline parallelism (pp 4): echobench has no "
        "pipeline layout",
        "refused: row tt-llama3-70b-h100-256gpu-tp8 (fsdp full_shard tp8 ac full fp8 compiled): FSDP with tensor "
        "parallelism (torchtitan 2D, tp 8): echobench runs FSDP2 or megatron TP, not both",
        "refused: row kor-megatron-22b-full (tp8 dp1 ac full): fp16: echobench trains in bf16, fp32 or fp8",
        "refused: row lf-mpt-3b-h100-fp8-8gpu-s2048 (fsdp full_shard fp8): fp8 recipe delayed (TransformerEngine's): "
        "echobench's float8 is torchao's tensorwise / rowwise"]
    path = tmp_path / "sw" / "reproduce.yaml"
    runs = {r.cfg.card.partition("#")[2]: r.cfg for r in expand(load_matrix(path), "slurm").runs}
    assert set(runs) == {"lf-mpt-1b-512gpu", "lf-mpt-7b-8gpu", "mlm-gpt-1.7b-48gpu", "mlm-gpt-7.1b-96gpu"}
    sp = runs["mlm-gpt-7.1b-96gpu"]  # TP with sequence parallelism, as the row says
    assert (sp.framework, sp.parallelism, sp.sequence_parallel, sp.distributed_optimizer) == ("megatron", "tp2", True, True)
    zero2, full, tp1 = runs["lf-mpt-1b-512gpu"], runs["lf-mpt-7b-8gpu"], runs["mlm-gpt-1.7b-48gpu"]
    # 512 GPUs at micro-batch 12 x 1 -> 2 nodes of 4: the per-GPU batch kept, the global batch 8 x 12
    assert (zero2.parallelism, zero2.reshard_after_forward, zero2.nodes, zero2.gpus_per_node) == ("fsdp2", False, 2, 4)
    assert (zero2.micro_batch, zero2.grad_accum, zero2.global_batch, zero2.precision) == (12, 1, 96, "bf16")
    # 8 GPUs fit in 2 nodes of 4: the published GPUs and batch, as 2 x 4 instead of 1 x 8
    assert (full.parallelism, full.reshard_after_forward, full.world_size, full.global_batch) == ("fsdp2", True, 8, 48)
    assert (tp1.framework, tp1.parallelism, tp1.distributed_optimizer, tp1.world_size) == ("megatron", "tp1", True, 8)
    assert (tp1.micro_batch, tp1.grad_accum, tp1.global_batch) == (1, 4, 32)
    text = path.read_text()
    for said in ("changed: GPUs 512 -> 8 (2 node(s) x 4)", "changed: global batch 6144 -> 96",
                 "changed: accumulation 1 kept", "changed: 2 node(s) x 4 GPUs (published 1 x 8)",
                 "changed: GPUs 48 -> 8 (2 node(s) x 4)", "changed: global batch 192 -> 32", "changed: accumulation 4 kept",
                 "refused: row nemo-llama2-13b-16gpu"):
        assert said in text, said
    assert load_matrix(path).spec.slurm.partition == "gpu"  # the site's sections, as given
    # the output says what changed too, and nothing ran
    flat = " ".join(out.split())
    assert "changed: global batch 6144 -> 96" in flat and "dry run: nothing measured" in flat
    assert not any(p.name == "sweep.json" for p in (tmp_path / "sw").iterdir())


def test_layouts_of_test_rows_map_and_refuse(tmp_path):
    rows = rows_file(tmp_path / "rows.yaml", [
        tiny_row("t-tp2", 2, layout="tp2", global_batch=2),
        tiny_row("t-hybrid", 4, layout="fsdp", sharding="hybrid_shard", micro_batch=1, global_batch=4),
        tiny_row("t-hybrid-1node", 2, layout="fsdp", sharding="hybrid_shard", micro_batch=1, global_batch=2),
        {**tiny_row("t-alibi", 1), "model": {**MODEL, "positions": "alibi"}},
        tiny_row("t-tp3", 2, layout="tp2", tp=2, micro_batch=2, global_batch=2) | {"model": {**MODEL, "heads": 6, "hidden": 96,
                                                                                              "kv_heads": 3}}])
    code, out, err = invoke(rows, "--rows", "t-tp2,t-hybrid,t-hybrid-1node,t-alibi,t-tp3", "--executor", "slurm",
                            "--device", "cpu", "--out", tmp_path / "sw", "--dry-run")
    assert code == 0, out + err
    lines = err.strip().splitlines()
    assert lines == ["refused: row t-hybrid-1node (hsdp hybrid_shard): hybrid_shard on 1 node: HSDP replicates across "
                     "nodes: give --scale-down 2 or more",
                     "refused: row t-alibi (ddp): ALiBi positions: echobench's decoder has learned, rotary or no positions",
                     "refused: row t-tp3 (tp2 dp1): tp=2 does not divide the card's kv_heads 3: give a tp that does"]
    runs = {r.cfg.card.partition("#")[2]: r.cfg for r in expand(load_matrix(tmp_path / "sw/reproduce.yaml"), "slurm").runs}
    assert (runs["t-tp2"].framework, runs["t-tp2"].parallelism, runs["t-tp2"].dp) == ("megatron", "tp2", 1)
    assert (runs["t-hybrid"].parallelism, runs["t-hybrid"].nodes, runs["t-hybrid"].gpus_per_node) == ("hsdp", 2, 2)


def test_bad_input_is_one_line(tmp_path):
    rows = rows_file(tmp_path / "rows.yaml", [{**tiny_row("only-alibi", 1), "model": {**MODEL, "positions": "alibi"}}])
    code, _, err = invoke(PUBLISHED, "--rows", "lf-mpt-1b-8gpux", "--dry-run", "--out", tmp_path / "a")
    assert code == 2 and err.strip().count("\n") == 0 and "no row 'lf-mpt-1b-8gpux': did you mean lf-mpt-1b-8gpu" in err
    code, _, err = invoke(rows, "--rows", "only-alibi", "--dry-run", "--out", tmp_path / "b")
    assert code == 2 and err.strip().splitlines()[-1] == f"error: no row of {rows} given can run here (why: above, a line each)"
    code, _, err = invoke(rows, "--rows", "only-alibi", "--scale-down", "0", "--out", tmp_path / "c")
    assert code == 2 and "--scale-down 0: give a node count >= 1" in err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


# ---- end to end on this machine ----

@pytest.fixture(scope="module")
def reproduced(tmp_path_factory):
    """Two tiny rows, single and DDP on 2 CPU processes, 3 steps each, through the local executor; the
    sweep measures its hardware profile first (hardware.calibrate_comm, a --site file), which the
    predictions take."""
    tmp = tmp_path_factory.mktemp("reproduce")
    rows = rows_file(tmp / "rows.yaml", [tiny_row("tiny-single", 1), tiny_row("tiny-ddp", 2)])
    site = tmp / "site.yaml"
    site.write_text(yaml.safe_dump({"name": "site", "local": {"time": "00:05:00"}, "hardware": {
        "calibrate_comm": True, "comm_limits": {"budget_s": 0.1, "comm_budget_s": 0.1, "max_bytes": 1024}}}))
    sweep = tmp / "sweep"
    proc = run_cli("reproduce", rows, "--rows", "tiny-single,tiny-ddp", "--site", site, "--device", "cpu", "--steps", 3,
                   "--warmup-steps", 1, "--peak-tflops", 1, "--out", sweep, tmp_path=tmp, timeout=600, env=ONE_THREAD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r.card["label"]: r for r in map(Record.load, sweep.glob("*/result.json"))}
    return tmp, sweep, proc.stdout, records


def predicted(record: Record, sweep):
    """predict_card at the layout the run ran, on the sweep's own profile, at the record's peak."""
    cfg = RunConfig.from_dict(record_settings(record))
    return predict_card(measured_card(record.card), measured_layout(cfg, 32, record.precision, record.compile),
                        load_profile(sweep / "profile.yaml"), row_flops_per_token=record.card["row_flops_per_token"],
                        row_peak_tflops=1.0, peak=(1.0, "test"))


def test_a_local_reproduce_prints_measured_published_and_predicted(reproduced):
    _, sweep, out, records = reproduced
    assert set(records) == {"tiny-single", "tiny-ddp"}
    assert (records["tiny-single"].parallelism, records["tiny-ddp"].parallelism, records["tiny-ddp"].world_size) == \
        ("single", "ddp", 2)
    lines = out.splitlines()
    for label, r in records.items():
        assert r.status == "ok" and r.card["published"]["step_s"] == pytest.approx(2 * 32 / 5000)  # each GPU's step
        row = [line for line in lines if re.match(rf"^. {label} ", line)]
        assert len(row) == 1, out
        step, p = r.step_time_s, predicted(r, sweep)
        cells = [c.strip() for c in row[0].split("│")[1:-1]]
        assert cells[1:5] == ["step time (s)", f"{step:.4g} [{r.step_time_p10_s:.4g}-{r.step_time_p90_s:.4g}]",
                              "0.0128", f"{p.step_time_s:.4g}"]
        assert cells[5] == f"{(step / 0.0128 - 1):+.1%}" and cells[6] == f"{(p.step_time_s / step - 1):+.1%}"
        # the MFU under the row's convention: the record's, the made-up 5%, the prediction's at the record's peak
        mfu = next(line for line in lines[lines.index(row[0]):] if "MFU (row's convention)" in line)
        lo, hi = (r.card["row_flops_per_token"] * 64 / (t * 1e12)  # 64 tokens a GPU a step, peak 1
                  for t in (r.step_time_p90_s, r.step_time_p10_s))
        verdict = "within" if lo <= 0.05 <= hi else "beyond"
        assert f"{pct(r.card['row_mfu'])} [{pct(lo)}-{pct(hi)}]" in mfu and f"{pct(p.mfu_row)}" in mfu
        assert f"{(r.card['row_mfu'] - 0.05) * 100:+.1f} pp {verdict}" in mfu
        sentence = f"{label}: the reference reaches {pct(r.card['row_mfu'])} MFU of its published 5% "
        assert any(line.startswith(sentence) and f"{verdict} the run's spread" in line for line in lines), out
    assert "MEASURED vs published vs predicted" in out and f"({sweep.resolve() / 'profile.yaml'})" in out


def test_predict_against_prices_card_runs_as_cards(reproduced):
    _, sweep, _, records = reproduced
    result = CliRunner().invoke(app, ["validate", "measured", str(sweep), "--json"])
    assert result.exit_code == 0, result.output
    got = {c["run_id"]: c for c in json.loads(result.stdout)}
    for r in records.values():
        p = predicted(r, sweep)
        c = got[r.run_id]
        assert c["tokens_per_step"] == r.global_batch * 32  # a card's prediction (Echo's has no such key)
        assert c["step_time_s"] == pytest.approx(p.step_time_s, rel=1e-9)
        assert c["mfu"] == pytest.approx(p.mfu, rel=1e-9) and c["error"] == pytest.approx(p.step_time_s / r.step_time_s - 1)


def test_the_dashboard_has_the_reference_workloads(reproduced):
    tmp, sweep, _, records = reproduced
    page = tmp / "report.html"
    result = CliRunner().invoke(app, ["report", str(sweep), "-o", str(page)])
    assert result.exit_code == 0, result.output
    html = page.read_text()
    section = html[html.index('<section id="reference-workloads">'):]
    section = section[:section.index("</section>")]
    for label, r in records.items():
        assert f"<td>{label}</td>" in section
        assert f"{label}: the reference reaches {pct(r.card['row_mfu'])} MFU of its published 5% " in section
        assert pct(predicted(r, sweep).mfu_row) in section  # the prediction, on the sweep's own profile
    assert "6N + 12 L d s per token (TEST DATA), peak 1" in section


@pytest.mark.browser
def test_the_reference_workloads_in_chromium(reproduced):
    from test_report import assert_clean, browser_or_skip

    tmp, sweep, _, records = reproduced
    page = tmp / "report-browser.html"
    assert CliRunner().invoke(app, ["report", str(sweep), "-o", str(page)]).exit_code == 0
    with browser_or_skip() as browser:
        browser.open(page)
        assert_clean(browser)
        rows = browser.evaluate("document.querySelectorAll('#reference-table tr').length")
        sentences = browser.evaluate("Array.from(document.querySelectorAll('#reference-sentences li'), li => li.innerText)")
        visible = browser.evaluate("document.querySelector('#reference-table').offsetParent !== null")
    assert rows == 1 + len(records) and visible  # the header, a row per card run
    assert sorted(s.split(":")[0] for s in sentences) == sorted(records)
