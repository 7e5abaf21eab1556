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

from echobench.console import esc

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__ and "Benchmark Echo TTS training: throughput and MFU.")
data_app = typer.Typer(no_args_is_help=True, help="Training data: write tar shards.")
app.add_typer(data_app, name="data")
# Wide enough for the tables when output goes to a file or a CI log.
console = Console(width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)


def fail(message: str, code: int = 2) -> None:
    """A clear one-line error for bad input; no Python traceback. The message is plain text."""
    err_console.print(f"[bold red]error:[/] {esc(message)}", highlight=False, soft_wrap=True)
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
    profile: bool = typer.Option(False, "--profile", help="Trace 3 steps after the measured ones (untimed): OUT/trace-rankN.json and the time breakdown OUT/breakdown.json (echobench explain)."),
    fail_at_step: Optional[int] = typer.Option(None, help="Testing: inject a failure at this step (-1: at start-up, "
                                               "before the process group forms)."),
    fail_rank: Optional[int] = typer.Option(None, help="Testing: ... on this rank only."),
    fail_kind: str = typer.Option("error", help="Testing: error or oom."),
    time_limit_s: Optional[float] = typer.Option(None, help="Stop the run after this many seconds (status timeout)."),
):
    """One benchmark run: real training steps of the full model; writes OUT/result.json."""
    params = {k: v for k, v in locals().items() if k not in LAUNCH_OPTIONS}
    from echobench.config import RunConfig

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
        if int(os.environ.get("RANK", 0)) == 0:
            print_record(record)
            console.print(f"wrote {esc(out / 'result.json')}", highlight=False)
        # A non-zero exit makes torchrun stop the other ranks.
        exit_process(0 if record.status == "ok" else 1)
        if record.status != "ok":
            raise typer.Exit(1)
        return
    print_record(record)
    console.print(f"wrote {esc(out / 'result.json')}", highlight=False)
    if record.status != "ok" or code:
        raise typer.Exit(code or 1)


