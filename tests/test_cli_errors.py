"""The one map of known errors to one-line messages and exit codes (echobench/cli/errors.py): every
type it names exists, a command says any of them as one `error:` line with its code wherever it is
raised, and anything else still raises."""

import importlib

import pytest
from typer.testing import CliRunner

from echobench.cli import app
from echobench.cli.errors import KNOWN_ERRORS, known_exit_code
from echobench.records.paths import SWEEP_FILE


def known_type(name: str) -> type:
    module, _, qualname = name.rpartition(".")
    return getattr(importlib.import_module(module), qualname)


@pytest.mark.parametrize("name", sorted(KNOWN_ERRORS))
def test_every_known_error_names_an_exception_type(name):
    """A renamed or moved error type would drop out of the map silently: its name must resolve."""
    cls = known_type(name)
    assert isinstance(cls, type) and issubclass(cls, Exception) and f"{cls.__module__}.{cls.__qualname__}" == name


def test_known_exit_codes():
    from echobench.calibrate.commcalibrate import CalibrateError
    from echobench.sweep.matrix import MatrixError

    class Narrower(MatrixError):
        pass

    assert known_exit_code(MatrixError("x")) == 2 and known_exit_code(Narrower("x")) == 2  # a subclass too
    assert known_exit_code(CalibrateError("x", 7)) == 7 and known_exit_code(CalibrateError("x")) == 2  # its own code
    assert known_exit_code(ValueError("x")) is None and known_exit_code(KeyError("x")) is None


def test_a_known_error_raised_deep_in_a_command_is_one_line(tmp_path):
    """`status DIR --only` with a key that is no setting: the MatrixError from deep in parse_only is
    one `error:` line and exit 2 (bad input), no traceback; a corrupt sweep state likewise."""
    result = CliRunner().invoke(app, ["status", str(tmp_path), "--only", "nosuchkey=1"])
    assert result.exit_code == 2 and "nosuchkey" in result.output and "Traceback" not in result.output
    assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1
    (tmp_path / SWEEP_FILE).write_text("{not json")
    result = CliRunner().invoke(app, ["cancel", str(tmp_path)])
    assert result.exit_code == 2 and result.output.startswith("error:") and "Traceback" not in result.output


def test_another_error_is_not_swallowed(tmp_path, monkeypatch):
    """Only the known errors are mapped: a bug (any other exception) still raises with its traceback."""
    from echobench.sweep import status

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(status, "status", broken)
    result = CliRunner().invoke(app, ["status", str(tmp_path), "--json"])
    assert isinstance(result.exception, KeyError) and result.exit_code == 1 and "error:" not in result.output
