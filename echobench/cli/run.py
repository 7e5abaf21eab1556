"""`echobench run` and `echobench flops`: one benchmark run of the full model, and the parameter and
FLOP breakdown of a sample."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
import yaml

from echobench.backends import parallelism_problem
from echobench.cli.common import app, console, err_console, fail, settings_options, writable_dir
from echobench.records.config import RunConfig, auto_switch
from echobench.records.layout import Layout
from echobench.records.console import esc, record_report, repeats_report
from echobench.records.states import RunState
from echobench.records.results import RECORD_FILE
from echobench.records.yamltext import yaml_problem


def run_settings(ctx: typer.Context, params: dict, config: Path | None) -> dict:
    """Settings from --config YAML (the keys of a matrix's defaults); explicit flags override."""
    settings = {}
    if config is not None:
        try:
            settings = yaml.safe_load(config.read_text()) or {}
        except OSError as exc:
            fail(f"--config {config}: cannot read it ({exc.strerror})")
        except yaml.YAMLError as exc:
            fail(f"--config {config}: not valid YAML: {yaml_problem(exc)}")
        if not isinstance(settings, dict):
            fail(f"--config {config}: expected a mapping of run settings")
    # Compared by name: typer may carry its own copy of click's ParameterSource enum.
    explicit = ("COMMANDLINE", "ENVIRONMENT")
    for name, value in params.items():
        source = ctx.get_parameter_source(name)
        if value is None and (auto_switch(name) or name == "scale"):  # not given: the file's value, else the field's default
            continue
        if name not in settings or getattr(source, "name", None) in explicit:
            settings[name] = value
    return settings


@app.command()
@settings_options(scale=None)  # no default scale: --scale or scale in --config
def run(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory for result.json (created)."),
    config: Optional[Path] = typer.Option(None, "--config", help="YAML file of run settings; flags override it."),
    nproc: Optional[int] = typer.Option(None, help="Launch torchrun with this many processes on this node."),
    nnodes: int = typer.Option(1, help="With --nproc: number of nodes (one launcher per node)."),
    node_rank: int = typer.Option(0, help="With --nproc: this node's rank (SLURM_NODEID)."),
    master_addr: Optional[str] = typer.Option(None, help="With --nproc: rendezvous host (first node)."),
    master_port: int = typer.Option(29500, help="With --nproc: rendezvous port."),
    repeats: int = typer.Option(1, "--repeats", help="Independent launches of these settings, each a fresh process "
                                "group writing OUT/repeat-K/result.json; prints the median over them."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size (megatron): sets --parallelism tpN."),
    **params,
):
    """One benchmark run: real training steps of the full model (or, with --card, of a plain decoder from a
    model card); writes OUT/result.json."""
    from echobench.train.launch import LAUNCHED, dump_stacks_on_signal, launch, rendezvous_problem
    from echobench.train.metrics_log import metrics_log_problem

    if nproc is None:  # a rank: SLURM's USR1 before the time limit puts its stacks in the log (from here on)
        dump_stacks_on_signal()
    settings = run_settings(ctx, params, config)
    code = 0  # torchrun's exit code, with --nproc
    if tp is not None:
        settings["parallelism"] = tp_parallelism(ctx, tp)
    if nproc is not None:
        if nproc < 1 or nnodes < 1:
            fail("--nproc and --nnodes must be >= 1")
        settings.update(gpus_per_node=nproc, nodes=nnodes)
    try:
        cfg = RunConfig.from_dict(settings)
    except (ValueError, TypeError) as exc:
        fail(f"{config or 'run settings'}: {exc}")
    if problem := parallelism_problem(cfg):
        fail(problem)
    workload = card_workload(cfg)
    if problem := metrics_log_problem(cfg.log_metrics):  # before any process starts
        fail(problem)
    if "scale" not in settings and cfg.card is None:  # no default: one would benchmark the 0.35M-parameter toy on a GPU node
        fail("--scale is required: tiny (0.35M parameters, a smoke test on a CPU), 800M, 3B or 8B (Echo TTS as "
             "trained); or scale in the --config file")
    if nproc is not None and (problem := rendezvous_problem(nnodes, node_rank, master_addr)):
        fail(problem)
    writable_dir(out)
    if repeats != 1:
        run_repeats(cfg, out, repeats, nproc, nnodes, node_rank, master_addr, master_port)
        return
    if nproc is not None:
        record, code = launch(cfg, out, nproc, nnodes, node_rank, master_addr, master_port)
        if record is None:  # not node 0: node 0's launcher owns the record; this one exits as torchrun did,
            raise typer.Exit(code)  # so that srun --kill-on-bad-exit stops the job when this node failed
    else:
        from echobench.train.bench import run_benchmark
        from echobench.train.distributed import exit_process

        record = run_benchmark(cfg, out, workload)
        if int(os.environ.get("RANK", 0)) == 0 and LAUNCHED not in os.environ:  # echobench's launcher prints it
            print_record(record, out)
        # A non-zero exit makes torchrun stop the other ranks.
        exit_process(0 if record.status == RunState.OK else 1)
        if record.status != RunState.OK:
            raise typer.Exit(1)
        return
    print_record(record, out)
    if record.status != RunState.OK or code:
        raise typer.Exit(code or 1)


def card_workload(cfg):
    """A card run's workload (setting card: the card file or published row read, predict.cards.run),
    checked against the run's backend and layout (backends.checks.card_problem); None for Echo."""
    if cfg.card is None:
        return None
    from echobench.backends.checks import card_problem
    from echobench.predict.cards.run import run_card
    from echobench.predict.errors import PredictError

    try:
        workload = run_card(cfg.card)
    except PredictError as exc:
        fail(f"--card: {exc}")
    if problem := card_problem(cfg, workload):
        fail(problem)
    return workload


def run_repeats(cfg, out: Path, repeats: int, *launch_args) -> None:
    """`run --repeats N`: N launches one after another, then the median over the ok ones."""
    from echobench.train.launch import launch_repeats, under_torchrun

    if repeats < 1:
        fail(f"--repeats {repeats}: must be >= 1")
    if under_torchrun():
        fail("--repeats launches its own processes: run it outside torchrun (with --nproc N for several per node)")
    records, code = launch_repeats(cfg, out, repeats, *launch_args)
    if not records:  # not node 0: node 0's launcher owns the records; this one exits as its torchruns did
        raise typer.Exit(code)
    for part in repeats_report(records, out):
        console.print(part)
    if any(r.status != RunState.OK for r in records):
        raise typer.Exit(1)


def tp_parallelism(ctx: typer.Context, tp: int) -> str:
    """`--tp N` is shorthand for `--parallelism tpN`; both at once must agree."""
    if tp < 1:
        fail(f"--tp {tp}: must be >= 1")
    given, layout = ctx.params.get("parallelism"), Layout.tensor(tp).name
    if getattr(ctx.get_parameter_source("parallelism"), "name", None) == "COMMANDLINE" and given != layout:
        fail(f"--tp {tp} conflicts with --parallelism {given}: give one of them")
    return layout


def print_record(record, out: Path) -> None:
    """A run's Record as a table (its error, when it failed), and where it was written."""
    if record.status != RunState.OK:
        err_console.print(f"[bold red]{esc(record.status)}:[/] {esc(record.error)}", highlight=False,
                          soft_wrap=True)
    else:
        for part in record_report(record):
            console.print(part)
    console.print(f"wrote {esc(out / RECORD_FILE)}", highlight=False)


@app.command()
@settings_options("scale", "audio_frames", "text_tokens", "speaker_frames", "ac", "encoder_model", "frozen_encoder",
                  scale="8B")
def flops(as_json: bool = typer.Option(False, "--json", help="Print JSON."), **settings):
    """Parameter and FLOP breakdown of one training sample."""
    from echobench.model.flops import flops_report, flops_table

    try:
        cfg = RunConfig(**settings)
    except ValueError as exc:
        fail(str(exc))
    report = flops_report(cfg.model_config(), cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames, cfg.ac)
    if as_json:
        print(json.dumps(report, indent=2))
        return
    for part in flops_table(report, cfg):
        console.print(part)
