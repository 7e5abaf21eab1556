"""Site files (echobench.sweep.site): a cluster's settings written once, under the matrix's own; job
scripts whose interpreter and import path come from the site, never the submitting checkout unless
nothing names one; preflight holding each node's echobench against the submitter's. The last tests
run on the local SLURM cluster."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

import echobench
from conftest import ROOT, TINY_CARD, run_cli
from echobench.sweep.executors.slurm_script import render_script
from echobench.sweep.matrix import MatrixError, expand, load_matrix
from echobench.sweep.preflight import preflight_script
from echobench.sweep.site import cluster_sections

TINY = {"scale": "tiny", "device": "cpu", "steps": 2, "warmup_steps": 1, "micro_batch": 1, "audio_frames": 30,
        "text_tokens": 8, "speaker_frames": 30}


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def cluster_site(path: Path, **slurm) -> Path:
    """A site for the local cluster: CPU processes, one thread each."""
    return write(path, {"executor": "slurm", "slurm": {"time": "00:10:00", "gpus_per_node": 1, "request_gpus": False,
                                                       "env": {"OMP_NUM_THREADS": 1, "EB_SITE_VAR": "site"},
                                                       **slurm},
                        "hardware": {"peak_tflops": 0.5}})


def test_the_matrix_wins_key_by_key_env_by_variable_and_the_interpreter_as_one_choice(tmp_path):
    write(tmp_path / "sites" / "c.yaml", {"executor": "slurm", "slurm": {
        "partition": "gpu", "account": "tts", "time": "01:00:00", "setup": ["module load a"],
        "env": {"A": "site", "B": "site"}, "venv": "/sw/eb-venv", "rendezvous": {"suffix": "i"}},
        "hardware": {"device": "GH200", "peak_tflops": 990}})
    m = load_matrix(write(tmp_path / "m" / "x.yaml", {
        "name": "x", "site": "../sites/c.yaml", "defaults": TINY,
        "slurm": {"time": "00:05:00", "account": None, "env": {"B": "matrix", "C": "matrix"},
                  "container": {"image": "/img.sqsh"}},
        "hardware": {"peak_tflops": 1.5}}))
    s = m.spec.slurm
    assert m.spec.executor == "slurm" and s.partition == "gpu" and s.time == "00:05:00"
    assert s.account == "tts"  # null in the matrix: not set there
    assert s.env == {"A": "site", "B": "matrix", "C": "matrix"} and s.setup == ["module load a"]
    assert s.container.image == "/img.sqsh" and s.venv is None  # the matrix's container replaces the site's venv
    assert s.rendezvous.suffix == "i" and m.spec.hardware.device == "GH200" and m.spec.hardware.peak_tflops == 1.5
    site = f"site {tmp_path / 'sites' / 'c.yaml'}"
    o = m.origins
    assert (o["executor"], o["slurm.partition"], o["slurm.time"], o["slurm.account"]) == (site, site, "matrix", site)
    assert (o["slurm.env.A"], o["slurm.env.B"], o["slurm.env.C"]) == (site, "matrix", "matrix")
    assert "slurm.venv" not in o and o["slurm.container"] == "matrix" and o["hardware.peak_tflops"] == "matrix"


def test_a_bad_site_is_one_line_naming_the_key_and_the_nearest(tmp_path):
    bad = write(tmp_path / "s.yaml", {"slurm": {"partiton": "gpu"}})
    matrix = write(tmp_path / "m.yaml", {"name": "m", "site": "s.yaml", "defaults": TINY})
    with pytest.raises(MatrixError) as err:
        load_matrix(matrix)
    assert str(err.value).startswith(f"{bad}: unknown key 'slurm.partiton' (did you mean 'partition'?)")
    write(tmp_path / "s.yaml", {"slrum": {}})
    with pytest.raises(MatrixError, match=r"unknown key 'slrum' \(did you mean 'slurm'\?\)"):
        load_matrix(matrix)
    write(tmp_path / "m.yaml", {"name": "m", "site": "missing.yaml", "defaults": TINY})
    with pytest.raises(MatrixError, match="missing.yaml: no such file"):
        load_matrix(tmp_path / "m.yaml")
    write(bad, {"slurm": {"partiton": "gpu"}})
    proc = run_cli("plan", tmp_path / "m.yaml", "--site", bad, tmp_path=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "partiton" in proc.stderr
    proc = run_cli("plan", ROOT / "sites" / "hgx-pyxis.yaml", tmp_path=tmp_path)  # a site given as the matrix
    assert proc.returncode == 2 and "this is a site file" in proc.stderr and "--site " in proc.stderr


def test_a_key_given_twice_in_a_site_is_refused_as_in_a_matrix(tmp_path):
    # plain YAML keeps the last one: the first partition would be dropped without a word
    site = tmp_path / "s.yaml"
    site.write_text("slurm:\n  partition: gpu\n  account: tts\n  partition: debug\n")
    matrix = write(tmp_path / "m.yaml", {"name": "m", "site": "s.yaml", "defaults": TINY})
    with pytest.raises(MatrixError) as err:
        load_matrix(matrix)
    assert str(err.value) == f"{site}: duplicate key 'partition' (line 4): each key once"
    with pytest.raises(MatrixError, match="duplicate key 'partition'"):
        cluster_sections(site)


def test_one_site_two_matrices_and_site_flag_over_the_key(tmp_path):
    """--site takes the place of the matrix's site: key; plan says where each setting came from."""
    site = cluster_site(tmp_path / "local.yaml", partition="debug")
    other = cluster_site(tmp_path / "other.yaml", partition="other")
    a = write(tmp_path / "a.yaml", {"name": "a", "site": "other.yaml", "defaults": TINY})
    b = write(tmp_path / "b.yaml", {"name": "b", "defaults": TINY, "slurm": {"env": {"EB_SITE_VAR": "matrix"}}})
    plans = {}
    for path in (a, b):
        proc = run_cli("plan", path, "--site", site, "--json", tmp_path=tmp_path)
        assert proc.returncode == 0, proc.stderr
        plans[path.stem] = json.loads(proc.stdout)
    for name, summary in plans.items():
        rows = {r["setting"]: r for r in summary["settings"]}
        assert summary["executor"] == "slurm" and summary["site"] == str(site)
        assert rows["slurm.partition"] == {"setting": "slurm.partition", "value": "debug", "from": f"site {site}"}
        assert rows["slurm.qos"]["from"] == "default"
    assert {r["setting"]: r for r in plans["b"]["settings"]}["slurm.env.EB_SITE_VAR"]["from"] == "matrix"
    assert load_matrix(a).spec.slurm.partition == "other" and str(other) != str(site)
    text = run_cli("plan", b, "--site", site, tmp_path=tmp_path).stdout
    assert f"site {site}" in text and "at their defaults:" in text


