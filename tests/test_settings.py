"""Run settings: one typed definition drives the flags, --config files, matrix files and the docs' settings page;
the backend registry."""

import re
import subprocess
import sys

import pytest
import typer
import yaml
from typer.testing import CliRunner

from conftest import ROOT
from echobench.backends import BACKENDS, parallelism_problem
from echobench.cli import app
from echobench.records.config import FIELDS, RunConfig, settings_table
from echobench.records.layout import Layout
from echobench.sweep.matrix import MatrixError, expand, parse_matrix

# Every command's options (names and secondary names) as they were before the options were
# generated from RunConfig (captured from main at 5729728): no flag may go missing or change name.
OPTIONS = {
    "run": ["--ac", "--audio-frames", "--batching", "--buckets", "--card", "--cfg-drop", "--cfg-drop-attention", "--master-weights", "--grad-accum-dtype", "--compile", "--config", "--data", "--synthetic-lengths", "--device", "--encoder-checkpoint",
            "--encoder-model", "--fail-at-step", "--fail-kind", "--fail-rank", "--float8-recipe", "--framework", "--frozen-encoder",
            "--master-addr", "--master-port", "--micro-batch", "--nnodes", "--no-compile", "--no-skip-bad-samples",
            "--node-rank", "--nproc", "--out", "--parallelism", "--peak-tflops", "--precision", "--trace", "--log-metrics",
            "--trace-limit-s", "--progress-every-s",
            "--repeats", "--scale", "--seed", "--sequence-parallel", "--skip-bad-samples", "--speaker-frames",
            "--steps", "--t5-hidden-dim", "--te", "--text-tokens", "--time-limit-s", "--tokenizer", "--tp",
            "--train-encoder", "--warmup-steps",
            # added since: gradient accumulation, attention kernels, data-parallel and megatron knobs
            "--distributed-optimizer", "--gc-every", "--grad-accum", "--grad-reduce-dtype", "--key-masking",
            "--loader-workers", "--no-distributed-optimizer", "--no-reshard-after-forward", "--no-sequence-parallel",
            "--reshard-after-forward", "--sdpa-backend"],
    "flops": ["--ac", "--audio-frames", "--encoder-model", "--frozen-encoder", "--json", "--scale",
              "--speaker-frames", "--text-tokens", "--train-encoder"],
    "calibrate": ["--audio-frames", "--budget-s", "--comm", "--comm-budget-s", "--device", "--dtype", "--iters", "--json",
                  "--master-addr", "--master-port", "--matrix", "--max-bytes", "--micro-batch", "--nnodes",
                  "--node-rank", "--nproc", "--out", "--scale", "--size", "--speaker-frames", "--text-tokens",
                  "--site"],  # the site file of --matrix
    "report": ["--margin", "--only", "--out", "--profile", "--reference", "--table", "-o", "paths"],
    "results": ["--columns", "--csv", "--json", "--only", "--sort", "paths"],
    "predict": ["--json", "--nodes", "--notes", "--only", "--profile", "path"],  # a matrix's runs only, since:
    # the model held against measured runs (predict --against) and published ones (predict --validate) became validate's
    "validate measured": ["--json", "--profile", "paths"],
    "validate published": ["--json", "--refit", "--write-fit", "path"],
    "compare": ["--alpha", "--threshold", "new", "old"],
    "explain": ["--json", "run_dir"],
    "plan": ["--executor", "--json", "--max-runs", "--only", "--out", "--profile", "--script", "--write-scripts", "matrix_path",
             "--site"],  # added since: a site file under the matrix
    "sweep": ["--executor", "--force", "--max-runs", "--no-preflight", "--no-wait", "--only", "--out", "--poll",
              "--preflight", "--retry-failed", "--wait", "matrix_path", "--site"],
    "preflight": ["--dry-run", "--executor", "--max-runs", "--only", "--out", "matrix_path", "--site"],
    "status": ["--export", "--json", "--only", "--poll", "--wait", "runs_dir"],
    "cancel": ["sweep_dir"],
    "data synth": ["--max-seconds", "--out", "--samples-per-shard", "--seed", "--shards"],
    "data index": ["--rebuild", "data"],
    "tune": ["--budget-gpu-hours", "--dry-run", "--executor", "--no-preflight", "--out", "--preflight", "--profile",
             "--top-k", "tune_file", "--site"],  # added since: issue 36
    "reproduce": ["--device", "--dry-run", "--executor", "--out", "--peak-tflops", "--profile", "--rows",
                  "--scale-down", "--site", "--steps", "--warmup-steps", "rows_file"],  # issue 45
}
# ... and the defaults of run's and flops' options then (compile and sequence_parallel: None, the
# flag not given, leaves the setting at auto).
DEFAULTS = {
    "run": {"out": None, "config": None, "nproc": None, "nnodes": 1, "node_rank": 0, "master_addr": None,
            "master_port": 29500, "repeats": 1, "scale": None, "framework": "torchtitan", "parallelism": "single",
            "tp": None, "te": "auto", "sequence_parallel": None, "steps": 30, "warmup_steps": 10, "micro_batch": 8,
            "data": "synthetic", "synthetic_lengths": "full", "precision": "auto", "peak_tflops": None, "audio_frames": 750, "text_tokens": 256,
            "speaker_frames": 750, "compile": None, "ac": "none", "seed": 0, "device": "auto",
            "skip_bad_samples": False, "batching": "pad", "buckets": None, "card": None, "encoder_model": None, "frozen_encoder": True, "t5_hidden_dim": None,
            "encoder_checkpoint": None, "tokenizer": None, "trace": False, "fail_at_step": None, "fail_rank": None,
            "fail_kind": "error", "time_limit_s": None, "trace_limit_s": 120.0, "log_metrics": "none", "progress_every_s": 30.0,
            "grad_accum": 1, "key_masking": "auto", "cfg_drop": "mask", "cfg_drop_attention": "split", "master_weights": "auto", "grad_accum_dtype": "auto", "sdpa_backend": "auto", "float8_recipe": "tensorwise",
            "reshard_after_forward": True,
            "grad_reduce_dtype": "fp32", "distributed_optimizer": False, "loader_workers": 0, "gc_every": 50},
    "flops": {"scale": "8B", "audio_frames": 750, "text_tokens": 256, "speaker_frames": 750, "ac": "none",
              "encoder_model": None, "frozen_encoder": True, "as_json": False},
}


