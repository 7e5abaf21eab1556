"""The known errors of echobench's modules and the exit code each gives on the command line (2: bad
input; docs/reference/failures.md#exit-codes). Every command says one of them as one `error:` line
(its text, no traceback: cli.common.App wraps the commands), so a command lets them propagate and
catches one itself only to add to its line or to exit otherwise.

The types are named, not imported: their modules are slow to import (predict, pandas), and
`echobench --help` imports this one."""

from __future__ import annotations

# module.qualname of the exception type -> its exit code (None: the exception's own `code`)
KNOWN_ERRORS: dict[str, int | None] = {
    "echobench.sweep.cluster.MatrixError": 2,  # a matrix, site or tune file, --only
    "echobench.sweep.state.CorruptSweepState": 2,  # a sweep directory's state file
    "echobench.sweep.reproduce.ReproduceError": 2,  # a reproduce rows file, --rows
    "echobench.predict.errors.PredictError": 2,  # --profile, --nodes, a model card
    "echobench.tune.space.TuneError": 2,  # a tune file
    "echobench.report.listing.ListingError": 2,  # results' --sort, --columns
    "echobench.report.tables.ReferenceError": 2,  # report's --reference CSV
    "echobench.data.format.DataError": 2,  # data shards
    "echobench.calibrate.commcalibrate.CalibrateError": None,  # 2, or the exit code of its torchrun
}


def known_exit_code(exc: BaseException) -> int | None:
    """The exit code of a known error (of its type or a base of it); None for any other."""
    for cls in type(exc).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in KNOWN_ERRORS:
            code = KNOWN_ERRORS[name]
            return code if code is not None else exc.code
    return None