def scripts(tmp_path: Path, slurm: dict) -> str:
    """Every script of a one-run sweep (the run's, the preflight's) from a site with `slurm`."""
    site = write(tmp_path / "site.yaml", {"executor": "slurm", "slurm": {"gpus_per_node": 2, **slurm}})
    m = load_matrix(write(tmp_path / "m.yaml", {"name": "m", "site": "site.yaml",
                                                "defaults": {**TINY, "parallelism": "ddp", "device": "auto"}}))
    runs = expand(m).runs
    assert m.site == site
    return render_script(runs[0].cfg, tmp_path / "sweep" / runs[0].id, m.spec.slurm) + preflight_script(
        m, runs, tmp_path / "sweep")


@pytest.mark.parametrize("slurm, python", [
    ({"venv": "/sw/eb-venv/"}, "PYTHON=/sw/eb-venv/bin/python"),
    ({"uenv": {"image": "prgenv-gnu/24.11:v1"}, "venv": "/scratch/eb"}, "PYTHON=/scratch/eb/bin/python"),
    ({"container": {"image": "/img/eb.sqsh"}}, "PYTHON=python3"),
    ({"python": "/opt/py/bin/python3", "setup": ["source /opt/other/bin/activate"]}, "PYTHON=/opt/py/bin/python3"),
])
def test_a_script_from_a_site_naming_its_interpreter_has_no_trace_of_the_submitting_checkout(tmp_path, slurm, python):
    text = scripts(tmp_path, slurm)
    assert str(ROOT) not in text and str(Path(echobench.__file__).parent) not in text
    assert sys.executable not in text and python in text.splitlines()
    assert {"unset PYTHONPATH", "export PYTHONSAFEPATH=1"} <= set(text.splitlines())  # the submitter's path and folder
    assert "command -v python3" not in text  # a setup line's activation does not override the site's choice


