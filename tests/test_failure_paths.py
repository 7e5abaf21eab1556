"""Failure paths, as a user meets them: text from outside printed verbatim (never read as rich
markup), node ranks >= 1 that fail, corrupt records, `--out` where nothing can be written."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from conftest import ROOT, TINY_CARD, cli_env, run_cli, two_launchers
from echobench.records.atomic import write_json_atomic
from echobench.records.config import RunConfig
from echobench.sweep.matrix import expand, parse_matrix
from echobench.records.results import Record

TINY = {"scale": "tiny", "steps": 2, "warmup_steps": 1, "micro_batch": 1, "audio_frames": 50, "text_tokens": 16,
        "speaker_frames": 40}
TINY_ARGS = [a for k, v in TINY.items() for a in (f"--{k.replace('_', '-')}", str(v))]
# The launched runs whose failures are the launcher's, whatever it trains: a model card's tiny decoder.
CARD_ARGS = ["--card", TINY_CARD, "--steps", "2", "--warmup-steps", "1", "--micro-batch", "1"]
# Rich would read each as markup: a closing tag with no opening one (a MarkupError, as in gloo's
# "[/__w/pytorch/.../pair.cc:537]"), a style, a hyperlink.
MARKUP = "no-tok-[/x]-[bold]-[link=http://x]"


def flat(table_text: str) -> str:
    """A rich table's text with borders, spaces and line breaks removed: folded cells join up."""
    return table_text.replace("│", "").replace(" ", "").replace("\n", "")


def one_line_error(proc) -> str:
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "Traceback" not in err and len(err.splitlines()) == 1, proc.stderr
    return err


# ---- 1. outside text is data, never markup ----

def test_outside_text_passes_verbatim_through_run_sweep_and_status(cli, tmp_path):
    # `run`: the record's error names the tokenizer as given, markup and all.
    out = tmp_path / "run"
    proc = cli("run", *TINY_ARGS, "--peak-tflops", "1", "--tokenizer", MARKUP, "--out", out)
    error = json.loads((out / "result.json").read_text())["error"]
    assert MARKUP in error
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and error in proc.stderr, proc.stderr

    # `sweep`: the log line of the failed run, then sweep.json settled and results.csv written.
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({"name": "t", "executor": "local", "hardware": {"peak_tflops": 1},
                                  "defaults": TINY, "include": [{"tokenizer": MARKUP}]}))
    sweep = tmp_path / "sweep"
    proc = cli("sweep", matrix, "--out", sweep)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert MARKUP in proc.stdout
    (entry,) = json.loads((sweep / "sweep.json").read_text())["runs"].values()
    assert entry["settled"] and entry["state"] == "error"
    assert (sweep / "results.csv").exists()

    # `status`: the error column; exit 1, a run failed.
    proc = cli("status", sweep)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert MARKUP in flat(proc.stdout), proc.stdout


LONG_ERROR = ("rank 1: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
              "[127.0.0.1]:41234 while all-reducing the gradients of step 7 " + "x" * 200)


def runs_with_errors(root: Path) -> Path:
    for rid, status, error in (("r1", "error", LONG_ERROR), ("r2", "ok", ""), ("r3", "timeout", "time limit")):
        Record.without_run(RunConfig(), status, error).update(run_id=rid).save(root / rid)
    return root


def test_status_exits_1_when_a_run_failed_as_its_help_says(cli, tmp_path):
    """A CI step can gate on `status`: 0 while no run failed, 1 once one has."""
    runs = tmp_path / "runs"
    Record.without_run(RunConfig(), "ok", "").update(run_id="r2").save(runs / "r2")
    assert cli("status", runs).returncode == 0
    Record.without_run(RunConfig(), "oom", "out of memory").update(run_id="r4").save(runs / "r4")
    assert cli("status", runs).returncode == 1
    assert "1 when any has: its record says error, oom, timeout" in " ".join(cli("status", "--help").stdout.split())


