"""The `echobench` command line (typer). Each command is a thin layer over a module."""

from __future__ import annotations

import inspect
import io
import json
import os
import sys
import typing
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console
from rich.table import Table

from echobench.config import FIELDS, allowed_text, auto_switch, base_type, choices
from echobench.console import esc, fmt, record_report, repeats_report
from echobench.matrix import MAX_RUNS
from echobench.yamltext import yaml_problem

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__ and "Benchmark Echo TTS training: throughput and MFU.")
data_app = typer.Typer(no_args_is_help=True, help="Training data: write tar shards.")
app.add_typer(data_app, name="data")
# Wide enough for the tables when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def print_error(message: str) -> None:
    """The one `error:` line of bad input; the message is plain text."""
    err_console.print(f"[bold red]error:[/] {esc(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    """A clear one-line error for bad input; no Python traceback."""
    print_error(message)
    raise typer.Exit(code)


def writable_dir(path: Path, what: str | None = None) -> Path:
    """Creates the directory `path` (and its parents) and checks a file can be written in it;
    else one line naming `what` (default: --out PATH)."""
    import tempfile

    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        fail(f"{what or f'--out {path}'}: cannot write a directory there ({exc.strerror or exc}): choose another path")
    return path


def writable_file(path: Path, what: str) -> Path:
    """Checks that the file `path` can be written (its folder made, not a directory itself) before
    the work that fills it; else one line naming `what`."""
    if path.is_dir():
        fail(f"{what} {path}: is a directory: give a file name (e.g. {path / 'profile.yaml'})")
    writable_dir(path.parent, f"{what} {path}")
    return path


def settings_options(*names: str, **defaults) -> Callable:
    """Adds RunConfig fields (the given names, else every one with a flag) to a command as options
    that land in its **kwargs: flag, type, default and help all come from the field, so a field
    added once is a flag too. Choices stay plain text, checked by RunConfig (config.check_value), so
    a bad value reads the same from a flag, a --config file or a matrix file."""
    def options():
        for name in names or FIELDS:
            meta, default = FIELDS[name].metadata, defaults.get(name, FIELDS[name].default)
            if meta["flag"] == "":
                continue
            if auto_switch(name):  # a flag is on or off; left out, the setting stays "auto"
                default = None
            allowed = choices(name)
            kind = str if allowed else base_type(name)
            option = typer.Option(default, *filter(None, [meta["flag"]]),
                                  help=f"{meta['help']} Allowed: {allowed_text(name)}." if allowed else meta["help"])
            yield inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                    annotation=kind if default is not None else Optional[kind])

    def add(command: Callable) -> Callable:
        own = inspect.signature(command, eval_str=True).parameters.values()
        command.__signature__ = inspect.Signature([p for p in own if p.kind != p.VAR_KEYWORD] + list(options()))
        return command

    return add


def run_settings(ctx: typer.Context, params: dict, config: Path | None) -> dict:
    """Settings from --config YAML (the keys of a matrix's defaults); explicit flags override."""
    import yaml

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
        if value is None and auto_switch(name):  # flag not given: the file's value, else the field's default
            continue
        if name not in settings or getattr(source, "name", None) in explicit:
            settings[name] = value
    return settings


@app.command()
@settings_options()
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
    """One benchmark run: real training steps of the full model; writes OUT/result.json."""
    from echobench.config import RunConfig
    from echobench.launch import LAUNCHED, dump_stacks_on_signal

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
    from echobench.backends import parallelism_problem

    if problem := parallelism_problem(cfg):
        fail(problem)
    from echobench.launch import rendezvous_problem

    if nproc is not None and (problem := rendezvous_problem(nnodes, node_rank, master_addr)):
        fail(problem)
    writable_dir(out)
    if repeats != 1:
        run_repeats(cfg, out, repeats, nproc, nnodes, node_rank, master_addr, master_port)
        return
    if nproc is not None:
        from echobench.launch import launch

        record, code = launch(cfg, out, nproc, nnodes, node_rank, master_addr, master_port)
        if record is None:  # not node 0: node 0's launcher owns the record; this one exits as torchrun did,
            raise typer.Exit(code)  # so that srun --kill-on-bad-exit stops the job when this node failed
    else:
        from echobench.bench import run_benchmark
        from echobench.distributed import exit_process

        record = run_benchmark(cfg, out)
        if int(os.environ.get("RANK", 0)) == 0 and LAUNCHED not in os.environ:  # echobench's launcher prints it
            print_record(record, out)
        # A non-zero exit makes torchrun stop the other ranks.
        exit_process(0 if record.status == "ok" else 1)
        if record.status != "ok":
            raise typer.Exit(1)
        return
    print_record(record, out)
    if record.status != "ok" or code:
        raise typer.Exit(code or 1)


def run_repeats(cfg, out: Path, repeats: int, *launch_args) -> None:
    """`run --repeats N`: N launches one after another, then the median over the ok ones."""
    from echobench.launch import launch_repeats

    if repeats < 1:
        fail(f"--repeats {repeats}: must be >= 1")
    from echobench.launch import under_torchrun

    if under_torchrun():
        fail("--repeats launches its own processes: run it outside torchrun (with --nproc N for several per node)")
    records, code = launch_repeats(cfg, out, repeats, *launch_args)
    if not records:  # not node 0: node 0's launcher owns the records; this one exits as its torchruns did
        raise typer.Exit(code)
    for part in repeats_report(records, out):
        console.print(part)
    if any(r.status != "ok" for r in records):
        raise typer.Exit(1)


def tp_parallelism(ctx: typer.Context, tp: int) -> str:
    """`--tp N` is shorthand for `--parallelism tpN`; both at once must agree."""
    if tp < 1:
        fail(f"--tp {tp}: must be >= 1")
    given = ctx.params.get("parallelism")
    if getattr(ctx.get_parameter_source("parallelism"), "name", None) == "COMMANDLINE" and given != f"tp{tp}":
        fail(f"--tp {tp} conflicts with --parallelism {given}: give one of them")
    return f"tp{tp}"


def print_record(record, out: Path) -> None:
    """A run's Record as a table (its error, when it failed), and where it was written."""
    if record.status != "ok":
        err_console.print(f"[bold red]{esc(record.status)}:[/] {esc(record.error)}", highlight=False,
                          soft_wrap=True)
    else:
        for part in record_report(record):
            console.print(part)
    console.print(f"wrote {esc(out / 'result.json')}", highlight=False)


@app.command()
@settings_options("scale", "audio_frames", "text_tokens", "speaker_frames", "ac", "encoder_model", "frozen_encoder",
                  scale="8B")
def flops(as_json: bool = typer.Option(False, "--json", help="Print JSON."), **settings):
    """Parameter and FLOP breakdown of one training sample."""
    from echobench.config import RunConfig
    from echobench.flops import flops_report, flops_table

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


@app.command()
@settings_options("device", "micro_batch", "audio_frames", "text_tokens", "speaker_frames")
def calibrate(
    ctx: typer.Context,
    dtype: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU), bf16 or fp32."),
    scale: Optional[str] = typer.Option(None, help="Model preset whose DiT-block GEMM shapes are swept, at the "
                                        "rows of --micro-batch and the lengths (default 3B on GPU, tiny on CPU)."),
    size: Optional[int] = typer.Option(None, min=1, help="The square shape's size (default 8192 on GPU, 1024 on CPU)."),
    iters: Optional[int] = typer.Option(None, min=1, help="Timed matmuls per shape, after the warm-up ones "
                                        "(default 50 on GPU, at least 50 there; 5 on CPU)."),
    budget_s: Optional[float] = typer.Option(None, min=0.1, help="Seconds of matmuls the sweep may take at most "
                                             "(warm-up and timed; default 15, with --comm 5 on CPU); a shape that "
                                             "cannot fit its iterations times fewer."),
    as_json: bool = typer.Option(False, "--json"),
    comm: bool = typer.Option(False, "--comm", help="Measure a hardware profile instead: collectives on this process "
                              "group (alpha-beta fits per link class), the run's GEMMs, attention and memory bandwidth "
                              "(see README, Hardware profiles). Under torchrun on its group; else it launches --nproc."),
    nproc: Optional[int] = typer.Option(None, min=1, help="With --comm outside torchrun: processes to launch on this "
                                        "node (default 2 on CPU, the GPU count on GPU)."),
    out: Optional[Path] = typer.Option(None, "--out", help="With --comm: also write the profile here (YAML)."),
    max_bytes: Optional[int] = typer.Option(None, min=1024, help="With --comm: largest message (default 1 GiB on "
                                            "GPU, 64 MiB on CPU; at most a third of free memory)."),
    comm_budget_s: Optional[float] = typer.Option(None, min=0.1, help="With --comm: seconds for the collectives "
                                                  "(default 120 on GPU, 20 on CPU)."),
    matrix: Optional[Path] = typer.Option(None, "--matrix", help="With --comm: measure the shapes of every run of "
                                          "this matrix file (as `echobench plan` lists them) instead of --scale and "
                                          "the lengths."),
    nnodes: int = typer.Option(1, min=1, help="With --comm outside torchrun: number of nodes (one launcher per "
                               "node, as `run --nproc` takes them)."),
    node_rank: int = typer.Option(0, min=0, help="With --comm and --nnodes: this node's rank (SLURM_NODEID)."),
    master_addr: Optional[str] = typer.Option(None, help="With --comm and --nnodes: rendezvous host (first node)."),
    master_port: int = typer.Option(29500, help="With --comm and --nnodes: rendezvous port."),
    **settings,
):
    """Measure the achievable GEMM rate of this device (the best of a sweep of shapes); runs then
    report MFU against it too. With --comm: a hardware profile of this machine (profiles/ has the
    shipped ones)."""
    import torch

    from echobench.config import check_value
    from echobench.distributed import pick_device
    from echobench.hardware import calibrate as measure

    try:
        dev = pick_device(check_value("device", settings.pop("device")))
        if scale is not None:
            check_value("scale", scale)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    dtypes = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
    if dtype not in dtypes:
        fail(f"dtype={dtype!r} is not valid: allowed auto, bf16, fp32")
    comm_only = {"--matrix": matrix is not None, "--nnodes": nnodes != 1, "--master-addr": master_addr is not None,
                 "--nproc": nproc is not None, "--out": out is not None, "--max-bytes": max_bytes is not None,
                 "--comm-budget-s": comm_budget_s is not None}
    if not comm and any(comm_only.values()):
        given = [flag for flag, set_ in comm_only.items() if set_]
        fail(f"{', '.join(given)}: {'options' if len(given) > 1 else 'an option'} of calibrate --comm: add --comm")
    from echobench.launch import rendezvous_problem

    if problem := rendezvous_problem(nnodes, node_rank, master_addr):
        fail(problem)
    if comm:
        if out is not None:
            writable_file(out, "--out")  # before minutes of measuring, not after
        runs, shape_args = comm_runs(ctx, dev, scale, matrix, settings)
        calibrate_comm(dev, dtype, dtypes[dtype], runs, shape_args, budget_s, nproc, out, max_bytes, comm_budget_s,
                       (nnodes, node_rank, master_addr, master_port))
        return
    budget_s = 15.0 if budget_s is None else budget_s
    try:
        record = measure(dev, dtypes[dtype], size, iters, scale=scale, budget_s=budget_s, **settings)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(record, indent=2))
        return
    src = record["shapes_from"]
    table = Table(title=f"{record['dtype']} GEMM sweep: {src['scale']} DiT block at micro-batch {src['micro_batch']}, "
                        f"{src['audio_frames']} audio frames, {src['text_tokens']} text tokens, "
                        f"{src['speaker_frames']} speaker frames; TFLOP/s over each shape's timed matmuls")
    for col in ("shape", "m", "n", "k", "timed", "median", "min", "max"):
        table.add_column(col, justify="left" if col == "shape" else "right")
    for s in record["shapes"]:
        best = s["name"] == record["best_shape"]
        table.add_row(esc(s["name"]) + (" (ceiling)" if best else ""), str(s["m"]), str(s["n"]), str(s["k"]),
                      str(s["iters"]), f"{s['tflops_median']:.4g}", f"{s['tflops_min']:.4g}", f"{s['tflops_max']:.4g}",
                      style="bold" if best else None)
    console.print(table)
    sheet = record["datasheet_tflops"]
    console.print(f"{esc(record['device'])}: {record['dtype']} GEMM ceiling {record['tflops']:.4g} TFLOP/s median of "
                  f"{record['iters']} (min {record['tflops_min']:.4g}, max {record['tflops_max']:.4g}), "
                  f"{esc(record['best_shape'])}, best of {len(record['shapes'])} shapes in {record['wall_s']:.1f} s"
                  + (f", {record['tflops'] / sheet:.1%} of the {sheet:g} datasheet peak" if sheet else ""),
                  soft_wrap=True)
    console.print(f"saved {esc(record['path'])}", highlight=False)


