"""Preflight (issue 33): one short job in the matrix's exact environment before any run. Its checks
on their own (the NCCL transport read from real-looking NCCL_DEBUG=INFO lines, held against the
fabric; the CPU's all-reduce on gloo, which claims no NCCL transport; CPUs, numactl, interfaces,
imports), how its log is read and judged, and, on the local SLURM cluster, a preflight that fails
on a missing import (the sweep submits nothing and resumes after the fix). A passing one runs
before the main sweep of tests/test_slurm.py, which checks what its transport check said."""

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest

from conftest import TINY_CARD, run_cli
from test_slurm_submit import cluster  # noqa: F401 - a cluster that answers; this test's jobs scancelled after it
from echobench.train import nodecheck
from echobench.train.fabric import nccl_transport, transport_problem
from echobench.sweep.matrix import expand, parse_matrix
from echobench.sweep.preflight import parse_checks, preflight_spec, verdict

# What NCCL 2.2x prints with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET, one rank of a 2-node job each.
NCCL_IB = """\
gpu-001:12345:12345 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.1<0>
gpu-001:12345:12345 [0] NCCL INFO NET/Plugin: Plugin load returned 2 : libnccl-net.so: cannot open shared object file: No such file or directory : when loading libnccl-net.so
gpu-001:12345:12345 [0] NCCL INFO NET/Plugin: Using internal network plugin.
gpu-001:12345:12401 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB [2]mlx5_2:1/IB [3]mlx5_3:1/IB [RO]; OOB ib0:10.0.0.1<0>
gpu-001:12345:12401 [0] NCCL INFO Using network IB
gpu-001:12345:12401 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] via P2P/CUMEM/read
gpu-001:12345:12401 [0] NCCL INFO Channel 00/0 : 4[0] -> 0[0] [receive] via NET/IB/0/GDRDMA
gpu-001:12345:12401 [0] NCCL INFO Channel 00/0 : 0[0] -> 4[0] [send] via NET/IB/0/GDRDMA
"""
NCCL_SOCKET = """\
gpu-001:12345:12345 [0] NCCL INFO Bootstrap : Using eth0:10.1.0.1<0>
gpu-001:12345:12345 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so)
gpu-001:12345:12401 [0] NCCL INFO NET/IB : No device found.
gpu-001:12345:12401 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.1<0>
gpu-001:12345:12401 [0] NCCL INFO Using network Socket
gpu-001:12345:12401 [0] NCCL INFO Channel 00/0 : 4[0] -> 0[0] [receive] via NET/Socket/0
gpu-001:12345:12401 [0] NCCL INFO Channel 00/0 : 0[0] -> 4[0] [send] via NET/Socket/0
"""
NCCL_OFI = """\
nid001234:4567:4567 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v8)
nid001234:4567:4567 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.14.0
nid001234:4567:4567 [0] NCCL INFO NET/OFI Selected provider is cxi, fabric is cxi (found 4 nics)
nid001234:4567:4601 [0] NCCL INFO Using network AWS Libfabric
nid001234:4567:4601 [0] NCCL INFO Channel 00/0 : 4[0] -> 0[0] [receive] via NET/AWS Libfabric/0/GDRDMA
"""


@pytest.mark.parametrize("log, network", [(NCCL_IB, "IB"), (NCCL_SOCKET, "Socket"), (NCCL_OFI, "AWS Libfabric")])
def test_the_network_nccl_chose_is_read_from_its_info_lines(log, network):
    found = nccl_transport(log)
    assert found.network == network and found.via_net and found.label == f"NET/{network}"
    assert nccl_transport("\n".join(line for line in log.splitlines() if "via NET" not in line)).network == network