def test_the_checkout_route_only_where_nothing_names_an_interpreter(tmp_path):
    text = scripts(tmp_path, {})
    assert f"PYTHON={sys.executable}" in text and f"export PYTHONPATH={ROOT}" in text
    named = scripts(tmp_path, {"python": "/opt/site/bin/python3", "pythonpath": ["/shared/echobench"]})
    assert str(ROOT) not in named and "export PYTHONPATH=/shared/echobench${PYTHONPATH:+:$PYTHONPATH}" in named
    activated = scripts(tmp_path, {"setup": ["source /opt/venv/bin/activate"]}).splitlines()
    # an activated environment takes its own python3 and leaves the checkout off its path
    assert [x for x in activated if x.startswith("if [") and "command -v python3" in x and "else export PYTHONPATH" in x]


def test_the_shipped_sites_load_and_plan(tmp_path):
    sites = sorted((ROOT / "sites").glob("*.yaml"))
    assert {p.stem for p in sites} >= {"gh200-infiniband-venv", "alps-slingshot-uenv", "hgx-pyxis"}
    routes = set()
    for site in sites:
        sections = cluster_sections(site)
        slurm = sections["slurm"]
        routes |= {k for k in ("venv", "container", "uenv") if k in slurm}
        matrix = write(tmp_path / f"{site.stem}.yaml", {"name": site.stem, "site": str(site), "defaults": {
            "device": "cuda", "scale": "3B", "parallelism": "fsdp2", "precision": "bf16"}, "axes": {"nodes": [1, 2]}})
        proc = run_cli("plan", matrix, "--json", tmp_path=tmp_path)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout)
        rows = {r["setting"]: r["from"] for r in summary["settings"]}
        assert summary["executor"] == "slurm" and len(summary["runs"]) == 2 and rows["slurm.fabric"] == f"site {site}"
        out = tmp_path / site.stem
        proc = run_cli("plan", matrix, "--write-scripts", out, "--out", tmp_path / "runs", tmp_path=tmp_path)
        assert proc.returncode == 0, proc.stderr
        text = "".join(p.read_text() for p in out.glob("*.sh"))
        assert (out / "preflight.sh").exists() and str(ROOT) not in text  # each route stands alone
    assert routes == {"venv", "container", "uenv"}


def test_tune_reproduce_and_calibrate_take_the_same_site(tmp_path):
    from echobench.calibrate.commcalibrate import comm_runs
    from echobench.sweep.reproduce import site_sections
    from echobench.tune.space import load_tune_file

    site = cluster_site(tmp_path / "site.yaml", partition="debug", gpus_per_node=2)
    tune = write(tmp_path / "t.yaml", {"name": "t", "site": "site.yaml", "scale": "tiny",
                                       "slurm": {"time": "00:20:00"}})
    spec = load_tune_file(tune)
    assert spec.executor == "slurm" and spec.slurm["partition"] == "debug" and spec.slurm["time"] == "00:20:00"
    assert site_sections(site)["slurm"]["partition"] == "debug"
    assert site_sections(write(tmp_path / "m.yaml", {"name": "m", "site": "site.yaml",
                                                    "slurm": {"partition": "mine"}}))["slurm"]["partition"] == "mine"
    matrix = write(tmp_path / "c.yaml", {"name": "c", "defaults": TINY, "axes": {"parallelism": ["ddp"]}})
    runs, flags = comm_runs("cpu", None, matrix, {}, site)
    assert runs[0].gpus_per_node == 2 and flags[-2:] == ["--site", str(site.resolve())]  # the site's processes per node