def test_status_only_lists_the_runs_with_those_settings(cli, tmp_path):
    """--only KEY=VALUE on status as on plan / sweep: in a directory of records, and in a sweep (each
    run's run.yaml); a failed run it leaves out does not fail the exit code."""
    runs = tmp_path / "runs"
    Record.without_run(RunConfig(scale="tiny", micro_batch=2), "ok", "").update(run_id="mb2").save(runs / "mb2")
    Record.without_run(RunConfig(scale="tiny", micro_batch=4), "oom", "x").update(run_id="mb4").save(runs / "mb4")
    proc = cli("status", runs, "--only", "micro_batch=2", "--json")
    assert proc.returncode == 0 and [r["run_id"] for r in json.loads(proc.stdout)] == ["mb2"]
    sweep = tmp_path / "sweep"
    for rid, cfg in (("a", RunConfig(scale="tiny", micro_batch=2)), ("b", RunConfig(scale="tiny", ac="full"))):
        (sweep / rid).mkdir(parents=True)
        (sweep / rid / "run.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
        Record.without_run(cfg, "ok", "").update(run_id=rid).save(sweep / rid)
    rows = json.loads(cli("status", sweep, "--only", "ac=full", "--json").stdout)
    assert [r["run_id"] for r in rows] == ["b"]
    assert "--only 'acc=full'" in one_line_error(cli("status", sweep, "--only", "acc=full"))


def test_report_only_keeps_the_runs_with_those_settings(cli, tmp_path):
    fixture = json.loads((ROOT / "tests" / "fixtures" / "record-v2.json").read_text())
    for rid, ac in (("a", "none"), ("b", "full")):
        record = {**fixture, "run_id": rid, "ac": ac, "config": {**fixture["config"], "ac": ac}}
        (tmp_path / "runs" / rid).mkdir(parents=True)
        (tmp_path / "runs" / rid / "result.json").write_text(json.dumps(record))
    both = cli("report", tmp_path / "runs", "--table", "csv", check=True).stdout
    assert len(both.strip().splitlines()) == 3  # a row per configuration
    cli("report", tmp_path / "runs", "-o", tmp_path / "r.html", "--only", "ac=full", check=True)
    import csv

    rows = list(csv.DictReader((tmp_path / "r.runs.csv").open()))
    assert [r["run_id"] for r in rows] == ["b"]


def test_status_prints_each_error_whole_on_one_line_in_a_log(cli, tmp_path):
    """Not a terminal (a pipe, a CI log): the errors under the table, each on one line, in full."""
    proc = cli("status", runs_with_errors(tmp_path / "runs"))
    assert proc.returncode == 1, proc.stderr  # runs failed
    lines = proc.stdout.splitlines()
    assert f"r1: {LONG_ERROR}" in lines and "r3: time limit" in lines
    assert "1 error, 1 ok, 1 timeout" in lines


def test_status_in_a_narrow_terminal_cuts_errors_at_its_width(tmp_path):
    """A 60-column terminal (a real pty): every line fits, each error is one line ending in an
    ellipsis, and --json has the full text."""
    import fcntl
    import pty
    import struct
    import termios

    runs = runs_with_errors(tmp_path / "runs")
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 60, 0, 0))
    env = {**cli_env(tmp_path), "TERM": "xterm"}  # rich takes a "dumb" one for 80 columns
    env.pop("COLUMNS", None)
    proc = subprocess.Popen([sys.executable, "-m", "echobench", "status", str(runs)], stdin=follower, stdout=follower,
                            stderr=follower, env=env, cwd=ROOT, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.wait(timeout=120) == 1  # runs failed
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07", "", b"".join(chunks).decode())  # colours, links
    lines = text.replace("\r", "").splitlines()
    assert lines and all(len(line) <= 60 for line in lines), lines
    (error_line,) = [line for line in lines if line.startswith("r1: ")]
    assert error_line.endswith("…") and LONG_ERROR.startswith(error_line[4:-1]), error_line
    proc = run_cli("status", runs, "--json", tmp_path=tmp_path)
    assert proc.returncode == 1 and {r["run_id"]: r["error"] for r in json.loads(proc.stdout)}["r1"] == LONG_ERROR


def test_progress_table_shows_outside_text_verbatim():
    # The sweep's log lines are checked through a real sweep's output (the test above).
    from echobench.sweep import loop as sw

    console = Console(record=True, width=300)
    console.print(sw.SweepProgress(console).table([("run-1", "error", MARKUP)]))
    text = console.export_text()
    assert text.count(MARKUP) == 1, text


def test_bad_input_naming_markup_is_a_verbatim_one_line_error(cli, tmp_path):
    proc = cli("run", "--scale", "[bold]X[/x]", "--out", tmp_path / "x")
    assert "scale='[bold]X[/x]' is not valid" in one_line_error(proc)


# ---- 2. a failure on node rank >= 1 ----

def ddp_on_two_nodes(tmp_path: Path, *extra: str) -> tuple[list[int], list[str], dict]:
    """One tiny DDP run (a card's decoder) of two launchers (node ranks 0 and 1, one process each) on this machine:
    (their exit codes, their outputs, the run's record)."""
    out = tmp_path / "run"
    codes, outputs = two_launchers([*CARD_ARGS, "--peak-tflops", "1", "--parallelism", "ddp", *extra, "--out", out],
                                   {**cli_env(tmp_path), "OMP_NUM_THREADS": "1"}, timeout=300)
    return codes, outputs, json.loads((out / "result.json").read_text())


def test_a_failing_rank_on_node_1_fails_both_launchers(tmp_path):
    """Rank 1 fails at its first step. Each launcher exits non-zero (srun's --kill-on-bad-exit
    needs that) and the record is an error naming rank 1."""
    codes, outputs, record = ddp_on_two_nodes(tmp_path, "--fail-at-step", "0", "--fail-rank", "1")
    assert codes[0] != 0 and codes[1] != 0, (codes, outputs[1][-3000:])
    assert record["status"] == "error" and "rank 1" in record["error"] and "injected failure at step 0" in record["error"]
    assert record["cause_rank"] == 1
    for rank, output in enumerate(outputs):  # each said, before it waited, where it waits for the other
        assert f"echobench: node {rank} of 2: waiting for the other nodes at 127.0.0.1:" in output, output[-3000:]


def test_a_failed_run_says_its_cause_last_and_keeps_torchruns_traceback_in_the_launchers_log(cli, tmp_path):
    """Rank 1 of 2 fails: stderr ends with echobench's line on the cause, after one line naming the
    launcher's log; torchrun's ChildFailedError traceback and its "failed (exitcode" line are in that
    log, not on stderr."""
    out = tmp_path / "run"
    proc = cli("run", *CARD_ARGS, "--peak-tflops", "1", "--parallelism", "ddp", "--nproc", "2", "--fail-at-step", "1",
               "--fail-rank", "1", "--out", out, env={"OMP_NUM_THREADS": "1"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) >= 2, proc.stderr
    assert "ChildFailedError" not in proc.stderr and "failed (exitcode" not in proc.stderr, proc.stderr
    assert lines[-1].startswith("error: rank 1: InjectedFailure: injected failure at step 1"), proc.stderr
    log = out / "ranks" / "node-0.log"
    assert "workers failed (" in lines[-2] and lines[-2].endswith(f"torchrun's traceback: {log}"), proc.stderr
    assert "ChildFailedError" in log.read_text() and "failed (exitcode: 1)" in log.read_text()


def test_a_launcher_of_several_nodes_says_where_it_waits_before_it_does(capsys, monkeypatch):
    """torchrun prints nothing while it waits for the other nodes: the launcher says where, once."""
    from echobench.calibrate import commcalibrate
    from echobench.train.launch import torchrun_command

    cmd = torchrun_command(["--out", "o"], 1, 2, 0, None, 29511, Path("note.json"))
    assert "--master-addr=127.0.0.1" in cmd and "--node-rank=0" in cmd
    assert capsys.readouterr().err == ("echobench: node 0 of 2: waiting for the other nodes at 127.0.0.1:29511 "
                                       "(rendezvous; --master-addr names the first node)\n")
    torchrun_command(["--out", "o"], 2, 1, 0, None, 29500, Path("note.json"))  # one node: no one to wait for
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(subprocess, "call", lambda cmd, env=None: 0)
    assert commcalibrate.launch_node(["--device", "cpu"], 1, 3, 2, "node-a", 29512) == 0  # calibrate --comm's launcher
    assert capsys.readouterr().err.startswith("echobench: node 2 of 3: waiting for the other nodes at node-a:29512 ")


def test_a_cpu_runs_workers_are_forked_from_what_its_node_check_imports(tmp_path):
    """A CPU node imports torch and the run's backends once, in torchrun's forkserver, and forks its workers
    from it; a GPU run's workers (device cuda, or auto) are processes of their own, as torchrun starts them."""
    from echobench.train.launch import node_command
    from echobench.train.nodecheck import ECHO_IMPORTS, RUN_PATH

    def command(**settings):
        return node_command(RunConfig(**{"scale": "tiny", **settings}), tmp_path, 2, 1, 0, None, 29500)

    def preload(cmd):
        return next((a.removeprefix("--preload=").split(",") for a in cmd if a.startswith("--preload=")), None)

    echo = command(device="cpu")
    assert preload(echo) == [*RUN_PATH, *ECHO_IMPORTS] and "--start-method=forkserver" in echo
    assert echo[echo.index("--start-method=forkserver") + 1:][:2] == [str(ROOT / "echobench" / "__main__.py"), "run"]
    assert "megatron.core" in preload(command(device="cpu", framework="megatron", parallelism="tp2"))
    assert not set(ECHO_IMPORTS) & set(preload(command(device="cpu", card=str(TINY_CARD))))
    for device in ("cuda", "auto"):
        gpu = command(device=device)
        assert preload(gpu) is None and "--run-path" not in gpu and gpu[-7:-4] == ["-m", "echobench", "run"], gpu


def test_a_node_other_than_the_first_without_master_addr_is_refused(cli, tmp_path):
    """It would wait at its own 127.0.0.1 for ever: one line, before anything runs or is written."""
    from echobench.train.launch import torchrun_command

    with pytest.raises(ValueError, match=r"^--node-rank 1 of --nnodes 2 needs --master-addr: the host name or "
                                         r"address of the first node \(node rank 0\), where the nodes meet$"):
        torchrun_command([], 1, 2, 1, None, 29500, Path("note.json"))
    out = tmp_path / "out"
    for args in (["run", *TINY_ARGS, "--parallelism", "ddp", "--nproc", "1", "--out", out],
                 ["calibrate", "--comm", "--nproc", "1"]):
        err = one_line_error(cli(*args, "--nnodes", "2", "--node-rank", "1"))
        assert "--node-rank 1 of --nnodes 2 needs --master-addr" in err, err
    assert not out.exists()


@pytest.mark.parametrize("step", [1, -1])
def test_a_worker_killed_by_a_signal_is_the_rank_named(tmp_path, step):
    """Rank 1 (node 1) is SIGKILLed mid-run (step 1) or at start-up (-1): it writes nothing, and
    rank 0 then fails with a broken connection (or times out waiting for it). The record names
    rank 1, its node and how it died, not the survivor's "connection reset by peer"."""
    config = tmp_path / "run.yaml"  # at start-up rank 0 waits for rank 1 until this (srun would stop it first)
    config.write_text("collective_timeout_s: 20\n")
    codes, outputs, record = ddp_on_two_nodes(tmp_path, "--config", str(config), "--fail-at-step", str(step),
                                              "--fail-rank", "1", "--fail-kind", "sigkill")
    assert codes[0] != 0 and codes[1] != 0, (codes, outputs[0][-3000:])
    assert record["status"] == "error" and record["cause_rank"] == 1, record["error"]
    assert record["error"].startswith("rank 1 (node 1, ") and "killed by SIGKILL (exit code -9)" in record["error"]
    dead = next(r for r in record["per_rank"] if r["rank"] == 1)
    assert (dead["signal"], dead["exit_code"], dead["node_rank"]) == ("SIGKILL", -9, 1)
    assert 1 in record["failed_ranks"]


def test_a_startup_failure_writes_a_record(cli, tmp_path):
    """fail_at_step -1: the failure point before the process group forms."""
    out = tmp_path / "run"
    proc = cli("run", *CARD_ARGS, "--peak-tflops", "1", "--fail-at-step", "-1", "--out", out)
    assert proc.returncode == 1, proc.stderr
    record = json.loads((out / "result.json").read_text())
    assert record["status"] == "error" and "rank 0" in record["error"] and "start-up" in record["error"]
    assert (out / "ranks" / "rank-0.json").exists()


def node_note(out: Path, node: int, *workers: tuple[int, int, str | None], at: float = 2.0) -> None:
    """RUN/ranks/node-K.json as echobench.train.torchrun writes it: (rank, exit code, signal) per worker."""
    write_json_atomic(out / "ranks" / f"node-{node}.json", {"host": f"host{node}", "ended": "workers failed", "at": at,
        "failures": [{"rank": r, "local_rank": 0, "pid": 100 + r, "exit_code": c, "signal": sig} for r, c, sig in workers]})


def test_a_signal_death_outranks_the_earlier_broken_connections_of_its_peers(tmp_path):
    """The survivors fail first ("connection reset" as the dead worker's sockets close); torchrun
    notices the death a moment later. The dead rank is the cause; a worker stopped by SIGTERM (a
    teardown) is not; an OOM anywhere still comes first."""
    from echobench.train.launch import rank_failures
    from echobench.records.results import originating_failure

    write_json_atomic(tmp_path / "ranks" / "rank-0.json", {
        "rank": 0, "status": "error", "failed_at": 1.0, "error": "rank 0: RuntimeError: [../gloo/transport/tcp/"
        "pair.cc:537] Read error [127.0.0.1]:3235: Connection reset by peer"})
    node_note(tmp_path, 0, (0, 1, None))  # rank 0 has its own file: that one is kept
    node_note(tmp_path, 1, (2, -9, "SIGKILL"), (3, -15, "SIGTERM"))
    failures = rank_failures(tmp_path)
    assert sorted(f["rank"] for f in failures) == [0, 2, 3]
    cause = originating_failure(failures)
    assert cause["rank"] == 2 and cause["error"] == ("rank 2 (node 1, host1, pid 102): killed by SIGKILL (exit code -9), "
                                                     "leaving no error of its own")
    assert originating_failure([f for f in failures if f["rank"] != 2])["rank"] == 0  # SIGTERM: a teardown
    oom = {"rank": 5, "status": "oom", "failed_at": 9.0, "error": "rank 5: OutOfMemoryError"}
    assert originating_failure([*failures, oom])["rank"] == 5
    record = Record.without_run(RunConfig(), "error", "").fail(failures)
    assert (record.cause_rank, record.failed_ranks) == (2, [0, 2, 3])
    assert next(r for r in record.per_rank if r.rank == 2).signal == "SIGKILL"


TWO_NODES = RunConfig(parallelism="ddp", nodes=2, gpus_per_node=1)


def test_a_job_killed_at_start_up_names_the_dead_rank_from_its_nodes_note(tmp_path):
    """srun stopped node 0 before anything was written there: node 1's torchrun note is all there is;
    rank 0, which left no word, was stopped with the run."""
    from echobench.sweep.executors import finish_without_record

    node_note(tmp_path, 1, (1, -9, "SIGKILL"))
    record = finish_without_record(TWO_NODES, tmp_path, "error", "SLURM job 5 ended FAILED (exit 9:0)")
    assert record.status == "error" and record.cause_rank == 1 and record.failed_ranks == [0, 1]
    assert record.error.startswith("rank 1 (node 1, host1, pid 101): killed by SIGKILL (exit code -9)")
    stopped = next(r for r in record.per_rank if r.rank == 0)
    assert stopped.error == "rank 0 (node 0): stopped with the run, leaving no error of its own" and stopped.stopped


def test_a_job_that_died_without_a_record_names_the_rank_that_failed(tmp_path):
    """srun stops node 0's launcher when node 1's fails; should it die before it writes the record,
    the sweep's record is the one it would have written: the rank's error, from the file it left,
    not the job's exit code."""
    from echobench.sweep.executors import finish_without_record

    for run in (tmp_path, tmp_path / "timed-out"):
        write_json_atomic(run / "ranks" / "rank-1.json", {
            "rank": 1, "status": "error", "error": "rank 1: InjectedFailure: injected failure at start-up on rank 1",
            "traceback_tail": "Traceback ...", "failed_at": 1.0})
    record = finish_without_record(TWO_NODES, tmp_path, "error", "SLURM job 5: job exited with code 1 without writing a record")
    assert record.status == "error" and record.failed_ranks == [0, 1] and record.traceback_tail == "Traceback ..."
    assert record.error == "rank 1: InjectedFailure: injected failure at start-up on rank 1", record.error
    assert record.env.recorded_by.startswith("echobench sweep")
    # A verdict of the scheduler's that says more than "failed" is the status, said after the rank's error.
    timeout = finish_without_record(TWO_NODES, tmp_path / "timed-out", "timeout", "SLURM job 6 ended TIMEOUT")
    assert timeout.status == "timeout" and timeout.error.startswith("rank 1: InjectedFailure: injected failure at "
                                                                    "start-up on rank 1; SLURM job 6 ended TIMEOUT")


EXIT_PROCESS = """
import atexit, torch.distributed as dist
from echobench.train.distributed import exit_process, shutdown
exit_process(5)  # no group yet: returns
atexit.register(lambda: print("teardown ran"))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
shutdown()
print("record written", end="")  # unflushed: exit_process must flush it
exit_process(3)
"""


def test_a_process_that_had_a_group_exits_without_interpreter_teardown():
    """A gloo worker thread can abort Python's teardown (distributed.exit_process says why): a
    worker that had a process group leaves by os._exit, its output flushed, with its own code."""
    proc = subprocess.run([sys.executable, "-c", EXIT_PROCESS], capture_output=True, text=True, env=cli_env(),
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "record written"  # flushed, and no atexit handler ran


FORKED_EXIT = """
import multiprocessing


def worker(said):
    import torch.distributed as dist
    from echobench.train.distributed import exit_process, shutdown
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shutdown()
    exit_process(0)
    said.put("returned")


if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")
    said = context.Queue()
    child = context.Process(target=worker, args=(said,))
    child.start()
    print(said.get(timeout=60), end="")
    child.join(60)
    raise SystemExit(child.exitcode)
"""


def test_a_forked_worker_that_had_a_group_returns_to_multiprocessing(tmp_path):
    """A worker forked by torchrun's multiprocessing (a CPU run's, launch.rank_preload) must return from
    its entry point: torchrun waits for the return value, and multiprocessing ends the process without
    the interpreter's teardown anyway. os._exit there would leave torchrun waiting for ever."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED_EXIT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=cli_env(), cwd=ROOT,
                          timeout=240)
    assert (proc.returncode, proc.stdout) == (0, "returned"), proc.stderr[-2000:]


@pytest.mark.parametrize("text, problem", [
    ("name: t\naxes:\n  scale: [800M, 3B\ndefaults: {steps: 3}\n",
     "line 4, column 9: expected ',' or ']', but got ':' (while parsing a flow sequence that starts at line 3)"),
    ("name: t\n\tdefaults: {steps: 3}\n",
     "line 2, column 1: found character '\\t' that cannot start any token (while scanning for the next token)"),
    ("steps: 3\n  warmup_steps: 1\n", "line 2, column 15: mapping values are not allowed here"),
])
@pytest.mark.parametrize("command", ["plan", "run"])
def test_a_yaml_syntax_error_is_one_line_with_its_line_and_column(cli, tmp_path, text, problem, command):
    """PyYAML's own message is several lines with a caret under a copy of the text."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    args = ["plan", path] if command == "plan" else ["run", "--config", path, "--out", tmp_path / "x"]
    where = f"{path}" if command == "plan" else f"--config {path}"
    assert one_line_error(cli(*args)) == f"error: {where}: not valid YAML: {problem}"


def test_fail_at_step_below_minus_one_is_refused(cli, tmp_path):
    assert "fail_at_step=-2" in one_line_error(cli("run", "--scale", "tiny", "--fail-at-step", "-2", "--out", tmp_path / "x"))


# ---- 8. a SLURM sweep without a peak ----

def test_a_slurm_sweep_without_a_peak_submits_one_calibration_job_that_only_peakless_runs_wait_for(
        cli, tmp_path, monkeypatch):
    """Against a stand-in sbatch that logs its arguments (the real cluster: tests/test_slurm.py)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" >>"{calls}"\necho $((100 + $(wc -l <"{calls}")))\n')
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({"name": "t", "executor": "slurm", "slurm": {"request_gpus": False},
                                  "defaults": TINY, "include": [{"seed": 1}, {"seed": 2, "peak_tflops": 3}]}))
    sweep = tmp_path / "sweep"
    proc = cli("sweep", matrix, "--out", sweep, "--no-wait", "--no-preflight")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, *jobs = calls.read_text().splitlines()
    assert first.endswith(f"{sweep}/calibrate.sh") and "calibrating once on a compute node (job 101" in proc.stdout
    waits = {job.split()[-1].split("/")[-2]: "--dependency=afterany:101" in job for job in jobs}
    by_seed = {yaml.safe_load((sweep / rid / "run.yaml").read_text())["seed"]: w for rid, w in waits.items()}
    assert by_seed == {1: True, 2: False}


# ---- 4. a corrupt current record ----

def corrupt_sweep(tmp_path: Path) -> tuple[Path, Path, str]:
    """A sweep directory whose run has a failed first attempt under attempts/1 and a corrupt
    current record (as a full disk or a hand edit leaves it)."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({"name": "t", "executor": "local", "hardware": {"peak_tflops": 1}, "defaults": TINY}))
    (run,) = expand(parse_matrix(matrix.read_text(), matrix)).runs
    sweep = tmp_path / "sweep"
    rd = sweep / run.id
    Record.without_run(run.cfg, "error", "the first attempt failed").save(rd / "attempts" / "1")
    (rd / "run.yaml").write_text(json.dumps(run.cfg.to_dict()))
    write_json_atomic(sweep / "sweep.json", {"matrix": "t", "runs": {run.id: {
        "executor": "local", "attempt": 2, "job_id": "local-1", "settled": True, "state": "ok"}}})
    (rd / "result.json").write_text('{"run_id": "truncat')
    return matrix, sweep, run.id


def test_status_names_a_corrupt_record(cli, tmp_path):
    _, sweep, rid = corrupt_sweep(tmp_path)
    proc = cli("status", sweep)
    assert proc.returncode == 1 and "1 corrupt" in proc.stdout, proc.stdout
    assert f"{rid}/result.json" in flat(proc.stdout)


def test_sweep_names_a_corrupt_record_and_does_not_rerun_it_silently(cli, tmp_path):
    matrix, sweep, rid = corrupt_sweep(tmp_path)
    proc = cli("sweep", matrix, "--out", sweep)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 to run" in proc.stdout and "corrupt" in proc.stdout and "submitted" not in proc.stdout
    assert f"{rid}/result.json" in proc.stdout.replace("\n", "")
    assert (sweep / rid / "result.json").read_text() == '{"run_id": "truncat'  # the evidence stays


def test_report_never_takes_an_attempt_for_the_current_record(cli, tmp_path):
    _, sweep, rid = corrupt_sweep(tmp_path)
    proc = cli("report", sweep, "--table", "csv")
    assert proc.returncode == 0, proc.stderr
    assert f"{rid}/result.json" in proc.stderr and "unreadable" in proc.stderr
    from echobench.report import load_report_input

    data = load_report_input([sweep])
    assert data.records == [] and any(f"{rid}/result.json" in p for p in data.problems)
    # An attempts directory given by itself is read as what it is.
    assert [r.error for r in load_report_input([sweep / rid / "attempts" / "1"]).records] == ["the first attempt failed"]


def test_a_job_that_ends_beside_a_corrupt_record_keeps_it(tmp_path):
    from echobench.sweep.executors import finish_without_record

    (tmp_path / "result.json").write_text("{not json")
    record = finish_without_record(RunConfig(), tmp_path, "timeout", "SLURM job 7 ended TIMEOUT")
    assert record.status == "timeout" and "corrupt" in record.error
    assert (tmp_path / "result.json.corrupt").read_text() == "{not json"
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "timeout"


# ---- 6. --out where nothing can be written ----

@pytest.mark.parametrize("command", [
    ["run", "--scale", "tiny"],
    ["data", "synth"],
])
@pytest.mark.parametrize("where", ["file", "under-file"])
def test_out_on_a_file_is_a_one_line_error(cli, tmp_path, command, where):
    existing = tmp_path / "existing"
    existing.write_text("x")
    target = existing if where == "file" else existing / "sub"
    err = one_line_error(cli(*command, "--out", target))
    assert str(target) in err and "--out" in err
    assert existing.read_text() == "x"


def test_sweep_and_report_out_on_a_file_are_one_line_errors(cli, tmp_path):
    existing = tmp_path / "existing"
    existing.write_text("x")
    matrix = tmp_path / "m.yaml"
    matrix.write_text(json.dumps({"name": "t", "executor": "local", "hardware": {"peak_tflops": 1}, "defaults": TINY}))
    for target in (existing, existing / "sub"):
        assert str(target) in one_line_error(cli("sweep", matrix, "--out", target))
    runs = tmp_path / "runs"
    Record.without_run(RunConfig(), "error", "x").save(runs / "r")
    for target in (existing / "report.html", tmp_path):  # under a file; an existing directory
        assert str(target) in one_line_error(cli("report", runs, "-o", target))
    assert existing.read_text() == "x"


@pytest.mark.parametrize("args, said", [
    (["run", "--steps", "abc"], "error: Invalid value for '--steps'"),
    (["run", "--bogus"], "error: No such option: --bogus"),
    (["calibrate", "--comm", "--nproc", "0"], "error: Invalid value for '--nproc'"),
    (["nosuch"], "error: No such command 'nosuch'"),
    (["compare"], "error: Missing argument"),
])
def test_a_usage_error_is_one_error_line_naming_the_help(args, said):
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    text = proc.stderr.strip()
    assert text.startswith(said) and "--help` lists them)" in text and "╭" not in proc.stderr


def test_the_installed_command_is_the_one_that_formats_usage_errors():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"echobench": "echobench.cli:main"}


def test_sweep_progress_shows_what_each_run_last_said(tmp_path):
    """On a terminal the sweep's table gives a running run's newest progress line (from its log's
    tail, srun's rank label and all), a finished run's MFU from its record, and a bar of the runs
    finished; log text is printed verbatim."""
    from echobench.records.console import SweepProgress

    running, done = tmp_path / "a", tmp_path / "b"
    (running / "logs").mkdir(parents=True)
    (running / "logs" / "slurm-7.out").write_text(
        "0: [echobench] warm-up: 1 shape\n" + "noise\n" * 5000
        + f"0: [echobench] step 12/40 measured, loss 1.2, MFU 31.0% {MARKUP}\n0: other output\n")
    record = Record.without_run(RunConfig(), "ok", "")
    record.mfu, record.samples_per_s = 0.4567, 12.5
    record.save(done)
    console = Console(record=True, width=300)
    console.print(SweepProgress(console).table([("a", "running", "job 7", running), ("b", "ok", "", done),
                                          ("c", "queued", "", None)]))
    text = console.export_text()
    assert f"step 12/40 measured, loss 1.2, MFU 31.0% {MARKUP}" in text and "warm-up" not in text
    assert "MFU 45.7%, 12.5 samples/s" in text and "1/3 finished" in text
