"""The `echobench` command line (typer). Each command is a thin layer over a module."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__ and "Benchmark Echo TTS training: throughput and MFU.")
data_app = typer.Typer(no_args_is_help=True, help="Training data: write tar shards.")
app.add_typer(data_app, name="data")
# Wide enough for the tables when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def fail(message: str, code: int = 2) -> None:
    """A clear one-line error for bad input; no Python traceback."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def fmt(value, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


LAUNCH_OPTIONS = ("out", "config", "nproc", "nnodes", "node_rank", "master_addr", "master_port", "ctx", "tp", "repeats")


def run_settings(ctx: typer.Context, params: dict, config: Path | None) -> dict:
    """Settings from --config YAML (the keys of a matrix's defaults); explicit flags override."""
    import yaml

    settings = {}
    if config is not None:
        try:
            settings = yaml.safe_load(config.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            fail(f"--config {config}: cannot read it ({exc})")
        if not isinstance(settings, dict):
            fail(f"--config {config}: expected a mapping of run settings")
    # Compared by name: typer may carry its own copy of click's ParameterSource enum.
    explicit = ("COMMANDLINE", "ENVIRONMENT")
    for name, value in params.items():
        source = ctx.get_parameter_source(name)
        if name not in settings or getattr(source, "name", None) in explicit:
            settings[name] = value
    return settings


@app.command()
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
    scale: str = typer.Option("tiny", help="Model preset: tiny, 800M, 3B, 8B."),
    framework: str = typer.Option("torchtitan", help="torchtitan or megatron."),
    parallelism: str = typer.Option("single", help="single, ddp, fsdp2, hsdp (torchtitan) or tpN (megatron)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size (megatron): sets --parallelism tpN."),
    te: str = typer.Option("auto", help="megatron: TransformerEngine kernels auto (when they import), on, off."),
    sequence_parallel: bool = typer.Option(False, "--sequence-parallel", help="megatron, GPU only: sequence parallelism."),
    steps: int = typer.Option(30, help="Measured steps."),
    warmup_steps: int = typer.Option(10, help="Warm-up steps, excluded from timing (compile happens here)."),
    micro_batch: int = typer.Option(8, help="Samples per data-parallel rank per step."),
    data: str = typer.Option("synthetic", help="'synthetic' (in memory) or a directory of tar shards."),
    precision: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU), bf16, fp32, fp8."),
    peak_tflops: Optional[float] = typer.Option(None, help="Dense bf16 peak TFLOP/s per device for MFU (else table / calibration)."),
    audio_frames: int = typer.Option(750, help="Max audio latent frames (25 per second)."),
    text_tokens: int = typer.Option(256, help="Max text tokens."),
    speaker_frames: int = typer.Option(750, help="Max speaker reference frames."),
    compile: bool = typer.Option(False, "--compile/--no-compile", help="torch.compile each block."),
    ac: str = typer.Option("none", help="Activation checkpointing: none, selective, full."),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto", help="auto, cuda or cpu."),
    skip_bad_samples: bool = typer.Option(False, help="Count and skip corrupt samples instead of failing."),
    encoder_model: Optional[str] = typer.Option(None, help="Text encoder: t5gemma-2-270m|1b|4b, t5-base, t5-large "
                                                "(default: the preset's)."),
    frozen_encoder: bool = typer.Option(True, "--frozen-encoder/--train-encoder", help="Freeze the text encoder (default) or train it."),
    t5_hidden_dim: Optional[int] = typer.Option(None, help="Expected encoder hidden size (checked against encoder_model)."),
    encoder_checkpoint: Optional[str] = typer.Option(None, help="Local checkpoint directory for the text encoder."),
    tokenizer: Optional[str] = typer.Option(None, help="Local Hugging Face tokenizer directory (else byte-level)."),
    profile: bool = typer.Option(False, "--profile", help="Write a torch.profiler chrome trace of the last 3 measured steps (OUT/trace-rankN.json)."),
    fail_at_step: Optional[int] = typer.Option(None, help="Testing: inject a failure at this step."),
    fail_rank: Optional[int] = typer.Option(None, help="Testing: ... on this rank only."),
    fail_kind: str = typer.Option("error", help="Testing: error or oom."),
    time_limit_s: Optional[float] = typer.Option(None, help="Stop the run after this many seconds (status timeout)."),
):
    """One benchmark run: real training steps of the full model; writes OUT/result.json."""
    params = {k: v for k, v in locals().items() if k not in LAUNCH_OPTIONS}
    from echobench.config import RunConfig

    settings = run_settings(ctx, params, config)
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
    if repeats != 1:
        run_repeats(cfg, out, repeats, nproc, nnodes, node_rank, master_addr, master_port)
        return
    if nproc is not None:
        from echobench.launch import launch

        record = launch(cfg, out, nproc, nnodes, node_rank, master_addr, master_port)
        if record is None:  # not node 0: node 0's launcher owns the record
            return
    else:
        from echobench.bench import run_benchmark

        record = run_benchmark(cfg, out)
        if int(os.environ.get("RANK", 0)) != 0:
            if record["status"] != "ok":  # a non-zero exit makes torchrun stop the other ranks
                raise typer.Exit(1)
            return
    print_record(record)
    console.print(f"wrote {out / 'result.json'}")
    if record["status"] != "ok":
        raise typer.Exit(1)