def comm_runs(ctx: typer.Context, dev, scale: str | None, matrix: Path | None, settings: dict) -> tuple[list, list[str]]:
    """calibrate --comm's runs, whose shapes it measures, and the worker flags that give them again:
    every run of --matrix (expanded as `plan` does), else the one of --scale and the lengths."""
    from echobench.config import FIELDS, RunConfig

    if matrix is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("scale", *settings)
                 if getattr(ctx.get_parameter_source(k), "name", None) == "COMMANDLINE"]
        if given:
            fail(f"--matrix {matrix} gives the shapes (every run of it): drop {', '.join(given)}")
        the_plan = load_plan(matrix, None, None)[1]
        if not the_plan.runs:
            fail(f"--matrix {matrix}: no runs to take shapes from (see `echobench plan {matrix}`)")
        return [r.cfg for r in the_plan.runs], ["--matrix", str(matrix.resolve())]
    try:
        run = RunConfig(scale=scale or ("3B" if dev.type == "cuda" else "tiny"), device=dev.type,
                        **{k: FIELDS[k].default if v is None else v for k, v in settings.items()})
    except ValueError as exc:
        fail(str(exc))
    return [run], ["--scale", run.scale, "--micro-batch", str(run.micro_batch), "--audio-frames", str(run.audio_frames),
                   "--text-tokens", str(run.text_tokens), "--speaker-frames", str(run.speaker_frames)]


