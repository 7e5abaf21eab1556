"""`echobench calibrate`: the achievable GEMM rate of this device (echobench.hardware.device), or with
--comm a hardware profile of this machine (echobench.calibrate.commcalibrate)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from echobench.cli.common import SITE_HELP, app, console, fail, settings_options, writable_file
from echobench.records.config import check_value
from echobench.records.console import esc, fmt


@app.command(short_help="This device's achievable GEMM rate; with --comm, a hardware profile (collectives, GEMMs, attention, bandwidth).")
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
                              "(docs/reference/hardware-profiles.md). Under torchrun on its group; else it launches --nproc."),
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
    site: Optional[Path] = typer.Option(None, "--site", metavar="FILE", help="With --matrix: " + SITE_HELP),
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
    from echobench.train.launch import rendezvous_problem

    # The flags are checked before torch is imported (some 2 CPU s): a usage error is said at once.
    try:
        device = check_value("device", settings.pop("device"))
        if scale is not None:
            check_value("scale", scale)
    except ValueError as exc:
        fail(str(exc))
    if dtype not in ("auto", "bf16", "fp32"):
        fail(f"dtype={dtype!r} is not valid: allowed auto, bf16, fp32")
    if site is not None and matrix is None:
        fail("--site: the site file of --matrix: give --matrix too")
    comm_only = {"--matrix": matrix is not None, "--nnodes": nnodes != 1, "--master-addr": master_addr is not None,
                 "--nproc": nproc is not None, "--out": out is not None, "--max-bytes": max_bytes is not None,
                 "--comm-budget-s": comm_budget_s is not None}
    if not comm and any(comm_only.values()):
        given = [flag for flag, set_ in comm_only.items() if set_]
        fail(f"{', '.join(given)}: {'options' if len(given) > 1 else 'an option'} of calibrate --comm: add --comm")
    if problem := rendezvous_problem(nnodes, node_rank, master_addr):
        fail(problem)
    if comm:
        check_comm_flags(ctx, matrix, settings, out)
    import torch

    from echobench.train.distributed import pick_device

    try:
        dev = pick_device(device)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    dtypes = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}
    if comm:
        calibrate_comm(dev, dtype, dtypes[dtype], (scale, matrix, settings, site), budget_s, nproc, out, max_bytes,
                       comm_budget_s, (nnodes, node_rank, master_addr, master_port))
        return
    from echobench.hardware.device import calibrate as measure

    budget_s = 15.0 if budget_s is None else budget_s
    try:
        record = measure(dev, dtypes[dtype], size, iters, scale=scale, budget_s=budget_s, **settings)
    except ValueError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(record, indent=2))
        return
    print_gemm_sweep(record)


def print_gemm_sweep(record: dict) -> None:
    """hardware.calibrate's record: a row per shape, then the ceiling and where it was saved."""
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


def check_comm_flags(ctx: typer.Context, matrix: Path | None, settings: dict, out: Path | None) -> None:
    """calibrate --comm's own usage errors: --out that cannot be written, shape flags beside --matrix."""
    if out is not None:
        writable_file(out, "--out")  # before minutes of measuring, not after
    if matrix is not None:
        given = [f"--{k.replace('_', '-')}" for k in ("scale", *settings)
                 if getattr(ctx.get_parameter_source(k), "name", None) == "COMMANDLINE"]
        if given:
            fail(f"--matrix {matrix} gives the shapes (every run of it): drop {', '.join(given)}")


def calibrate_comm(dev, dtype_flag: str, dtype, shapes: tuple, budget_s, nproc, out, max_bytes,
                   comm_budget_s, rendezvous: tuple[int, int, str | None, int]) -> None:
    """`calibrate --comm` (its flags checked: check_comm_flags): commcalibrate.calibrate_command
    (`shapes`: --scale, --matrix and the lengths), then the profile where this process shows it."""
    from echobench.calibrate import commcalibrate
    from echobench.train.distributed import exit_process

    profile, paths = commcalibrate.calibrate_command(dev, dtype_flag, dtype, shapes, budget_s, nproc, out,
                                                     max_bytes, comm_budget_s, rendezvous)
    if profile is not None:
        print_profile(profile, paths)
    exit_process(0)


def print_profile(profile, paths) -> None:
    """A hardware profile's fits and rates, and where it was written."""
    from echobench.hardware.profile import memory_gbps

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
