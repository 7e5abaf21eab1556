"""Matrix files: schema errors, expansion, skip reasons, memory estimate, ids, shell safety."""

import json
import re
import subprocess

import pytest
import yaml

from conftest import ROOT
from echobench import backends
from echobench.records.config import FIELDS, RunConfig, config_id, run_id
from echobench.sweep.executors.slurm_script import LAUNCH_BODY, render_script
from echobench.sweep.matrix import (MATRIX_ONLY_KEYS, TUNE_ONLY_KEYS, MatrixError, MatrixFile, expand, load_matrix,
                                    parse_matrix, parse_only, select)
from echobench.hardware.devicememory import device_memory_gib
from echobench.predict.memory import estimate_memory
from echobench.sweep.loop import run_dir


def plan(text, executor=None):
    return expand(parse_matrix(text, "m.yaml"), executor)


def error(text) -> str:
    with pytest.raises(MatrixError) as exc:
        parse_matrix(text, "m.yaml")
    return str(exc.value)


# ---- expansion ----

def test_axes_expand_to_their_product_minus_excludes_plus_includes():
    p = plan("""
name: t
defaults: {scale: tiny}
axes:
  micro_batch: [1, 2, 4]
  ac: [none, selective, full]
  compile: [false, true]
exclude:
  - {ac: full, compile: true}          # 3 combos
  - {micro_batch: [1, 2], ac: none}    # 4 combos
include:
  - {micro_batch: 8}
  - {micro_batch: 1, ac: none}         # excluded above, back by include
""")
    assert p.excluded == 7
    assert len(p.runs) == 3 * 3 * 2 - 7 + 2 and not p.skipped
    mbs = sorted(r.cfg.micro_batch for r in p.runs)
    assert mbs.count(8) == 1 and any(r.cfg.micro_batch == 1 and r.cfg.ac == "none" for r in p.runs)
    # No exclude entry matched a run that stayed.
    for r in p.runs[:-2]:
        assert not (r.cfg.ac == "full" and r.cfg.compile) and not (r.cfg.micro_batch in (1, 2) and r.cfg.ac == "none")


def test_no_axes_means_the_defaults_alone_or_the_includes_alone():
    assert len(plan("name: t\ndefaults: {scale: tiny}\n").runs) == 1
    p = plan("name: t\ninclude: [{seed: 1}, {seed: 2}, {seed: 1}]\n")
    assert [r.cfg.seed for r in p.runs] == [1, 2] and p.duplicates == 1


def test_processes_per_node_come_from_slurm_and_single_takes_one():
    p = plan("""
name: t
slurm: {gpus_per_node: 4, fabric: none}
axes: {parallelism: [single, ddp, fsdp2]}
include: [{parallelism: ddp, gpus_per_node: 2, nodes: 2}]
""", executor="slurm")
    cfgs = [r.cfg for r in p.runs] + [s.cfg for s in p.skipped]  # skipped: until the backend has the layout
    layouts = sorted((c.parallelism, c.nodes, c.gpus_per_node) for c in cfgs)
    assert layouts == [("ddp", 1, 4), ("ddp", 2, 2), ("fsdp2", 1, 4), ("single", 1, 1)]


def test_each_skip_reason(monkeypatch):
    reasons = {}

    def reason(text, executor="slurm"):
        p = plan(text, executor)
        assert not p.runs and len(p.skipped) == 1, (p.runs, p.skipped)
        return p.skipped[0].reason

    base = "name: t\nslurm: {gpus_per_node: 2}\n"
    reasons["framework"] = reason(base + "defaults: {framework: megatron, parallelism: ddp}")
    assert reasons["framework"] == "megatron has no parallelism ddp (it has tpN)"
    reasons["single"] = reason(base + "defaults: {parallelism: single, nodes: 2}")
    assert reasons["single"] == "single runs on one process, not 2 node(s) x 1: use ddp, fsdp2 or hsdp"
    reasons["tp_node"] = reason(base + "defaults: {framework: megatron, parallelism: tp4}")
    assert reasons["tp_node"] == "tp4 needs 4 GPUs in one node; a node has 2"
    reasons["divisible"] = reason("name: t\nslurm: {gpus_per_node: 3}\ndefaults: {framework: megatron, parallelism: tp2}")
    assert reasons["divisible"] == "world size 3 is not divisible by tp=2"
    reasons["heads"] = reason("name: t\nslurm: {gpus_per_node: 4}\ndefaults: {scale: 800M, framework: megatron, parallelism: tp4}")
    assert reasons["heads"] == "tp=4 does not divide the 10 attention heads of 800M"
    reasons["hsdp"] = reason(base + "defaults: {parallelism: hsdp}")
    assert "hsdp" in reasons["hsdp"] and "nodes >= 2" in reasons["hsdp"]
    reasons["local"] = reason(base + "defaults: {parallelism: ddp, nodes: 2}", executor="local")
    assert "local executor" in reasons["local"] and "--executor slurm" in reasons["local"]
    # The backend's own verdict (echobench.backends.parallelism_problem) comes last, verbatim.
    monkeypatch.setattr(backends, "parallelism_problem", lambda cfg: "the backend says no")
    assert reason(base + "defaults: {parallelism: ddp}") == "the backend says no"
    # A bad combination of valid values (RunConfig's own check) is skipped too, not fatal.
    assert "t5_hidden_dim" in reason("name: t\ndefaults: {t5_hidden_dim: 7}")


def test_only_filters_by_setting():
    p = plan("name: t\naxes: {micro_batch: [1, 2, 4], ac: [none, full]}\n")
    assert len(select(p.runs, parse_only(["micro_batch=2"]))) == 2
    assert len(select(p.runs, parse_only(["micro_batch=2", "micro_batch=4", "ac=full"]))) == 2
    with pytest.raises(MatrixError, match="KEY=VALUE"):
        parse_only(["micro_batch"])
    with pytest.raises(MatrixError, match="unknown run key 'bogus': allowed scale"):
        parse_only(["bogus=1"])
    with pytest.raises(MatrixError, match="ac='most' is not valid: allowed none, selective, full"):
        parse_only(["ac=most"])