def commands() -> dict:
    group = typer.main.get_command(app)
    out = {}
    for name, cmd in group.commands.items():
        for sub, inner in getattr(cmd, "commands", {name: cmd}).items():
            out[name if sub == name else f"{name} {sub}"] = inner
    return out


def test_every_command_keeps_its_options_and_defaults():
    cmds = commands()
    assert {name: sorted(o for p in cmd.params for o in p.opts + p.secondary_opts) for name, cmd in cmds.items()} \
        == {name: sorted(options) for name, options in OPTIONS.items()}
    for name, defaults in DEFAULTS.items():
        assert {p.name: p.default for p in cmds[name].params} == defaults


def test_the_help_of_a_run_option_is_its_fields():
    params = {p.name: p for p in commands()["run"].params}
    flagged = [name for name, f in FIELDS.items() if f.metadata["flag"] != ""]
    assert flagged and set(flagged) <= set(params)
    for name in flagged:
        assert params[name].help.startswith(FIELDS[name].metadata["help"]), name
    assert params["precision"].help.endswith("Allowed: auto, bf16, fp32, fp8.")
    assert "after the measured ones (untimed)" in params["trace"].help
    # Fields set another way (--nproc / --nnodes, a matrix's repeats) have no flag of their own.
    assert not {"nodes", "gpus_per_node", "repeat"} & set(params)