def test_a_network_that_does_not_fit_the_fabric_is_a_failure_naming_the_missing_device_or_plugin():
    socket = nccl_transport(NCCL_SOCKET)
    seen, fix = transport_problem("infiniband", socket)
    assert seen == "NCCL chose NET/Socket under fabric infiniband (NET/IB : No device found.)"
    assert "/dev/infiniband" in fix and "NCCL_IB_HCA" in fix
    seen, fix = transport_problem("slingshot", socket)
    assert seen.startswith("NCCL chose NET/Socket under fabric slingshot") and "aws-ofi-nccl" in fix
    assert 'com.hooks.aws_ofi_nccl.enabled = "true"' in fix
    assert transport_problem("infiniband", nccl_transport(NCCL_IB)) is None
    assert transport_problem("slingshot", nccl_transport(NCCL_OFI)) is None
    assert transport_problem("tcp", socket) is None and transport_problem(None, socket) is None  # takes any
    assert transport_problem("infiniband", nccl_transport("")) is None  # no line: said by the check


def test_the_transport_check_reads_nccls_lines_and_fails_only_across_nodes():
    check = nodecheck.transport_check(NCCL_SOCKET, "infiniband", "nccl", 2)
    assert check.ok is False and "NET/Socket" in check.detail and check.fix
    one_node = nodecheck.transport_check(NCCL_SOCKET, "infiniband", "nccl", 1)
    assert one_node.ok is True and one_node.seen == "NET/Socket"
    ok = nodecheck.transport_check(NCCL_IB, "infiniband", "nccl", 2)
    assert (ok.ok, ok.seen) == (True, "NET/IB")
    assert nodecheck.transport_check("", "infiniband", "nccl", 2).ok is False  # NCCL said no network


def test_the_preflights_collective_on_cpus_runs_gloo_and_claims_no_nccl_transport(tmp_path):
    """The preflight's own all-reduce (torchrun) on the CPU: the ranks report gloo, and the
    transport check says gloo and claims no NCCL network (seen stays empty: no record gets one),
    even under a fabric that would fail a NCCL sockets transport."""
    from types import SimpleNamespace

    spec = {"device": "cpu", "nproc": 1, "bytes": 1 << 12, "timeout_s": 300, "fabric": "infiniband"}
    collective, transport = nodecheck.collective_checks(spec, SimpleNamespace(nnodes=1, node_rank=0))
    assert collective.ok and "over 1 ranks on 1 node(s) (gloo)" in collective.detail, collective.detail
    assert transport.ok is None and transport.seen is None and transport.detail.startswith("gloo: "), transport


def test_cpus_numactl_and_interfaces(tmp_path, monkeypatch):
    few = nodecheck.check_cpus("1", 8)
    assert few.ok is False and "1 CPU(s) for 8 processes" in few.detail and "--cpus-per-task=64" in few.fix
    assert nodecheck.check_cpus("64", 8).ok and nodecheck.check_cpus(None, 8).ok is None
    monkeypatch.setenv("PATH", str(tmp_path))  # no numactl here
    missing = nodecheck.check_numactl("node")
    assert missing.ok is False and "needs the numactl command" in missing.detail and "numactl" in missing.fix
    (tmp_path / "numactl").write_text("#!/bin/sh\n")
    (tmp_path / "numactl").chmod(0o755)
    assert nodecheck.check_numactl("node").ok and nodecheck.check_numactl(None).ok is None
    names = {"lo", "eth0", "ib0", "hsn0", "hsn1"}
    assert nodecheck.interfaces_missing("hsn", names, prefixes=True) == []
    assert nodecheck.interfaces_missing("=hsn", names, prefixes=True) == ["hsn"]
    assert nodecheck.interfaces_missing("^lo,docker0", names, prefixes=True) == []
    assert nodecheck.interfaces_missing("ib0,ib1", names, prefixes=False) == ["ib1"]
    bad = nodecheck.check_interfaces({"GLOO_SOCKET_IFNAME": "no-such-if0"})
    assert bad.ok is False and "GLOO_SOCKET_IFNAME=no-such-if0: no such interface" in bad.detail


def test_the_rendezvous_check_names_an_address_that_does_not_resolve_and_the_fix():
    assert nodecheck.check_rendezvous("127.0.0.1").ok
    bad = nodecheck.check_rendezvous("node1.invalid")  # .invalid never resolves (RFC 6761)
    assert bad.ok is False and bad.detail.startswith("MASTER_ADDR node1.invalid does not resolve on this node")
    assert "slurm.rendezvous" in bad.fix