def run_repeats(cfg, out: Path, repeats: int, *launch_args) -> None:
    """`run --repeats N`: N launches one after another, then the median over the ok ones."""
    from echobench.launch import launch_repeats
    from echobench.results import configuration_key, over_repeats

    if repeats < 1:
        fail(f"--repeats {repeats}: must be >= 1")
    if "RANK" in os.environ:
        fail("--repeats launches its own processes: run it outside torchrun (with --nproc N for several per node)")
    records = launch_repeats(cfg, out, repeats, *launch_args)
    if not records:  # not node 0: node 0's launcher owns the records
        return
    table = Table(title=f"{len(records)} repeats of {configuration_key(records[0])}")
    for col in ("repeat", "run id", "status", "samples/s", "MFU", "step time median s", "mean vs median"):
        table.add_column(col, justify="left" if col in ("run id", "status") else "right")
    for k, r in enumerate(records):
        ok = r["status"] == "ok"
        table.add_row(str(k), r["run_id"], r["status"], fmt(r["samples_per_s"], ".4g") if ok else "-",
                      f"{r['mfu']:.2%}" if ok else "-", fmt(r["step_time_s"], ".4f") if ok else "-",
                      f"{r['step_time_mean_vs_median']:+.1%}" if ok else "-")
    console.print(table)
    ok = [r for r in records if r["status"] == "ok"]
    if ok:
        sps, mfu = over_repeats(r["samples_per_s"] for r in ok), over_repeats(r["mfu"] for r in ok)
        console.print(f"median over {len(ok)} ok repeat(s): samples/s {sps['median']:.4g} "
                      f"({sps['min']:.4g}-{sps['max']:.4g}), MFU {mfu['median']:.2%} "
                      f"({mfu['min']:.2%}-{mfu['max']:.2%})", highlight=False)
    console.print(f"wrote {', '.join(str(out / f'repeat-{k}' / 'result.json') for k in range(len(records)))}",
                  highlight=False)
    if len(ok) < len(records):
        raise typer.Exit(1)


def tp_parallelism(ctx: typer.Context, tp: int) -> str:
    """`--tp N` is shorthand for `--parallelism tpN`; both at once must agree."""
    if tp < 1:
        fail(f"--tp {tp}: must be >= 1")
    given = ctx.params.get("parallelism")
    if getattr(ctx.get_parameter_source("parallelism"), "name", None) == "COMMANDLINE" and given != f"tp{tp}":
        fail(f"--tp {tp} conflicts with --parallelism {given}: give one of them")
    return f"tp{tp}"