def calibrate_comm(dev, dtype_flag: str, dtype, runs: list, shape_args: list[str], budget_s, nproc, out, max_bytes,
                   comm_budget_s, rendezvous: tuple[int, int, str | None, int]) -> None:
    """`calibrate --comm`: in a torchrun worker (or alone with one process on one node) measure here;
    else launch torchrun for this node (commbench.launch_node: --nproc processes, one of --nnodes) running this
    command, then, on node 0, show what rank 0 wrote."""
    from echobench import commbench
    from echobench.distributed import exit_process
    from echobench.hardware import default_dtype, device_name
    from echobench.hwprofile import ProfileError, calibrated_profile_path, load_profile
    from echobench.launch import under_torchrun

    gpu = dev.type == "cuda"
    path = calibrated_profile_path(device_name(dev), str(dtype or default_dtype(dev)).removeprefix("torch."))
    paths = list(dict.fromkeys([path, *([out] if out is not None else [])]))
    gemm_budget_s = budget_s if budget_s is not None else (15.0 if gpu else 5.0)
    nproc = nproc or (torch_device_count() if gpu else 2)
    nnodes, node_rank, master_addr, _ = rendezvous
    if not under_torchrun() and (nproc > 1 or nnodes > 1 or master_addr is not None):
        args = ["--device", dev.type, "--dtype", dtype_flag, *shape_args, "--budget-s", gemm_budget_s,
                "--out", out or path, *(["--max-bytes", max_bytes] if max_bytes else []),
                *(["--comm-budget-s", comm_budget_s] if comm_budget_s else [])]
        code = commbench.launch_node(list(map(str, args)), nproc, *rendezvous)
        where = f"{nproc} processes" + (f" of node {node_rank} of {nnodes}" if nnodes > 1 else "")
        if code:
            fail(f"calibrate --comm on {where}: torchrun exited with code {code} (its output is above)", code)
        if node_rank != 0:
            return  # node 0's rank 0 wrote the profile
        try:
            load_profile(out or path)  # rank 0 wrote it to every path and showed it
        except ProfileError as exc:
            fail(str(exc))
        return
    profile = commbench.calibrate_in_group(dev.type, runs, paths, dtype=dtype, max_bytes=max_bytes,
                                           comm_budget_s=comm_budget_s, gemm_budget_s=gemm_budget_s)
    if profile is not None:
        print_profile(profile, paths)
    exit_process(0)


def torch_device_count() -> int:
    import torch

    return max(1, torch.cuda.device_count())