def test_run_ids_are_stable_and_follow_the_settings():
    text = "name: t\naxes: {scale: [tiny], micro_batch: [1, 2]}\ndefaults: {steps: 3}\n"
    reordered = "name: other\ndefaults: {steps: 3}\naxes: {micro_batch: [1, 2], scale: [tiny]}\n"
    ids = [r.id for r in plan(text).runs]
    assert ids == [r.id for r in plan(text).runs]
    assert sorted(ids) == sorted(r.id for r in plan(reordered).runs)  # the matrix's name or order: no matter
    assert len(set(ids)) == 2 and ids[0].startswith("tiny-torchtitan-single-n1x1-mb1-")
    # Same as the run itself computes, and blind to settings that do not change what is measured.
    cfg = plan(text).runs[0].cfg
    assert ids[0] == run_id(cfg) == run_id(RunConfig.from_dict({**cfg.to_dict(), "device": "cpu"}))
    assert run_id(RunConfig.from_dict({**cfg.to_dict(), "seed": 1})) != ids[0]


def test_repeats_run_every_run_n_times_with_distinct_ids():
    text = "name: t\ndefaults: {scale: tiny}\naxes: {micro_batch: [1, 2]}\n"
    once = plan(text)
    p = plan(text + "repeats: 3\n")
    assert len(p.runs) == 6 and p.duplicates == 0 and len({r.id for r in p.runs}) == 6
    for mb in (1, 2):
        runs = [r for r in p.runs if r.cfg.micro_batch == mb]
        assert sorted(r.cfg.repeat for r in runs) == [0, 1, 2]
        # the same settings otherwise: one configuration id, and repeat 0 keeps the id it had without repeats
        assert len({config_id(r.cfg) for r in runs}) == 1
        assert {r.id for r in runs} == {config_id(runs[0].cfg)} | {f"{config_id(runs[0].cfg)}-r{k}" for k in (1, 2)}
    assert {r.id for r in once.runs} <= {r.id for r in p.runs}
    assert "m.yaml: repeats: Input should be greater than or equal to 1" in error("name: t\nrepeats: 0\n")


# ---- validation errors: the file, the key, what is allowed ----

@pytest.mark.parametrize("text, expected", [
    ("name: t\nexecutr: local\n", "m.yaml: unknown key 'executr' (did you mean 'executor'?): allowed name, site, executor, slurm, local, hardware"),
    ("name: t\nslurm: {gpu_per_node: 4}\n", "m.yaml: unknown key 'slurm.gpu_per_node' (did you mean 'gpus_per_node'?): allowed partition, account"),
    ("name: t\nexecutor: cloud\n", "m.yaml: executor: Input should be 'local' or 'slurm' (got 'cloud')"),
    ("name: t\nslurm: {gpus_per_node: four}\n", "m.yaml: slurm.gpus_per_node: Input should be a valid integer"),
    ("name: t\nslurm: {gpus_per_node: 0}\n", "m.yaml: slurm.gpus_per_node: Input should be greater than or equal to 1"),
    ("name: t\nslurm: {time: soon}\n", "m.yaml: slurm.time: 'soon' is not a valid time limit"),
    ("name: t\nhardware: {peak_tflops: -1}\n", "m.yaml: hardware.peak_tflops: Input should be greater than 0"),
    ("name: t\nhardware: {device: TPU9}\n", "m.yaml: hardware.device: no memory size known for device 'TPU9'"),
    ("axes: {}\n", "m.yaml: name is required"),
    ("name: t\naxes: {scale: [800M, 5B]}\n", "m.yaml: axes.scale: scale='5B' is not valid: allowed tiny, 800M, 3B, 8B"),
    ("name: t\naxes: {parallelism: [tp0]}\n", "m.yaml: axes.parallelism: parallelism='tp0' is not valid: allowed single, ddp, fsdp2, hsdp (torchtitan); tpN with N >= 1 (megatron)"),
    ("name: t\naxes: {parallelism: [tpN]}\n", "m.yaml: axes.parallelism: parallelism='tpN' is not valid: allowed"),
    ("name: t\naxes: {parallelism: [tpx]}\n", "m.yaml: axes.parallelism: parallelism='tpx' is not valid: allowed single"),
    ("name: t\naxes: {steps: [10, ten]}\n", "m.yaml: axes.steps: steps='ten' has the wrong type: expected int"),
    ("name: t\naxes: {compile: [yes please]}\n", "m.yaml: axes.compile: compile='yes please' is not valid: allowed auto, true or false"),
    ("name: t\naxes: {scale: []}\n", "m.yaml: axes.scale: an axis needs at least one value"),
    ("name: t\naxes: {scale: 3B}\n", "m.yaml: axes.scale: Input should be a valid list"),
    ("name: t\ndefaults: {batch: 8}\n", "m.yaml: defaults.batch: unknown run key 'batch' (did you mean 'batching' or 'micro_batch'?): allowed scale, framework"),
    ("name: t\ndefaults: {precision: fp16}\n", "m.yaml: defaults.precision: precision='fp16' is not valid: allowed auto, bf16, fp32, fp8"),
    ("name: t\nexclude: [{}]\n", "m.yaml: exclude[0] is empty"),
    ("name: t\nexclude: [{ac: [none, most]}]\n", "m.yaml: exclude[0].ac: ac='most' is not valid: allowed none, selective, full"),
    ("name: t\ninclude: [{nodes: 0}]\n", "m.yaml: include[0].nodes: nodes=0 is not valid: allowed an integer >= 1"),
    ("name: t\naxes: {nodes: [1, -1]}\n", "m.yaml: axes.nodes: nodes=-1 is not valid: allowed an integer >= 1"),
    ("name: t\ndefaults: {micro_batch: 0}\n", "m.yaml: defaults.micro_batch: micro_batch=0 is not valid: allowed an integer >= 1"),
    ("name: t\nexclude: [{warmup_steps: -1}]\n", "m.yaml: exclude[0].warmup_steps: warmup_steps=-1 is not valid: allowed an integer >= 0"),
    ("name: t\nname: u\n", "m.yaml: duplicate key 'name' (line 2): each key once"),
    ("name: t\ndefaults: {steps: 3, micro_batch: 2, steps: 4}\n", "m.yaml: duplicate key 'steps' (line 2): each key once"),
    ("name: t\nmax_runs: 0\n", "m.yaml: max_runs: Input should be greater than or equal to 1"),
    ("name: t\ninclude: [{time_limit: forever}]\n", "m.yaml: include[0].time_limit: 'forever' is not a valid time limit"),
    ("- a list\n", "m.yaml: expected a mapping"),
    ("name: [unclosed\n", "m.yaml: not valid YAML"),
    ("name: t\n? [a, b]\n: 1\n", "m.yaml: not valid YAML"),  # an unhashable key, as safe_load says
])
def test_validation_errors_name_the_file_the_key_and_the_allowed_values(text, expected):
    assert expected in error(text)