def print_record(record: dict) -> None:
    if record["status"] != "ok":
        err_console.print(f"[bold red]{record['status']}:[/] {record['error']}", highlight=False)
        return
    from echobench.results import peak_notes

    table = Table(title=record["run_id"], show_header=False)
    rows = [
        ("device", record["env"]["device_name"]),
        ("step time (median, p10-p90)", f"{record['step_time_s']:.4f} s ({record['step_time_p10_s']:.4f}-{record['step_time_p90_s']:.4f})"),
        ("step time (mean)", f"{record['step_time_mean_s']:.4f} s ({record['step_time_mean_vs_median']:+.1%} vs median)"),
        ("measured window", f"{record['measured_steps']} steps, {record['measured_time_s']:.3f} s, "
                            f"{record['measured_samples']} samples"),
        ("samples/s (window)", fmt(record["samples_per_s"], ".2f")),
        ("audio seconds/s (window)", fmt(record["audio_seconds_per_s"], ".1f")),
        ("model TFLOP/sample", fmt(record["model_flops_per_sample"] / 1e12, ".4g")),
        ("TFLOP/s per device", fmt(record["tflops_per_gpu"], ".4g")),
        ("peak TFLOP/s", f"{record['peak_tflops']:.4g} {record['peak_precision']} ({record['peak_source']})"),
        ("MFU (window)", f"{record['mfu']:.2%}"),
        *([("MFU vs fp8 peak", "-" if record.get("mfu_fp8_peak") is None else f"{record['mfu_fp8_peak']:.2%}")]
          if record.get("precision") == "fp8" else []),
        ("HFU (window)", f"{record['hfu']:.2%}"),
        ("MFU vs GEMM ceiling", "-" if record.get("mfu_vs_ceiling") is None else f"{record['mfu_vs_ceiling']:.2%}"),
        ("peak memory", f"{record['peak_mem_gib']:.2f} GiB"),
        ("allocator retries / OOMs", "-" if record.get("num_alloc_retries") is None
         else f"{record['num_alloc_retries']} / {record['num_ooms']}"),
        ("data wait", f"{record['data_wait_frac']:.1%}"),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    console.print(table)
    for note in peak_notes(record):
        console.print(f"note: {note}", highlight=False, markup=False)


@app.command()
def flops(
    scale: str = typer.Option("8B", help="Model preset: tiny, 800M, 3B, 8B."),
    audio_frames: int = typer.Option(750),
    text_tokens: int = typer.Option(256),
    speaker_frames: int = typer.Option(750),
    ac: str = typer.Option("none", help="Activation checkpointing for HFU: none, selective, full."),
    encoder_model: Optional[str] = typer.Option(None, help="Text encoder (default: the preset's)."),
    frozen_encoder: bool = typer.Option(True, "--frozen-encoder/--train-encoder"),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Parameter and FLOP breakdown of one training sample."""
    from echobench.flops import flops_report
    from echobench.model.config import get_preset

    try:
        report = flops_report(get_preset(scale, encoder_model, frozen_encoder), audio_frames, text_tokens, speaker_frames, ac)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(report, indent=2))
        return
    params = report["params"]
    table = Table(title=f"Echo TTS {scale}: {audio_frames} audio frames, {text_tokens} text tokens, "
                        f"{speaker_frames} speaker frames")
    for col in ("part", "params (M)", "forward GFLOP", "backward GFLOP", "total GFLOP", "share"):
        table.add_column(col, justify="right" if col != "part" else "left")
    total = report["model_flops_per_sample"]
    for name, part in report["breakdown"]["parts"].items():
        table.add_row(name, f"{params['parts'][name] / 1e6:.1f}", f"{part['forward'] / 1e9:.1f}",
                      f"{part['backward'] / 1e9:.1f}", f"{part['total'] / 1e9:.1f}", f"{part['total'] / total:.1%}")
    table.add_row("total", f"{(params['trainable'] + params['frozen']) / 1e6:.1f}", "", "", f"{total / 1e9:.1f}", "100%")
    console.print(table)
    console.print(f"trainable parameters: {params['trainable'] / 1e6:.1f}M; frozen text encoder: {params['frozen'] / 1e6:.1f}M")
    console.print(f"model FLOPs per sample: {total / 1e12:.3f} TFLOP; with ac={ac}: "
                  f"{report['hardware_flops_per_sample'] / 1e12:.3f} TFLOP (HFU numerator)")


@app.command()
def calibrate(
    device: str = typer.Option("auto", help="auto, cuda or cpu."),
    dtype: str = typer.Option("auto", help="auto (bf16 on GPU, fp32 on CPU), bf16 or fp32."),
    size: Optional[int] = typer.Option(None, help="Matrix size (default 8192 on GPU, 1024 on CPU)."),
    iters: int = typer.Option(10, help="Timed matmuls (after 3 warm-up ones)."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Measure the achievable GEMM rate of this device; runs then report MFU against it too."""
    import torch

    from echobench.distributed import pick_device
    from echobench.hardware import calibrate as measure

    try:
        dev = pick_device(device)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    dtypes = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
    if dtype not in dtypes:
        fail(f"dtype={dtype!r} is not valid: allowed auto, bf16, fp32")
    record = measure(dev, dtypes[dtype], size, iters)
    if as_json:
        print(json.dumps(record, indent=2))
        return
    sheet = record["datasheet_tflops"]
    console.print(f"{record['device']}: {record['dtype']} {record['size']}^3 GEMM "
                  f"{record['tflops']:.4g} TFLOP/s median (min {record['tflops_min']:.4g}, max {record['tflops_max']:.4g})"
                  + (f", {record['tflops'] / sheet:.1%} of the {sheet:g} datasheet peak" if sheet else ""))
    console.print(f"saved {record['path']}")


@app.command()
def report(
    paths: list[Path] = typer.Argument(..., help="Sweep or run directories (or result.json files); merged, newest record per run id."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Dashboard HTML file (default report.html unless --table)."),
    table: Optional[str] = typer.Option(None, "--table", help="Print the publication table: md, csv or latex."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="CSV of published figures to put beside the measured ones, in the table and the dashboard (see README)."),
):
    """Dashboard (self-contained HTML) and publication tables, from stored result records only."""
    from echobench.report import load_report_input, read_reference, render_dashboard, render_table
    from echobench.report.tables import RENDERERS, ReferenceError

    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        fail(f"no such file or directory: {', '.join(missing)}")
    if table is not None and table not in RENDERERS:
        fail(f"--table {table!r} is not valid: allowed {', '.join(RENDERERS)}")
    ref = None
    if reference is not None:
        try:
            ref = read_reference(reference)
        except ReferenceError as exc:
            fail(str(exc))
    data = load_report_input(paths)
    for problem in data.problems:
        err_console.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
    if not data.records:
        err_console.print(f"no result records under {', '.join(map(str, paths))}", highlight=False)
    elif data.ok.empty:
        err_console.print(f"no successful runs: all {len(data.records)} record(s) failed", highlight=False)
    if table is not None:
        sys.stdout.write(render_table(data.frame, table, ref))
    if out is None and table is None:
        out = Path("report.html")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_dashboard(data, ref, str(reference) if reference else None), encoding="utf-8")
        err_console.print(f"wrote {out} ({len(data.records)} runs, {len(data.skipped)} skipped)", highlight=False)


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
    from echobench.report.compare import MIN_STEPS
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
        err_console.print(f"[yellow]warning:[/] {problem}", highlight=False, soft_wrap=True)
    result = compare_records(old_records, new_records, threshold, alpha)
    if not result.changes:
        fail(f"no configurations in common between {old} ({len(old_records)} records) and {new} "
             f"({len(new_records)} records)")

    def pct(v):
        return "-" if v is None else f"{v:+.1f}%"

    t = Table(title=f"{old} -> {new} (threshold {threshold:g}%, alpha {alpha:g})")
    t.add_column("configuration", overflow="fold")
    for col in ("repeats", "status", "samples/s old -> new", "MFU old -> new", "steps", "p (slower)", "verdict"):
        t.add_column(col, justify="left" if col in ("status", "verdict") else "right")
    explained = []
    for c in result.changes:
        status = c.new_status if c.old_status == c.new_status else f"{c.old_status} -> {c.new_status}"
        mfu_old = "-" if c.old_mfu is None else f"{c.old_mfu:.2%}"
        mfu_new = "-" if c.new_mfu is None else f"{c.new_mfu:.2%}"
        verdict = ("REGRESSION" if c.regressed else "weak" if c.weak else "not significant" if c.reason else "ok")
        t.add_row(Text(c.run_id), f"{c.old_repeats}/{c.new_repeats}", Text(status),
                  f"{fmt(c.old_samples_per_s, '.4g')} -> {fmt(c.new_samples_per_s, '.4g')} ({pct(c.samples_change_pct)})",
                  f"{mfu_old} -> {mfu_new} ({pct(c.mfu_change_pct)})", f"{c.old_steps}/{c.new_steps}",
                  "-" if c.p_value is None else f"{c.p_value:.2g}",
                  Text(verdict, style="red" if c.regressed else "yellow" if verdict != "ok" else ""))
        if c.reason:  # one line each, so the reason is never squeezed into a column
            explained.append(Text(f"{c.run_id}: ") + Text(f"{verdict} ", style="red" if c.regressed else "yellow")
                             + Text(c.reason))
    console.print(t)
    for line in explained:
        console.print(line, soft_wrap=True)
    for label, ids in (("only in OLD", result.only_old), ("only in NEW", result.only_new)):
        if ids:
            console.print(f"{label} ({len(ids)}): {', '.join(ids)}", highlight=False)
    if result.weak:
        console.print(f"[yellow]{len(result.weak)} weak comparison(s): fewer than {MIN_STEPS} stored steps a side, "
                      "not decided[/]")
    if result.regressions:
        console.print(f"[red]{len(result.regressions)} of {len(result.changes)} configuration(s) regressed "
                      f"(more than {threshold:g}% and p < {alpha:g}, or now failing)[/]")
        raise typer.Exit(1)
    console.print(f"{len(result.changes)} paired configuration(s), no significant loss of more than {threshold:g}%")


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

    paths = synth_shards(out, shards, samples_per_shard, seed=seed, max_seconds=max_seconds)
    size = sum(p.stat().st_size for p in paths)
    console.print(f"wrote {len(paths)} shards, {len(paths) * samples_per_shard} samples, {size / 1e6:.1f} MB to {out}")


# ---- matrices: plan, sweep, status (echobench.matrix, echobench.sweep) ----

def load_plan(matrix_path: Path, executor: str | None):
    from echobench.matrix import MatrixError, expand, load_matrix

    if executor not in (None, "local", "slurm"):
        fail(f"--executor {executor!r} is not valid: allowed local, slurm")
    try:
        matrix = load_matrix(matrix_path)
    except MatrixError as exc:
        fail(str(exc))
    executor = executor or matrix.spec.executor
    return matrix, expand(matrix, executor), executor


def gib(value) -> str:
    return "-" if value is None else f"{value:.1f}"


@app.command()
def plan(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME): paths in --script."),
    script: Optional[str] = typer.Option(None, "--script", metavar="RUN_ID", help="Print this run's exact job script."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
):
    """Runs of a matrix, skipped ones with the reason, per-GPU memory estimates, GPU-hours."""
    from echobench import sweep as sw

    matrix, the_plan, executor = load_plan(matrix_path, executor)
    sweep_dir = (out or sw.default_out(matrix)).resolve()
    if script is not None:
        run = the_plan.by_id(script)
        if run is None:
            fail(f"no run {script!r} in {matrix_path}: `echobench plan {matrix_path}` lists the run ids")
        try:
            print(sw.render_job_script(run, sw.run_dir(sweep_dir, run.id), matrix, executor), end="")
        except ValueError as exc:
            fail(str(exc))
        return
    hw = matrix.spec.hardware
    from echobench.memory import device_memory_gib

    capacity = device_memory_gib(hw.memory_gib, hw.device)
    limit_h = sw.time_limit_s(matrix, executor) / 3600
    table = Table(title=f"{matrix.name}: {len(the_plan.runs)} runs ({executor}; time limit {limit_h:.2f} h per run; "
                        f"device memory {gib(capacity)} GiB)")
    table.add_column("run id", no_wrap=True)
    for col in ("tp x dp", "mb / global", "mem GiB", "fits", "GPU-h est", "GPU-h limit"):
        table.add_column(col, justify="right")
    est_total, limit_total, rows = 0.0, 0.0, []
    for run in the_plan.runs:
        c = run.cfg
        est = sw.estimated_seconds(run, matrix)
        est_h = None if est is None else est / 3600 * c.world_size
        est_total += est_h or 0
        run_limit_h = sw.time_limit_s(matrix, executor, run) / 3600
        limit_total += run_limit_h * c.world_size
        fits = {True: "yes", False: "[red]NO[/]", None: "?"}[run.fits]
        rows.append({"run_id": run.id, "settings": run.settings, "memory_gib": run.memory.as_gib(), "fits": run.fits,
                     "gpu_hours_estimate": est_h, "gpu_hours_limit": run_limit_h * c.world_size})
        table.add_row(run.id, f"{c.tp} x {c.dp}",
                      f"{c.micro_batch} / {c.global_batch}", gib(run.memory.total_gib), fits,
                      "-" if est_h is None else f"{est_h:.2f}", f"{run_limit_h * c.world_size:.2f}")
    if as_json:
        print(json.dumps({"name": matrix.name, "executor": executor, "device_memory_gib": capacity, "runs": rows,
                          "skipped": [{"settings": s.settings, "reason": s.reason} for s in the_plan.skipped],
                          "excluded": the_plan.excluded, "duplicates": the_plan.duplicates}, indent=2, default=str))
        return
    console.print(table)
    keys = sw.varying_keys(the_plan)
    if the_plan.skipped:
        skipped = Table(title=f"skipped: {len(the_plan.skipped)}")
        skipped.add_column("settings")
        skipped.add_column("reason")
        for s in the_plan.skipped:
            skipped.add_row(" ".join(f"{k}={s.settings.get(k)}" for k in keys if k in s.settings), s.reason)
        console.print(skipped)
    too_big = [r for r in the_plan.runs if r.fits is False]
    console.print(f"{len(the_plan.runs)} runs, {len(the_plan.skipped)} skipped, {the_plan.excluded} excluded"
                  + (f", {the_plan.duplicates} duplicates" if the_plan.duplicates else "")
                  + (f"; {len(too_big)} would not fit in {gib(capacity)} GiB (sweep skips them unless --force)"
                     if too_big else ""))
    if the_plan.runs:
        console.print(f"GPU-hours: {limit_total:.2f} at most (time limits), "
                      + (f"~{est_total:.2f} estimated at {hw.assumed_mfu:.0%} MFU" if est_total else
                         "no estimate (no peak known: set hardware.peak_tflops or hardware.device)"))


@app.command()
def sweep(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME)."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait for the jobs and collect (slurm: --no-wait returns after submitting)."),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Also re-run runs whose record is a failure."),
    only: list[str] = typer.Option([], "--only", metavar="KEY=VALUE", help="Only runs with this setting (repeatable)."),
    force: bool = typer.Option(False, "--force", help="Also run what the memory estimate says will not fit."),
    poll: Optional[float] = typer.Option(None, help="Seconds between state checks (default 1 local, 5 slurm)."),
):
    """Run every run of a matrix not yet done (resumable); shows progress, collects results."""
    from echobench import sweep as sw
    from echobench.matrix import MatrixError, parse_only, select

    matrix, the_plan, executor = load_plan(matrix_path, executor)
    if not wait and executor == "local":
        fail("--no-wait needs --executor slurm: the local executor runs each job from this process")
    try:
        runs = select(the_plan.runs, parse_only(only))
    except MatrixError as exc:
        fail(str(exc))
    skipped = []
    for s in the_plan.skipped:
        console.print(f"[dim]skipped[/] {' '.join(f'{k}={v}' for k, v in s.settings.items() if k in sw.varying_keys(the_plan))}: {s.reason}", highlight=False)
        skipped.append(sw.skipped_entry(s.settings, s.reason, s.cfg))
    too_big = [r for r in runs if r.fits is False]
    if too_big and not force:
        for r in too_big:
            why = f"needs ~{r.memory.total_gib:.1f} GiB per GPU, more than the device has (--force runs it anyway)"
            console.print(f"[yellow]not run[/] {r.id}: {why}", highlight=False)
            skipped.append(sw.skipped_entry(r.settings, why, r.cfg))
        runs = [r for r in runs if r.fits is not False]
    if not runs:
        fail("no runs to do: every combination was skipped or filtered out (see `echobench plan`)", code=1)
    opts = sw.SweepOptions(executor=executor, out=out or sw.default_out(matrix), wait=wait,
                           retry_failed=retry_failed, force=force, poll_s=poll)
    try:
        code = sw.run_sweep(matrix, runs, opts, console, skipped)
    except ValueError as exc:
        fail(str(exc))
    raise typer.Exit(code)


