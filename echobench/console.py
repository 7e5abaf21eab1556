"""What echobench prints through rich: text from outside, run states, log lines, sweep progress.

Text from outside (records, logs, matrices, exceptions, paths): rich reads "[...]" in a printed
string as markup: a gloo error holding "[/__w/.../pair.cc:537]" is a closing tag with no opening
one (a MarkupError), "[bold]" would vanish into a style. Every such string goes through `esc`
before it reaches a rich format string or a table cell.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from rich.markup import escape

STATE_COLORS = {"ok": "green", "running": "cyan", "pending": "yellow", "queued": ""}  # any other: a failure, red


def esc(value: object) -> str:
    """`value` as text that rich prints verbatim."""
    return escape(str(value))


def state_markup(state: str) -> str:
    """A run's state (a record status, pending, running, ...) in its color."""
    color = STATE_COLORS.get(state, "red")
    return f"[{color}]{esc(state)}[/]" if color else esc(state)


def state_counts(states) -> str:
    """"2 ok, 1 running": how many runs are in each state."""
    return ", ".join(f"{v} {k}" for k, v in sorted(Counter(states).items()))


def log(console, text: str) -> None:
    """One timestamped line; `text` is rich markup: pass outside strings through esc()."""
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}", highlight=False)


@dataclass
class Progress:
    """A sweep's live table of runs (on a terminal; elsewhere the log lines say it all)."""

    console: object
    live: object = None

    def table(self, rows: list[tuple[str, str, str]]):
        from rich.table import Table

        table = Table(title="sweep: " + state_counts(state for _, state, _ in rows))
        for col in ("run", "state", "detail"):
            table.add_column(col, overflow="fold")
        for rid, state, detail in rows:
            table.add_row(esc(rid), state_markup(state), esc(detail[:80]))
        return table

    def __enter__(self):
        if getattr(self.console, "is_terminal", False):
            from rich.live import Live

            self.live = Live(console=self.console, refresh_per_second=2, transient=False).__enter__()
        return self

    def update(self, rows):
        if self.live is not None:
            self.live.update(self.table(rows))

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)
