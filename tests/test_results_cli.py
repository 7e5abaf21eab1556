"""`echobench results DIR...`: every record under the directories as a table, CSV or JSON; filtered
by --only, sorted by --sort; unreadable records named and kept; record text printed literally."""

import csv
import io
import json
from pathlib import Path

import pytest

from conftest import run_cli
from echobench.records.results import Env, Record

MARKUP = "[bold]x[/bold]"
XSS = "<script>alert(1)</script>"


def record(run_id, scale="800M", framework="torchtitan", parallelism="ddp", nodes=1, gpus_per_node=4, status="ok",
           mfu=0.4, samples_per_s=100.0, step_time_s=1.0, peak_mem_gib=40.0, time="2026-11-01T10:20:30+00:00",
           **extra) -> Record:
    """A hand-built record with round numbers (its settings are its top-level fields)."""
    world = nodes * gpus_per_node
    rec = Record(run_id=run_id, status=status, scale=scale, framework=framework, parallelism=parallelism, tp=1,
                 dp=world, nodes=nodes, gpus_per_node=gpus_per_node, world_size=world, micro_batch=8,
                 global_batch=8 * world, audio_frames=750, text_tokens=256, speaker_frames=750, precision="bf16",
                 compile=False, ac="none", steps=30, warmup_steps=10, peak_mem_gib=peak_mem_gib,
                 env=Env(device_name="NVIDIA H200", time=time))
    if status == "ok":
        rec.update(mfu=mfu, samples_per_s=samples_per_s, step_time_s=step_time_s)
    else:
        rec.update(error=extra.pop("error", f"{status} at step 3"))
    return rec.update(**extra)


# (sweep, record): two sweeps, one of which repeats a run id of the other
RECORDS = [
    ("sweep-a", record("800m-ddp-1", nodes=1, mfu=0.40, samples_per_s=101.5)),
    ("sweep-a", record("800m-ddp-2", nodes=2, mfu=0.38, samples_per_s=190.25, step_time_s=1.0625)),
    ("sweep-a", record("3b-fsdp2-1", scale="3B", parallelism="fsdp2", mfu=0.45, samples_per_s=30.125,
                       peak_mem_gib=77.5)),
    ("sweep-a", record("3b-tp2-1", scale="3B", framework="megatron", parallelism="tp2", status="oom",
                       peak_mem_gib=139.0)),
    ("sweep-b", record("800m-ddp-1", nodes=1, mfu=0.42, samples_per_s=106.0, time="2026-11-02T08:00:00+00:00")),
    ("sweep-b", record("tiny-single", scale="tiny", parallelism="single", gpus_per_node=1, mfu=0.05,
                       samples_per_s=12.0)),
]


def write_records(root: Path) -> Path:
    for sweep, rec in RECORDS:
        rec.save(root / sweep / rec.run_id)
    return root


def results(*args, **kw):
    return run_cli("results", *args, **kw)


def csv_rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_the_table_lists_every_record_sorted_by_scale_nodes_and_mfu(tmp_path):
    root = write_records(tmp_path / "runs")
    proc = results(root, check=True)
    body = [line for line in proc.stdout.splitlines() if "│" in line]  # the rows (the header has ┃)
    assert len(body) == len(RECORDS), proc.stdout
    ids = [line.split("│")[2].strip() for line in body]
    sweeps = [line.split("│")[1].strip() for line in body]
    # no merging: both sweeps' 800m-ddp-1 are there; scale by size (tiny, 800M, 3B), nodes, then MFU descending
    assert list(zip(sweeps, ids)) == [("runs/sweep-b", "tiny-single"), ("runs/sweep-b", "800m-ddp-1"),
                                      ("runs/sweep-a", "800m-ddp-1"), ("runs/sweep-a", "800m-ddp-2"),
                                      ("runs/sweep-a", "3b-fsdp2-1"), ("runs/sweep-a", "3b-tp2-1")]
    row = next(line for line in body if "3b-fsdp2-1" in line)
    cells = [c.strip() for c in row.split("│")[1:-1]]
    assert cells == ["runs/sweep-a", "3b-fsdp2-1", "3B", "torchtitan", "fsdp2", "1", "4", "ok", "45.00%", "30.12",
                     "36.88", "1.0000", "77.5", "2026-11-01 10:20"]  # 4 GPUs x 1e6 / 30.125 samples/s = 36.88 GPU-h
    oom = [c.strip() for c in next(line for line in body if "3b-tp2-1" in line).split("│")[1:-1]]
    assert oom[7:13] == ["oom", "-", "-", "-", "-", "139"]
    assert "6 records, 5 ok" in proc.stdout


