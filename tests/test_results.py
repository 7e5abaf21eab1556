import json

import pytest
import torch

from conftest import FIXTURES
from echobench.train.bench_record import start_record
from echobench.records.config import RunConfig
from echobench.records.results import (
    SCHEMA_VERSION,
    Record,
    load_records,
    originating_failure,
    records_frame,
)
from test_report import record, write


def test_newest_record_per_run_wins_and_corrupt_ones_are_reported(tmp_path):
    def rec(run_id, time, mfu, status="ok"):
        return record(run_id, gpus_per_node=1, samples_per_s=2.0, mfu=mfu, status=status, time=time)

    write(tmp_path / "old", rec("a", "2026-01-01T00:00:00", 0.1))
    write(tmp_path / "new", rec("a", "2026-02-01T00:00:00", 0.2))
    write(tmp_path / "new", rec("b", "2026-02-01T00:00:00", None, "oom"))
    (tmp_path / "new" / "c").mkdir()
    (tmp_path / "new" / "c" / "result.json").write_text('{"run_id": "c", "sta')
    (tmp_path / "new" / "d").mkdir()
    (tmp_path / "new" / "d" / "result.json").write_text(json.dumps({"hello": 1}))
    records, problems = load_records([tmp_path / "old", tmp_path / "new"])
    by_id = {r.run_id: r for r in records}
    assert set(by_id) == {"a", "b"} and by_id["a"].mfu == 0.2
    assert len(problems) == 2 and any("c/result.json" in p for p in problems)
    frame = records_frame(records)
    assert len(frame) == 2 and set(frame["status"]) == {"ok", "oom"}
    assert frame.set_index("run_id").loc["a", "samples_per_s_per_gpu"] == 2.0


def test_the_originating_failure_explains_a_multi_rank_run():
    peer = {"rank": 0, "status": "error", "error": "rank 0: Connection closed by peer", "failed_at": 20.0}
    cause = {"rank": 1, "status": "error", "error": "rank 1: injected failure", "failed_at": 10.0}
    assert originating_failure([peer, cause]) is cause
    oom = {"rank": 1, "status": "oom", "error": "rank 1: out of memory", "failed_at": 30.0}
    assert originating_failure([peer, cause, oom]) is oom


