"""PyYAML's errors as one line, for every YAML file a user writes (matrices, run configs, profiles)."""

from __future__ import annotations

from pathlib import Path

import yaml


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line, "line L, column C: problem (context at line K)", instead of
    its several lines with a caret under a copy of the text."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    if context := getattr(exc, "context", None):
        where = getattr(exc, "context_mark", None)
        text += f" ({context}" + (f" that starts at line {where.line + 1})" if where and where.line != mark.line else ")")
    return text


def read_yaml(path: Path, what: str, error: type[Exception], missing: str = "",
              loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> object:
    """The YAML document in `path`, else `error` in one line naming the file: not there (with
    `missing`, the fix, where given), unreadable (as `what`), not valid YAML, or refused by `loader`
    (a SafeLoader subclass that raises `error`, e.g. for a key given twice)."""
    try:
        return yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a SafeLoader (sub)class
    except error as exc:
        raise error(f"{path}: {exc}") from None
    except FileNotFoundError as exc:
        raise error(f"{path}: no such file: {missing}" if missing else
                    f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except OSError as exc:
        raise error(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise error(f"{path}: not valid YAML: {yaml_problem(exc)}") from None
