"""PyYAML's errors as one line, for every YAML file a user writes (matrices, run configs, profiles)."""

from __future__ import annotations

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