def run_repeats(cfg, out: Path, repeats: int, *launch_args) -> None:
    """`run --repeats N`: N launches one after another, then the median over the ok ones."""
    from echobench.launch import launch_repeats
    from echobench.results import configuration_key, over_repeats

    if repeats < 1:
        fail(f"--repeats {repeats}: must be >= 1")
    if "RANK" in os.environ:
        fail("--repeats launches its own processes: run it outside torchrun (with --nproc N for several per node)")
    records, code = launch_repeats(cfg, out, repeats, *launch_args)
    if not records:  # not node 0: node 0's launcher owns the records; this one exits as its torchruns did
        raise typer.Exit(code)
    table = Table(title=esc(f"{len(records)} repeats of {configuration_key(records[0])}"))
    for col in ("repeat", "run id", "status", "samples/s", "MFU", "step time median s", "mean vs median"):
        table.add_column(col, justify="left" if col in ("run id", "status") else "right")
    for k, r in enumerate(records):
        ok = r.status == "ok"
        table.add_row(str(k), esc(r.run_id), esc(r.status), fmt(r.samples_per_s, ".4g") if ok else "-",
                      f"{r.mfu:.2%}" if ok else "-", fmt(r.step_time_s, ".4f") if ok else "-",
                      f"{r.step_time_mean_vs_median:+.1%}" if ok else "-")
    console.print(table)
    ok = [r for r in records if r.status == "ok"]
    if ok:
        sps, mfu = over_repeats(r.samples_per_s for r in ok), over_repeats(r.mfu for r in ok)
        console.print(f"median over {len(ok)} ok repeat(s): samples/s {sps['median']:.4g} "
                      f"({sps['min']:.4g}-{sps['max']:.4g}), MFU {mfu['median']:.2%} "
                      f"({mfu['min']:.2%}-{mfu['max']:.2%})", highlight=False)
    console.print(f"wrote {esc(', '.join(str(out / f'repeat-{k}' / 'result.json') for k in range(len(records))))}",
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


def print_record(r) -> None:
    """A run's Record as a table (its error, when it failed)."""
    if r.status != "ok":
        err_console.print(f"[bold red]{esc(r.status)}:[/] {esc(r.error)}", highlight=False, soft_wrap=True)
        return
    from echobench.results import peak_notes

    table = Table(title=esc(r.run_id), show_header=False)
    rows = [
        ("device", r.env.device_name),
        ("step time (median, p10-p90)", f"{r.step_time_s:.4f} s ({r.step_time_p10_s:.4f}-{r.step_time_p90_s:.4f})"),
        ("step time (mean)", f"{r.step_time_mean_s:.4f} s ({r.step_time_mean_vs_median:+.1%} vs median)"),
        ("measured window", f"{r.measured_steps} steps, {r.measured_time_s:.3f} s, {r.measured_samples} samples"),
        ("samples/s (window)", fmt(r.samples_per_s, ".2f")),
        ("audio seconds/s (window)", fmt(r.audio_seconds_per_s, ".1f")),
        ("model TFLOP/sample", fmt(r.model_flops_per_sample / 1e12, ".4g")),
        ("TFLOP/s per device", fmt(r.tflops_per_gpu, ".4g")),
        ("peak TFLOP/s", f"{r.peak_tflops:.4g} {r.peak_precision} ({r.peak_source})"),
        ("MFU (window)", f"{r.mfu:.2%}"),
        *([("MFU vs fp8 peak", "-" if r.mfu_fp8_peak is None else f"{r.mfu_fp8_peak:.2%}")]
          if r.precision == "fp8" else []),
        ("HFU (window)", f"{r.hfu:.2%}"),
        ("MFU vs GEMM ceiling", "-" if r.mfu_vs_ceiling is None else f"{r.mfu_vs_ceiling:.2%}"),
        ("peak memory", f"{r.peak_mem_gib:.2f} GiB"),
        ("allocator retries / OOMs", "-" if r.num_alloc_retries is None else f"{r.num_alloc_retries} / {r.num_ooms}"),
        ("data wait", f"{r.data_wait_frac:.1%}"),
    ]
    for k, v in rows:
        table.add_row(k, esc(v))
    console.print(table)
    for note in peak_notes(r):
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
    console.print(f"{esc(record['device'])}: {record['dtype']} {record['size']}^3 GEMM "
                  f"{record['tflops']:.4g} TFLOP/s median (min {record['tflops_min']:.4g}, max {record['tflops_max']:.4g})"
                  + (f", {record['tflops'] / sheet:.1%} of the {sheet:g} datasheet peak" if sheet else ""))
    console.print(f"saved {esc(record['path'])}", highlight=False)


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
    data = load_report_input(paths)
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
        err_console.print(f"[yellow]warning:[/] {esc(problem)}", highlight=False, soft_wrap=True)
    result = compare_records(old_records, new_records, threshold, alpha)
    if not result.changes:
        fail(f"no configurations in common between {old} ({len(old_records)} records) and {new} "
             f"({len(new_records)} records)")

    def pct(v):
        return "-" if v is None else f"{v:+.1f}%"

    t = Table(title=esc(f"{old} -> {new} (threshold {threshold:g}%, alpha {alpha:g})"))
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
            console.print(f"{label} ({len(ids)}): {esc(', '.join(ids))}", highlight=False)
    if result.weak:
        console.print(f"[yellow]{len(result.weak)} weak comparison(s): fewer than {MIN_STEPS} stored steps a side, "
                      "not decided[/]")
    if result.regressions:
        console.print(f"[red]{len(result.regressions)} of {len(result.changes)} configuration(s) regressed "
                      f"(more than {threshold:g}% and p < {alpha:g}, or now failing)[/]")
        raise typer.Exit(1)
    console.print(f"{len(result.changes)} paired configuration(s), no significant loss of more than {threshold:g}%")


@app.command()
def explain(
    run_dir: Path = typer.Argument(..., metavar="RUN_DIR", help="One run's directory (result.json, and breakdown.json "
                                   "from a --profile run)."),
    as_json: bool = typer.Option(False, "--json", help="Print the breakdown and the waterfall as JSON."),
):
    """Where one step's time went (from the run's profiler breakdown) and the MFU waterfall."""
    from echobench.breakdown import CATEGORIES, LABELS, RULE, read_breakdown, waterfall
    from echobench.results import Record, peak_notes

    if not (run_dir / "result.json").is_file():
        inner = sorted(run_dir.rglob("result.json")) if run_dir.is_dir() else []
        fail(f"{run_dir}: no result.json" + (f"; give one run's directory, e.g. {inner[0].parent}" if inner
                                             else ": not a run directory"))
    try:
        record = Record.load(run_dir / "result.json")
    except ValueError as exc:
        fail(str(exc))
    run_id = record.run_id
    if record.status != "ok":
        fail(f"{run_id}: status {record.status}, nothing to explain ({record.error or 'no error text'})")
    summary = record.breakdown or {}
    if "error" in summary:
        fail(f"{run_id}: the profiler breakdown failed during the run: {summary['error']}")
    if not (run_dir / "breakdown.json").exists():
        fail(f"{run_dir}: no breakdown.json: the run was not profiled; rerun it with --profile "
             "(in a matrix: profile: true)")
    try:
        bd = read_breakdown(run_dir)
    except ValueError as exc:
        fail(str(exc))
    steps = waterfall(record)
    if as_json:
        print(json.dumps({"run_id": run_id, "summary": summary, "breakdown": bd, "waterfall": steps}, indent=2))
        return
    rank = next(r for r in bd["ranks"] if r.get("rank") == bd["busiest_rank"])
    step_s = rank["step_time_s"]
    t = Table(title=esc(f"Where the time goes: {run_id} (rank {rank['rank']}, {rank['timeline']}, mean of "
                        f"{rank['steps']} profiled steps)"))
    for col in ("part", "ms / step", "% of step", "biggest items (ms / step)"):
        t.add_column(col, justify="right" if col in ("ms / step", "% of step") else "left",
                     overflow="fold" if col.startswith("biggest") else "ellipsis")
    for c in CATEGORIES:
        top = "; ".join(f"{name} {s * 1e3:.3g}" for name, s in rank["top"].get(c, [])[:3])
        t.add_row(Text(LABELS[c]), f"{rank['seconds'][c] * 1e3:.3f}", f"{rank['seconds'][c] / step_s:.1%}", Text(top))
    comm = rank["communication"]
    t.add_row(Text("communication overlapped with compute (not in the sum)", style="dim"), f"{comm['overlapped_s'] * 1e3:.3f}",
              f"{comm['overlapped_s'] / step_s:.1%}", "")
    t.add_row(Text("profiled step", style="bold"), f"{step_s * 1e3:.3f}", "100%",
              Text(f"parts sum to {sum(rank['seconds'].values()) * 1e3:.3f} ms"))
    console.print(t)
    if len(bd["ranks"]) > 1:
        per = Table(title="per rank (the busiest, whose device computed longest, is explained above)")
        for col in ("rank", "step ms", "compute %", "exposed comm %", "overlapped comm %", "idle %", "data wait %"):
            per.add_column(col, justify="right")
        for r in bd["ranks"]:
            if "error" in r:
                per.add_row(str(r["rank"]), Text(r["error"]), "", "", "", "", "")
                continue
            s, step = r["seconds"], r["step_time_s"]
            compute = sum(s[c] for c in ("gemm", "attention", "optimizer", "other_compute", "memcpy"))
            per.add_row(str(r["rank"]), f"{step * 1e3:.3f}", f"{compute / step:.1%}", f"{s['communication'] / step:.1%}",
                        f"{r['communication']['overlapped_s'] / step:.1%}", f"{s['idle'] / step:.1%}",
                        f"{s['data_wait'] / step:.1%}")
        console.print(per)
    measured = record.step_time_mean_s or record.step_time_s
    console.print(f"measured step (mean over the window, unprofiled): {measured * 1e3:.3f} ms; the profiled steps took "
                  f"{step_s / measured - 1:+.1%} (profiler overhead and noise). Rule: {RULE}.", highlight=False,
                  markup=False)
    if steps:
        w = Table(title=f"MFU waterfall: {esc(run_id)} (percentage points of the {record.peak_tflops:.4g} TFLOP/s peak)")
        for col in ("step", "points", "MFU after (%)"):
            w.add_column(col, justify="left" if col == "step" else "right")
        level = 0.0
        for s in steps:
            level = s["pp"] if s["kind"] != "relative" else level + s["pp"]
            w.add_row(Text(s["label"], style="bold" if s["kind"] != "relative" else ""),
                      f"{s['pp']:.2f}" if s["kind"] != "relative" else f"{s['pp']:+.2f}", f"{level:.2f}")
        console.print(w)
        console.print("Each loss after the ceiling is the ceiling's share x that part's fraction of the profiled step; "
                      "the last loss is what remains to the measured MFU (README: Where the time goes).", highlight=False)
    for note in peak_notes(record):
        console.print(f"note: {note}", highlight=False, markup=False)


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


# ---- matrices: plan, sweep, status (echobench.matrix, echobench.sweep) ----

def load_plan(matrix_path: Path, executor: str | None, max_runs: int | None):
    from echobench.matrix import MatrixError, expand, load_matrix

    if executor not in (None, "local", "slurm"):
        fail(f"--executor {executor!r} is not valid: allowed local, slurm")
    if max_runs is not None and max_runs < 1:
        fail(f"--max-runs {max_runs}: must be >= 1")
    try:
        matrix = load_matrix(matrix_path)
        executor = executor or matrix.spec.executor
        return matrix, expand(matrix, executor, max_runs), executor
    except MatrixError as exc:
        fail(str(exc))


MAX_RUNS_HELP = "Refuse a matrix of more runs than this (default: the file's max_runs, else 10000)."


def gib(value) -> str:
    return "-" if value is None else f"{value:.1f}"


@app.command()
def plan(
    matrix_path: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    executor: Optional[str] = typer.Option(None, help="local or slurm (default: the matrix's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Sweep directory (default runs/NAME): paths in --script."),
    script: Optional[str] = typer.Option(None, "--script", metavar="RUN_ID", help="Print this run's exact job script."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
):
    """Runs of a matrix, skipped ones with the reason, per-GPU memory estimates, GPU-hours."""
    from echobench import sweep as sw

    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs)
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
        peak, peak_source = sw.planned_peak(run, matrix)
        rows.append({"run_id": run.id, "settings": run.settings, "memory_gib": run.memory.as_gib(), "fits": run.fits,
                     "peak_tflops": peak, "peak_source": peak_source,
                     "gpu_hours_estimate": est_h, "gpu_hours_limit": run_limit_h * c.world_size})
        table.add_row(run.id, f"{c.tp} x {c.dp}",
                      f"{c.micro_batch} / {c.global_batch}", gib(run.memory.total_gib), fits,
                      "-" if est_h is None else f"{est_h:.2f}", f"{run_limit_h * c.world_size:.2f}")
    no_peak = sw.peak_note(the_plan.runs, matrix, executor)
    if as_json:
        print(json.dumps({"name": matrix.name, "executor": executor, "device_memory_gib": capacity, "runs": rows,
                          "no_peak": no_peak,
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
            skipped.add_row(esc(" ".join(f"{k}={s.settings.get(k)}" for k in keys if k in s.settings)), esc(s.reason))
        console.print(skipped)
    too_big = [r for r in the_plan.runs if r.fits is False]
    console.print(f"{len(the_plan.runs)} runs, {len(the_plan.skipped)} skipped, {the_plan.excluded} excluded"
                  + (f", {the_plan.duplicates} duplicates" if the_plan.duplicates else "")
                  + (f"; {len(too_big)} would not fit in {gib(capacity)} GiB (sweep skips them unless --force)"
                     if too_big else ""))
    if the_plan.runs:
        console.print(f"GPU-hours: {limit_total:.2f} at most (time limits), "
                      + (f"~{est_total:.2f} estimated at {hw.assumed_mfu:.0%} MFU" if est_total else "no estimate"))
    if no_peak:
        console.print(f"[yellow]{esc(no_peak)}[/]", highlight=False)


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
    max_runs: Optional[int] = typer.Option(None, "--max-runs", help=MAX_RUNS_HELP),
):
    """Run every run of a matrix not yet done (resumable); shows progress, collects results."""
    from echobench import sweep as sw
    from echobench.matrix import MatrixError, parse_only, select

    matrix, the_plan, executor = load_plan(matrix_path, executor, max_runs)
    if not wait and executor == "local":
        fail("--no-wait needs --executor slurm: the local executor runs each job from this process")
    try:
        runs = select(the_plan.runs, parse_only(only))
    except MatrixError as exc:
        fail(str(exc))
    skipped = []
    for s in the_plan.skipped:
        settings = " ".join(f"{k}={v}" for k, v in s.settings.items() if k in sw.varying_keys(the_plan))
        console.print(f"[dim]skipped[/] {esc(settings)}: {esc(s.reason)}", highlight=False)
        skipped.append(sw.skipped_entry(s.settings, s.reason, s.cfg))
    too_big = [r for r in runs if r.fits is False]
    if too_big and not force:
        for r in too_big:
            why = f"needs ~{r.memory.total_gib:.1f} GiB per GPU, more than the device has (--force runs it anyway)"
            console.print(f"[yellow]not run[/] {esc(r.id)}: {esc(why)}", highlight=False)
            skipped.append(sw.skipped_entry(r.settings, why, r.cfg))
        runs = [r for r in runs if r.fits is not False]
    if not runs:
        fail("no runs to do: every combination was skipped or filtered out (see `echobench plan`)", code=1)
    opts = sw.SweepOptions(executor=executor, out=writable_dir(out or sw.default_out(matrix)), wait=wait,
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
        rows = [{"run_id": r.run_id, "state": r.status, "step_time_s": r.step_time_s, "mfu": r.mfu,
                 "samples_per_s": r.samples_per_s, "peak_mem_gib": r.peak_mem_gib, "error": r.error} for r in records]
        for p in problems:
            err_console.print(f"[yellow]skipped a corrupt record:[/] {esc(p)}", highlight=False, soft_wrap=True)
    else:
        while True:
            rows = sw.refresh_status(runs_dir)
            if not wait or not any(r["state"] in ACTIVE for r in rows):
                break
            _time.sleep(poll)
    table = Table(title=esc(f"{runs_dir}: {len(rows)} runs"))
    table.add_column("run id", no_wrap=True)
    for col in ("state", "job", "step time s", "samples/s", "MFU", "mem GiB", "error"):
        table.add_column(col, overflow="fold")
    for r in rows:
        st = r["state"]
        color = "green" if st == "ok" else ("cyan" if st in ACTIVE else "red")
        table.add_row(esc(r["run_id"]), f"[{color}]{esc(st)}[/]", esc(r.get("job_id") or "-"), fmt(r.get("step_time_s"), ".4f"),
                      fmt(r.get("samples_per_s"), ".3g"), "-" if r.get("mfu") is None else f"{r['mfu']:.2%}",
                      fmt(r.get("peak_mem_gib"), ".2f"), esc((r.get("error") or "")[:160]))
    console.print(table)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    console.print(esc(", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "no runs"))
    if export:
        writable_dir(runs_dir, f"--export into {runs_dir}")
        if plain_records is not None:
            from echobench.results import export_table, records_frame

            paths = export_table(records_frame(plain_records), runs_dir)
            console.print(f"results: {esc(', '.join(map(str, paths)))}", highlight=False)
        else:
            sw.collect(runs_dir.resolve(), [runs_dir.resolve() / r["run_id"] for r in rows], console)


def main() -> None:
    app()


if __name__ == "__main__":
    sys.exit(main())