@pytest.mark.parametrize("by", ["key", "flag"])
def test_a_tunes_written_matrices_name_its_site_and_carry_only_their_own_values(tmp_path, by):
    """A tune given a site file (its site: key, or --site) writes its measuring matrix and its winner's
    with `site:` (the path from where each is written) and only the tune file's own sections: each
    loads and plans the same runs as the matrix of the merged settings did, which are the runs the tune
    measures (the site's hardware taken alike), and a site changed afterwards is what the written matrix
    runs with."""
    from test_predict import profile
    from echobench.tune.loop import measure_matrix_text
    from echobench.tune.output import write_winner
    from echobench.tune.space import build_problem, load_tune_file

    # hardware as the shipped sites set it: the sweep's runs take its peak_tflops, and device auto becomes cuda
    def tune_site(partition):
        return write(tmp_path / "sites" / "site.yaml", {
            "executor": "slurm", "hardware": {"device": "GH200", "peak_tflops": 990, "memory_gib": 64},
            "slurm": {"partition": partition, "gpus_per_node": 2}})

    site = tune_site("debug")
    own = {"name": "t", "scale": "tiny", "gpus_per_node": 2, "slurm": {"time": "00:20:00"},
           "defaults": {k: v for k, v in TINY.items() if k not in ("scale", "micro_batch", "device")}}
    tune = write(tmp_path / "tunes" / "t.yaml", {**own, "site": "../sites/site.yaml"} if by == "key" else own)
    spec = load_tune_file(tune, site if by == "flag" else None)
    problem = build_problem(spec, "tiny", 1, profile(device="CPU synthetic", gpus_per_node=2))
    chosen = problem.ranked[:2]
    tune_dir = tmp_path / "tune"
    tune_dir.mkdir()
    measure = tune_dir / "measure.yaml"
    measure.write_text(measure_matrix_text(spec, chosen, tune_dir))
    written = yaml.safe_load(measure.read_text())
    assert written["site"] == "../sites/site.yaml" and written["slurm"] == {"time": "00:20:00"}
    assert not {"executor", "hardware", "local"} & set(written)
    merged = write(tmp_path / "merged.yaml", {**{k: v for k, v in written.items() if k != "site"},
                                              "executor": spec.executor, "slurm": spec.slurm,
                                              "hardware": spec.hardware})

    def runs(path):
        matrix = load_matrix(path)
        return matrix.spec.slurm, [(r.id, r.cfg) for r in expand(matrix, "slurm").runs]

    assert runs(measure) == runs(merged) and len(runs(measure)[1]) == 2
    # the sweep runs what the tune measures: the same run ids (else "the sweep would not run ...")
    assert sorted(rid for rid, _ in runs(measure)[1]) == sorted(c.run_id for c in chosen)
    assert {(cfg.peak_tflops, cfg.device) for _, cfg in runs(measure)[1]} == {(990, "cuda")}
    assert runs(measure)[0].partition == "debug" and runs(measure)[0].time == "00:20:00"
    winner = Path(write_winner(spec, problem, chosen[0], tune_dir)["matrix"])
    assert yaml.safe_load(winner.read_text())["site"] == "../../sites/site.yaml"
    assert [r.id for r in expand(load_matrix(winner), "slurm").runs] == [chosen[0].run_id]
    tune_site("other")  # the site changes after the tune
    assert load_matrix(measure).spec.slurm.partition == load_matrix(winner).spec.slurm.partition == "other"


# ---- on the local cluster ----

def needs_cluster():
    from test_slurm import cluster_nodes

    if len(cluster_nodes()) < 1:
        if os.environ.get("ECHOBENCH_REQUIRE_SLURM") == "1":
            pytest.fail("no local SLURM cluster: bash scripts/slurm-local.sh up 2")
        pytest.skip("no local SLURM cluster: bash scripts/slurm-local.sh up 2")


