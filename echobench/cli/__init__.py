"""The `echobench` command line (typer). Each command is a thin layer over a module: it parses its
options, calls the module that owns the work, and prints.

Start-up: `echobench --help` (and every command) imports all the command modules, so a command
imports what is heavy to load (torch, pandas, scipy, the model, predict, the sweep) inside its
function, where only that command pays for it; the modules imported at the top of these (sweep.matrix,
records) do the same. Such an import carries no comment unless it is lazy for another reason.

May import: every package (the top layer).
"""

from __future__ import annotations

import logging
import sys

import typer

from echobench.cli.common import app, err_console, print_error

# The command modules register their commands on `app` as they are imported: in this order, that
# of `echobench --help`.
# isort: off
from echobench.cli import run  # noqa: F401,E402
from echobench.cli import calibrate  # noqa: F401,E402
from echobench.cli import report  # noqa: F401,E402
from echobench.cli import results  # noqa: F401,E402
from echobench.cli import plan  # noqa: F401,E402
from echobench.cli import validate  # noqa: F401,E402
from echobench.cli import tune  # noqa: F401,E402
from echobench.cli import sweep  # noqa: F401,E402
from echobench.cli import reproduce  # noqa: F401,E402
from echobench.cli import data  # noqa: F401,E402
# isort: on

__all__ = ["app", "main"]


def quiet_third_party_logs() -> None:
    """Start-up noise kept out of every command's output and job log (a rank is `python -m echobench
    run`): torchao, which transformers imports, warns of its optional C++ kernels (MX formats, sm90a
    CUTLASS) that fail to load where they cannot run, and that import trips a torch deprecation
    warning. echobench's float8 path uses neither (torchao's Float8Linear over torch's scaled GEMM)."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def main() -> None:
    """The `echobench` command: typer's app, with its usage errors (a bad flag value, an unknown
    option or command) as one `error:` line like every other bad input, not a boxed panel."""
    quiet_third_party_logs()
    try:
        code = app(standalone_mode=False)
    except typer.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # Ctrl-C where no command caught it (status --wait)
            err_console.print("interrupted (Ctrl-C)", highlight=False)
            sys.exit(130)
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