def test_yaml_merge_keys_work_as_in_safe_load():
    m = parse_matrix("name: t\ndefaults: &base {steps: 2, micro_batch: 2}\n"
                     "include: [{<<: *base, seed: 1}, {<<: *base, steps: 3}]\n", "m.yaml")
    assert m.include == [{"steps": 2, "micro_batch": 2, "seed": 1}, {"steps": 3, "micro_batch": 2}]


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_bytes("name: t\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(MatrixError) as exc:
        load_matrix(path)
    assert str(exc.value) == f"{path}: not UTF-8 text (byte 0xe9 at offset 13): save the file as UTF-8"


def test_tp_of_any_width_is_well_formed_and_skipped_with_its_reason_when_it_cannot_run():
    p = plan("name: t\nslurm: {gpus_per_node: 3}\ndefaults: {scale: 3B, framework: megatron}\n"
             "axes: {parallelism: [tp3, tp16]}\n", executor="slurm")
    assert not p.runs and [s.reason for s in p.skipped] == [
        "tp=3 does not divide the 20 attention heads of 3B", "tp16 needs 16 GPUs in one node; a node has 3"]


def test_a_matrix_over_the_run_limit_is_refused_before_expanding():
    axes = "axes: {seed: [%s], steps: [%s], micro_batch: [%s]}\n" % tuple(
        ", ".join(str(i) for i in range(1, 101)) for _ in range(3))
    with pytest.raises(MatrixError) as exc:
        plan("name: t\n" + axes)  # 10^6 runs
    assert "m.yaml: axes: 1,000,000 runs (seed 100 x steps 100 x micro_batch 100) are over the limit of 10,000" \
        in str(exc.value) and "max_runs" in str(exc.value) and "--max-runs" in str(exc.value)
    small = "name: t\naxes: {seed: [1, 2, 3]}\ninclude: [{seed: 4}]\n"
    with pytest.raises(MatrixError, match="4 runs .* over the limit of 3"):
        expand(parse_matrix(small, "m.yaml"), max_runs=3)
    assert len(expand(parse_matrix(small + "max_runs: 3\n", "m.yaml"), max_runs=4).runs) == 4  # the flag wins
    with pytest.raises(MatrixError, match="over the limit of 3"):
        plan(small + "max_runs: 3\n")


def test_a_missing_file_is_a_one_line_error(tmp_path):
    with pytest.raises(MatrixError, match="cannot read it"):
        load_matrix(tmp_path / "nope.yaml")


# ---- shell safety ----

@pytest.mark.parametrize("text, where", [
    ("name: 'x; rm -rf ~'\n", "name"),
    ("name: ../../etc\n", "name"),
    ("name: t\nslurm: {partition: \"debug\\n#SBATCH --wrap=id\"}\n", "slurm.partition"),
    ("name: t\nslurm: {account: '$(id)'}\n", "slurm.account"),
    ("name: t\nslurm: {extra: [\"--comment=a\\n#SBATCH --wrap=id\"]}\n", "slurm.extra"),
    ("name: t\nslurm: {srun_args: ['--x=a', '-w node1']}\n", "slurm.srun_args"),
    ("name: t\nslurm: {extra: ['-w node1']}\n", "slurm.extra"),
    ("name: t\nslurm: {env: {'A;id': x}}\n", "slurm.env"),
    ("name: t\nslurm: {time: '1:00; id'}\n", "slurm.time"),
    ("name: t\nslurm: {mem: '1G --wrap=id'}\n", "slurm.mem"),
])
def test_injection_attempts_are_rejected(text, where):
    assert f"m.yaml: {where}" in error(text)


def test_env_values_reach_the_script_quoted(tmp_path):
    """An env value full of shell syntax is exported literally: nothing runs."""
    marker = tmp_path / "pwned"
    evil = f"$(touch {marker}); `touch {marker}` ' \" \\ \n; touch {marker}"
    m = parse_matrix(json.dumps({"name": "t", "executor": "slurm", "slurm": {"env": {"EVIL": evil}}}), "m.yaml")
    run = expand(m).runs[0]
    script = render_script(run.cfg, tmp_path / run.id, m.spec.slurm)
    exports = [line for line in script.splitlines(keepends=True) if line.startswith("export EVIL=")]
    start = script.index("export EVIL=")
    end = script.index("\nMASTER_ADDR=") if "# setup" not in script else script.index("# setup")
    proc = subprocess.run(["bash", "-c", script[start:end] + '\nprintf %s "$EVIL"'], capture_output=True, text=True)
    assert exports and proc.returncode == 0 and proc.stdout == evil and not marker.exists()
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0


def test_run_dirs_stay_inside_the_sweep(tmp_path):
    assert run_dir(tmp_path, "tiny-torchtitan-single-n1x1-mb2-12345678") == tmp_path / "tiny-torchtitan-single-n1x1-mb2-12345678"
    for bad in ("../x", "..", "a/b", "/etc", "x y", "$(id)"):
        with pytest.raises(ValueError):
            run_dir(tmp_path, bad)


def test_job_script_asks_slurm_for_the_layout_and_matches_scripts_run_sh(tmp_path):
    m = parse_matrix("""
name: t
executor: slurm
slurm: {partition: gpu, account: proj1, qos: high, constraint: 'gh200&ib', time: "00:20:00", gpus_per_node: 4,
        cpus_per_task: 72, extra: ['--reservation=bench'], setup: ['module load cuda'], env: {NCCL_DEBUG: WARN}}
defaults: {parallelism: single}
""", "m.yaml")
    run = expand(m).runs[0]
    script = render_script(run.cfg, tmp_path / run.id, m.spec.slurm)
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=1", "#SBATCH --time=00:20:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj1", "#SBATCH --qos=high",
                 "#SBATCH --constraint=gh200&ib", "#SBATCH --cpus-per-task=72", "#SBATCH --reservation=bench",
                 f"#SBATCH --output={tmp_path / run.id}/logs/slurm-%j.out", "module load cuda", "export NCCL_DEBUG=WARN",
                 "NPROC=1", "#SBATCH --no-requeue"):
        assert line in script.splitlines(), line
    assert script.endswith(LAUNCH_BODY)
    by_hand = (ROOT / "scripts" / "run.sh").read_text()
    # A requeued job would rerun under the same id and truncate its log: never requeued, --retry-failed reruns.
    assert by_hand.endswith(LAUNCH_BODY) and "#SBATCH --no-requeue" in by_hand.splitlines()
    with pytest.raises(ValueError, match="#SBATCH lines"):
        render_script(run.cfg, tmp_path / "a dir" / run.id, m.spec.slurm)


