"""`echobench validate published`: the published rows' strict schema (every unknown key, a row's own
value missing from its assumed values, refused in one line naming the key and the row), the
published step under each row's convention, the assumed values priced as a range, the command's
table, summary and --json, and the leave-one-source-out cross-validation held under committed
limits (a change that makes the model worse on sources it was not fitted to fails here)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
import yaml
from rich.console import Console

from conftest import ROOT
from echobench.predict import PredictError
from echobench.hardware.profile import find_profile, load_profile
from echobench.predict.cards.card import load_card_file, model_card, run_layout
from echobench.predict.cards.model import predict_card
from echobench.predict.crossval import crossval
from echobench.predict.frameworks import GENERIC, SPANNED
from echobench.predict.intervals import interval
from echobench.predict.tables import validation_table
from echobench.predict.validate import (
    SERIES_AIM,
    ValidationRow,
    load_rows,
    published_step,
    scaling_series,
    validate,
    validate_row,
    validation_summary,
)

ROWS = yaml.safe_load((ROOT / "validation" / "published-runs.yaml").read_text())
BY_ID = {r["id"]: r for r in ROWS}
# The committed limits on the model's error on sources it was not fitted to: issue 42's aims, mean <= 12%,
# max <= 30% (7.0% / 23.5% at reports/predict-loso-2026-12-04.md). Raising one needs a reason.
LOSO_MEAN, LOSO_MAX = 0.12, 0.30


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump(rows, sort_keys=False))
    return str(path)


def one_error(tmp_path, row) -> str:
    with pytest.raises(PredictError) as err:
        load_rows(write_rows(tmp_path, [row]))
    assert "\n" not in str(err.value)
    return str(err.value)


ROW = BY_ID["lf-mpt-7b-8gpu"]


@pytest.mark.parametrize("change, said", [
    (lambda r: {**r, "run": {**r["run"], "shard_grop": 128}}, "row lf-mpt-7b-8gpu: run: unknown key 'shard_grop'"),
    (lambda r: {**r, "run": {**r["run"], "step_time_s": 1.0}}, "row lf-mpt-7b-8gpu: run: unknown key 'step_time_s'"),
    (lambda r: {**r, "hardware": {**r["hardware"], "nics": 4}}, "unknown key hardware.nics"),
    (lambda r: {**r, "published": {**r["published"], "mfu_pct": 46}}, "unknown key published.mfu_pct"),
    (lambda r: {**r, "extra": 1}, "row lf-mpt-7b-8gpu: unknown key 'extra'"),
    (lambda r: {**r, "model": {**r["model"], "moe_experts": 8}}, "model: unknown key 'moe_experts'"),
    (lambda r: {**r, "run": {**r["run"], "dp": 4}}, "dp 4 is not gpus 8 / (tp 1 x pp 1 x cp 1) = 8"),
    (lambda r: {**r, "assumed": [{"field": "run.micro_batch", "values": [2, 4], "why": "x"}]},
     "assumed run.micro_batch: the row's own value 6 is not among the values [2, 4]"),
    (lambda r: {**r, "assumed": ["interconnect unstated"]}, "give exactly field, values and why"),
    (lambda r: {**r, "assumed": [{"field": "hardware.nics", "values": [1], "why": "x"}]}, "assumed field 'hardware.nics'"),
    (lambda r: {**r, "run": {k: v for k, v in r["run"].items() if k != "seq"}}, "lacks 'seq'"),
    (lambda r: {**r, "run": {**r["run"], "head_chunk": True}}, "run: embedding_chunk / head_chunk without pipeline"),
    (lambda r: {**r, "source": {k: v for k, v in r["source"].items() if k != "name"}}, "lacks source.name"),
])
def test_a_row_the_schema_does_not_know_is_refused_in_one_line_naming_the_key_and_the_row(tmp_path, change, said):
    assert said in one_error(tmp_path, change(ROW))


def test_shard_group_dp_and_cp_are_read_not_dropped():
    """An HSDP row's shard group is its own, not a node (the issue's 128-GPU group priced as 8)."""
    run = {**ROW["run"], "sharding": "hybrid_shard", "shard_group": 32}
    layout = run_layout({**run, "global_batch": 6 * 128}, {**ROW["hardware"], "gpus": 128})
    assert (layout.layout, layout.shard_size) == ("hsdp", 32)
    cp = run_layout({**run, "layout": "megatron", "cp": 2, "dp": 64, "global_batch": 6 * 64, "sharding": "full_shard",
                     "shard_group": None}, {**ROW["hardware"], "gpus": 128})
    assert (cp.cp, cp.data_parallel, cp.tokens) == (2, 64, 6 * 2048 // 2)


def test_every_row_loads_and_the_ground_truth_spans_sources_and_gpu_generations():
    rows = load_rows(ROOT / "validation" / "published-runs.yaml")
    assert len(rows) >= 60 and len({r["source"]["name"] for r in rows}) >= 5
    assert {r["hardware"]["profile"].split("-")[0] for r in rows} >= {"a100", "h100"}
    assert all(len(str(r["source"]["commit"])) == 40 for r in rows)


def test_the_published_step_comes_from_tokens_from_tflops_under_the_rows_convention_or_the_step_itself():
    for row in ROWS:
        card, layout = model_card(row["model"]), run_layout(row["run"], row["hardware"])
        step, how = published_step(row, card, layout)
        pub = row["published"]
        if pub.get("step_s"):
            assert how == "step_s" and step == pub["step_s"]
        elif pub.get("tokens_per_s_per_gpu"):
            assert step == pytest.approx(layout.global_batch * layout.seq / (pub["tokens_per_s_per_gpu"] * layout.gpus))
        else:
            assert how.startswith("TFLOP/s")
            if row.get("derived"):  # the Megatron-LM rows' own tokens/s, derived from their convention
                assert step == pytest.approx(layout.global_batch * layout.seq /
                                             (row["derived"]["tokens_per_s_per_gpu"] * layout.gpus),
                                             rel=0.5 / row["derived"]["tokens_per_s_per_gpu"])  # rounded to a token/s


def test_an_assumed_micro_batch_gives_a_range_the_published_step_lies_in():
    """The Megatron-LM 32B row: its micro-batch is not published; priced at 1, 2 and 4 (grad_accum
    following), the range holds the published step (at 1 alone it was 50% slow)."""
    r = validate_row(BY_ID["mlm-gpt-32b-384gpu"], {})
    assert r.low_s < r.high_s and r.inside
    assert r.predicted_step_s == pytest.approx((r.low_s * r.high_s) ** 0.5)  # the middle of the range
    plain = validate_row({**BY_ID["mlm-gpt-32b-384gpu"], "assumed": []}, {})
    assert plain.low_s == plain.high_s == plain.predicted_step_s
    # every row's interval: its range widened by the cross-validated residuals at each end
    assert (r.interval_low_s, r.interval_high_s) == pytest.approx((interval(r.low_s)[0], interval(r.high_s)[1]))


def test_a_row_with_nothing_assumed_has_the_cross_validated_interval_not_one_of_zero_width():
    """Nothing assumed: no range, but the model's leave-one-source-out residuals still give the row
    an interval around its prediction (validation/fit.json's quantiles), printed as errors."""
    plain = validate_row({**BY_ID["mlm-gpt-32b-384gpu"], "assumed": []}, {})
    lo, hi = interval(plain.predicted_step_s)
    assert plain.interval_low_s < plain.predicted_step_s < plain.interval_high_s
    assert (plain.interval_low_s, plain.interval_high_s) == pytest.approx((lo, hi))
    wider = validate_row({**BY_ID["mlm-gpt-32b-384gpu"], "assumed": []}, {}, quantiles=(-0.3, 0.3))
    assert wider.interval_high_s / wider.interval_low_s == pytest.approx(math.exp(0.6))
    console = Console(record=True, width=300)
    console.print(validation_table([plain], "t"))
    band = re.search(r"([+-]\d+\.\d)% \.\. ([+-]\d+\.\d)%", console.export_text())
    assert band and float(band.group(1)) < float(band.group(2)), console.export_text()


def test_validate_on_three_rows_prints_each_row_its_range_and_the_cross_validation(tmp_path, cli):
    three = ["lf-mpt-7b-8gpu", "mlm-gpt-7.1b-96gpu", "kor-megatron-22b-full"]
    path = write_rows(tmp_path, [BY_ID[i] for i in three])
    proc = cli("validate", "published", path, check=True)
    for rid in three:
        line = next(x for x in proc.stdout.splitlines() if f" {rid} " in x)
        assert re.search(r"[+-]\d+\.\d%", line), line
    assert "leave-one-source-out" in proc.stdout and re.search(r"│ all +│ +3 │", proc.stdout), proc.stdout
    out = json.loads(cli("validate", "published", path, "--json", check=True).stdout)
    assert [r["id"] for r in out["rows"]] == three and out["summary"]["priced"] == 3
    assert set(out["crossval"]["loso_errors"]) == set(three) and out["crossval"]["sources"] == 3
    assert out["summary"]["mean_abs_error"] == pytest.approx(sum(abs(r["error"]) for r in out["rows"]) / 3)


def held_out_rows(faster: float) -> list[dict]:
    """Three Hopper rows of three sources under new ids (outside the committed fit set), each
    publishing a step `faster` x faster than the committed fit predicts it."""
    out = []
    for rid in ("tt-llama3-8b-h100-8gpu", "mlm-gpt-7.1b-96gpu", "nemo-llama3-8b-8gpu"):
        row = BY_ID[rid]
        step = validate_row(row, {}).predicted_step_s
        out.append({**row, "id": f"new-{rid}", "published": {"convention": "the step itself", "step_s": step / faster}})
    return out


def test_validate_prices_a_file_at_the_committed_fit_and_a_refit_is_labelled_in_sample(tmp_path, cli):
    """Rows outside the committed fit set, 25% faster than it predicts: by default each is priced at
    validation/fit.json (+25.0%, the JSON naming that fit), held out; --refit fits the clock to these
    very rows (another clock, smaller errors) and says the errors are in-sample."""
    committed = json.loads((ROOT / "validation" / "fit.json").read_text())
    path = write_rows(tmp_path, held_out_rows(1.25))
    out = json.loads(cli("validate", "published", path, "--json", check=True).stdout)
    assert out["fit"]["fit"] == "committed" and not out["fit"]["in_sample"]
    assert out["fit"]["clock"] == committed["clock"] and out["fit"]["file"] == "validation/fit.json"
    assert out["fit"]["rows_file"] == committed["rows_file"] and out["fit"]["fitted_on"] == len(committed["fitted_on"])
    assert [r["error"] for r in out["rows"]] == pytest.approx([0.25] * 3)
    assert not any(r["in_fit_set"] for r in out["rows"]) and out["summary"]["held_out"]["rows"] == 3
    text = " ".join(cli("validate", "published", path, check=True).stdout.split())
    assert "PREDICTED (at the committed fit)" in text and "+25.0%" in text
    assert "3 held out: mean |error| 25.0%, max 25.0%" in text and "IN-SAMPLE" not in text

    refit = json.loads(cli("validate", "published", path, "--refit", "--json", check=True).stdout)
    assert refit["fit"]["fit"] == "refit" and refit["fit"]["in_sample"] and refit["fit"]["rows_file"] == path
    assert refit["fit"]["clock"]["hopper"] > committed["clock"]["hopper"]
    assert all(abs(r["error"]) < 0.25 and r["in_fit_set"] for r in refit["rows"])
    text = " ".join(cli("validate", "published", path, "--refit", check=True).stdout.split())
    assert "PREDICTED (IN-SAMPLE" in text and "not a held-out error" in text


def scaled(row: dict, gpus: int, rid: str) -> dict:
    """The row at `gpus` GPUs with the same work per GPU (the global batch grown with the GPU count)."""
    per_gpu = row["run"]["global_batch"] // row["hardware"]["gpus"]
    return {**row, "id": rid, "hardware": {**row["hardware"], "gpus": gpus},
            "run": {**row["run"], "global_batch": per_gpu * gpus}}


def test_a_scaling_series_is_a_sources_rows_at_constant_per_gpu_work_and_its_error_change_is_reported(tmp_path, cli):
    """Three rows of one source at 8, 64 and 256 GPUs doing the same work per GPU form one series, by
    GPU count whatever the file's order; a row with other work per GPU (another micro-batch) or of
    another source is not in it. Its change is the error at the most GPUs minus at the fewest, and it
    is within the aim only inside +-SERIES_AIM; --json and the text report it."""
    base = BY_ID["lf-mpt-7b-8gpu"]
    rows = [scaled(base, 256, "s-256"), scaled(base, 8, "s-8"), scaled(base, 64, "s-64"),
            {**scaled(base, 64, "other-work"), "run": {**scaled(base, 64, "x")["run"], "micro_batch": 3, "grad_accum": 2}},
            {**scaled(base, 64, "other-source"), "source": {**base["source"], "name": "elsewhere"}}]
    errors = {"s-8": -0.01, "s-64": -0.03, "s-256": -0.10, "other-work": 0.0, "other-source": 0.0}
    results = [ValidationRow(r["id"], r["source"]["name"], r["hardware"]["gpus"], "fsdp", error=errors[r["id"]])
               for r in rows]
    [series] = scaling_series(rows, results, {"s-8": 0.0, "s-256": -0.02})
    assert series.ids == ["s-8", "s-64", "s-256"] and series.gpus == [8, 64, 256]
    assert series.change == pytest.approx(-0.09) and not series.within_aim
    assert series.loso_change == pytest.approx(-0.02)
    results[0].error = -0.01 - SERIES_AIM + 1e-9  # the 256-GPU row: just inside the aim
    assert scaling_series(rows, results)[0].within_aim and scaling_series(rows, results)[0].loso_change is None
    assert scaling_series(rows[1:3], [r for r in results if r.id in ("s-8",)]) == []  # one priced row: no series

    path = write_rows(tmp_path, rows[:3])
    out = json.loads(cli("validate", "published", path, "--json", check=True).stdout)["scaling_series"]
    assert out["count"] == 1 and out["series"][0]["gpus"] == [8, 64, 256] and out["aim"] == SERIES_AIM
    errs = out["series"][0]["errors"]
    assert out["series"][0]["change"] == pytest.approx(errs[-1] - errs[0])
    text = " ".join(cli("validate", "published", path, check=True).stdout.split())
    assert "s-8 .. s-256 (llm-foundry, 8 / 64 / 256 GPUs)" in text and f"{(errs[-1] - errs[0]) * 100:+.1f} points" in text
    assert "leave-one-source-out: not meaningful" in text  # one source: no other to refit the clock on


def test_the_held_out_file_is_outside_the_committed_fit_and_holds_six_scaling_series():
    """validation/held-out-runs.yaml: every row loads, none is in the committed fit's set (each one's
    error held out), its rows share no id with the fitted file, and its scaling series are the six
    tables of the recipes (8B at 5 counts, 70B at 6, 405B at 3; bf16 and fp8), each by GPU count."""
    path = ROOT / "validation" / "held-out-runs.yaml"
    rows = load_rows(path)
    assert not {r["id"] for r in rows} & set(BY_ID)
    results = validate(rows, with_range=False)
    assert all(r.error is not None and r.in_fit_set is False for r in results)
    series = scaling_series(rows, results)
    assert sorted(len(s.gpus) for s in series) == [3, 3, 5, 5, 6, 6]
    assert all(s.gpus == sorted(s.gpus) and len(set(s.gpus)) == len(s.gpus) for s in series)


def test_a_row_over_its_devices_memory_is_priced_and_flagged_with_its_memory_error():
    """A 7B model trained unsharded (DDP) at a long sequence on 8 H100s estimates past 80 GB: still
    priced, flagged in the row, its notes and the summary; against a published figure, its error."""
    row = BY_ID["lf-mpt-7b-8gpu"]
    big = {**row, "id": "big", "run": {**row["run"], "sharding": "no_shard", "layout": "ddp"},
           "published": {**row["published"], "memory_gib": 100.0}}
    r = validate_row(big, {})
    assert r.error is not None and r.memory_gib > r.device_memory_gib == pytest.approx(79.6) and r.over_memory
    assert r.memory_error == pytest.approx(r.memory_gib / 100 - 1)
    assert any("exceeds the 79.6 GiB" in n for n in r.notes)
    fits = validate_row(row, {})
    assert fits.over_memory is False and fits.memory_error is None
    assert validation_summary([r, fits])["over_memory"] == ["big"]
    console = Console(record=True, width=300)
    console.print(validation_table([r], "t"))
    assert f"{r.memory_gib:.1f}!" in console.export_text()


def test_a_devices_memory_is_the_size_its_name_gives_else_the_tables():
    from echobench.hardware.devicememory import device_capacity_gib

    assert device_capacity_gib("NVIDIA A100-SXM4-40GB") == pytest.approx(39.8)  # the table's A100 is the 80 GB part
    assert device_capacity_gib("NVIDIA A100-SXM4-80GB") == pytest.approx(79.2)  # the table's, the same part
    assert device_capacity_gib("NVIDIA H100 96GB HBM2e (500 W)") == pytest.approx(95.52)
    assert device_capacity_gib("NVIDIA GH200 120GB") == pytest.approx(95.0)  # its name's size is not its HBM's
    assert device_capacity_gib("NVIDIA H200") == pytest.approx(139.8) and device_capacity_gib("a cpu") is None


def test_the_summary_counts_only_the_rows_priced():
    bad = {**ROW, "id": "x", "hardware": {**ROW["hardware"], "profile": "nosuch"}}
    results = validate([ROW, BY_ID["mlm-gpt-7.1b-96gpu"], bad])
    s = validation_summary(results)
    assert (s["priced"], s["refused"]) == (2, 1) and s["max_abs_error"] == max(abs(r.error) for r in results[:2])
    assert "no hardware profile 'nosuch'" in results[2].refused


def one_error_line(proc) -> str:
    lines = [x for x in (proc.stderr + proc.stdout).strip().splitlines() if x.strip()]
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    return lines[0]


def test_bad_input_is_one_line_and_exit_1(tmp_path, cli):
    assert "no such file" in one_error_line(cli("validate", "published", tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- id: x\n  model: [\n")
    assert "not valid YAML: line" in one_error_line(cli("validate", "published", bad))
    unknown = {**ROW, "run": {**ROW["run"], "shard_group": 128, "sharding": "full_shard", "bucket_mb": 25}}
    assert "run: unknown key 'bucket_mb'" in one_error_line(cli("validate", "published", write_rows(tmp_path, [unknown])))
    # predict prices a matrix only: the published rows are validate's
    proc = cli("predict", ROOT / "matrices" / "smoke.yaml", "--validate", bad)
    assert proc.returncode == 2 and "No such option: --validate" in proc.stderr


def test_a_small_card_file_reads_as_a_rows_card(tmp_path):
    """A card file (model, run, hardware; no published figures) gives the card and layout its row gives."""
    row = BY_ID["mlm-gpt-16b-192gpu"]
    path = tmp_path / "card.yaml"
    path.write_text(yaml.safe_dump({k: row[k] for k in ("model", "run", "hardware")}))
    card, layout, profile = load_card_file(path)
    assert (card, layout) == (model_card(row["model"]), run_layout(row["run"], row["hardware"])) and profile == "h100-hgx-ib"
    path.write_text(yaml.safe_dump({"model": row["model"], "run": {**row["run"], "layout": "pipeline"},
                                    "hardware": row["hardware"]}))
    with pytest.raises(PredictError, match="unknown layout 'pipeline'"):
        load_card_file(path)


def test_the_validation_table_prints_outside_text_verbatim():
    console = Console(record=True, width=250)
    console.print(validation_table([ValidationRow("[bold]x[/]", "repo", 8, "[red]fsdp", refused="why")], "[t]"))
    text = console.export_text()
    assert "[bold]x[/]" in text and "[red]fsdp" in text and "[t]" in text



def without_framework(row: dict, *drop: str) -> dict:
    return {**row, "id": f"{row['id']}-unnamed", "run": {k: v for k, v in row["run"].items()
                                                         if k not in ("framework", "framework_version", *drop)}}


def test_a_row_naming_no_framework_takes_the_generic_default_its_interval_spanning_the_named_ones():
    """A row that names no framework is priced at frameworks.GENERIC (gradient reduction and
    parameter gathers overlapped, not every overlap off) and its interval spans its price at each
    current framework's defaults (frameworks.SPANNED): a Megatron-LM interleaved row and a
    torchtitan FSDP row, their framework and overlap flags dropped."""
    flags = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "attention_kernel")
    for rid in ("mlm-gpt-70b-768gpu", "tt-llama3-8b-h100-8gpu"):
        row = without_framework(BY_ID[rid], *flags)
        r = validate_row(row, {})
        assert r.error is not None and any(n.startswith("the generic defaults taken") for n in r.notes), r.notes
        named = {name: validate_row({**row, "run": {**row["run"], "framework": name}}, {}) for name in SPANNED}
        for name, n in named.items():
            assert r.interval_low_s < n.predicted_step_s < r.interval_high_s, (rid, name)
        assert r.interval_high_s / r.interval_low_s > max(n.interval_high_s / n.interval_low_s for n in named.values())
        # the card file's path (predict_card) spans them too
        card, layout = model_card(row["model"]), run_layout(row["run"], row["hardware"])
        profile = load_profile(find_profile(row["hardware"]["profile"]))
        p = predict_card(card, layout, profile)
        steps = [predict_card(card, replace(layout, framework=name), profile).step_time_s for name in SPANNED]
        assert p.step_time_low_s < min(steps) <= max(steps) < p.step_time_high_s
        assert p.framework_span_s == (min(p.step_time_s, *steps), max(p.step_time_s, *steps))
    # with its overlaps unstated, a Megatron row is no longer priced with every overlap off
    row = without_framework(BY_ID["mlm-gpt-70b-768gpu"], *flags)
    off = {**row, "run": {**row["run"], **{k: False for k in flags[:3]}, "overlap_p2p_comm": False}}
    assert validate_row(row, {}).predicted_step_s < validate_row(off, {}).predicted_step_s
    assert (GENERIC.overlap_grad_reduce, GENERIC.overlap_param_gather, GENERIC.overlap_p2p_comm) == (True, True, True)


def test_a_framework_outside_the_list_is_priced_from_its_settings_and_refused_in_one_line_without_them(tmp_path):
    """A framework echobench does not name, described by its settings, is priced as they say: given
    torchtitan's (eager Llama block, q, k, v apart, fp32 reduction, FlashAttention-2) it is priced
    as torchtitan; without them, one line naming the settings to add."""
    row = BY_ID["tt-llama3-8b-h100-128gpu"]
    mine = {**row, "run": {**row["run"], "framework": "my-trainer", "grad_reduce_dtype": "fp32",
                           "attention_kernel": "flash2", "elementwise_kernels": "llama", "fused_qkv": False}}
    assert load_rows(write_rows(tmp_path, [mine]))
    assert validate_row(mine, {}).predicted_step_s == pytest.approx(validate_row(row, {}).predicted_step_s, rel=1e-12)
    fused = validate_row({**mine, "run": {**mine["run"], "elementwise_kernels": "fused"}}, {})
    assert fused.predicted_step_s < validate_row(mine, {}).predicted_step_s
    said = one_error(tmp_path, {**BY_ID["mlm-gpt-70b-768gpu"], "run": {**BY_ID["mlm-gpt-70b-768gpu"]["run"],
                                                                        "framework": "my-trainer"}})
    assert "row mlm-gpt-70b-768gpu: run: framework 'my-trainer' is not one of" in said
    assert "describe it by its settings (add attention_kernel, elementwise_kernels, overlap_p2p_comm)" in said
    bare = {**mine, "run": {k: v for k, v in mine["run"].items() if k not in ("elementwise_kernels", "attention_kernel")}}
    assert "(add attention_kernel, elementwise_kernels)" in one_error(tmp_path, bare)
    assert "unknown elementwise_kernels 'eager'" in one_error(tmp_path, {**mine, "run": {**mine["run"],
                                                                                         "elementwise_kernels": "eager"}})

@pytest.fixture(scope="module")
def cv():
    return crossval(load_rows(ROOT / "validation" / "published-runs.yaml"))


def test_the_model_holds_on_sources_it_was_not_fitted_to(cv):
    """Leave-one-source-out: each source predicted with the in-step clock fitted on the others, under
    the committed limits; the clock stays inside its bounds in every fold."""
    assert cv["sources"] >= 5 and cv["rows"] >= 60
    assert cv["loso"]["mean_abs_error"] <= LOSO_MEAN and cv["loso"]["max_abs_error"] <= LOSO_MAX, cv["loso"]
    assert all(0.6 <= c <= 1.0 for fold in cv["folds"].values() for c in fold.values())


def test_the_clock_each_row_needs_reprices_it_at_its_published_step(cv):
    """The clock each row would need (crossval.RowFit.clock_needed) makes its surrogate step its
    published one; per source and overall its min / median / max bracket the fitted clock."""
    from echobench.predict.crossval import RowFit, clocks_needed

    row = RowFit("r", "s", "hopper", a=0.2, b=0.5, published=0.9)
    assert row.step(row.clock_needed()) == pytest.approx(0.9)
    assert RowFit("r", "s", "hopper", a=1.0, b=0.5, published=0.9).clock_needed() is None  # too slow at any clock
    rows = [RowFit(str(i), "s", "hopper", 0.1, 0.5, 0.1 + 0.5 / c) for i, c in enumerate((0.6, 0.7, 0.9))]
    assert clocks_needed(rows)["hopper"] == pytest.approx([0.6, 0.7, 0.9])
    for fam, (lo, mid, hi) in cv["clock_needed"].items():
        assert lo <= cv["fit"][fam] <= hi and lo <= mid <= hi
    assert all("clock_needed" in v for v in cv["per_source"].values())


def test_the_committed_fit_is_the_fit_on_every_row_and_its_interval_is_never_zero_width(cv):
    committed = json.loads((ROOT / "validation" / "fit.json").read_text())
    assert committed["clock"] == cv["fit"], "stale: rerun `echobench validate published validation/published-runs.yaml --write-fit`"
    assert committed["rows_file"] == "validation/published-runs.yaml"
    assert committed["residual_quantiles"] == pytest.approx(cv["residual_quantiles"])
    lo, hi = interval(1.0)
    assert lo < 1.0 < hi
    # the interval holds the published step of about the share of rows its quantiles say
    held = [e for e in cv["loso_errors"].values()]
    inside = sum(interval(1 + e)[0] <= 1 <= interval(1 + e)[1] for e in held) / len(held)
    assert 0.7 <= inside <= 0.9


def test_the_docs_accuracy_figures_are_the_committed_runs():
    """The leave-one-source-out and in-sample figures of docs/explanation/predict.md are
    validation/fit.json's (written by `validate published --write-fit`), not typed apart from it."""
    fit = json.loads((ROOT / "validation" / "fit.json").read_text())
    text = " ".join((ROOT / "docs" / "explanation" / "predict.md").read_text().split())
    loso = f"leave-one-source-out mean |error| {fit['loso']['mean_abs_error']:.1%}, max {fit['loso']['max_abs_error']:.1%}"
    inside = f"in-sample (fitted on every row) {fit['in_sample']['mean_abs_error']:.1%} / {fit['in_sample']['max_abs_error']:.1%}"
    assert loso in text and inside in text
    over = validate_row(BY_ID["nemo-nemotron-340b-128gpu"], {})  # the row the page names over its device's memory
    assert over.over_memory and f"{over.memory_gib:.1f} GiB estimated against {over.device_memory_gib:.1f}" in text