def test_over_repeats_leaves_out_missing_and_non_finite_values():
    from echobench.records.results import over_repeats

    assert over_repeats([2.0, None, float("nan"), float("inf"), 4.0, float("-inf")]) == {
        "median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert over_repeats([float("inf")]) is None


# ---- the typed record: save, load, validation, older versions ----

def started(**settings) -> Record:
    cfg = RunConfig(scale="tiny", device="cpu", peak_tflops=1.0, steps=3, **settings)
    return start_record(cfg, torch.device("cpu"))


def test_a_record_saves_and_loads_to_the_same_record(tmp_path):
    rec = started(micro_batch=2).update(
        status="ok", step_times_s=[0.1, 0.2, float("nan")], mfu=0.25, measured_model_flops=10**18,
        losses=[1.5, float("inf")], flops_breakdown={"params": {"trainable": 12}},
        per_rank=[{"rank": 0, "hostname": "h", "memory": {"peak_rss_gib": 1.0}, "losses": [1.5]}])
    path = rec.save(tmp_path / "run")
    assert path == tmp_path / "run" / "result.json"
    back = Record.load(path)
    # NaN is not equal to itself: compare the JSON both write
    assert json.dumps(back.model_dump()) == json.dumps(rec.model_dump()) and back.path == path
    assert back.measured_model_flops == 10**18 and back.per_rank[0].memory == {"peak_rss_gib": 1.0}
    assert back.env.device_name.startswith("CPU") and back.precision == "fp32" and back.config["micro_batch"] == 2
    assert [p.name for p in tmp_path.joinpath("run").iterdir()] == ["result.json"]  # no temp file left


def test_records_written_before_the_typed_record_still_load():
    """record-v2.json: `echobench run` of commit 5729728 (the --peak-tflops 1 run of record-v1.json);
    record-v2-stub.json: its results.stub_record for a job that timed out (settings at the top
    level, te the setting "auto")."""
    ok = Record.load(FIXTURES / "record-v2.json")
    raw = json.loads((FIXTURES / "record-v2.json").read_text())
    assert ok.status == "ok" and ok.migrated_from == 2
    assert (ok.mfu, ok.step_times_s, ok.te, ok.data_wait_clock) == (raw["mfu"], raw["step_times_s"], False, "host")
    stub = Record.load(FIXTURES / "record-v2-stub.json")
    assert (stub.status, stub.te, stub.precision, stub.config["device"]) == ("timeout", None, "auto", "cpu")
    assert stub.env.recorded_by.startswith("echobench sweep")


def test_a_version_2_record_s_sdpa_backends_become_predicted():
    """record-v2-sdpa.json: `echobench run --scale tiny --steps 3 --warmup-steps 1 --micro-batch 2
    --audio-frames 64 --text-tokens 16 --speaker-frames 64 --device cpu --peak-tflops 1` of commit
    205cd9a: its sdpa_backends were torch's choice asked after the run, not kernels seen running."""
    raw = json.loads((FIXTURES / "record-v2-sdpa.json").read_text())
    rec = Record.load(FIXTURES / "record-v2-sdpa.json")
    assert (rec.schema_version, rec.migrated_from) == (SCHEMA_VERSION, 2)
    assert rec.sdpa_backends_predicted == raw["sdpa_backends"] and rec.attention_kernels is None
    assert rec.compiles_in_window is None and rec.mfu == raw["mfu"]  # unknown, not zero


def test_a_version_1_record_migrates_on_load(tmp_path):
    rec = Record.load(FIXTURES / "record-v1.json")
    assert (rec.schema_version, rec.migrated_from) == (SCHEMA_VERSION, 1)
    assert rec.measured_samples == 6 and rec.peak_precision == "bf16"  # window figures and fields v1 lacked
    rec.save(tmp_path)  # saved, it is a current record: read back without migrating again
    assert Record.load(tmp_path / "result.json").model_dump() == rec.model_dump()


@pytest.mark.parametrize("version", [99, 0, "2"])
def test_a_record_of_an_unknown_version_is_named(tmp_path, version):
    path = write(tmp_path, record("a"))
    data = json.loads(path.read_text()) | {"schema_version": version}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as exc:
        Record.load(path)
    assert str(exc.value) == (f"{path}: schema_version {version!r} is not one this echobench reads (1 to "
                              f"{SCHEMA_VERSION}): a newer echobench wrote it, or it is not a result record")


@pytest.mark.parametrize("change, message", [
    ({"micro_batch": None}, "micro_batch: Input should be a valid integer"),
    ({"mfu": "fast"}, "mfu: Input should be a valid number, unable to parse string as a number (got 'fast')"),
    ({"status": "exploded"}, "status: Input should be 'ok', 'oom', 'error', 'timeout', 'cancelled', 'node_fail' or 'preempted'"),
    ({"per_rank": [{"hostname": "h"}]}, "missing per_rank.0.rank"),
    ({"env": None}, "env: Input should be a valid dictionary or instance of Env"),
])
def test_a_wrong_field_is_named_in_one_line(tmp_path, change, message):
    path = write(tmp_path, record("a"))
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    records, problems = load_records([tmp_path])
    assert records == [] and len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"{path}: invalid result record: {message}")


def test_a_missing_field_is_named(tmp_path):
    path = write(tmp_path, record("a"))
    data = json.loads(path.read_text())
    del data["world_size"], data["env"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"result.json: invalid result record: missing world_size, env$"):
        Record.load(path)


def test_a_writer_cannot_set_an_unknown_field_or_a_wrong_type():
    rec = started()
    with pytest.raises(ValueError, match="mfu_typo"):
        rec.update(mfu_typo=0.5)
    with pytest.raises(ValueError, match="status"):
        rec.status = "finished"
    assert rec.status == "error"
