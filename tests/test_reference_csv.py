"""The reference CSV of `report --reference`: the shipped example holds published figures (each row the
one of validation/published-runs.yaml its source names) and `report` puts its rows beside measured ones;
docs/reference/reference-csv.md lists exactly the columns read_reference reads."""

import csv
import io
import json
import re
import shutil

import pandas as pd
import pytest
import yaml

from conftest import FIXTURES, ROOT, run_cli
from echobench.model.config import PRESETS
from echobench.report.tables import KEYS, REFERENCE_FIGURES, ReferenceError, read_reference

EXAMPLE = ROOT / "validation" / "reference-example.csv"
PAGE = ROOT / "docs" / "reference" / "reference-csv.md"
ROW_ID = re.compile(r"\[published-runs\.yaml: ([\w.-]+)\]")


def example_rows() -> list[dict]:
    return list(csv.DictReader(EXAMPLE.open()))


def test_the_examples_figures_are_the_published_ones():
    published = {r["id"]: r for r in yaml.safe_load((ROOT / "validation" / "published-runs.yaml").read_text())}
    rows = example_rows()
    assert len(rows) >= 5 and len({(r["scale"], r["framework"], r["parallelism"], r["nodes"]) for r in rows}) == len(rows)
    for row in rows:
        (rid,) = ROW_ID.findall(row["source"])
        run = published[rid]
        src, hw, fig = run["source"], run["hardware"], run["published"]
        assert src["repo"] in row["source"] and src["path"] in row["source"] and src["commit"][:12] in row["source"]
        assert "line" not in src or f"line {src['line']}" in row["source"]
        # the figures as published (the source's own rounding), none derived
        assert float(row["mfu"]) == pytest.approx(fig["mfu"], abs=1e-9)
        assert (row["tflops_per_gpu"] == "") == (fig.get("tflops_per_gpu") is None)
        if row["tflops_per_gpu"]:
            assert float(row["tflops_per_gpu"]) == fig["tflops_per_gpu"]
        assert row["samples_per_s"] == ""  # none of these sources publishes samples/s
        assert int(row["nodes"]) * hw["gpus_per_node"] == hw["gpus"] and f"{hw['gpus']} GPUs" in row["source"]
        framework = {"megatron-lm-2024": "megatron", "torchtitan": "torchtitan"}[src["name"]]
        layout = f"tp{run['run']['tp']}" if framework == "megatron" else "fsdp2"
        assert (row["framework"], row["parallelism"]) == (framework, layout)
        # another model's run: never paired with an echobench run by accident
        assert row["scale"] not in PRESETS


def test_report_puts_the_examples_rows_beside_the_measured_ones(tmp_path):
    runs = tmp_path / "runs"
    for name in ("record-v2.json", "record-v2-sdpa.json"):  # two ok tiny runs of one configuration
        (runs / name.removesuffix(".json")).mkdir(parents=True)
        shutil.copy(FIXTURES / name, runs / name.removesuffix(".json") / "result.json")
    proc = run_cli("report", runs, "--table", "csv", "--reference", EXAMPLE, tmp_path=tmp_path, check=True)
    table = pd.read_csv(io.StringIO(proc.stdout))
    measured = table[table["scale"] == "tiny"]
    assert len(measured) == 1 and measured.iloc[0]["repeats"] == 2 and measured.iloc[0]["mfu"] > 0
    assert measured[["ref_mfu", "ref_tflops_per_gpu", "ref_source"]].isna().all(axis=None)
    published = table[table["scale"] != "tiny"].set_index(KEYS)
    for row in example_rows():
        got = published.loc[(row["scale"], row["framework"], row["parallelism"], int(row["nodes"]))]
        assert got["ref_mfu"] == pytest.approx(float(row["mfu"])) and got["ref_source"] == row["source"]
        assert pd.isna(got["mfu"]) and pd.isna(got["diff_mfu_pp"])  # no measured run of another model
    assert len(published) == len(example_rows())
    md = run_cli("report", runs, "--table", "md", "--reference", EXAMPLE, tmp_path=tmp_path, check=True).stdout
    assert "| published MFU (%) |" in md and "| GPT-7.1B | megatron | tp2 | 12 |" in md and "| 47.0 |" in md


def test_a_reference_row_shows_no_nan_in_a_setting_column(tmp_path):
    """Measured runs that differ in a setting (here ac) get a column for it; published rows have none
    of it and show "-", not nan."""
    runs = tmp_path / "runs"
    for name, ac in (("a", "none"), ("b", "full")):
        record = json.loads((FIXTURES / "record-v2.json").read_text())
        record.update(run_id=f"{record['run_id']}-{name}", ac=ac, config={**record["config"], "ac": ac})
        (runs / name).mkdir(parents=True)
        (runs / name / "result.json").write_text(json.dumps(record))
    md = run_cli("report", runs, "--table", "md", "--reference", EXAMPLE, tmp_path=tmp_path, check=True).stdout
    assert "| ac |" in md and "| GPT-7.1B | megatron | tp2 | - | 12 |" in md and "nan" not in md


