"""`echobench compare OLD NEW`: pair configurations, report throughput and MFU changes, gate regressions.

Runs pair by configuration at a node count (`echobench.records.results.configuration_key`: its repeats,
and whatever differs only in how long or how often it measured, e.g. steps); each side's figure is
the median over its successful runs. A paired configuration
regresses when its samples/s or MFU fell by more than the threshold (percent of the old value)
AND its stored per-step times say the slowdown is real: a one-sided Mann-Whitney U test (new
steps slower than old, all repeats' steps pooled) with p below alpha, as asv's compare does
before it trusts a difference. Fewer than MIN_STEPS steps on a side is a weak comparison:
reported, never decided. A configuration that succeeded in OLD and has a failure in NEW
regresses whatever the numbers. Configurations in only one side are listed, never a regression:
a matrix may grow or shrink between two sweeps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

from echobench.records.console import esc, fmt
from echobench.records.results import Record, configuration_key, over_repeats, slower_p_value
from echobench.records.states import RunState

MIN_STEPS = 5  # below this per side, even a 2x slowdown could be chance: no verdict
DEFAULT_ALPHA = 0.01


@dataclass
class Change:
    run_id: str  # the configuration, named by its first run in NEW (the run id of its first repeat)
    old_status: str
    new_status: str
    old_samples_per_s: float | None = None
    new_samples_per_s: float | None = None
    old_mfu: float | None = None
    new_mfu: float | None = None
    old_repeats: int = 0
    new_repeats: int = 0
    old_steps: int = 0
    new_steps: int = 0
    p_value: float | None = None  # one-sided Mann-Whitney U: new steps slower than old
    regressed: bool = False
    weak: bool = False  # too few steps a side to decide
    reason: str = ""

    @property
    def samples_change_pct(self) -> float | None:
        return _change(self.old_samples_per_s, self.new_samples_per_s)

    @property
    def mfu_change_pct(self) -> float | None:
        return _change(self.old_mfu, self.new_mfu)


@dataclass
class Comparison:
    threshold_pct: float
    alpha: float = DEFAULT_ALPHA
    changes: list[Change] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regressed]

    @property
    def weak(self) -> list[Change]:
        return [c for c in self.changes if c.weak]


def _change(old: float | None, new: float | None) -> float | None:
    if old is None or new is None or old == 0:
        return None
    return (new / old - 1) * 100


def _ok(record: Record) -> bool:
    return record.status == RunState.OK and record.mfu is not None


def _status(records: list[Record]) -> str:
    statuses = sorted({r.status for r in records})
    return statuses[0] if len(statuses) == 1 else "/".join(statuses)


def first_run_id(records: list[Record]) -> str:
    """The name a configuration goes by in the output: its first run's id (lowest repeat)."""
    return min((r.repeat, r.run_id) for r in records)[1]


def compare_configuration(old: list[Record], new: list[Record], threshold_pct: float, alpha: float) -> Change:
    old_ok, new_ok = [r for r in old if _ok(r)], [r for r in new if _ok(r)]

    def median(records, name):
        stats = over_repeats(getattr(r, name) for r in records)
        return stats["median"] if stats else None

    change = Change(first_run_id(new), _status(old), _status(new), median(old_ok, "samples_per_s"), median(new_ok, "samples_per_s"),
                    median(old_ok, "mfu"), median(new_ok, "mfu"), len(old), len(new))
    failed = [r for r in new if not _ok(r)]
    if old_ok and failed and len(failed) / len(new) > 1 - len(old_ok) / len(old):
        first = failed[0]
        change.regressed = True
        change.reason = (f"{len(failed)} of {len(new)} now {first.status}: {first.error}".strip()
                         if len(new) > 1 else f"now {first.status}: {first.error}".strip())
        return change
    if not (old_ok and new_ok):
        return change
    old_steps = [t for r in old_ok for t in r.step_times_s or []]
    new_steps = [t for r in new_ok for t in r.step_times_s or []]
    change.old_steps, change.new_steps = len(old_steps), len(new_steps)
    losses = [(name, -pct) for name, pct in (("samples/s", change.samples_change_pct), ("MFU", change.mfu_change_pct))
              if pct is not None and -pct > threshold_pct]
    if min(len(old_steps), len(new_steps)) < MIN_STEPS:
        change.weak = True
        change.reason = f"{len(old_steps)} old / {len(new_steps)} new steps stored (need {MIN_STEPS} a side to decide)"
        return change
    change.p_value = slower_p_value(old_steps, new_steps)
    if losses and change.p_value < alpha:
        change.regressed = True
        change.reason = ", ".join(f"{name} -{loss:.1f}%" for name, loss in losses) + f" (p={change.p_value:.2g})"
    elif losses:
        change.reason = (", ".join(f"{name} -{loss:.1f}%" for name, loss in losses)
                         + f" but not significant (p={change.p_value:.2g} >= {alpha:g})")
    return change