def test_the_import_check_names_each_module_that_does_not_import():
    check = nodecheck.check_imports(["json", "echobench_no_such_module", "yaml"])
    assert check.ok is False and "echobench_no_such_module: ModuleNotFoundError" in check.detail
    assert "pip install -e" in check.fix
    echo = list(nodecheck.ECHO_IMPORTS)
    assert nodecheck.backend_imports("megatron", "on") == [*echo, "megatron.core", "echobench.backends.megatron",
                                                           "transformer_engine.pytorch"]
    assert nodecheck.backend_imports("torchtitan", precision="fp8") == [*echo, "torchao.float8"]
    # a model card's decoder is no Echo: its nodes need no text encoder
    assert nodecheck.backend_imports("torchtitan", echo=False) == []
    assert nodecheck.backend_imports("megatron", echo=False) == ["megatron.core", "echobench.backends.megatron"]


def spec_of(text: str, executor: str = "slurm") -> dict:
    m = parse_matrix(text, "m.yaml")
    return preflight_spec(m, expand(m, executor).runs, executor)


def test_the_spec_asks_for_two_nodes_where_a_run_has_several_and_the_backends_runs_import():
    spec = spec_of("name: t\nexecutor: slurm\nslurm: {gpus_per_node: 4, fabric: infiniband, numa_binding: node}\n"
                   "hardware: {device: H100}\ndefaults: {parallelism: ddp}\naxes: {nodes: [1, 4]}\n"
                   "include: [{framework: megatron, parallelism: tp2}, {parallelism: fsdp2, compile: true}]\n")
    assert (spec["nodes"], spec["nproc"], spec["expect_gpus"], spec["device"]) == (2, 4, True, "cuda")
    assert {"megatron.core", "echobench.backends.megatron", "echobench.cli"} <= set(spec["imports"])
    assert spec["compile"] and spec["numa_binding"] == "node" and spec["fabric"] == "infiniband"
    cpu = spec_of("name: t\nslurm: {request_gpus: false}\ndefaults: {parallelism: single}\n")
    assert (cpu["nodes"], cpu["expect_gpus"], cpu["device"]) == (1, False, "cpu")


def line(node: int, name: str, ok, detail: str = "d", fix: str = "") -> str:
    return f"{node}: {nodecheck.MARK} " + json.dumps({"name": name, "ok": ok, "detail": detail, "fix": fix,
                                                       "node": node, "host": f"h{node}"})


def test_the_verdict_reads_every_nodes_lines_from_the_log():
    spec = {"nodes": 2}
    both = "\n".join([line(0, "imports", True), "1: noise", line(1, "imports", True), line(0, "transport", True),
                      line(1, "transport", None), "0: " + nodecheck.MARK + " {cut"])
    checks = parse_checks(both)
    assert [c["name"] for c in checks] == ["imports", "imports", "transport", "transport"]
    # srun may pass a line on in pieces, each labelled: they are put together again.
    cut = line(0, "interfaces", True, "eth0, lo")
    pieces = "\n".join([cut[:60], line(1, "cpus", True), "0: " + cut[60:]])
    assert [(c["name"], c["node"]) for c in parse_checks(pieces)] == [("cpus", 1), ("interfaces", 0)]
    # ... even inside the marker ("0: echo", then "0: bench-check {...}"), and a failed check cut there counts.
    failing = line(0, "compile", False, "inductor failed", "install a compiler")
    in_marker = "\n".join(["0: echo", line(1, "cpus", True), "0: " + failing[len("0: echo"):]])
    assert [(c["name"], c["ok"]) for c in parse_checks(in_marker)] == [("cpus", True), ("compile", False)]
    # a piece of an open line that reads like the marker's start is still the open line's
    json_cut = line(0, "cpus", True, "echo")
    at = json_cut.index("echo")
    assert parse_checks("\n".join([json_cut[:at], "0: " + json_cut[at:at + 2], "0: " + json_cut[at + 2:]])) == \
        parse_checks(json_cut)
    assert verdict(spec, checks, "COMPLETED", both, "7") == (True, "")
    failed = both + "\n" + line(1, "cpus", False, "1 CPU(s) for 4 processes", "ask for 4")
    assert verdict(spec, parse_checks(failed), "FAILED", failed, "7") == (False, "")
    # A job that died before node 1 said anything: its log's lines that explain it, with a fix where known.
    died = "\n".join([line(0, "imports", True), line(0, "transport", True), "/usr/bin/python3: Error while finding "
                      "module specification for 'echobench.train.nodecheck' (ModuleNotFoundError: No module named 'echobench')",
                      "srun: error: node2: task 1: Exited with exit code 1"])
    passed, why = verdict(spec, parse_checks(died), "FAILED (exit 1:0)", died, "7")
    assert not passed and why.startswith("preflight job 7 ended (FAILED (exit 1:0)) before node(s) 1 said their checks")
    assert "No module named 'echobench'" in why and "slurm.pythonpath" in why
    setup = "echobench: setup line 2 failed (exit 1): 'module load nccl'"
    assert "fix: fix that line of slurm.setup" in verdict(spec, [], "FAILED", setup, "8")[1]


