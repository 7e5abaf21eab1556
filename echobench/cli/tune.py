"""`echobench tune`: the best configuration of a scale on a node count, ranked by the performance
model and proven by measurement (echobench.tune)."""

from __future__ import annotations

import typing
from collections import Counter
from pathlib import Path
from typing import Optional

import typer

from echobench.cli.common import app, console, err_console, fail, load_profiles_or_fail, writable_dir
from echobench.records.console import esc, log
from echobench.sweep.matrix import ExecutorName


@app.command(short_help="The best configuration of a scale on a node count: searched, ranked by predict, proven by a sweep.")
def tune(
    tune_file: Path = typer.Argument(..., metavar="TUNE_FILE", help="A tune file (docs/reference/tune-file.md): the scale(s), "
                                     "node counts, GPUs per node, axes to fix or widen, and the matrix sections the "
                                     "measuring sweep takes."),
    out: Optional[Path] = typer.Option(None, "--out", help="Tune directory (default runs/tune-NAME): tune.json, "
                                       "report.md, winners/, the measuring sweep; the same --out resumes."),
    executor: Optional[str] = typer.Option(None, "--executor", help="local or slurm (default: the tune file's)."),
    profile: Optional[str] = typer.Option(None, "--profile", metavar="NAME|FILE", help="The hardware profile to rank "
                                          "on (default: the device's shipped profile, else the one `calibrate --comm` "
                                          "measured on this machine)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Candidates measured per scale and node count besides "
                                        "each layout family's best (default: the file's top_k, else 3)."),
    budget: Optional[float] = typer.Option(None, "--budget-gpu-hours", help="Stop measuring once this many device-hours "
                                           "are spent (default: the file's budget_gpu_hours, else none)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Prune and rank only: write tune.json and report.md, measure "
                                 "nothing."),
    preflight: bool = typer.Option(True, "--preflight/--no-preflight", help="SLURM: the sweep's preflight job first."),
    site: Optional[Path] = typer.Option(None, "--site", metavar="FILE", help="A site file: the cluster's executor, "
                                        "slurm, local and hardware settings, under the tune file's own (in place of "
                                        "its site: key)."),
):
    """Search layouts, micro-batch, accumulation, checkpointing, compile, resharding and fp8; prune by
    memory and rules; rank by predicted samples/s; measure the top K and each family's best;
    recalibrate and re-rank until the measured winner is the predicted one or the budget is spent."""
    from echobench.predict import machine_device, no_profile_message, profile_for_device
    from echobench.records.config import RunConfig
    from echobench.tune.cards import card_problems, card_table
    from echobench.tune.loop import run_tune, sweep_measure
    from echobench.tune.output import prior_charges, ranking_table, write_outputs
    from echobench.tune.space import TuneError, build_problem, load_tune_file, sharing_warning

    if executor not in (None, *typing.get_args(ExecutorName)):
        fail(f"--executor {executor!r} is not valid: allowed {', '.join(typing.get_args(ExecutorName))}")
    spec = load_tune_file(tune_file, site)
    updates = {k: v for k, v in (("top_k", top_k), ("budget_gpu_hours", budget), ("executor", executor))
               if v is not None}
    if top_k is not None and not 1 <= top_k <= 20:
        fail(f"--top-k {top_k}: between 1 and 20")
    if budget is not None and budget <= 0:
        fail(f"--budget-gpu-hours {budget:g}: must be > 0")
    spec = spec.model_copy(update=updates)
    if spec.scale and spec.executor == "local" and any(n > 1 for n in spec.nodes):  # a card's: ranked only there
        fail(f"{tune_file}: nodes {spec.nodes}: the local executor runs on this one machine: nodes [1], or "
             "--executor slurm")
    if warning := sharing_warning(spec):
        err_console.print(f"[yellow]warning:[/] {esc(warning)}", highlight=False, soft_wrap=True)
    tune_dir = writable_dir((out or Path("runs") / f"tune-{spec.name}").resolve())
    profiles = load_profiles_or_fail([profile] if profile else [])
    if profiles:
        prof = profiles[0]
    elif not spec.scale:
        prof = None  # a card alone: its file names its profile
    else:
        try:
            cfg = RunConfig.from_dict({**spec.defaults, "scale": spec.scale[0]})
        except (TypeError, ValueError) as exc:
            fail(f"{tune_file}: defaults: {exc}")
        device = spec.hardware.get("device") or machine_device([cfg])
        prof = profile_for_device(device, fabric=spec.slurm.get("fabric"))
        if prof is None:
            fail(no_profile_message(f"tune file {tune_file} (device {device!r}: its hardware.device, else this "
                                       "machine's)") + "; or give --profile")
    try:
        problems = [build_problem(spec, scale, nodes, prof) for scale in spec.scale for nodes in spec.nodes]
        cards = card_problems(spec, prof)  # the tune's profile; a card alone: its file's
    except TuneError as exc:
        fail(str(exc), 1)
    log(console, f"{esc(spec.name)}: " + "; ".join(
        f"{esc(p.key)} {len(p.ranked)} candidates, {len(p.pruned)} pruned" for p in [*problems, *cards]))
    if dry_run:
        def measure(_):
            return {}
        info = None
        spec = spec.model_copy(update={"max_rounds": 1})
    else:
        measure, info = sweep_measure(spec, tune_dir, console, executor=spec.executor, preflight=preflight)
    try:
        result = run_tune(spec, [*problems, *cards], prof or cards[0].profile, measure, tune_dir, info,
                          (lambda s: None) if dry_run else lambda s: log(console, esc(s)), spec.executor,
                          prior_charges(tune_dir))
    except TuneError as exc:
        fail(str(exc), 1)
    if dry_run:
        result.rounds.clear()
        result.stops = {p.key: "--dry-run: nothing measured" for p in [*problems, *cards]}
    doc = write_outputs(spec, tune_file, result, tune_dir)
    for p in problems:
        console.print(ranking_table(p, result))
    for p in cards:
        console.print(card_table(p, result.measured))
    for p in doc["cards"]:
        if reasons := Counter(c["unmeasured"] for c in p["candidates"] if c["unmeasured"]):
            console.print(f"{esc(p['key'])}: ranked only, not measured: " + "; ".join(
                f"{n} x {esc(r)}" for r, n in reasons.most_common()), highlight=False, soft_wrap=True)
        if p["winner"]:
            console.print(f"{esc(p['key'])}: measured winner [bold]{esc(p['winner'])}[/] ({esc(p['stop'])})",
                          highlight=False, soft_wrap=True)
    for p in doc["problems"]:
        if p["winner"]:
            console.print(f"{esc(p['key'])}: measured winner [bold]{esc(p['winner'])}[/] "
                          f"({esc(p['stop'])}) -> {esc(p['files']['config'])}", highlight=False, soft_wrap=True)
        else:
            console.print(f"{esc(p['key'])}: no measured winner ({esc(p['stop'])}); predicted: "
                          f"{esc(p['predicted_winner'])}", highlight=False, soft_wrap=True)
    console.print(f"wrote {esc(tune_dir / 'tune.json')}, {esc(tune_dir / 'report.md')}; dashboard: echobench report "
                  f"{esc(tune_dir)}", highlight=False, soft_wrap=True)
    if result.interrupted:
        err_console.print(f"interrupted: nothing measured is lost; the same command resumes (--out {esc(tune_dir)})",
                          highlight=False)
        raise typer.Exit(130)
    if not dry_run and problems and not any(p["winner"] for p in doc["problems"]):
        raise typer.Exit(1)