@pytest.mark.slurm
def test_one_site_two_matrices_on_the_cluster_and_a_matrix_value_over_the_sites(tmp_path):
    """A site that names its interpreter and import path (this checkout, said so): one matrix sweeps
    on it; the other overrides one of its variables, which reaches its job and not the first's."""
    needs_cluster()
    site = cluster_site(tmp_path / "sites" / "local.yaml", partition="debug", python=sys.executable,
                        pythonpath=[str(ROOT)])
    trained = {**TINY, "card": TINY_CARD}  # what the site sets reaches the job, whatever it trains: the tiny card
    first = write(tmp_path / "m" / "first.yaml", {"name": "first", "site": "../sites/local.yaml", "defaults": trained})
    second = write(tmp_path / "m" / "second.yaml", {"name": "second", "site": "../sites/local.yaml", "defaults": trained,
                                                    "slurm": {"env": {"EB_SITE_VAR": "matrix"}}})
    for path in (first, second):
        assert run_cli("plan", path, tmp_path=tmp_path).returncode == 0
    proc = run_cli("sweep", first, "--out", tmp_path / "first", "--no-preflight", tmp_path=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rid = next(iter(json.loads((tmp_path / "first" / "sweep.json").read_text())["runs"]))
    record = json.loads((tmp_path / "first" / rid / "result.json").read_text())
    assert record["status"] == "ok" and record["env"]["scheduler"]["partition"] == "debug"
    assert (tmp_path / "first" / "site.yaml").read_text() == site.read_text()
    job = (tmp_path / "first" / rid / "job.sh").read_text().splitlines()
    assert "export EB_SITE_VAR=site" in job and "unset PYTHONPATH" in job
    proc = run_cli("plan", second, "--script", rid, tmp_path=tmp_path)
    assert "export EB_SITE_VAR=matrix" in proc.stdout.splitlines() and "export OMP_NUM_THREADS=1" in proc.stdout


@pytest.mark.slurm
def test_preflight_names_the_node_and_both_versions_where_its_echobench_is_another(tmp_path):
    """The site's import path holds a second copy of echobench at another version: preflight fails on
    it in one line naming the node and both versions; this checkout's passes."""
    needs_cluster()
    skew = tmp_path / "skew"
    shutil.copytree(ROOT / "echobench", skew / "echobench", ignore=shutil.ignore_patterns("__pycache__"))
    init = skew / "echobench" / "__init__.py"
    init.write_text(init.read_text().replace(f'__version__ = "{echobench.__version__}"', '__version__ = "0.0.1.skew"'))
    site = cluster_site(tmp_path / "site.yaml", partition="debug", python=sys.executable, pythonpath=[str(skew)])
    matrix = write(tmp_path / "m.yaml", {"name": "skewed", "site": "site.yaml", "defaults": {**TINY, "card": TINY_CARD}})
    proc = run_cli("preflight", matrix, "--out", tmp_path / "sweep", tmp_path=tmp_path, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = json.loads((tmp_path / "sweep" / "preflight.json").read_text())["checks"]
    failed = [c for c in checks if c["ok"] is False]
    assert [(c["name"], c["node"]) for c in failed] == [("echobench", 0)], checks
    detail = failed[0]["detail"]
    assert detail.startswith(f"echobench 0.0.1.skew (no commit known) from {skew / 'echobench'}, but the submitter "
                             f"runs echobench {echobench.__version__}"), detail
    shown = " ".join(proc.stdout.split())  # the console folds long lines
    assert f"FAILED echobench node 0: {detail}" in shown
    site = cluster_site(tmp_path / "site.yaml", partition="debug", python=sys.executable, pythonpath=[str(ROOT)])
    proc = run_cli("preflight", matrix, "--out", tmp_path / "sweep", tmp_path=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = json.loads((tmp_path / "sweep" / "preflight.json").read_text())["checks"]
    assert [c["detail"] for c in checks if c["name"] == "echobench" and c["ok"]][0].endswith("as the submitter's")