# ---- on the local SLURM cluster ----

def two_nodes() -> None:
    from test_slurm import cluster_nodes

    if len(cluster_nodes()) < 2:
        message = "no local SLURM cluster with 2 or more nodes: bash scripts/slurm-local.sh up 2"
        if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)


# device cpu: no run compiles, so the preflight jobs skip their compile check (some 3-13 CPU s of inductor
# on each node) unless a test's run asks for compile, as the script submitted by hand does. A model card's
# tiny decoder: the nodes then import no text encoder (Echo's runs have theirs checked in tests/test_slurm.py).
TINY = {"card": TINY_CARD, "steps": 3, "warmup_steps": 1, "micro_batch": 2, "device": "cpu"}


def cpu_matrix(path: Path, slurm: dict, include: list[dict]) -> Path:
    path.write_text(json.dumps({
        "name": "pf", "executor": "slurm", "hardware": {"peak_tflops": 0.5}, "defaults": TINY, "include": include,
        "slurm": {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False, "env": {"OMP_NUM_THREADS": 1}, **slurm}}))
    return path


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.slurm
def test_a_missing_import_fails_preflight_submits_nothing_and_the_same_sweep_resumes_after_the_fix(tmp_path, cluster):
    """As in an image without typer: a setup line puts a typer that does not import first on the
    path. The sweep's preflight names the module and the fix, submits no run (nothing measured is
    lost), exits 1; with the setup line gone the same sweep passes its preflight and submits."""
    shim = tmp_path / "shim" / "typer"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'typer' (not in this image)\")\n")
    matrix, out = tmp_path / "m.yaml", tmp_path / "sweep"
    cpu_matrix(matrix, {"setup": [f"export PYTHONPATH={shim.parent}:$PYTHONPATH"]}, [{"seed": 1}])
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", tmp_path=tmp_path, timeout=600)
    text = flat(proc.stdout)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "preflight FAILED" in text and "FAILED imports node 0:" in text, text
    assert "typer: ModuleNotFoundError: No module named 'typer' (not in this image)" in text
    assert "fix: install echobench's dependencies where $PYTHON runs" in text
    assert "no run submitted: 1 runs wait for a passing preflight" in text
    assert json.loads((out / "sweep.json").read_text())["runs"] == {}
    rows = json.loads(run_cli("status", out, "--json", tmp_path=tmp_path).stdout)
    assert [r["state"] for r in rows] == ["not started"]
    cpu_matrix(matrix, {}, [{"seed": 1}])  # the fix
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", tmp_path=tmp_path, timeout=600)
    assert proc.returncode == 0 and "preflight passed" in flat(proc.stdout), proc.stdout + proc.stderr
    (entry,) = json.loads((out / "sweep.json").read_text())["runs"].values()
    assert entry["job_id"] and "submitted as" in proc.stdout
    subprocess.run(["scancel", entry["job_id"]])