def print_profile(profile, paths) -> None:
    """A hardware profile's fits and rates, and where it was written."""
    from echobench.hwprofile import memory_gbps

    table = Table(title=esc(f"{profile.name}: collective fits (time = alpha + bus bytes / bus bandwidth)"))
    for col in ("link", "collective", "alpha us", "bus GB/s", "points", "groups", "rel rms"):
        table.add_column(col, justify="left" if col in ("link", "collective") else "right")
    for link, ops in profile.links.items():
        for op, fit in ops.items():
            table.add_row(link, op, f"{fit.alpha_s * 1e6:.1f}", f"{fit.bus_gbps:.3g}", str(len(fit.points)),
                          ",".join(map(str, sorted({p.group_size for p in fit.points}))), fmt(fit.rel_rms, ".2f"))
    console.print(table)
    best = max(profile.gemm, key=lambda p: p.tflops)
    console.print(f"GEMM: {len(profile.gemm)} shapes, {min(p.tflops for p in profile.gemm):.3g} .. {best.tflops:.3g} "
                  f"TFLOP/s (best {esc(best.name)} {best.m}x{best.n}x{best.k}); attention "
                  + ", ".join(f"{esc(a.name)} {a.tflops:.3g}" for a in profile.attention)
                  + f" TFLOP/s; memory {memory_gbps(profile):.3g} GB/s (add)", highlight=False, soft_wrap=True)
    console.print(f"saved {esc(', '.join(map(str, dict.fromkeys(paths))))}", highlight=False)


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="Sweep or run directories (or result.json files); merged, newest record per run id."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Dashboard HTML file (default report.html unless --table)."),
    table: Optional[str] = typer.Option(None, "--table", help="Print the publication table: md, csv or latex."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="CSV of published figures to put beside the measured ones, in the table and the dashboard (see README)."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help="Hardware profile(s): put each "
                                      "run's prediction (echobench predict) beside it in the dashboard."),
    margin: float = typer.Option(15.0, "--margin", help="With --profile: flag runs more than this percent below "
                                 "their predicted throughput."),
):
    """Dashboard (self-contained HTML) and publication tables, from stored result records only."""
    from echobench.report import load_report_input, read_reference, render_dashboard, render_table
    from echobench.report.tables import RENDERERS, ReferenceError

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such file or directory: {', '.join(missing)}")
    if table is not None and table not in RENDERERS:
        fail(f"--table {table!r} is not valid: allowed {', '.join(RENDERERS)}")
    if out is None and table is None:
        out = Path("report.html")
    if out is not None:
        if out.is_dir():
            fail(f"-o {out} is a directory: give the HTML file's path (e.g. {out / 'report.html'})")
        writable_dir(out.parent, f"-o {out}")
    ref = None
    if reference is not None:
        try:
            ref = read_reference(reference)
        except ReferenceError as exc:
            fail(str(exc))
    if not 0 <= margin < 100:
        fail(f"--margin {margin:g}: a percentage from 0 to below 100")
    profiles = load_profiles_or_fail(profile)
    data = load_report_input(paths)
    if profiles:
        from echobench.report.data import with_predictions

        data = with_predictions(data, profiles, margin / 100)
    for problem in data.problems:
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    if not data.records:
        err_console.print(f"no result records under {esc(', '.join(map(str, paths)))}", highlight=False)
    elif data.ok.empty:
        err_console.print(f"no successful runs: all {len(data.records)} record(s) failed", highlight=False)
    if table is not None:
        sys.stdout.write(render_table(data.frame, table, ref))
    if out is not None:
        try:
            out.write_text(render_dashboard(data, ref, str(reference) if reference else None), encoding="utf-8")
        except OSError as exc:
            fail(f"-o {out}: cannot write it ({exc.strerror or exc})")
        err_console.print(f"wrote {esc(out)} ({len(data.records)} runs, {len(data.skipped)} skipped)", highlight=False)


@app.command()
def compare(
    old: Path = typer.Argument(..., help="Baseline sweep or run directory."),
    new: Path = typer.Argument(..., help="Candidate sweep or run directory."),
    threshold: float = typer.Option(5.0, "--threshold", help="Percent loss of samples/s or MFU that fails the gate."),
    alpha: float = typer.Option(0.01, "--alpha", help="Significance level of the step-time test (one-sided Mann-Whitney U)."),
):
    """Pair configurations, print throughput / MFU changes; exit 1 when any lost more than the
    threshold and its step times say the slowdown is significant."""
    from echobench.report import compare_records
    from echobench.report.compare import comparison_report
    from echobench.results import load_records

    for p in (old, new):
        if not p.exists():
            fail(f"no such file or directory: {p}")
    if threshold < 0:
        fail("--threshold must be >= 0 (a percentage)")
    if not 0 < alpha < 1:
        fail(f"--alpha {alpha:g}: must be between 0 and 1 (e.g. 0.01)")
    (old_records, old_problems), (new_records, new_problems) = load_records([old]), load_records([new])
    for problem in old_problems + new_problems:
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    result = compare_records(old_records, new_records, threshold, alpha)
    if not result.changes:
        fail(f"no configurations in common between {old} ({len(old_records)} records) and {new} "
             f"({len(new_records)} records)")

    table, *lines = comparison_report(result, f"{old} -> {new}")
    console.print(table)
    for line in lines:
        console.print(line, soft_wrap=True)
    if result.regressions:
        raise typer.Exit(1)


@app.command()
def explain(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="One run's directory (result.json, and breakdown.json "
                                   "from a --profile run)."),
    as_json: bool = typer.Option(False, "--json", help="Print the breakdown and the waterfall as JSON."),
):
    """Where one step's time went (from the run's profiler breakdown) and the MFU waterfall."""
    from echobench.breakdown import explain_report, read_profiled_run, waterfall

    try:
        record, bd = read_profiled_run(run_dir)
    except ValueError as exc:
        fail(str(exc))
    steps = waterfall(record)
    if as_json:
        # padding: the record's figures (null: a record written before padding was counted)
        padding = {k: getattr(record, k) for k in ("measured_padded_flops", "measured_hardware_flops",
                                                   "padded_flops_frac", "padded_frac_latent", "padded_frac_text",
                                                   "padded_frac_speaker")}
        print(json.dumps({"run_id": record.run_id, "summary": record.breakdown or {}, "breakdown": bd,
                          "padding": padding, "waterfall": steps}, indent=2))
        return
    for part in explain_report(record, bd, steps):
        console.print(part)


@data_app.command("synth")
def data_synth(
    out: Path = typer.Option(..., "--out", help="Directory for the shards (created)."),
    shards: int = typer.Option(4, help="Number of tar shards."),
    samples_per_shard: int = typer.Option(64),
    seed: int = typer.Option(0),
    max_seconds: float = typer.Option(30.0, help="Longest audio clip in seconds (25 latent frames/s)."),
):
    """Write tar shards of (latent, speaker reference, text) triplets in the training format."""
    from echobench.data import synth_shards

    paths = synth_shards(writable_dir(out), shards, samples_per_shard, seed=seed, max_seconds=max_seconds)
    size = sum(p.stat().st_size for p in paths)
    console.print(f"wrote {len(paths)} shards, {len(paths) * samples_per_shard} samples, {size / 1e6:.1f} MB to {esc(out)}", highlight=False)