def test_only_and_sort(tmp_path):
    root = write_records(tmp_path / "runs")
    rows = csv_rows(results(root, "--only", "scale=800M", "--sort", "samples_per_s", "--csv", "-",
                            check=True).stdout)
    assert [(r["run_id"], r["samples_per_s"]) for r in rows] == [("800m-ddp-1", "101.5"), ("800m-ddp-1", "106.0"),
                                                                 ("800m-ddp-2", "190.25")]
    rows = csv_rows(results(root, "--only", "status=oom", "--only", "status=ok", "--only", "parallelism=tp2",
                            "--csv", "-", check=True).stdout)
    assert [r["run_id"] for r in rows] == ["3b-tp2-1"]
    rows = csv_rows(results(root / "sweep-a", "--only", "nodes=2", "--only", "nodes=1", "--sort=-date",
                            "--sort=run_id", "--csv", "-", check=True).stdout)
    assert [r["run_id"] for r in rows] == ["3b-fsdp2-1", "3b-tp2-1", "800m-ddp-1", "800m-ddp-2"]
    assert {r["sweep_dir"] for r in rows} == {"sweep-a"}  # relative to the folder given
    one = root / "sweep-a" / "3b-tp2-1"  # a run directory and its record file: one row, its sweep named
    rows = csv_rows(results(one, one / "result.json", "--csv", "-", check=True).stdout)
    assert [(r["sweep_dir"], r["run_id"]) for r in rows] == [("sweep-a", "3b-tp2-1")]
    table = results(root, "--only", "framework=megatron", check=True).stdout
    assert "3b-tp2-1" in table and "800m-ddp" not in table and "5 left out by --only" in table