class Interrupted:
    """A scheduler that takes the preflight job as 77, and Ctrl-C while the sweep waits for it."""

    name, poll_s, max_active = "slurm", 5.0, None

    def __init__(self, cancel_fails: bool = False):
        self.cancel_fails, self.cancelled = cancel_fails, []

    def sbatch(self, script, what, after=()):
        return "77"

    def states(self, jobs):
        raise KeyboardInterrupt

    def cancel(self, job_ids):
        if self.cancel_fails:
            raise RuntimeError("scancel did not answer within 60 s")
        self.cancelled += job_ids


@pytest.mark.parametrize("cancel_fails", [False, True])
def test_ctrl_c_during_the_preflight_says_its_job_was_cancelled_or_how_to(tmp_path, cancel_fails):
    import io

    from rich.console import Console

    from echobench.sweep.preflight import on_slurm

    m = parse_matrix("name: t\nexecutor: slurm\nslurm: {request_gpus: false}\ndefaults: {parallelism: single}\n", "m.yaml")
    console, executor = Console(record=True, width=200, file=io.StringIO()), Interrupted(cancel_fails)
    (tmp_path / "logs").mkdir()
    with pytest.raises(KeyboardInterrupt):
        on_slurm(m, preflight_spec(m, expand(m).runs, "slurm"), executor, tmp_path, console, lambda job: None)
    said = flat(console.export_text())
    if cancel_fails:
        assert "preflight: job 77 not cancelled: scancel did not answer within 60 s; `scancel 77` ends it" in said, said
    else:
        assert executor.cancelled == ["77"] and "preflight: job 77 cancelled (Ctrl-C)" in said, said


def test_a_passed_preflight_is_not_run_again_for_the_same_matrix_unless_the_runs_need_more(tmp_path):
    from echobench.records.atomic import write_json_atomic
    from echobench.sweep.preflight import Preflight, matrix_sha, passed_before

    m = parse_matrix("name: t\nexecutor: slurm\nslurm: {request_gpus: false}\ndefaults: {device: cpu, parallelism: ddp, "
                     "gpus_per_node: 2}\naxes: {nodes: [1, 2]}\n", "m.yaml")
    runs = expand(m).runs
    one_node = [r for r in runs if r.cfg.nodes == 1]
    spec = preflight_spec(m, one_node, "slurm")  # a sweep with --only nodes=1 checked one node
    write_json_atomic(tmp_path / "preflight.json", Preflight(passed=True, executor="slurm", job="5",
                                                             matrix_sha=matrix_sha(m), spec=spec).model_dump())
    assert passed_before(tmp_path, m, one_node, "slurm").job == "5"
    assert passed_before(tmp_path, m, runs, "slurm") is None  # the 2-node runs need a 2-node preflight
    other = parse_matrix(m.text + "# edited\n", "m.yaml")
    assert passed_before(tmp_path, other, one_node, "slurm") is None  # another matrix file


def test_plan_writes_the_preflight_script_and_preflight_dry_run_prints_it(tmp_path):
    """The first job of a sweep can be read before it runs: `plan --write-scripts` writes it beside the
    runs' (its log in DIR/logs), `preflight --dry-run` prints the very script the sweep would submit
    into its directory, and writes nothing."""
    from echobench.sweep.matrix import load_matrix
    from echobench.sweep.preflight import preflight_script

    matrix, sweep, scripts = cpu_matrix(tmp_path / "m.yaml", {"setup": ["echo from-setup"]}, [{"seed": 1}]), \
        tmp_path / "sweep", tmp_path / "scripts"
    proc = run_cli("plan", matrix, "--out", sweep, "--write-scripts", scripts, tmp_path=tmp_path, check=True)
    assert "and the preflight job's, preflight.sh," in flat(proc.stdout), proc.stdout
    written = (scripts / "preflight.sh").read_text()
    assert "echobench.train.nodecheck node" in written and "echo from-setup" in written
    assert f"#SBATCH --output={scripts.resolve() / 'logs' / 'preflight-%j.out'}" in written
    proc = run_cli("preflight", matrix, "--out", sweep, "--dry-run", tmp_path=tmp_path, check=True)
    m = load_matrix(matrix)
    assert proc.stdout == preflight_script(m, expand(m, "slurm").runs, sweep.resolve())
    assert [line for line in proc.stdout.splitlines() if not line.startswith("#SBATCH --output=")] == \
        [line for line in written.splitlines() if not line.startswith("#SBATCH --output=")]
    assert not sweep.exists()  # nothing written, nothing submitted
    local = run_cli("preflight", matrix, "--executor", "local", "--out", sweep, "--dry-run", tmp_path=tmp_path,
                    check=True)
    assert "-m echobench.train.nodecheck node --spec" in local.stdout and not sweep.exists()