@data_app.command("index")
def data_index(
    data: Path = typer.Argument(..., help="Directory of *.tar shards, or one shard."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Rebuild indexes that are up to date too."),
):
    """Index shards written elsewhere (synth indexes its own): each sample's member offsets and lengths, so that
    a reader seeks straight to its own samples. Beside each shard, or in echobench's cache (ECHOBENCH_CACHE)
    when its directory cannot be written; one line per shard. Exits 1 if a shard is damaged or nowhere to write."""
    from collections import Counter

    from echobench.data import DataError
    from echobench.data.dataset import find_shards
    from echobench.data.index import ensure_index

    try:
        shards = find_shards(data)
    except DataError as exc:
        fail(str(exc))
    status_of, samples = Counter(), 0
    for shard in shards:
        index, status, detail = ensure_index(shard, rebuild=rebuild)
        status_of[status] += 1
        if index is not None:
            samples += index.count
            line = f"{shard.name}: {index.count} samples, {'written to' if status == 'built' else 'up to date:'} {detail}"
        elif status == "damaged":
            line = f"{shard.name}: damaged, not indexed (readers walk it; its bad samples raise or are skipped): {detail}"
        elif status == "unreadable":
            line = f"{shard.name}: cannot be read, not indexed: {detail}"
        else:
            line = f"{shard.name}: not indexed: {detail}"
        console.print(esc(line), highlight=False, soft_wrap=True)
    console.print(f"{len(shards)} shards, {samples} samples indexed: {status_of['built']} written, {status_of['fresh']} up to date, "
                  f"{status_of['damaged']} damaged, {status_of['unreadable']} unreadable, {status_of['unwritable']} with "
                  "nowhere to write", highlight=False)
    if status_of["damaged"] or status_of["unreadable"] or status_of["unwritable"]:
        raise typer.Exit(1)


# ---- matrices: plan, sweep, status (echobench.matrix, echobench.sweep) ----

def load_plan(matrix_path: Path, executor: str | None, max_runs: int | None):
    from echobench.matrix import ExecutorName, MatrixError, expand, load_matrix

    if executor not in (None, *typing.get_args(ExecutorName)):
        fail(f"--executor {executor!r} is not valid: allowed {', '.join(typing.get_args(ExecutorName))}")
    if max_runs is not None and max_runs < 1:
        fail(f"--max-runs {max_runs}: must be >= 1")
    try:
        matrix = load_matrix(matrix_path)
        executor = executor or matrix.spec.executor
        return matrix, expand(matrix, executor, max_runs), executor
    except MatrixError as exc:
        fail(str(exc))


MAX_RUNS_HELP = f"Refuse a matrix of more runs than this (default: the file's max_runs, else {MAX_RUNS})."


@app.command()
def plan(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME): paths in --script."),
    script: Optional[str] = typer.Option(None, "--script", metavar="RUN_ID", help="Print this run's exact job script."),
    write_scripts: Optional[Path] = typer.Option(None, "--write-scripts", metavar="DIR",
                                                 help="Write every run's job script to DIR/RUN_ID.sh, submit nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help="Hardware profile for the "
                                      "predicted step time and MFU (echobench predict); default: the shipped "
                                      "profile of hardware.device, if any."),
):
    """Runs of a matrix, skipped ones with the reason, per-GPU memory estimates, GPU-hours,
    predicted step time and MFU."""
    from echobench import plan as pl
    from echobench.sweep import run_dir

    if write_scripts is not None and script is not None:
        fail("--write-scripts writes every run's script, --script prints one: give one of them")
    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs)
    if write_scripts is not None:  # for review on a cluster before spending GPU-hours
        dest = writable_dir(write_scripts, f"--write-scripts {write_scripts}")
        sweep_dir = (out or pl.default_out(matrix)).resolve()
        try:
            # Logs beside the scripts: SLURM does not start a job whose --output directory is missing.
            (logs := dest / "logs").mkdir(exist_ok=True)
            for run in the_plan.runs:
                path = dest / f"{run.id}.sh"
                log = logs.resolve() / f"{run.id}-%j.out" if executor == "slurm" else None
                path.write_text(pl.render_job_script(run, run_dir(sweep_dir, run.id), matrix, executor, log))
                path.chmod(0o755)
        except OSError as exc:
            fail(f"--write-scripts {write_scripts}: cannot write {exc.filename} ({exc.strerror or exc}): "
                 "choose another directory")
        except ValueError as exc:
            fail(str(exc))
        console.print(f"{len(the_plan.runs)} job scripts in {esc(dest)} (paths as for `echobench sweep --out "
                      f"{esc(sweep_dir)}`; each writes its run.yaml there, its log goes to {esc(dest / 'logs')}); "
                      f"nothing submitted", highlight=False)
        return
    if script is not None:
        run = the_plan.by_id(script)
        if run is None:
            fail(f"no run {script!r} in {matrix_path}: `echobench plan {matrix_path}` lists the run ids")
        try:
            sweep_dir = (out or pl.default_out(matrix)).resolve()
            print(pl.render_job_script(run, run_dir(sweep_dir, run.id), matrix, executor), end="")
        except ValueError as exc:
            fail(str(exc))
        return
    hw = matrix.spec.hardware
    from echobench.memory import device_memory_gib

    capacity = device_memory_gib(hw.memory_gib, hw.device)
    from echobench.predict import profile_for_device

    profiles = load_profiles_or_fail(profile) or list(filter(None, [profile_for_device(hw.device)]))
    rows, no_peak = pl.plan_rows(the_plan, executor, profiles), pl.peak_note(the_plan.runs, matrix, executor)
    comm_note = pl.comm_note(the_plan.runs, matrix, executor)
    preflight_note, te_note = pl.preflight_note(the_plan.runs, matrix, executor), pl.te_note(the_plan.runs, matrix)
    if as_json:
        print(json.dumps({"name": matrix.name, "executor": executor, "device_memory_gib": capacity, "runs": rows,
                          "no_peak": no_peak, "calibrate_comm": comm_note, "preflight": preflight_note, "te": te_note,
                          "skipped": [{"settings": s.settings, "reason": s.reason} for s in the_plan.skipped],
                          "excluded": the_plan.excluded, "duplicates": the_plan.duplicates}, indent=2, default=str))
        return
    rule = matrix.spec.slurm.time_from_estimate if executor == "slurm" else None
    limits = (f"time limits {rule.factor:g} x the estimate, {rule.floor} .. {matrix.spec.slurm.time}" if rule else
              f"time limit {pl.time_limit_s(matrix, executor) / 3600:.2f} h per run")
    table = Table(title=f"{matrix.name}: {len(the_plan.runs)} runs ({executor}; {limits}; "
                        f"device memory {fmt(capacity, '.1f')} GiB)")
    table.add_column("run id", no_wrap=True)
    for col in ("tp x dp", "mb / global", "mem GiB", "fits", "limit", "GPU-h est", "GPU-h limit"):
        table.add_column(col, justify="right")
    if profiles:  # the predicted step time and MFU (echobench predict)
        table.add_column("pred s / MFU", justify="right", no_wrap=True)
    for run, row in zip(the_plan.runs, rows):
        c, est_h = run.cfg, row["gpu_hours_estimate"]
        predicted = [] if not profiles else ["-" if row["predicted_mfu"] is None else
                                             f"{row['predicted_step_time_s']:.3g} / {row['predicted_mfu']:.0%}"]
        table.add_row(run.id, f"{c.tp} x {c.dp}", f"{c.micro_batch} / {c.global_batch}",
                      fmt(run.memory.total_gib, ".1f"),
                      {True: "yes", False: "[red]NO[/]", None: "?"}[run.fits], row["time_limit"],
                      "-" if est_h is None else f"{est_h:.2f}",
                      f"{row['gpu_hours_limit']:.2f}", *predicted)
    console.print(table)
    if profiles:
        console.print(f"predicted (echobench predict): {esc(', '.join(p.name for p in profiles))}"
                      + ("" if all(p.measured for p in profiles) else ", a profile not measured here (datasheets)"),
                      highlight=False)
    if the_plan.skipped:
        skipped = Table(title=f"skipped: {len(the_plan.skipped)}")
        skipped.add_column("settings")
        skipped.add_column("reason")
        for s in the_plan.skipped:
            skipped.add_row(esc(pl.settings_label(the_plan, s.settings)), esc(s.reason))
        console.print(skipped)
    too_big = [r for r in the_plan.runs if r.fits is False]
    console.print(f"{len(the_plan.runs)} runs, {len(the_plan.skipped)} skipped, {the_plan.excluded} excluded"
                  + (f", {the_plan.duplicates} duplicates" if the_plan.duplicates else "")
                  + (f"; {len(too_big)} would not fit in {fmt(capacity, '.1f')} GiB (sweep skips them unless --force)"
                     if too_big else ""))
    if the_plan.runs:
        est_total = sum(r["gpu_hours_estimate"] or 0 for r in rows)
        console.print(f"GPU-hours: {sum(r['gpu_hours_limit'] for r in rows):.2f} at most (time limits), "
                      + (f"~{est_total:.2f} estimated at {hw.assumed_mfu:.0%} MFU" if est_total else "no estimate"))
    if no_peak:
        console.print(f"[yellow]{esc(no_peak)}[/]", highlight=False)
    if comm_note:
        console.print(esc(comm_note), highlight=False)
    if rule:
        from echobench.estimate import startup_parts

        parts = ", ".join(f"{k} {v} s" for k, v in startup_parts(matrix, any(r.cfg.may_compile() for r in the_plan.runs)).items())
        console.print(f"estimates allow for the job's start: {esc(parts)} (echobench/estimate.py)", highlight=False)
    for note in (preflight_note, te_note):
        if note:
            console.print(esc(note), highlight=False)