@pytest.mark.parametrize("args, message", [
    (["--only", "scale"], "expected KEY=VALUE"),
    (["--only", "scael=3B"], "did you mean 'scale'"),
    (["--only", "scale=9B"], "scale='9B' is not valid"),
    (["--only", "status=fine"], "status is one of ok, oom"),
    (["--sort", "speed"], "--sort 'speed': not a column"),
    (["--csv", "-", "--json"], "give one of them"),
])
def test_bad_options_are_one_line_errors(tmp_path, args, message):
    root = write_records(tmp_path / "runs")
    proc = results(root, *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_csv_and_json_parse_back_with_the_recorded_numbers(tmp_path):
    root = write_records(tmp_path / "runs")
    out = tmp_path / "out" / "results.csv"
    proc = results(root, "--csv", out, check=True)
    assert f"wrote {out}" in proc.stderr and proc.stdout == ""
    rows = {(r["sweep_dir"], r["run_id"]): r for r in csv_rows(out.read_text())}
    assert len(rows) == len(RECORDS)
    for sweep, rec in RECORDS:
        row = rows[(f"runs/{sweep}", rec.run_id)]
        for key, want in (("mfu", rec.mfu), ("samples_per_s", rec.samples_per_s), ("step_time_s", rec.step_time_s),
                          ("peak_mem_gib", rec.peak_mem_gib)):
            assert (float(row[key]) if row[key] else None) == want, (rec.run_id, key)
        assert (int(row["nodes"]), int(row["gpus"]), row["status"]) == (rec.nodes, rec.world_size, rec.status)
        # cost: the run's GPUs held for a million samples at its throughput
        cost = rec.world_size * 1e6 / rec.samples_per_s / 3600 if rec.samples_per_s else None
        assert (float(row["gpu_h_per_1m_samples"]) if row["gpu_h_per_1m_samples"] else None) == pytest.approx(cost)
        assert row["date"] == rec.env.time and row["path"] == str(root / sweep / rec.run_id / "result.json")
    assert rows[("runs/sweep-a", "3b-tp2-1")]["error"] == "oom at step 3"
    data = json.loads(results(root, "--json", "--only", "scale=3B", check=True).stdout)
    assert [(d["run_id"], d["mfu"], d["peak_mem_gib"]) for d in data] == [("3b-fsdp2-1", 0.45, 77.5),
                                                                          ("3b-tp2-1", None, 139.0)]


def test_an_unreadable_record_is_named_and_the_rest_kept(tmp_path):
    root = write_records(tmp_path / "runs")
    broken = root / "sweep-b" / "broken-run" / "result.json"
    broken.parent.mkdir(parents=True)
    broken.write_text('{"run_id": "broken-run", "status": "ok", "mfu": 0.4')  # cut short
    proc = results(root, "--only", "scale=800M", check=True)
    assert proc.stdout.count("800m-ddp-") == 3 and "unreadable" in proc.stdout
    assert f"unreadable: {broken}: unreadable result record" in proc.stdout
    rows = csv_rows(results(root, "--csv", "-", check=True).stdout)
    assert len(rows) == len(RECORDS) + 1
    assert rows[-1]["status"] == "unreadable" and rows[-1]["path"] == str(broken) and "Expecting" in rows[-1]["error"]
    proc = results(root, "--json")
    assert proc.returncode == 0 and f"unreadable record: {broken}" in proc.stderr.replace("\n", "")
    assert len(json.loads(proc.stdout)) == len(RECORDS) + 1


def test_a_folder_without_records_is_an_error(tmp_path):
    root = write_records(tmp_path / "runs")
    (empty := tmp_path / "empty" / "sub").mkdir(parents=True)
    for args in ([empty.parent], [root, empty.parent]):
        proc = results(*args)
        assert proc.returncode == 2 and proc.stdout == ""
        assert proc.stderr.strip() == f"error: {empty.parent}: no result records (result.json) in it or below it: " \
                                      "give a sweep or run directory"
    proc = results(tmp_path / "nowhere")
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr


def test_record_text_is_printed_literally(tmp_path):
    root = tmp_path / f"runs{MARKUP}"
    record(f"run-{MARKUP}", framework=XSS, status="error", error=f"{MARKUP} {XSS}").save(root / "s[red]" / "r1")
    record("plain").save(root / "s[red]" / "r2")
    proc = results(root, check=True)
    assert f"run-{MARKUP}" in proc.stdout and XSS in proc.stdout and "s[red]" in proc.stdout
    rows = csv_rows(results(root, "--csv", "-", check=True).stdout)
    assert {r["error"] for r in rows} == {f"{MARKUP} {XSS}", ""}
    bad = root / "s[red]" / "[bold]bad" / "result.json"
    bad.parent.mkdir()
    bad.write_text("[bold]not json")
    proc = results(root, check=True)
    assert f"unreadable: {bad}" in proc.stdout


def test_the_setting_that_tells_two_rows_apart_is_shown_and_columns_chooses(tmp_path):
    """Two runs of one scale, layout and size that differ in ac and compile: both columns appear
    after parallelism (they did not: the rows looked the same); --columns picks the table's columns
    and any run setting, in order, for the table, CSV and JSON; a column that does not exist is one line."""
    root = tmp_path / "runs"
    record("a", ac="full", compile=True, mfu=0.30).save(root / "a")
    record("b", mfu=0.40).save(root / "b")
    header = next(line for line in results(root, check=True).stdout.splitlines() if "┃" in line)
    names = [c.strip() for c in header.split("┃")[1:-1]]
    assert names[names.index("parallelism") + 1:names.index("nodes")] == ["compile", "ac"], names
    rows = csv_rows(results(root, "--csv", "-", check=True).stdout)
    assert {(r["run_id"], r["compile"], r["ac"]) for r in rows} == {("a", "True", "full"), ("b", "False", "none")}
    rows = csv_rows(results(root, "--columns", "run_id,ac", "--columns", "micro_batch,mfu", "--csv", "-",
                            check=True).stdout)
    assert list(rows[0]) == ["run_id", "ac", "micro_batch", "mfu", "error", "path"]
    table = results(root, "--columns", "run_id,ac,mfu", check=True).stdout
    header = next(line for line in table.splitlines() if "┃" in line)
    assert [c.strip() for c in header.split("┃")[1:-1]] == ["run id", "ac", "MFU"]
    data = json.loads(results(root, "--columns", "run_id,compile", "--json", check=True).stdout)
    assert {(d["run_id"], d["compile"]) for d in data} == {("a", True), ("b", False)}
    bad = results(root, "--columns", "run_id,acc")
    assert bad.returncode == 2 and "--columns: unknown column 'acc' (did you mean 'ac'?)" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