@pytest.mark.slurm
def test_the_written_preflight_script_passes_when_submitted_by_hand(tmp_path, cluster):
    # a run that compiles: the script checks the compile on the node's CPU (C++) too
    matrix, scripts = cpu_matrix(tmp_path / "m.yaml", {}, [{"seed": 1, "compile": True}]), tmp_path / "scripts"
    run_cli("plan", matrix, "--out", tmp_path / "sweep", "--write-scripts", scripts, tmp_path=tmp_path, check=True)
    subprocess.run(["sbatch", "--wait", str(scripts / "preflight.sh")], check=True, capture_output=True, timeout=600)
    (log,) = (scripts / "logs").glob("preflight-*.out")
    checks = parse_checks(log.read_text())
    assert checks and all(c["ok"] is not False for c in checks), log.read_text()[-3000:]


def rendezvous_lines(script: str) -> str:
    """The lines of a job script that make MASTER_ADDR: slurm.rendezvous's assignment and NODE_LAUNCH_ENV's."""
    lines = script.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("MASTER_ADDR="))
    end = lines.index("fi", start)
    return "\n".join([x for x in lines if x.startswith("EB_RENDEZVOUS_")] + lines[start:end + 1])


@pytest.mark.parametrize("rendezvous, address", [({"suffix": "i"}, "node1i"),
                                                 ({"command": "echo \"$MASTER_ADDR.ib.example\""}, "node1.ib.example"),
                                                 ({"interface": "ib0"}, "10.0.0.1"),
                                                 ({"interface": "ib9"}, None),
                                                 (None, "node1")])
def test_the_site_sets_the_rendezvous_address_after_the_setup_lines_in_every_job(tmp_path, rendezvous, address):
    """slurm.rendezvous (a suffix to the first node's name, an interface's address, or a command)
    makes MASTER_ADDR in the runs' jobs, the preflight's and the comm calibration's alike, after the
    setup lines; an interface with no IPv4 address on the node ends the job in one line."""
    from echobench.sweep.executors.slurm_script import render_comm_calibration_script, render_script
    from echobench.sweep.preflight import preflight_script

    slurm = {"setup": ["export SITE=1"], **({"rendezvous": rendezvous} if rendezvous else {})}
    m = parse_matrix(cpu_matrix(tmp_path / "m.yaml", slurm, [{"seed": 1, "nodes": 2, "parallelism": "ddp",
                                                                "gpus_per_node": 1}]).read_text(), "m.yaml")
    runs = expand(m, "slurm").runs
    stub = tmp_path / "bin" / "scontrol"
    stub.parent.mkdir()
    stub.write_text("#!/bin/bash\necho node1\necho node2\n")
    stub.chmod(0o755)
    ip = stub.parent / "ip"  # `ip -4 -o addr show dev IFACE` as iproute2 prints it, for ib0 only
    ip.write_text("#!/bin/bash\n[ \"$6\" = ib0 ] || { echo \"Device \\\"$6\\\" does not exist.\" >&2; exit 1; }\n"
                  "echo '4: ib0    inet 10.0.0.1/16 brd 10.0.255.255 scope global ib0\\       valid_lft forever'\n")
    ip.chmod(0o755)
    for script in (render_script(runs[0].cfg, tmp_path / "sw" / runs[0].id, m.spec.slurm),
                   preflight_script(m, runs, tmp_path / "sw"),
                   render_comm_calibration_script(tmp_path / "sw", m, 2, 1)):
        lines = script.splitlines()
        assert lines.index("export SITE=1") < next(i for i, x in enumerate(lines) if x.startswith("MASTER_ADDR="))
        proc = subprocess.run(["bash", "-c", f"set -euo pipefail\n{rendezvous_lines(script)}\necho \"$MASTER_ADDR\""],
                              capture_output=True, text=True, env={**os.environ, "SLURM_JOB_NODELIST": "node[1-2]",
                                                                   "PATH": f"{stub.parent}:{os.environ['PATH']}"})
        if address is None:
            assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
                "echobench: slurm.rendezvous.interface ib9 has no IPv4 address on "
                f"{socket.gethostname()} (ip -4 addr lists the node's interfaces)"], proc.stderr
        else:
            assert (proc.returncode, proc.stdout.strip()) == (0, address), proc.stderr