def default_profiles(records: list) -> dict[str, list]:
    """`predict --against` without --profile: run id -> [its profile], predict.profile_for_device of
    the record's device and file (its sweep's own profile first). A record without one is said and
    left out; none with one fails."""
    from echobench import predict as pr
    from echobench.executors import measured_profile

    found, missing, looked = {}, [], {}
    for record in records:
        near = str(record.path) if record.path else None
        key = (record.env.device_name, near and measured_profile(near))  # one lookup (and object) per sweep
        try:
            if key not in looked:
                looked[key] = pr.profile_for_device(record.env.device_name, near)
        except pr.PredictError as exc:
            fail(str(exc))
        profile = looked[key]
        if profile is None:
            missing.append(record)
        else:
            found[record.run_id] = [profile]
    if not found:
        fail(pr.no_profile_message(f"device {records[0].env.device_name!r}"))
    for record in missing:
        err_console.print(f"[yellow]not predicted:[/] {esc(record.run_id)}: "
                          f"{esc(pr.no_profile_message(f'device {record.env.device_name!r}'))}",
                          highlight=False, soft_wrap=True)
    return found


PROFILE_HELP = ("Hardware profile: a shipped name (profiles/) or a YAML file; repeatable: each run takes the one "
                "measured most like it (processes per node, GEMM shapes). Default: the shipped profile of the "
                "matrix's hardware.device (with --against: the profile their sweep measured, hardware.calibrate_comm, else "
                "that of the records' device), else this machine's calibrated one.")


def load_profiles_or_fail(names: list[str]):
    from echobench.predict import PredictError, load_profiles

    try:
        return load_profiles(names)
    except PredictError as exc:
        fail(str(exc))


