"""Text from outside (records, logs, matrices, exceptions, paths) printed through rich.

rich reads "[...]" in a printed string as markup: a gloo error holding "[/__w/.../pair.cc:537]"
is a closing tag with no opening one (a MarkupError), "[bold]" would vanish into a style. Every
such string goes through `esc` before it reaches a rich format string or a table cell.
"""

from __future__ import annotations

from rich.markup import escape


def esc(value: object) -> str:
    """`value` as text that rich prints verbatim."""
    return escape(str(value))