@pytest.mark.parametrize("rendezvous, said", [({}, "give one of suffix (e.g. i), interface (e.g. ib0) and command"),
                                              ({"suffix": "i", "command": "hostname"}, "give one of suffix"),
                                              ({"suffix": "i", "interface": "ib0"}, "give one of suffix"),
                                              ({"suffix": "i b"}, "is not a valid rendezvous.suffix"),
                                              ({"interface": "ib0; reboot"}, "is not a valid rendezvous.interface")])
def test_a_rendezvous_setting_that_cannot_work_is_one_line(tmp_path, rendezvous, said):
    proc = run_cli("plan", cpu_matrix(tmp_path / "m.yaml", {"rendezvous": rendezvous}, [{"seed": 1}]),
                   tmp_path=tmp_path)
    assert proc.returncode == 2 and said in flat(proc.stderr), proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # one line (a long one may wrap once)


@pytest.mark.slurm
def test_two_nodes_meet_at_the_address_the_sites_command_gives(tmp_path):
    """On the local cluster, with the address from a command that resolves the first node's name
    (as a site resolves its InfiniBand name): the preflight's all-reduce across 2 nodes passes."""
    from test_slurm_submit import answering_cluster

    gen = answering_cluster(tmp_path, min_nodes=2)
    next(gen)
    try:
        m = cpu_matrix(tmp_path / "m.yaml", {"rendezvous": {"command": "getent hosts \"$MASTER_ADDR\" | awk '{print $1}'"}},
                       [{"seed": 1, "nodes": 2, "parallelism": "ddp", "gpus_per_node": 1}])
        proc = run_cli("preflight", m, "--out", tmp_path / "sweep", tmp_path=tmp_path, timeout=600)
        assert proc.returncode == 0 and "preflight passed" in flat(proc.stdout), proc.stdout + proc.stderr
        log = next((tmp_path / "sweep" / "logs").glob("preflight-*.out")).read_text()
        checks = parse_checks(log)
        assert {c["node"] for c in checks} == {0, 1} and all(c["ok"] is not False for c in checks), log[-3000:]
    finally:
        next(gen, None)


def said_lines(stdout: str) -> list[str]:
    """The console's lines, each put together again where the terminal width wrapped it (each starts with a time)."""
    return [flat(x) for x in re.split(r"\n(?=\d\d:\d\d:\d\d )", stdout)]


IB_SUFFIX = "-ib"  # scripts/slurm-local.sh names every node NAME-ib too, as a site's InfiniBand names