def one_error(result) -> str:
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("key, value, allowed", [
    ("te", "maybe", "auto, on, off"),
    ("precision", "maybe", "auto, bf16, fp32, fp8"),
    ("ac", "most", "none, selective, full"),
    ("fail_kind", "segfault", "error, oom, sigkill, hang"),
    ("device", "tpu", "auto, cuda, cpu"),
    ("scale", "9B", "tiny, 800M, 3B, 8B"),
])
def test_a_bad_choice_reads_the_same_from_a_flag_a_config_file_and_a_matrix(tmp_path, key, value, allowed):
    message = f"{key}={value!r} is not valid: allowed {allowed}"
    runner = CliRunner()
    flag = one_error(runner.invoke(app, ["run", f"--{key.replace('_', '-')}", value, "--out", str(tmp_path / "a")]))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({key: value}))
    from_file = one_error(runner.invoke(app, ["run", "--config", str(config), "--out", str(tmp_path / "b")]))
    with pytest.raises(MatrixError) as exc:  # an error naming the file, never a silently skipped run
        expand(parse_matrix(f"name: t\naxes: {{{key}: [{value}]}}\n", "m.yaml"))
    assert flag == f"error: run settings: {message}"
    assert from_file == f"error: {config}: {message}"
    assert str(exc.value) == f"m.yaml: axes.{key}: {message}"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_yaml_boolean_for_a_text_choice_says_to_quote_it(tmp_path):
    with pytest.raises(MatrixError, match=r"te=False is not valid: allowed auto, on, off; quote the value in YAML"):
        parse_matrix("name: t\ndefaults: {te: off}\n", "m.yaml")


def test_the_docs_list_every_setting_as_the_dataclass_defines_it():
    """docs/reference/settings.md is generated (tools/docs_reference.py); tests/test_docs.py holds the
    whole page current, this the table in it."""
    assert settings_table() in (ROOT / "docs" / "reference" / "settings.md").read_text()


def test_the_registry_lists_both_backends_and_their_layouts():
    assert {name: b.layouts for name, b in BACKENDS.items()} == {
        "torchtitan": ("single", "ddp", "fsdp2", "hsdp"), "megatron": ("tpN",)}
    megatron = BACKENDS["megatron"]
    assert megatron.has_layout(Layout.parse("tp1")) and megatron.has_layout(Layout.parse("tp12"))
    assert not BACKENDS["torchtitan"].has_layout(Layout.parse("tp2")) and not megatron.has_layout(Layout.parse("ddp"))
    # The framework's allowed values are the registry's names.
    with pytest.raises(ValueError, match="framework='jax' is not valid: allowed torchtitan, megatron"):
        RunConfig(framework="jax")
    # A layout the backend lacks is the registry's verdict; the rest, the backend's own.
    assert parallelism_problem(RunConfig(framework="megatron", parallelism="ddp")) == \
        "megatron has no parallelism ddp (it has tpN)"
    assert parallelism_problem(RunConfig(parallelism="single", gpus_per_node=2)).startswith(
        "single runs on one process")


def test_a_matrix_skips_a_run_for_the_backends_reason_verbatim():
    """Each layout check lives once, in its backend: the matrix's skip reason is the backend's."""
    text = ("name: t\nslurm: {gpus_per_node: 2}\n"
            "include: [{parallelism: single, nodes: 2}, {framework: megatron, parallelism: tp4},"
            " {parallelism: hsdp}, {framework: megatron, parallelism: tp3, gpus_per_node: 3}]\n")
    plan = expand(parse_matrix(text, "m.yaml"), "slurm")
    assert len(plan.skipped) == 4 and not plan.runs
    for s in plan.skipped:
        assert s.reason == parallelism_problem(s.cfg)


def test_validation_needs_no_megatron_core():
    """`plan` and `run` check settings before any process starts, on machines that may lack
    megatron-core: the registry and megatron's validate never import it."""
    code = (
        "import sys\n"
        "sys.modules['megatron'] = None  # any import of megatron-core now fails\n"
        "from echobench.backends import parallelism_problem\n"
        "from echobench.records.config import RunConfig\n"
        "cfg = RunConfig(framework='megatron', parallelism='tp2', gpus_per_node=2)\n"
        "print(parallelism_problem(cfg))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None"]


