"""`echobench compare OLD NEW`: pair runs by id, report throughput and MFU changes, gate regressions.

A paired run regresses when its samples/s or its MFU fell by more than the threshold (percent of
the old value), or when it succeeded in OLD and failed in NEW. Runs in only one side are listed,
never a regression: a matrix may grow or shrink between two sweeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Change:
    run_id: str
    old_status: str
    new_status: str
    old_samples_per_s: float | None = None
    new_samples_per_s: float | None = None
    old_mfu: float | None = None
    new_mfu: float | None = None
    regressed: bool = False
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
    changes: list[Change] = field(default_factory=list)
    only_old: list[str] = field(default_factory=list)
    only_new: list[str] = field(default_factory=list)

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.regressed]


def _change(old: float | None, new: float | None) -> float | None:
    if old is None or new is None or old == 0:
        return None
    return (new / old - 1) * 100


def _ok(record: dict) -> bool:
    return record.get("status") == "ok" and record.get("mfu") is not None


def compare_records(old: list[dict], new: list[dict], threshold_pct: float) -> Comparison:
    old_by_id = {r["run_id"]: r for r in old}
    new_by_id = {r["run_id"]: r for r in new}
    result = Comparison(threshold_pct,
                        only_old=sorted(set(old_by_id) - set(new_by_id)),
                        only_new=sorted(set(new_by_id) - set(old_by_id)))
    for run_id in sorted(set(old_by_id) & set(new_by_id)):
        a, b = old_by_id[run_id], new_by_id[run_id]
        change = Change(run_id, a.get("status"), b.get("status"),
                        a.get("samples_per_s"), b.get("samples_per_s"), a.get("mfu"), b.get("mfu"))
        if _ok(a) and not _ok(b):
            change.regressed, change.reason = True, f"now {b.get('status')}: {b.get('error') or ''}".strip()
        elif _ok(a) and _ok(b):
            losses = [(name, -pct) for name, pct in (("samples/s", change.samples_change_pct),
                                                     ("MFU", change.mfu_change_pct))
                      if pct is not None and -pct > threshold_pct]
            if losses:
                change.regressed = True
                change.reason = ", ".join(f"{name} -{loss:.1f}%" for name, loss in losses)
        result.changes.append(change)
    return result