def group_by_configuration(records: list[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[configuration_key(r)].append(r)
    return groups


def compare_records(old: list[Record], new: list[Record], threshold_pct: float, alpha: float = DEFAULT_ALPHA) -> Comparison:
    old_by_key, new_by_key = group_by_configuration(old), group_by_configuration(new)
    result = Comparison(threshold_pct, alpha,
                        only_old=sorted(first_run_id(old_by_key[k]) for k in set(old_by_key) - set(new_by_key)),
                        only_new=sorted(first_run_id(new_by_key[k]) for k in set(new_by_key) - set(old_by_key)))
    for key in sorted(set(old_by_key) & set(new_by_key), key=lambda k: first_run_id(new_by_key[k])):
        result.changes.append(compare_configuration(old_by_key[key], new_by_key[key], threshold_pct, alpha))
    return result


def comparison_report(result: Comparison, title: str) -> list:
    """`echobench compare`: the table of paired configurations, then one line per reason, the
    unpaired ones and the verdict, as rich renderables (outside text wrapped in Text: verbatim)."""
    def pct(v):
        return "-" if v is None else f"{v:+.1f}%"

    threshold, alpha = result.threshold_pct, result.alpha
    t = Table(title=esc(f"{title} (threshold {threshold:g}%, alpha {alpha:g})"))
    t.add_column("configuration", overflow="fold")
    for col in ("repeats", "status", "samples/s old -> new", "MFU old -> new", "steps", "p (slower)", "verdict"):
        t.add_column(col, justify="left" if col in ("status", "verdict") else "right")
    lines = []
    for c in result.changes:
        status = c.new_status if c.old_status == c.new_status else f"{c.old_status} -> {c.new_status}"
        verdict = ("REGRESSION" if c.regressed else "weak" if c.weak else "not significant" if c.reason else "ok")
        t.add_row(Text(c.run_id), f"{c.old_repeats}/{c.new_repeats}", Text(status),
                  f"{fmt(c.old_samples_per_s, '.4g')} -> {fmt(c.new_samples_per_s, '.4g')} ({pct(c.samples_change_pct)})",
                  f"{fmt(c.old_mfu, '.2%')} -> {fmt(c.new_mfu, '.2%')} ({pct(c.mfu_change_pct)})",
                  f"{c.old_steps}/{c.new_steps}", fmt(c.p_value, ".2g"),
                  Text(verdict, style="red" if c.regressed else "yellow" if verdict != "ok" else ""))
        if c.reason:  # one line each, so the reason is never squeezed into a column
            said = "weak comparison:" if c.weak else verdict
            lines.append(Text(f"{c.run_id}: ") + Text(f"{said} ", style="red" if c.regressed else "yellow")
                         + Text(c.reason))
    lines += [Text(f"{label} ({len(ids)}): {', '.join(ids)}")
              for label, ids in (("only in OLD", result.only_old), ("only in NEW", result.only_new)) if ids]
    if result.weak:
        lines.append(Text(f"{len(result.weak)} weak comparison(s): fewer than {MIN_STEPS} stored steps a side, "
                          "not decided", style="yellow"))
    if result.regressions:
        lines.append(Text(f"{len(result.regressions)} of {len(result.changes)} configuration(s) regressed "
                          f"(more than {threshold:g}% and p < {alpha:g}, or now failing)", style="red"))
    else:
        lines.append(Text(f"{len(result.changes)} paired configuration(s), no significant loss of more than "
                          f"{threshold:g}%"))
    return [t, *lines]