@app.command("predict")
def predict_command(
    paths: list[Path] = typer.Argument(..., metavar="MATRIX | RUN_DIRS...", help="A matrix YAML file; with "
                                       "--against, sweep or run directories (or result.json files)."),
    profile: list[str] = typer.Option([], "--profile", metavar="NAME|FILE", help=PROFILE_HELP),
    nodes: Optional[str] = typer.Option(None, "--nodes", help="Every configuration at these node counts (1 .. "
                                        "1024, e.g. 1,4,16) instead of the matrix's."),
    against: bool = typer.Option(False, "--against", help="Predict measured runs and hold each against its "
                                 "record: step time, MFU and, for --profile runs, the parts of the step."),
    as_json: bool = typer.Option(False, "--json", help="A list with one object per run."),
):
    """The performance model: each run's predicted step time, its parts, samples/s, MFU, HFU,
    bytes per link and the bandwidth that would hide its exposed communication (README,
    Predicting a run); with --against, predicted vs measured."""
    import time as clock

    from echobench import predict as pr

    started = clock.perf_counter()
    wide = Console(width=None if sys.stdout.isatty() else 170)  # a row per run: the id and ten figures
    profiles = load_profiles_or_fail(profile)
    if against:
        from echobench.results import load_records

        if nodes is not None:
            fail("--nodes is for `predict MATRIX`: --against holds each record at the node count it ran on")
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            fail(f"no such file or directory: {', '.join(missing)}")
        records, problems = load_records(paths)
        for problem in problems:
            err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
        ok = [r for r in records if r.status == "ok" and r.step_time_s]
        if not ok:
            fail(f"no successful runs under {', '.join(map(str, paths))} to predict")
        each = {r.run_id: profiles for r in ok} if profiles else default_profiles(ok)
        for line in pr.other_device_lines(ok, profiles):
            err_console.print(f"[yellow]warning:[/] {esc(line)}", highlight=False, soft_wrap=True)
        comparisons = []
        for record in (r for r in ok if r.run_id in each):
            try:
                comparisons.append(pr.against(record, each[record.run_id]))
            except (pr.PredictError, ValueError) as exc:
                err_console.print(f"[yellow]not predicted:[/] {esc(exc)}", highlight=False, soft_wrap=True)
        profiles = list({id(p): p for ps in each.values() for p in ps}.values())  # those given or found, each once
        if as_json:
            print(json.dumps([c.as_dict() for c in comparisons], indent=2, default=str))
            return
        wide.print(pr.comparison_table(comparisons, f"predicted vs measured: {len(comparisons)} runs"))
        s = pr.summary(comparisons)
        if s["runs"]:
            console.print(f"step time: mean |error| {s['mean_abs_error']:.1%}, max {s['max_abs_error']:.1%} over "
                          f"{s['runs']} runs (error = (predicted - measured) / measured)"
                          + (f"; MFU: mean |error| {s['mean_abs_mfu_error']:.1%}, max {s['max_abs_mfu_error']:.1%}"
                             if s["mean_abs_mfu_error"] is not None else ""))
        for line in pr.profile_lines(profiles):
            console.print(esc(line), highlight=False)
        return
    if len(paths) != 1:
        fail(f"predict takes one matrix ({len(paths)} paths given): for run directories add --against")
    matrix, the_plan, _ = load_plan(paths[0], "slurm" if nodes is not None else None, None)
    cfgs = [r.cfg for r in the_plan.runs]
    try:
        if nodes is not None:
            cfgs = pr.at_nodes(cfgs, pr.parse_nodes(nodes))
    except pr.PredictError as exc:
        fail(str(exc))
    if not profiles:
        device = matrix.spec.hardware.device or pr.machine_device(cfgs)
        found = pr.profile_for_device(device)
        if found is None:
            fail(pr.no_profile_message(f"matrix {paths[0]} (device {device!r}: its hardware.device, else this "
                                       "machine's)"))
        profiles = [found]
    items = pr.predict_runs(cfgs, profiles)
    none_predicted = bool(cfgs) and not any(isinstance(p, pr.Prediction) for p in items)
    elapsed = clock.perf_counter() - started
    if as_json:
        rank = pr.ranks([p for p in items if isinstance(p, pr.Prediction)])
        print(json.dumps([{**p.as_dict(), "rank": rank[p.run_id]} if isinstance(p, pr.Prediction)
                          else {"run_id": pr.run_id(c), "error": str(p)} for p, c in zip(items, cfgs)],
                         indent=2, default=str))
        if none_predicted:
            raise typer.Exit(1)  # every object holds its error
        return
    wide.print(pr.prediction_table(items, cfgs, f"{matrix.name}: {len(cfgs)} runs, PREDICTED (not measured)"))
    for p, c in zip(items, cfgs):
        if isinstance(p, pr.PredictError):  # in full, one line each: a table cell cuts the fix off
            err_console.print(f"[red]not predicted:[/] {esc(pr.run_id(c))}: {esc(p)}", highlight=False, soft_wrap=True)
    for line in pr.profile_lines(profiles):
        console.print(esc(line), highlight=False)
    notes = sorted({n for p in items if isinstance(p, pr.Prediction) for n in p.notes})
    for note in notes:
        console.print(f"note: {esc(note)}", highlight=False)
    console.print(f"rank: by predicted MFU among the runs of a scale and node count; hide GB/s: the bus bandwidth "
                  f"per link at which the overlappable collectives take no longer than the compute they overlap; "
                  f"{len(cfgs)} runs in {elapsed:.2f} s", highlight=False)
    if none_predicted:
        fail(f"no run of {paths[0]} could be predicted (why: above)", 1)


@app.command()
def sweep(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the jobs and collect (slurm: --no-wait returns after submitting)."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Also re-run runs whose record is a failure."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help="Only runs with this setting (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Also run what the memory estimate says will not fit."),
    poll: Optional[float] = typer.Option(None, help="Seconds between state checks (default 1 local, 5 slurm; slurm "
                                                    "doubles it up to 60 while nothing changes)."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
    preflight: bool = typer.Option(True, "--preflight/--no-preflight", help="SLURM: one short job checks the runs' "
                                   "environment before any is submitted (default; skipped where this matrix passed "
                                   "it before)."),
):
    """Run every run of a matrix not yet done (resumable); shows progress, collects results.

    Exit 0 when every run is ok, 1 when some failed, 130 on Ctrl-C; with --no-wait, 0 once every
    run is submitted and 75 when some wait to be (slurm.max_submitted, a submit limit): the same
    command again submits them. Ctrl-C with SLURM jobs queued asks whether to cancel them (on a
    terminal; elsewhere they keep running: `echobench cancel DIR`)."""
    from echobench import sweep as sw
    from echobench.matrix import MatrixError
    from echobench.plan import default_out

    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs)
    try:
        runs, skipped = sw.choose_runs(the_plan, only, force, console)
    except MatrixError as exc:
        fail(str(exc))
    if not runs:
        fail("no runs to do: every combination was skipped or filtered out (see `echobench plan`)", code=1)
    try:
        opts = sw.SweepOptions(executor=executor, out=out or default_out(matrix), wait=wait,
                               retry_failed=retry_failed, poll_s=poll, ask=ask_on_a_terminal(), preflight=preflight)
        opts.out = writable_dir(opts.out)
        code = sw.run_sweep(matrix, runs, opts, console, skipped)
    except ValueError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command("preflight")