# ---- memory estimate ----

def cfg(**kw):
    return RunConfig.from_dict({"precision": "bf16", "audio_frames": 750, "text_tokens": 256, "speaker_frames": 750,
                                "micro_batch": 8, **kw})


def test_memory_estimate_follows_sharding_checkpointing_and_size():
    gib = lambda **kw: estimate_memory(cfg(**kw)).total_gib  # noqa: E731
    assert gib(scale="800M") < gib(scale="3B") < gib(scale="8B")
    assert gib(scale="3B", ac="full") < gib(scale="3B", ac="selective") < gib(scale="3B")
    assert gib(scale="3B", micro_batch=4) < gib(scale="3B", micro_batch=8)
    four = dict(scale="8B", nodes=1, gpus_per_node=4)
    assert gib(parallelism="fsdp2", **four) < gib(parallelism="ddp", **four)
    assert gib(parallelism="hsdp", scale="8B", nodes=2, gpus_per_node=4) > gib(parallelism="fsdp2", scale="8B", nodes=2, gpus_per_node=4)
    assert gib(framework="megatron", parallelism="tp4", **four) < gib(framework="megatron", parallelism="tp1", **four)
    e = estimate_memory(cfg(scale="3B", master_weights="fp32-autocast"))
    assert e.optimizer == 2 * e.weights and e.encoder > 0 and e.activations > 0
    # a GPU's default on one process: bf16 parameters + fp32 masters (6 bytes), no cast weights kept
    lean = estimate_memory(cfg(scale="3B"))
    assert lean.optimizer == 8 / 6 * lean.weights and lean.activations < e.activations


def test_runs_that_would_not_fit_are_marked():
    assert device_memory_gib(None, "NVIDIA GH200 480GB") == 95.0 and device_memory_gib(None, None) is None
    p = plan("name: t\nhardware: {device: H200}\ndefaults: {precision: bf16}\naxes: {scale: [800M, 8B]}\n")
    fits = {r.cfg.scale: r.fits for r in p.runs}
    assert fits == {"800M": True, "8B": False}  # 8B's weights + AdamW alone are ~130 GiB on one GPU
    p = plan("name: t\nhardware: {memory_gib: 2}\ndefaults: {scale: tiny}\n")
    assert p.runs[0].fits is True
    p = plan("name: t\ndefaults: {scale: tiny}\n")
    assert p.runs[0].fits is None  # no device memory known: not checked


# ---- shipped matrices ----

def test_shipped_matrices_parse_and_expand():
    smoke = expand(load_matrix(ROOT / "matrices" / "smoke.yaml"))
    layouts = {(r.cfg.framework, r.cfg.parallelism) for r in smoke.runs} | {
        (s.settings["framework"], s.settings["parallelism"]) for s in smoke.skipped}
    assert layouts == {("torchtitan", "single"), ("torchtitan", "ddp"), ("megatron", "tp2")}
    assert all(r.cfg.scale == "tiny" for r in smoke.runs)
    gh = expand(load_matrix(ROOT / "matrices" / "gh200-published.yaml"))
    combos = {(s.get("scale"), s.get("framework"), s.get("parallelism"), s.get("nodes"))
              for s in [r.settings for r in gh.runs] + [s.settings for s in gh.skipped]}
    # 3B: FSDP2 on one node, HSDP beyond (shard in a node, replicate across); every run compile: auto
    assert combos == {(scale, fw, par, n) for scale, fw, par in
                      [("800M", "torchtitan", "ddp"), ("3B", "megatron", "tp2"), ("8B", "megatron", "tp4")]
                      for n in (1, 4, 16)} | {("3B", "torchtitan", "fsdp2", 1), ("3B", "torchtitan", "hsdp", 4),
                                              ("3B", "torchtitan", "hsdp", 16)}
    assert all(r.cfg.compile == "auto" for r in gh.runs) and len(gh.runs) == 12
    assert all(r.cfg.gpus_per_node == 4 and r.fits for r in gh.runs)
    h200 = expand(load_matrix(ROOT / "matrices" / "h200-single.yaml"))
    titan = [r for r in h200.runs if r.cfg.framework == "torchtitan"]
    assert len(titan) == 24 and len(h200.runs) + len(h200.skipped) == 26  # + megatron tp1 at 800M and 3B
    assert all(r.cfg.world_size == 1 for r in h200.runs)


