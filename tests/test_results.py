import json

from echobench.results import load_records, records_frame, write_json_atomic


def rec(run_id, time, mfu, status="ok"):
    return {"run_id": run_id, "status": status, "mfu": mfu, "world_size": 1, "samples_per_s": 2.0,
            "env": {"time": time, "device_name": "X"}}


def test_newest_record_per_run_wins_and_corrupt_ones_are_reported(tmp_path):
    write_json_atomic(tmp_path / "old" / "a" / "result.json", rec("a", "2026-01-01T00:00:00", 0.1))
    write_json_atomic(tmp_path / "new" / "a" / "result.json", rec("a", "2026-02-01T00:00:00", 0.2))
    write_json_atomic(tmp_path / "new" / "b" / "result.json", rec("b", "2026-02-01T00:00:00", None, "oom"))
    (tmp_path / "new" / "c").mkdir()
    (tmp_path / "new" / "c" / "result.json").write_text('{"run_id": "c", "sta')
    (tmp_path / "new" / "d").mkdir()
    (tmp_path / "new" / "d" / "result.json").write_text(json.dumps({"hello": 1}))
    records, problems = load_records([tmp_path / "old", tmp_path / "new"])
    by_id = {r["run_id"]: r for r in records}
    assert set(by_id) == {"a", "b"} and by_id["a"]["mfu"] == 0.2
    assert len(problems) == 2 and any("c/result.json" in p for p in problems)
    frame = records_frame(records)
    assert len(frame) == 2 and set(frame["status"]) == {"ok", "oom"}
    assert frame.set_index("run_id").loc["a", "samples_per_s_per_gpu"] == 2.0


def test_the_originating_failure_explains_a_multi_rank_run():
    from echobench.launch import originating_failure

    peer = {"rank": 0, "status": "error", "error": "rank 0: Connection closed by peer", "failed_at": 20.0}
    cause = {"rank": 1, "status": "error", "error": "rank 1: injected failure", "failed_at": 10.0}
    assert originating_failure([peer, cause]) is cause
    oom = {"rank": 1, "status": "oom", "error": "rank 1: out of memory", "failed_at": 30.0}
    assert originating_failure([peer, cause, oom]) is oom


def test_over_repeats_leaves_out_missing_and_non_finite_values():
    from echobench.results import over_repeats

    assert over_repeats([2.0, None, float("nan"), float("inf"), 4.0, float("-inf")]) == {
        "median": 3.0, "min": 2.0, "max": 4.0, "n": 2}
    assert over_repeats([float("inf")]) is None