def documented_columns() -> dict[str, str]:
    """The page's column table: column -> what its `required` cell says."""
    text = PAGE.read_text()
    section = text[text.index("## Columns"):text.index("\n## ", text.index("## Columns") + 1)]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `(\w+)` \| ([\w ]+) \|", section, re.M)}


def test_the_docs_list_the_columns_read_reference_reads(tmp_path):
    documented = documented_columns()
    assert documented == {**{k: "key" for k in KEYS}, **{f: "figure" for f in REFERENCE_FIGURES}, "source": "no"}
    full = pd.DataFrame([{"scale": "3B", "framework": "torchtitan", "parallelism": "fsdp2", "nodes": 1, "mfu": 0.4,
                          "tflops_per_gpu": 400.0, "samples_per_s": 20.0, "source": "a table"}])
    path = tmp_path / "ref.csv"
    full.to_csv(path, index=False)
    read = read_reference(path)
    assert list(read.columns) == KEYS + [f"ref_{c}" for c in [*REFERENCE_FIGURES, "source"]]
    for column, required in documented.items():  # what the page says of each column is what the reader does
        full.drop(columns=column).to_csv(path, index=False)
        if required == "key":
            with pytest.raises(ReferenceError, match=f"missing key column.*{column}"):
                read_reference(path)
        else:
            assert len(read_reference(path)) == 1
    full.drop(columns=REFERENCE_FIGURES).to_csv(path, index=False)
    with pytest.raises(ReferenceError, match="no published figure column"):
        read_reference(path)


def test_the_page_shows_the_example_file_itself():
    assert '--8<-- "validation/reference-example.csv"' in PAGE.read_text()
    assert "reference/reference-csv.md" in (ROOT / "mkdocs.yml").read_text()


@pytest.mark.parametrize("row, said", [
    ("3b,torchtitan,fsdp2,1,0.3", "line 2: scale='3b' is not valid: allowed tiny, 800M, 3B, 8B (did you mean '3B'?)"),
    ("3B,torchtitan,fsdp,1,0.3", "line 2: parallelism='fsdp' is not valid: allowed single, ddp, fsdp2, hsdp "
                                 "(torchtitan); tpN with N >= 1 (megatron) (did you mean 'fsdp2'?)"),
    ("3B,Megatron,TP2,1,0.3", "line 2: framework='Megatron' is not valid: allowed torchtitan, megatron (did you mean "
                              "'megatron'?)"),
])
def test_a_slip_of_a_scale_framework_or_layout_is_refused_in_one_line_as_a_matrix_refuses_it(tmp_path, row, said):
    """The hand-typed row of a published table (`3b`) used to stand unmatched, silently; the matrix
    refuses the same value with the same words."""
    path = tmp_path / "ref.csv"
    path.write_text(f"scale,framework,parallelism,nodes,mfu\n{row}\n")
    with pytest.raises(ReferenceError) as exc:
        read_reference(path)
    assert str(exc.value) == f"{path}: {said}"
    proc = run_cli("report", FIXTURES, "--table", "md", "--reference", path, tmp_path=tmp_path)
    assert proc.returncode == 2 and said in " ".join(proc.stderr.split()), proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 3 and "Traceback" not in proc.stderr  # one line, maybe wrapped
    matrix = tmp_path / "m.yaml"
    key, value = re.search(r"(\w+)='([^']+)'", said).groups()
    matrix.write_text(json.dumps({"name": "m", "defaults": {key: value}}))
    refused = run_cli("plan", matrix, tmp_path=tmp_path)
    assert refused.returncode == 2 and f"{key}='{value}' is not valid" in " ".join(refused.stderr.split())


def test_a_row_of_echobench_keys_that_pairs_with_no_run_is_warned_naming_the_nearest_measured_one(tmp_path):
    """A row of valid keys that no run matches (another node count) is listed published-only, with a
    warning naming it and the measured configuration nearest to it; another model's row (the
    example's GPT-1.7B) stands published-only without one."""
    runs = tmp_path / "runs" / "a"
    runs.mkdir(parents=True)
    shutil.copy(FIXTURES / "record-v2.json", runs / "result.json")  # tiny, torchtitan, single, 1 node
    path = tmp_path / "ref.csv"
    path.write_text("scale,framework,parallelism,nodes,mfu\ntiny,torchtitan,single,1,0.3\ntiny,torchtitan,single,2,0.3\n"
                    "GPT-1.7B,megatron,tp1,6,0.41\n")
    proc = run_cli("report", runs.parent, "--table", "csv", "--reference", path, tmp_path=tmp_path, check=True)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, proc.stderr
    assert " ".join(proc.stderr.split()).count(
        f"warning: {path}: line 3 (tiny, torchtitan, single, 2 node(s)): no measured run has these keys, so its figures "
        f"stand alone; nearest measured: tiny, torchtitan, single, 1 node(s)") == 1, proc.stderr
    table = pd.read_csv(io.StringIO(proc.stdout))
    assert len(table) == 3  # paired, and the two published-only rows