def test_run_help_groups_every_flag_into_a_panel_and_hides_the_testing_switches():
    """`run --help`: each flagged setting in exactly one named panel (none left in a catch-all), the
    fail_* switches hidden from it but still accepted."""
    from typer.testing import CliRunner

    from echobench.cli import app
    from echobench.cli.common import RUN_PANELS

    placed = [name for names in RUN_PANELS.values() for name in names]
    flagged = [name for name, f in FIELDS.items() if f.metadata["flag"] != ""]
    assert sorted(placed) == sorted(flagged), set(placed) ^ set(flagged)
    text = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    for panel in RUN_PANELS:
        assert (f"─ {panel} " in text) == (panel != "hidden"), panel
    assert "--fail-at-step" not in text and "--micro-batch" in text and "Other settings" not in text
    bad = CliRunner().invoke(app, ["run", "--out", "/nonexistent/x", "--fail-kind", "nope"])
    assert bad.exit_code == 2 and "fail_kind='nope' is not valid" in " ".join(bad.output.split()), bad.output


def test_version():
    from importlib.metadata import version

    from typer.testing import CliRunner

    from echobench.cli import app

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"echobench {version('echobench')}"


# ---- keys stored under a former name (records.config.FORMER_NAMES) ----

def test_what_a_run_stored_under_an_old_key_reads_as_the_new_one():
    """A record (or a sweep's run.yaml) written before the rename: its settings read with the new
    keys, so it pools with a new run of the same configuration and loads as a RunConfig."""
    from echobench.records.config import upgraded
    from echobench.records.results import Record, configuration_key

    new = RunConfig(scale="tiny", trace=True, trace_limit_s=9.0).to_dict()
    old = {("profile" if k == "trace" else "profile_limit_s" if k == "trace_limit_s" else k): v for k, v in new.items()}
    assert "trace" not in old and upgraded(old) == new and RunConfig.from_dict(upgraded(old)).trace is True
    records = [Record.without_run(RunConfig(scale="tiny"), "error", "x") for _ in range(2)]
    records[0].config, records[1].config = new, old
    assert configuration_key(records[0]) == configuration_key(records[1])


def test_run_has_no_default_scale(tmp_path):
    """Without --scale (or scale in --config) a run is refused, not run on the tiny toy."""
    result = CliRunner().invoke(app, ["run", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "--scale is required" in result.output and not (tmp_path / "x").exists()
    config = tmp_path / "run.yaml"
    config.write_text("scale: tiny\nsteps: 0\n")  # scale from the file; steps 0 stops it at validation
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--out", str(tmp_path / "y")])
    assert "--scale is required" not in result.output and "steps=0" in result.output


def test_a_tune_file_searches_parallelism_and_refuses_an_axis_it_does_not_search(tmp_path):
    from echobench.tune.space import AXES, TuneError, load_tune_file

    tune = tmp_path / "t.yaml"
    tune.write_text(yaml.safe_dump({"name": "t", "scale": "tiny", "search": {"layout": ["ddp"]}}))
    with pytest.raises(TuneError, match="search.layout: not a searched axis: one of parallelism, "):
        load_tune_file(tune)
    tune.write_text(yaml.safe_dump({"name": "t", "scale": "tiny", "search": {"parallelism": ["ddp", "tp2"]}}))
    assert load_tune_file(tune).search == {"parallelism": ["ddp", "tp2"]}
    # The reference page lists the searched axes as the code has them.
    page = (ROOT / "docs" / "reference" / "tune-file.md").read_text()
    listed = page.split("The searched axes")[1].split("\n\n")[0]
    assert set(re.findall(r"`([a-z_]+)`", listed)) == set(AXES)


def test_validate_measured_takes_directories_and_predict_a_matrix(tmp_path):
    """Each command's positional means one thing: predict's a matrix, validate measured's run directories."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    both = CliRunner().invoke(app, ["predict", str(a), str(b)])
    assert both.exit_code == 2 and "unexpected extra argument" in both.output
    missing = CliRunner().invoke(app, ["validate", "measured", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "no such file or directory" in missing.output
    empty = CliRunner().invoke(app, ["validate", "measured", str(a), str(b)])
    assert empty.exit_code == 2 and f"no successful runs under {a}, {b}" in empty.output.replace("\n", "")
