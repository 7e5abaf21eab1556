"""`echobench reproduce --executor slurm --scale-down 2` on the local SLURM cluster (`bash
scripts/slurm-local.sh up 2`): two tiny rows published on 4 GPUs (DDP, FSDP full_shard) scaled down
to 2 nodes of 1 CPU process, preflight first, then measured; a second reproduce submits nothing.

The rows are TEST DATA (tests/test_reproduce.py's tiny_row): their published figures are made up.
Nothing here asserts a speed: the printed figures are held to the records they come from. Skipped
when no cluster is up, unless ECHOBENCH_REQUIRE_SLURM=1 (CI), where that is a failure.
"""

import json
import re

import pytest
import yaml

from conftest import run_cli
from echobench.predict.reference import pct
from echobench.records.results import Record
from test_reproduce import rows_file, tiny_row
from test_slurm import cluster, hostnames  # noqa: F401 - cluster: the module's fixture

pytestmark = pytest.mark.slurm

ROWS = "tiny-ddp-4gpu,tiny-fsdp-4gpu"


def reproduce(tmp, rows, site, sweep):
    return run_cli("reproduce", rows, "--rows", ROWS, "--executor", "slurm", "--scale-down", 2, "--site", site,
                   "--device", "cpu", "--steps", 2, "--warmup-steps", 1, "--peak-tflops", 1, "--out", sweep,
                   tmp_path=tmp, timeout=900)


def table_cells(out: str, label: str) -> list[list[str]]:
    """The table's three lines of a row (step time, tokens/s per GPU, MFU), as cells."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"^. {re.escape(label)} ", line))
    return [[c.strip() for c in line.split("│")[1:-1]] for line in lines[start:start + 3]]


@pytest.fixture(scope="module")
def reproduced(cluster, tmp_path_factory):  # noqa: F811 - the fixture imported above
    tmp = tmp_path_factory.mktemp("reproduce-slurm")
    rows = rows_file(tmp / "rows.yaml", [
        tiny_row("tiny-ddp-4gpu", 4),
        tiny_row("tiny-fsdp-4gpu", 4, layout="fsdp", sharding="full_shard")])
    site = tmp / "site.yaml"  # CPU nodes: `gpus_per_node` is processes per node, none requested as GPUs
    site.write_text(yaml.safe_dump({"name": "site", "slurm": {
        "time": "00:10:00", "gpus_per_node": 1, "request_gpus": False, "fabric": "tcp", "env": {"OMP_NUM_THREADS": 1}}}))
    sweep = tmp / "sweep"
    proc = reproduce(tmp, rows, site, sweep)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = {r.card["label"]: r for r in map(Record.load, sweep.glob("*/result.json"))}
    return tmp, rows, site, sweep, proc.stdout, records


def test_both_rows_ran_as_slurm_jobs_on_two_nodes(reproduced):
    _, _, _, sweep, out, records = reproduced
    said = " ".join(out.split())
    assert said.index("preflight passed") < said.index("submitted as"), said
    assert "changed: GPUs 4 -> 2 (2 node(s) x 1)" in said and "changed: global batch 8 -> 4" in said
    jobs = json.loads((sweep / "sweep.json").read_text())["runs"]
    assert set(records) == {"tiny-ddp-4gpu", "tiny-fsdp-4gpu"}
    assert {r.parallelism for r in records.values()} == {"ddp", "fsdp2"}
    for r in records.values():
        assert r.status == "ok", r.error
        assert (r.nodes, r.gpus_per_node, r.world_size, len(r.per_rank)) == (2, 1, 2, 2)
        # the record's SLURM job is the one the sweep submitted, and its allocation spans 2 nodes
        assert r.env.scheduler["job_id"] == jobs[r.run_id]["job_id"]
        assert len(set(hostnames(r.env.scheduler["nodelist"]))) == 2


def test_the_printed_table_is_the_records(reproduced):
    _, _, _, _, out, records = reproduced
    for label, r in records.items():
        step, tokens, mfu = table_cells(out, label)
        per_gpu_step = r.global_batch * r.card["seq"] / r.world_size  # 2 x 32: the published tokens a GPU a step
        assert per_gpu_step == 64 and step[1] == "step time (s)" and tokens[1] == "tokens/s per GPU"
        assert step[2] == f"{r.step_time_s:.4g} [{r.step_time_p10_s:.4g}-{r.step_time_p90_s:.4g}]"
        assert tokens[2] == (f"{r.card['tokens_per_s_per_gpu']:.4g} [{per_gpu_step / r.step_time_p90_s:.4g}-"
                             f"{per_gpu_step / r.step_time_p10_s:.4g}]")
        lo, hi = (r.card["row_flops_per_token"] * per_gpu_step / (t * 1e12) for t in (r.step_time_p90_s, r.step_time_p10_s))
        assert mfu[2] == f"{pct(r.card['row_mfu'])} [{pct(lo)}-{pct(hi)}]" and mfu[3] == "5%"
        assert f"{label}: the reference reaches {pct(r.card['row_mfu'])} MFU of its published 5% " in out


def test_a_second_reproduce_submits_nothing(reproduced):
    tmp, rows, site, sweep, first, records = reproduced
    before = json.loads((sweep / "sweep.json").read_text())["runs"]
    proc = reproduce(tmp, rows, site, sweep)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert "submitted as" not in said and "preflight" not in said, said
    assert "2 runs: 2 ok already, 0 in progress, 0 to run" in said, said
    assert json.loads((sweep / "sweep.json").read_text())["runs"] == before
    for label in records:  # the same records, the same figures
        assert table_cells(proc.stdout, label) == table_cells(first, label)