def test_plan_command_prints_runs_skips_and_the_exact_script(cli, tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text("name: t\nexecutor: slurm\nhardware: {peak_tflops: 100, memory_gib: 80}\n"
                 "axes: {parallelism: [single, tp2]}\n")
    proc = cli("plan", m, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [s["reason"] for s in out["skipped"]] == ["torchtitan has no parallelism tp2 (it has single, ddp, fsdp2, hsdp)"]
    rid = out["runs"][0]["run_id"]
    assert out["runs"][0]["fits"] is True and out["runs"][0]["gpu_hours_limit"] == pytest.approx(0.5)
    proc = cli("plan", m, "--out", tmp_path / "sweep", "--script", rid)
    assert proc.returncode == 0 and proc.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=eb-" + rid)
    assert f"RUN_DIR={tmp_path / 'sweep' / rid}" in proc.stdout
    proc = cli("plan", m)
    assert proc.returncode == 0 and "1 runs, 1 skipped" in proc.stdout and "GPU-hours" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\naxes: {scale: [9B]}\n")
    proc = cli("plan", bad)
    assert proc.returncode == 2 and "axes.scale: scale='9B' is not valid" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("body, expected", [
    (b"name: t\n# \xff\n", "not UTF-8 text"),
    (b"name: t\ndefaults: {steps: 1}\ndefaults: {steps: 2}\n", "duplicate key 'defaults' (line 3)"),
    (b"name: t\naxes: {nodes: [0]}\n", "axes.nodes: nodes=0 is not valid"),
    (b"name: t\naxes: {seed: [1, 2, 3], steps: [1, 2]}\n", "6 runs (seed 3 x steps 2) are over the limit of 5"),
])
def test_plan_and_sweep_refuse_a_bad_matrix_in_one_line_and_write_nothing(cli, tmp_path, body, expected):
    m = tmp_path / "m.yaml"
    m.write_bytes(body)
    out = tmp_path / "sweep"
    for command in (["plan", m], ["sweep", m, "--out", out]):
        proc = cli(*command, "--max-runs", "5")
        err = proc.stderr.strip()
        assert proc.returncode == 2 and len(err.splitlines()) == 1 and str(m) in err and expected in err, err
    assert not out.exists()


def test_plan_names_the_runs_without_a_peak_and_where_theirs_will_come_from(cli, tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text("name: t\nexecutor: slurm\nslurm: {request_gpus: false}\n"
                 "include: [{seed: 1}, {seed: 2, peak_tflops: 3}]\n")
    out = json.loads(cli("plan", m, "--json").stdout)
    no_peak, with_peak = out["runs"]
    assert (no_peak["peak_tflops"], with_peak["peak_tflops"], with_peak["peak_source"]) == (None, 3, "matrix")
    assert f"1 of 2 runs ({no_peak['run_id']})" in out["no_peak"] and "calibrates once on a compute node" in out["no_peak"]
    proc = cli("plan", m)
    assert proc.returncode == 0 and "no peak known for 1 of 2 runs" in proc.stdout
    # The run without a peak reads the calibration the sweep makes in SWEEP/cache; the other does not need it.
    for run, exported in ((no_peak, True), (with_peak, False)):
        script = cli("plan", m, "--out", tmp_path / "sweep", "--script", run["run_id"]).stdout
        assert (f"export ECHOBENCH_CACHE={tmp_path / 'sweep' / 'cache'}" in script.splitlines()) == exported


def test_the_calibration_job_script(tmp_path):
    from echobench.sweep.executors.slurm_script import render_calibration_script
    from echobench.sweep.cluster import ContainerSettings

    m = parse_matrix("name: t\nexecutor: slurm\nslurm: {partition: cpu, time: '2:00:00', gpus_per_node: 4, "
                     "env: {A: b}}\n", "m.yaml")
    script = render_calibration_script(tmp_path, m.spec.slurm, "cuda")
    lines = script.splitlines()
    for line in ("#SBATCH --nodes=1", "#SBATCH --gpus-per-node=1", "#SBATCH --partition=cpu", "#SBATCH --time=10",
                 "#SBATCH --no-requeue", f"#SBATCH --output={tmp_path}/logs/calibrate-%j.out", "export A=b",
                 f"export ECHOBENCH_CACHE={tmp_path}/cache"):
        assert line in lines, line
    assert lines[-1] == ('exec ${ON_FIRST_NODE[@]+"${ON_FIRST_NODE[@]}"} ${IN_CONTAINER[@]+"${IN_CONTAINER[@]}"} '
                         '"$PYTHON" -m echobench calibrate --device cuda')
    assert "ON_FIRST_NODE=()" in lines  # no container: run here
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    # In a container, calibration runs where the runs will: in the image, through srun.
    boxed = m.spec.slurm.model_copy(update={"container": ContainerSettings(image="img.sif", runtime="apptainer")})
    lines = render_calibration_script(tmp_path, boxed, "cuda").splitlines()
    assert "ON_FIRST_NODE=(srun --nodes=1 --ntasks=1 --kill-on-bad-exit=1)" in lines
    assert any(line.startswith("IN_CONTAINER=(apptainer exec --nv --bind ") and line.endswith(" img.sif)") for line in lines)


def test_every_matrix_the_docs_show_is_a_slurm_sweep_that_plans(tmp_path):
    """Every ```yaml block of README.md and docs/**/*.md: a matrix is a SLURM sweep that plans (none of its
    runs skipped: a card's file, from matrices/, is there), and every
    tune file (top-level `scale:`) loads and ranks on its device's profile."""
    from echobench.predict import profile_for_device
    from echobench.tune.space import build_problem, load_tune_file

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    blocks = [(page, text) for page in pages for text in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.S)]
    assert blocks
    tunes = 0
    for page, text in blocks:
        if "scale" in yaml.safe_load(text):
            (tmp_path / "tune.yaml").write_text(text)
            spec = load_tune_file(tmp_path / "tune.yaml")
            profile = profile_for_device(spec.hardware["device"], fabric=spec.slurm.get("fabric"))
            assert all(build_problem(spec, spec.scale[0], n, profile).ranked for n in spec.nodes), text
            tunes += 1
            continue
        # read as a file of matrices/, where the docs' commands keep them (a card's file is taken from there)
        matrix = parse_matrix(text, ROOT / "matrices" / f"{page.stem}.yaml")
        plan = expand(matrix)
        assert matrix.spec.executor == "slurm" and plan.runs and not plan.skipped, f"{page}: {text} {plan.skipped}"
    assert tunes and tunes < len(blocks)


def test_a_matrix_with_two_problems_is_still_one_line():
    with pytest.raises(MatrixError) as err:
        parse_matrix("name: 'bad name!'\nbogus: 1\n", "m.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("m.yaml: ") and "unknown key 'bogus'" in message
    assert "matrix name" in message and message.count("m.yaml") == 1


# ---- a file given to the wrong command ----

def test_the_kinds_of_file_are_told_apart_by_keys_only_each_has():
    from echobench.tune.space import TuneFile

    # global_batch: a tune file's, and meant for matrices too; it tells nothing about the kind
    assert TUNE_ONLY_KEYS == set(TuneFile.model_fields) - set(MatrixFile.model_fields) - set(FIELDS) - {"global_batch"}
    assert MATRIX_ONLY_KEYS == set(MatrixFile.model_fields) - set(TuneFile.model_fields)


@pytest.mark.parametrize("command, path, said", [
    ("plan", "tunes/cpu-tiny.yaml", "this is a tune file (search, top_k): `echobench tune tunes/cpu-tiny.yaml`"),
    ("sweep", "matrices/runs/megatron-3b-tp2.yaml", "this is a run file (run settings only): "
                                                    "`echobench run --config matrices/runs/megatron-3b-tp2.yaml`"),
    ("tune", "matrices/smoke.yaml", "this is a matrix file (axes, exclude, include): `echobench plan matrices/smoke.yaml`"),
])
def test_a_file_given_to_the_wrong_command_is_named_with_the_right_one(command, path, said):
    from typer.testing import CliRunner

    from echobench.cli import app

    result = CliRunner().invoke(app, [command, path])
    assert result.exit_code == 2 and said in " ".join(result.output.split()), result.output
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("text, said", [
    ("name: t\ndefaults: {mico_batch: 2}\n", "unknown run key 'mico_batch' (did you mean 'micro_batch'"),
    ("name: t\nlocal: {tiem: '00:05:00'}\n", "unknown key 'local.tiem' (did you mean 'time'?)"),
    ("name: t\nbogus: 1\n", "unknown key 'bogus': allowed name,"),  # nothing near: no guess
])
def test_an_unknown_key_names_the_nearest_allowed_one(text, said):
    with pytest.raises(MatrixError) as exc:
        parse_matrix(text, "m.yaml")
    assert said in str(exc.value)


def test_plan_and_predict_take_only_as_sweep_does(cli):
    """--only KEY=VALUE lists the same runs in plan, predict and (what it would run) sweep."""
    path = ROOT / "matrices" / "gh200-published.yaml"
    want = sorted(r.id for r in select(expand(load_matrix(path)).runs, parse_only(["scale=3B", "nodes=1"])))
    assert len(want) == 2
    planned = json.loads(cli("plan", path, "--only", "scale=3B", "--only", "nodes=1", "--json", check=True).stdout)
    predicted = json.loads(cli("predict", path, "--only", "scale=3B", "--only", "nodes=1", "--json", check=True).stdout)
    assert sorted(r["run_id"] for r in planned["runs"]) == want == sorted(r["run_id"] for r in predicted)
    bad = cli("plan", path, "--only", "scal=3B")
    assert bad.returncode == 2 and "unknown run key 'scal' (did you mean 'scale'?)" in " ".join(bad.stderr.split())


# ---- the global batch held, configs, local processes ----

GB = """
name: t
executor: slurm
slurm: {gpus_per_node: 4, fabric: none}
defaults: {scale: 3B, micro_batch: 8, device: cpu, %s}
configs:
  - {framework: torchtitan, parallelism: ddp}
  - {framework: torchtitan, parallelism: fsdp2, nodes: 1}
  - {framework: torchtitan, parallelism: hsdp, nodes: [2, 4]}
  - {framework: megatron, parallelism: tp2}
  - {framework: megatron, parallelism: tp4}
axes: {nodes: [1, 2, 4]}
"""


def test_global_batch_per_node_derives_grad_accum_for_every_layout_and_node_count():
    p = plan(GB % "global_batch_per_node: 32")
    assert not p.skipped
    got = {(r.cfg.parallelism, r.cfg.nodes): (r.cfg.grad_accum, r.cfg.global_batch) for r in p.runs}
    tp = {"ddp": 1, "fsdp2": 1, "hsdp": 1, "tp2": 2, "tp4": 4}
    # data-parallel ranks = nodes x 4 / tp; grad_accum = 32 x nodes / (8 x ranks) = tp
    want = {(par, n): (tp[par], 32 * n) for par in tp for n in (1, 2, 4)
            if not (par == "fsdp2" and n > 1) and not (par == "hsdp" and n == 1)}
    assert got == want
    for r in p.runs:  # the derived accumulation is a setting of the run: its id, run.yaml, plan --json
        assert r.settings["grad_accum"] == r.cfg.grad_accum and r.cfg.to_dict()["grad_accum"] == r.cfg.grad_accum


def test_the_derived_accumulation_reaches_the_runs_run_yaml(tmp_path):
    from echobench.sweep.executors import make_executor, write_run_files

    matrix = parse_matrix(GB % "global_batch_per_node: 32", "m.yaml")
    run = next(r for r in expand(matrix).runs if r.cfg.parallelism == "tp4" and r.cfg.nodes == 2)
    write_run_files(run, tmp_path / run.id, matrix, make_executor("slurm", matrix))
    written = yaml.safe_load((tmp_path / run.id / "run.yaml").read_text())
    assert written["grad_accum"] == 4 and "global_batch_per_node" not in written  # run settings only
    assert RunConfig.from_dict(written).global_batch == 64 and run_id(RunConfig.from_dict(written)) == run.id


def test_a_fixed_global_batch_is_skipped_with_the_reason_where_no_accumulation_makes_it():
    p = plan(GB % "global_batch: 64")
    ok = {(r.cfg.parallelism, r.cfg.nodes): r.cfg.grad_accum for r in p.runs}
    assert ok == {("ddp", 1): 2, ("ddp", 2): 1, ("fsdp2", 1): 2, ("hsdp", 2): 1, ("tp2", 1): 4, ("tp2", 2): 2,
                  ("tp2", 4): 1, ("tp4", 1): 8, ("tp4", 2): 4, ("tp4", 4): 2}
    assert all(r.cfg.global_batch == 64 for r in p.runs)
    skipped = {(s.settings["parallelism"], s.settings["nodes"]): s.reason for s in p.skipped}
    assert skipped == {
        ("ddp", 4): "global batch 64 is smaller than micro_batch 8 x 16 data-parallel ranks (128): "
                    "micro_batch 4 would make it (grad_accum 1)",
        ("hsdp", 4): "global batch 64 is smaller than micro_batch 8 x 16 data-parallel ranks (128): "
                     "micro_batch 4 would make it (grad_accum 1)"}
    # Not a whole number of micro-batches: a smaller micro-batch that would make it is named, or none.
    reasons = {(s.settings["parallelism"], s.settings["nodes"]): s.reason for s in plan(GB % "global_batch: 40").skipped}
    assert reasons["ddp", 1] == ("global batch 40 is not a whole number of micro_batch 8 x 4 data-parallel ranks (32): "
                              "micro_batch 5 would make it (grad_accum 2)")
    reasons = {(s.settings["parallelism"], s.settings["nodes"]): s.reason for s in plan(GB % "global_batch: 6").skipped}
    assert reasons["ddp", 1] == ("global batch 6 is smaller than micro_batch 8 x 4 data-parallel ranks (32): "
                              "no micro-batch makes it on 4 data-parallel ranks")
    # per node: the reason says how the global batch came about
    reasons = {(s.settings["parallelism"], s.settings["nodes"]): s.reason
               for s in plan(GB % "global_batch_per_node: 24").skipped}
    assert reasons["tp2", 1] == ("global_batch_per_node 24 x 1 nodes = global batch 24 is not a whole number of "
                                 "micro_batch 8 x 2 data-parallel ranks (16): micro_batch 6 would make it (grad_accum 2)")


def test_an_explicit_grad_accum_that_disagrees_with_the_global_batch_is_an_error():
    with pytest.raises(MatrixError) as exc:
        plan(GB % "global_batch_per_node: 32, grad_accum: 2")
    message = str(exc.value)
    assert "\n" not in message and message.startswith("m.yaml: run 3B-torchtitan-ddp-n1x4-mb8-")
    assert ("grad_accum 2 makes global batch 64 (micro_batch 8 x 4 data-parallel ranks x 2), but "
            "global_batch_per_node 32 x 1 nodes = global batch 32 needs grad_accum 1") in message
    with pytest.raises(MatrixError, match=r"global batch 40 cannot be made \(global batch 40 is not a whole number"):
        plan(GB % "global_batch: 40, grad_accum: 1")
    # One that agrees is no error: megatron TP=2 at 1 and 2 nodes, accumulating 2.
    p = plan("name: t\nslurm: {gpus_per_node: 4}\ndefaults: {scale: 3B, device: cpu, micro_batch: 8, grad_accum: 2}\n"
             "configs: [{framework: megatron, parallelism: tp2, global_batch_per_node: 32}]\naxes: {nodes: [1, 2]}\n",
             "slurm")
    assert [(r.cfg.nodes, r.cfg.global_batch) for r in p.runs] == [(1, 32), (2, 64)]


def test_the_batch_keys_are_checked_and_the_nearer_layer_wins():
    assert "global_batch=0 is not valid: allowed an integer >= 1" in error("name: t\ndefaults: {global_batch: 0}\n")
    assert "global_batch_per_node=True is not valid" in error("name: t\naxes: {global_batch_per_node: [true]}\n")
    assert ("defaults: global_batch and global_batch_per_node both given: give one"
            in error("name: t\ndefaults: {global_batch: 8, global_batch_per_node: 8}\n"))
    assert "axes: global_batch and global_batch_per_node both given" in error(
        "name: t\naxes: {global_batch: [8], global_batch_per_node: [8]}\n")
    assert "unknown run key 'global_bach' (did you mean 'global_batch'" in error("name: t\ndefaults: {global_bach: 8}\n")
    # An include's (or a config's) global batch replaces the defaults' per-node one, not adds to it.
    p = plan("name: t\nslurm: {gpus_per_node: 2}\ndefaults: {scale: tiny, micro_batch: 2, global_batch_per_node: 8}\n"
             "configs: [{parallelism: ddp}, {parallelism: ddp, global_batch: 16}]\n"
             "include: [{parallelism: single, global_batch: 6}]\n")
    assert [(r.cfg.parallelism, r.cfg.grad_accum, r.cfg.global_batch) for r in p.runs] == [
        ("ddp", 2, 8), ("ddp", 4, 16), ("single", 3, 6)]


def test_plan_shows_each_runs_global_batch_and_accumulation(cli, tmp_path):
    m = tmp_path / "m.yaml"
    m.write_text(GB % "global_batch_per_node: 32")
    out = json.loads(cli("plan", m, "--json", check=True).stdout)
    rows = {r["run_id"]: r for r in out["runs"]}
    tp2 = [r for r in rows.values() if r["settings"]["parallelism"] == "tp2" and r["settings"]["nodes"] == 4]
    assert len(tp2) == 1 and (tp2[0]["global_batch"], tp2[0]["grad_accum"]) == (128, 2)
    assert tp2[0]["settings"]["grad_accum"] == 2 and tp2[0]["settings"]["global_batch_per_node"] == 32
    text = cli("plan", m, check=True, env={"COLUMNS": "250"}).stdout
    line = next(line for line in text.splitlines() if tp2[0]["run_id"] in line)
    assert "8 x 2 / 128" in line
    m.write_text(GB % "global_batch: 64")
    out = json.loads(cli("plan", m, "--json", check=True).stdout)
    assert {s["reason"] for s in out["skipped"]} == {"global batch 64 is smaller than micro_batch 8 x 16 data-parallel "
                                                     "ranks (128): micro_batch 4 would make it (grad_accum 1)"}


def test_configs_cross_only_the_axes_they_leave_unset():
    p = plan("""
name: t
slurm: {gpus_per_node: 2}
defaults: {scale: tiny}
configs:
  - {parallelism: ddp}
  - {parallelism: single, micro_batch: [1, 2], seed: 7}
axes: {micro_batch: [4, 8], ac: [none, full]}
exclude: [{parallelism: ddp, micro_batch: 8, ac: full}]
include: [{parallelism: single, micro_batch: 16}]
""")
    got = [(r.cfg.parallelism, r.cfg.micro_batch, r.cfg.ac, r.cfg.seed) for r in p.runs]
    assert got == [("ddp", 4, "none", 0), ("ddp", 4, "full", 0), ("ddp", 8, "none", 0),
                   ("single", 1, "none", 7), ("single", 1, "full", 7), ("single", 2, "none", 7),
                   ("single", 2, "full", 7), ("single", 16, "none", 0)]
    assert p.excluded == 1 and not p.skipped
    assert "configs[1].micro_batch: give at least one value" in error("name: t\nconfigs: [{}, {micro_batch: []}]\n")
    assert "configs[0].ac: ac='most' is not valid" in error("name: t\nconfigs: [{ac: most}]\n")
    # counted before expanding: 2 configs (1 x 4 and 2 x 2 runs) + 1 include
    with pytest.raises(MatrixError, match=r"9 runs \(2 configs x micro_batch 2 x ac 2, \+ 1 included\)"):
        expand(parse_matrix("name: t\nconfigs: [{seed: 1}, {seed: 2, micro_batch: [1, 2]}]\n"
                            "axes: {micro_batch: [4, 8], ac: [none, full]}\ninclude: [{seed: 3}]\n", "m.yaml"),
               max_runs=8)


def test_local_processes_come_from_local_and_the_slurm_block_is_still_read():
    def per_node(text, executor=None):
        return {r.cfg.parallelism: r.cfg.gpus_per_node for r in plan(text, executor).runs}

    both = "name: t\nlocal: {gpus_per_node: 3}\nslurm: {gpus_per_node: 2, fabric: none}\naxes: {parallelism: [single, ddp]}\n"
    assert per_node(both) == {"single": 1, "ddp": 3}
    assert per_node(both, "slurm") == {"single": 1, "ddp": 2}  # --executor slurm: the slurm block's
    assert per_node("name: t\nslurm: {gpus_per_node: 2}\naxes: {parallelism: [ddp]}\n") == {"ddp": 2}  # the older form
    assert "local.gpus_per_node: Input should be greater than or equal to 1" in error("name: t\nlocal: {gpus_per_node: 0}\n")
    smoke = load_matrix(ROOT / "matrices" / "smoke.yaml")
    assert "slurm" not in yaml.safe_load(smoke.text) and smoke.spec.local.gpus_per_node == 2


# ---- the published matrix and the run files ----

PUBLISHED = ROOT / "matrices" / "gh200-published.yaml"


def test_the_published_matrix_is_its_five_configurations_at_one_global_batch_per_scale_and_node_count():
    p = expand(load_matrix(PUBLISHED))
    assert not p.skipped and not p.excluded and not p.duplicates
    assert sorted((r.cfg.scale, r.cfg.framework, r.cfg.parallelism, r.cfg.nodes) for r in p.runs) == sorted(
        [(s, fw, par, n) for s, fw, par in [("800M", "torchtitan", "ddp"), ("3B", "megatron", "tp2"),
                                            ("8B", "megatron", "tp4")] for n in (1, 4, 16)]
        + [("3B", "torchtitan", "fsdp2", 1), ("3B", "torchtitan", "hsdp", 4), ("3B", "torchtitan", "hsdp", 16)])
    batches: dict = {}
    for r in p.runs:
        batches.setdefault((r.cfg.scale, r.cfg.nodes), set()).add(r.cfg.global_batch)
    assert all(len(b) == 1 for b in batches.values()), batches
    assert {k: b.pop() for k, b in batches.items()} == {(s, n): per * n for s, per in (("800M", 32), ("3B", 32), ("8B", 8))
                                                        for n in (1, 4, 16)}
    # The Slingshot copy runs the same runs: only where and how they run differs.
    slingshot = expand(load_matrix(ROOT / "matrices" / "gh200-slingshot.yaml"))
    assert [r.cfg for r in slingshot.runs] == [r.cfg for r in p.runs]


# Keys a run file leaves to where it runs: --nproc / --nnodes, the device (auto: cuda on a GPU node; a
# CPU can try the file with overrides) and the peak (the matrix's hardware section; `run` takes the
# device's datasheet peak). Every other key must equal the published matrix's run on one node.
RUN_FILE_FREE = {"nodes", "gpus_per_node", "device", "peak_tflops"}


def run_file_disagreements(path, runs) -> list[str]:
    """One line per key where the run file `path` differs from its run in `runs` (the published
    matrix's runs on one node, by scale, framework and parallelism)."""
    settings = yaml.safe_load(path.read_text())
    nproc = re.search(r"--nproc (\d+)", path.read_text())
    cfg = RunConfig.from_dict({**settings, "gpus_per_node": int(nproc.group(1)) if nproc else 1})
    key = (cfg.scale, cfg.framework, cfg.parallelism)
    run = next((r for r in runs if (r.cfg.scale, r.cfg.framework, r.cfg.parallelism) == key), None)
    if run is None:
        return [f"{path.name}: no run of {PUBLISHED.name} on one node is {' '.join(key)}"]
    name = PUBLISHED.name
    ours, theirs = cfg.to_dict(), run.cfg.to_dict()
    lines = [f"{path.name}: {k}: {ours[k]!r} here, {theirs[k]!r} in {name} ({' '.join(key)}, 1 node)"
             for k in ours if k not in RUN_FILE_FREE and ours[k] != theirs[k]]
    if cfg.gpus_per_node != run.cfg.gpus_per_node:
        lines.append(f"{path.name}: its command's --nproc {cfg.gpus_per_node}, {run.cfg.gpus_per_node} GPUs a node in {name}")
    return lines


def test_each_run_file_is_its_published_run_on_one_node(tmp_path):
    runs = [r for r in expand(load_matrix(PUBLISHED)).runs if r.cfg.nodes == 1]
    files = sorted((ROOT / "matrices" / "runs").glob("*.yaml"))
    assert len(files) == 4
    problems = [line for path in files for line in run_file_disagreements(path, runs)]
    assert not problems, "\n".join(problems)
    # A disagreement is one line naming the file, the key and both values.
    bad = tmp_path / "megatron-8b-tp4.yaml"
    bad.write_text((ROOT / "matrices" / "runs" / "megatron-8b-tp4.yaml").read_text().replace("micro_batch: 8",
                                                                                             "micro_batch: 4"))
    assert run_file_disagreements(bad, runs) == [
        "megatron-8b-tp4.yaml: micro_batch: 4 here, 8 in gh200-published.yaml (8B megatron tp4, 1 node)"]