@pytest.mark.slurm
@pytest.mark.parametrize("suffix", [IB_SUFFIX, ".invalid"])  # .invalid never resolves (RFC 6761)
def test_two_nodes_meet_at_the_first_nodes_name_with_the_sites_suffix_and_a_name_that_does_not_resolve_is_one_line(
        tmp_path, suffix):
    """On the local cluster, `rendezvous: {suffix: -ib}`: every node resolves the first node's -ib
    name (as a site's InfiniBand names) and the preflight's all-reduce across 2 nodes meets there. A
    suffix whose name no node resolves fails the preflight at once, in one line naming the address
    and the fix, rather than when the all-reduce gives up waiting."""
    import socket

    from test_slurm import cluster_nodes
    from test_slurm_submit import answering_cluster

    gen = answering_cluster(tmp_path, min_nodes=2)
    next(gen)
    try:
        unresolved = []
        for name in (f"{node}{suffix}" for node in cluster_nodes()):
            try:
                socket.getaddrinfo(name, None)
            except OSError:
                unresolved.append(name)
        if suffix == IB_SUFFIX and unresolved:
            message = f"{', '.join(unresolved)} do not resolve: bash scripts/slurm-local.sh up 2 adds them"
            if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
                pytest.fail(message)
            pytest.skip(message)
        if suffix != IB_SUFFIX and len(unresolved) < len(cluster_nodes()):
            pytest.skip(f"a name ending {suffix} resolves here")
        m = cpu_matrix(tmp_path / "m.yaml", {"rendezvous": {"suffix": suffix}},
                       [{"seed": 1, "nodes": 2, "parallelism": "ddp", "gpus_per_node": 1}])
        proc = run_cli("preflight", m, "--out", tmp_path / "sweep", tmp_path=tmp_path, timeout=600)
        log = next((tmp_path / "sweep" / "logs").glob("preflight-*.out")).read_text()
        checks = parse_checks(log)
        said = [c for c in checks if c["name"] == "rendezvous"]
        if suffix == IB_SUFFIX:
            assert proc.returncode == 0 and "preflight passed" in flat(proc.stdout), proc.stdout + proc.stderr
            assert {c["node"] for c in checks} == {0, 1} and all(c["ok"] is not False for c in checks), log[-3000:]
            (first,) = {c["detail"].split()[1] for c in said}  # MASTER_ADDR NAME resolves to ...
            assert first.endswith(IB_SUFFIX) and first.removesuffix(IB_SUFFIX) in cluster_nodes(), said
            assert {c["node"] for c in said} == {0, 1} and all(c["ok"] for c in said), said
        else:
            assert proc.returncode == 1 and "preflight FAILED" in flat(proc.stdout), proc.stdout + proc.stderr
            (line,) = [x for x in said_lines(proc.stdout) if "FAILED rendezvous" in x]
            assert f"{suffix} does not resolve on this node" in line and "fix: set slurm.rendezvous" in line, line
            assert not [c for c in checks if c["name"] == "collective"], log[-3000:]  # no wait for a rank
    finally:
        next(gen, None)


@pytest.mark.slurm
@pytest.mark.parametrize("key", ["python", "venv"])
def test_an_interpreter_the_nodes_do_not_have_fails_the_preflight_naming_node_path_and_fix(tmp_path, cluster, key):
    """A site whose slurm.python / slurm.venv names a path the nodes lack (the aarch64 install of an
    x86 login node's site file, not made yet): the sweep's preflight fails in one line naming the
    node, the path and the fix, and no run is submitted."""
    from test_slurm import cluster_nodes

    missing = tmp_path / "aarch64-venv"
    python = missing / "bin" / "python"
    matrix, out = cpu_matrix(tmp_path / "m.yaml", {key: str(python if key == "python" else missing)},
                             [{"seed": 1}]), tmp_path / "sweep"
    proc = run_cli("sweep", matrix, "--out", out, "--no-wait", tmp_path=tmp_path, timeout=600)
    text = flat(proc.stdout)
    assert proc.returncode == 1 and "preflight FAILED" in text, proc.stdout + proc.stderr
    (line,) = [x for x in said_lines(proc.stdout) if "FAILED preflight job" in x]
    assert f"{python}: No such file or directory" in line, line
    assert any(f"{node}: task" in line for node in cluster_nodes()), line
    assert "fix: slurm.venv or slurm.python: no such interpreter on the nodes" in line, line
    assert "no run submitted" in text and json.loads((out / "sweep.json").read_text())["runs"] == {}