def preflight_command(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME): the job's script, "
                                       "log and preflight.json go there."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help="Only for runs with this setting."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
):
    """Check, in one short job in the matrix's exact environment, what its runs need: imports, GPUs,
    CPUs, numactl, the network interfaces, a tiny compile, an all-reduce across the nodes and the
    network NCCL chose for it. One line per check with the fix; exit 0 when every check passed, 1
    otherwise. A sweep of the same matrix into the same directory then does not check again."""
    from echobench import sweep as sw
    from echobench.executors import make_executor
    from echobench.matrix import MatrixError
    from echobench.plan import default_out
    from echobench.preflight import run_preflight

    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs)
    try:
        runs, _ = sw.choose_runs(the_plan, only, True, Console(file=io.StringIO()))
    except MatrixError as exc:
        fail(str(exc))
    if not runs:
        fail("no runs to check: every combination was skipped or filtered out (see `echobench plan`)", code=1)
    sweep_dir = writable_dir(out or default_out(matrix)).resolve()
    made = make_executor(executor, matrix)
    try:
        made.check_dir(sweep_dir)
        result = run_preflight(matrix, runs, made, sweep_dir, console)
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C): the preflight job was cancelled", 130)
    except Exception as exc:  # noqa: BLE001 - sbatch's refusal, a path SLURM cannot take: one line
        fail(f"the preflight job was not submitted: {exc}")
    raise typer.Exit(0 if result.passed else 1)


def ask_on_a_terminal() -> Callable[[str], bool] | None:
    """A yes/no question (default no) where stdin is a terminal; None elsewhere (nobody to answer)."""
    if not sys.stdin.isatty():
        return None
    return lambda question: typer.confirm(question, default=False)


@app.command()
def cancel(
    sweep_dir: Path = typer.Argument(..., metavar="DIR", help="A sweep directory."),
):
    """End a sweep's jobs: scancel of every job not yet over, then their records (cancelled, as the
    sweep writes them). Runs already over keep theirs; cancelling twice is harmless."""
    from echobench import sweep as sw

    if not sweep_dir.is_dir():
        fail(f"{sweep_dir}: no such directory: give the sweep's directory (`echobench sweep --out DIR`)")
    if not (sweep_dir / sw.SWEEP_FILE).is_file():
        fail(f"{sweep_dir}: no {sw.SWEEP_FILE} here: not a sweep directory")
    writable_dir(sweep_dir, f"cancel in {sweep_dir}")
    try:
        code = sw.cancel_sweep(sweep_dir, console)
    except sw.CorruptSweepState as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command()
def status(
    runs_dir: Path = typer.Argument(..., metavar="DIR", help="A sweep directory (or any directory of result.json)."),
    wait: bool = typer.Option(False, "--wait", help="Keep refreshing until no job is pending or running."),
    poll: float = typer.Option(5.0, help="Seconds between refreshes with --wait."),
    export: bool = typer.Option(False, "--export", help="Also write DIR/results.csv and results.parquet."),
    as_json: bool = typer.Option(False, "--json", help="The rows as JSON (errors in full) instead of the table."),
):
    """One row per run: state (refreshed from the scheduler), step time, MFU; then each failure's error."""
    from echobench import sweep as sw
    from echobench.console import state_counts, state_markup

    if not runs_dir.is_dir():
        fail(f"{runs_dir} is not a directory")
    try:
        rows, problems = sw.status(runs_dir, wait, poll)
    except sw.CorruptSweepState as exc:
        fail(str(exc))
    paths = []
    if export:
        writable_dir(runs_dir, f"--export into {runs_dir}")
        paths, unreadable = sw.export_status(runs_dir, rows)
        problems += unreadable
    for p in problems:
        err_console.print(f"[yellow]skipped a corrupt record:[/] {esc(p)}", highlight=False, soft_wrap=True)
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    table = Table(title=esc(f"{runs_dir}: {len(rows)} runs"))
    table.add_column("run id", overflow="fold")  # folds only where the terminal is narrower than the ids
    for col in ("state", "job", "step time s", "samples/s", "MFU", "mem GiB"):
        table.add_column(col)
    for r in rows:
        table.add_row(esc(r["run_id"]), state_markup(r["state"]), esc(r.get("job_id") or "-"),
                      fmt(r.get("step_time_s"), ".4f"), fmt(r.get("samples_per_s"), ".3g"),
                      "-" if r.get("mfu") is None else f"{r['mfu']:.2%}", fmt(r.get("peak_mem_gib"), ".2f"))
    console.print(table)
    # Errors under the table, one line each (in a table column they fold into a few characters per
    # line): cut at a terminal's width, whole in a log or pipe. In full: --json, or RUN/result.json.
    if errors := [r for r in rows if r.get("error")]:
        crop = console.is_terminal
        for r in errors:
            console.print(f"{esc(r['run_id'])}: {esc(' '.join(r['error'].split()))}", highlight=False,
                          no_wrap=crop, overflow="ellipsis" if crop else None, soft_wrap=not crop)
        if crop:
            console.print("[dim]errors in full: echobench status DIR --json[/]", highlight=False)
    console.print(esc(state_counts(r["state"] for r in rows) or "no runs"))
    if paths:
        console.print(f"results: {esc(', '.join(map(str, paths)))}", highlight=False)


def main() -> None:
    """The `echobench` command: typer's app, with its usage errors (a bad flag value, an unknown
    option or command) as one `error:` line like every other bad input, not a boxed panel."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        err_console.print("aborted", highlight=False)
        sys.exit(1)
    except typer.TyperException as exc:  # typer's click exceptions (it vendors click)
        if type(exc).__name__ == "NoArgsIsHelpError" or not hasattr(exc, "format_message"):
            sys.exit(getattr(exc, "exit_code", 2))  # the help is already printed
        ctx = getattr(exc, "ctx", None)
        hint = f" (`{ctx.command_path} --help` lists them)" if ctx is not None else ""
        print_error(" ".join(exc.format_message().split()) + hint)  # not fail(): no app here to catch its Exit
        sys.exit(getattr(exc, "exit_code", 2))
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    sys.exit(main())
