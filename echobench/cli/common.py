"""What every command of the command line uses: the typer apps, the consoles, the one-line errors,
the checks of paths to write, the RunConfig fields as options, and a matrix's plan."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import tempfile
import typing
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.console import Console

from echobench.cli.errors import known_exit_code
from echobench.records.config import FIELDS, allowed_text, auto_switch, base_type, choices
from echobench.records.console import esc
from echobench.sweep.matrix import MAX_RUNS, ExecutorName, expand, load_matrix, parse_only, select


class App(typer.Typer):
    """typer's app whose every command says a known error (cli.errors) as one `error:` line with its
    exit code, wherever in the command it is raised."""

    def command(self, *args, **kwargs) -> Callable:
        register = super().command(*args, **kwargs)
        return lambda command: register(says_known_errors(command))


def says_known_errors(command: Callable) -> Callable:
    @functools.wraps(command)
    def run(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as exc:  # typer.Exit included: not a known error, raised on
            if (code := known_exit_code(exc)) is None:
                raise
            fail(str(exc), code)

    return run


app = App(add_completion=False, no_args_is_help=True, help=__doc__ and "Benchmark Echo TTS training: throughput and MFU.")
data_app = App(no_args_is_help=True, help="Training data: write tar shards.")
app.add_typer(data_app, name="data")
validate_app = App(no_args_is_help=True, help="The performance model held against measured or published runs.")
app.add_typer(validate_app, name="validate")


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"echobench {version('echobench')}")
        except PackageNotFoundError:  # run from a checkout that was never pip-installed
            print("echobench (not installed: pip install -e .)")
        raise typer.Exit()


@app.callback()
def _options(_version: bool = typer.Option(False, "--version", is_eager=True, callback=print_version,
                                           help="Print echobench's version and exit.")) -> None:
    """Benchmark Echo TTS training: throughput and MFU."""


# `run --help`'s panels: each flagged RunConfig field in one (tests/test_settings.py holds every one
# placed); "hidden": testing switches, kept out of --help (docs/reference/settings.md lists them).
RUN_PANELS = {
    "What runs": ["scale", "card", "framework", "parallelism", "precision", "device", "seed"],
    "Steps and shapes": ["steps", "warmup_steps", "micro_batch", "grad_accum", "audio_frames", "text_tokens",
                         "speaker_frames", "batching", "buckets"],
    "Performance": ["compile", "ac", "master_weights", "grad_accum_dtype", "sdpa_backend", "reshard_after_forward", "grad_reduce_dtype", "te",
                    "sequence_parallel", "distributed_optimizer", "float8_recipe", "key_masking", "cfg_drop",
                    "cfg_drop_attention", "loader_workers", "gc_every"],
    "Data and text encoder": ["data", "synthetic_lengths", "skip_bad_samples", "encoder_model", "frozen_encoder", "encoder_checkpoint",
                              "t5_hidden_dim", "tokenizer"],
    "Measurement": ["peak_tflops", "trace", "time_limit_s", "trace_limit_s", "progress_every_s", "log_metrics"],
    "hidden": ["fail_at_step", "fail_rank", "fail_kind"],
}
PANEL_OF = {name: panel for panel, names in RUN_PANELS.items() for name in names}
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
            panel = PANEL_OF.get(name, "Other settings")
            option = typer.Option(default, *filter(None, [meta["flag"]]),
                                  help=f"{meta['help']} Allowed: {allowed_text(name)}." if allowed else meta["help"],
                                  rich_help_panel=None if panel == "hidden" else panel, hidden=panel == "hidden")
            yield inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                    annotation=kind if default is not None else Optional[kind])

    def add(command: Callable) -> Callable:
        own = inspect.signature(command, eval_str=True).parameters.values()
        command.__signature__ = inspect.Signature([p for p in own if p.kind != p.VAR_KEYWORD] + list(options()))
        return command

    return add


# ---- matrices (echobench.sweep.matrix): plan, predict, sweep, preflight ----

MAX_RUNS_HELP = f"Refuse a matrix of more runs than this (default: the file's max_runs, else {MAX_RUNS})."


ONLY_HELP = "Only runs with this setting (repeatable; the same key twice: either value)."
SITE_HELP = ("A site file: the cluster's executor, slurm, local and hardware settings, under the matrix's own "
             "(in place of the matrix's site: key).")


def load_plan(matrix_path: Path, executor: str | None, max_runs: int | None, only: list[str] = (),
              site: Path | None = None):
    """(the matrix over its site file (--site, else its site: key), its plan of the runs --only
    KEY=VALUE selects, the executor: --executor, else the matrix's); bad input fails."""
    if executor not in (None, *typing.get_args(ExecutorName)):
        fail(f"--executor {executor!r} is not valid: allowed {', '.join(typing.get_args(ExecutorName))}")
    if max_runs is not None and max_runs < 1:
        fail(f"--max-runs {max_runs}: must be >= 1")
    matrix = load_matrix(matrix_path, site)
    executor = executor or matrix.spec.executor
    plan = expand(matrix, executor, max_runs)
    if only:
        plan = dataclasses.replace(plan, runs=select(plan.runs, parse_only(only)))
    return matrix, plan, executor


def load_profiles_or_fail(names: list[str]):
    """The hardware profiles of --profile (echobench.predict.load_profiles); a bad one fails."""
    from echobench.predict import load_profiles

    return load_profiles(names)