@app.command()
def status(
    runs_dir: Path = typer.Argument(..., metavar="DIR", help="A sweep directory (or any directory of result.json)."),
    wait: bool = typer.Option(False, "--wait", help="Keep refreshing until no job is pending or running."),
    poll: float = typer.Option(5.0, help="Seconds between refreshes with --wait."),
    export: bool = typer.Option(False, "--export", help="Also write DIR/results.csv and results.parquet."),
):
    """One row per run: state (refreshed from the scheduler), step time, MFU, error."""
    import time as _time

    from echobench import sweep as sw
    from echobench.executors import ACTIVE

    if not runs_dir.is_dir():
        fail(f"{runs_dir} is not a directory")
    plain_records = None  # a directory of records that is not a sweep
    if not (runs_dir / sw.SWEEP_FILE).exists() and not list(runs_dir.glob("*/run.yaml")):
        from echobench.results import load_records

        records, problems = load_records([runs_dir])
        plain_records = records
        rows = [{"run_id": r["run_id"], "state": r["status"], "step_time_s": r.get("step_time_s"), "mfu": r.get("mfu"),
                 "samples_per_s": r.get("samples_per_s"), "peak_mem_gib": r.get("peak_mem_gib"), "error": r.get("error")}
                for r in records]
        for p in problems:
            err_console.print(f"[yellow]skipped a corrupt record:[/] {p}", highlight=False)
    else:
        while True:
            rows = sw.refresh_status(runs_dir)
            if not wait or not any(r["state"] in ACTIVE for r in rows):
                break
            _time.sleep(poll)
    table = Table(title=f"{runs_dir}: {len(rows)} runs")
    table.add_column("run id", no_wrap=True)
    for col in ("state", "job", "step time s", "samples/s", "MFU", "mem GiB", "error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        st = r["state"]
        color = "green" if st == "ok" else ("cyan" if st in ACTIVE else "red")
        table.add_row(r["run_id"], f"[{color}]{st}[/]", str(r.get("job_id") or "-"), fmt(r.get("step_time_s"), ".4f"),
                      fmt(r.get("samples_per_s"), ".3g"), "-" if r.get("mfu") is None else f"{r['mfu']:.2%}",
                      fmt(r.get("peak_mem_gib"), ".2f"), (r.get("error") or "")[:160])
    console.print(table)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    console.print(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no runs")
    if export:
        if plain_records is not None:
            from echobench.results import export_table, records_frame

            paths = export_table(records_frame(plain_records), runs_dir)
            console.print(f"results: {', '.join(map(str, paths))}")
        else:
            sw.collect(runs_dir.resolve(), [runs_dir.resolve() / r["run_id"] for r in rows], console)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
