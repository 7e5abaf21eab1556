"""The model's one fitted term held out as a reviewer would: leave-one-source-out cross-validation.

The fitted term is the in-step clock per GPU family (devicerates.in_step_clock), bounded to
CLOCK_BOUNDS. For each source (a row's `source.name`: a framework's table, a paper, a benchmark
suite), the clock of each family is fitted on every other source's rows and the left-out source's
rows are predicted with it: their errors are the cross-validated (LOSO) error. The in-sample error
is the fit on every row, predicted on the same rows.

The fit minimises the mean |log(predicted / published)| over a family's rows, on a grid of
CLOCK_STEP over CLOCK_BOUNDS. A row's step as a function of the clock c is taken as a + b / c (the
compute-bound kernels scale with 1 / c, the rest does not), a and b from the row priced at two
clocks: the fit is a grid search on that surrogate, the errors reported are the model's own at the
fitted clock.

Intervals: the LOSO log-residuals' RESIDUAL_QUANTILES (intervals.py) give how far a prediction
lands from a published run the model was not fitted on; write_fit commits them with the fit.

`validate published FILE` prices FILE's rows at the committed fit, held out for every row outside
its fit set; `--refit` prices them at the fit on FILE's own rows (refit), an in-sample error.
fit_used names the fit either way."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from echobench.hardware.devicerates import FIT_FILE, InStepFit, gpu_family
from echobench.hardware.profile import HardwareProfile
from echobench.predict.errors import PredictError
from echobench.predict.validate import central_step, error_summary, published_step, validate
from echobench.predict.cards.card import model_card, run_layout
from echobench.predict.intervals import RESIDUAL_QUANTILES

CLOCK_BOUNDS = (0.60, 1.00)  # a family's in-step clock: no lower than 0.6 of its isolated GEMM loop's, no higher
CLOCK_STEP = 0.005
PROBE = 0.7  # the second clock each row is priced at for the surrogate


@dataclass
class RowFit:
    """A row's step as a + b / clock, its published step, source and family."""

    id: str
    source: str
    family: str | None
    a: float
    b: float
    published: float

    def step(self, clock: float) -> float:
        return self.a + self.b / clock

    def clock_needed(self) -> float | None:
        """The clock at which this row's step is its published one (None: slower than published even
        at an infinite clock: the rest of its step alone is too slow)."""
        return self.b / (self.published - self.a) if self.published > self.a and self.b > 0 else None


def clocks_needed(fits: Sequence[RowFit]) -> dict[str, list[float]]:
    """Per family, the min, median and max of the clock each row needs (RowFit.clock_needed): how far
    one fitted clock is from every row's own."""
    out = {}
    for fam in sorted({f.family for f in fits if f.family}):
        cs = sorted(c for f in fits if f.family == fam and (c := f.clock_needed()) is not None)
        if cs:
            out[fam] = [cs[0], quantile(cs, 0.5), cs[-1]]
    return out


def _fit(family_of: str, rows: Sequence[RowFit]) -> float:
    """The clock of `family_of` minimising mean |log(step / published)| over its rows (1: none)."""
    mine = [r for r in rows if r.family == family_of]
    if not mine:
        return 1.0
    n = round((CLOCK_BOUNDS[1] - CLOCK_BOUNDS[0]) / CLOCK_STEP)
    grid = [CLOCK_BOUNDS[0] + i * CLOCK_STEP for i in range(n + 1)]
    return min(grid, key=lambda c: sum(abs(math.log(r.step(c) / r.published)) for r in mine))


def fit(rows: Sequence[RowFit], source: str = "") -> InStepFit:
    """The in-step clock of every family among `rows` (a family without rows is left out)."""
    clocks = {fam: round(_fit(fam, rows), 3) for fam in sorted({r.family for r in rows if r.family})}
    return InStepFit(clocks, tuple(r.id for r in rows), source)


def row_fits(rows: Sequence[Mapping], profiles: dict[str, HardwareProfile]) -> list[RowFit]:
    """Each priced row's surrogate: priced at clock 1 and PROBE for its family (refused rows left out)."""
    out = []
    for row in rows:
        try:
            s1 = central_step(row, profiles, InStepFit({"hopper": 1.0, "ampere": 1.0}))[0]
            s2 = central_step(row, profiles, InStepFit({"hopper": PROBE, "ampere": PROBE}))[0]
            prof = profiles[row["hardware"]["profile"]]
            card, layout = model_card(row["model"]), run_layout(row["run"], row["hardware"])
            pub, _ = published_step(row, card, layout)
        except PredictError:
            continue
        b = (s2 - s1) / (1 / PROBE - 1)
        out.append(RowFit(row["id"], row["source"]["name"], gpu_family(prof.device), s1 - b, b, pub))
    return out


def crossval(rows: Sequence[Mapping], profiles: dict[str, HardwareProfile] | None = None) -> dict:
    """Leave-one-source-out and in-sample errors, per source and overall, the fits, and the
    residual quantiles of the intervals; `profiles`: validate's."""
    profiles = {} if profiles is None else profiles
    fits = row_fits(rows, profiles)
    by_id = {r["id"]: r for r in rows}
    sources = list(dict.fromkeys(f.source for f in fits))
    loso, folds = {}, {}
    for s in sources:
        f = fit([r for r in fits if r.source != s], f"fitted leaving out {s}")
        folds[s] = f.clock
        held = validate([by_id[r.id] for r in fits if r.source == s], terms=f, profiles=profiles)
        loso.update({v.id: v.error for v in held if v.error is not None})
    everything = fit(fits, "fitted on every row")
    inside = {v.id: v.error for v in validate([by_id[r.id] for r in fits], terms=everything, profiles=profiles)
              if v.error is not None}
    per_source = {s: {"rows": sum(f.source == s for f in fits), "clock_fitted_without_it": folds[s],
                      "clock_needed": clocks_needed([f for f in fits if f.source == s]),
                      "loso": error_summary([loso[f.id] for f in fits if f.source == s]),
                      "in_sample": error_summary([inside[f.id] for f in fits if f.source == s])} for s in sources}
    residuals = sorted(math.log(1 + e) for e in loso.values())
    return {"sources": len(sources), "rows": len(fits), "fit": everything.clock, "folds": folds,
            "loso": error_summary(list(loso.values())), "in_sample": error_summary(list(inside.values())),
            "per_source": per_source, "clock_needed": clocks_needed(fits), "residual_quantiles": [quantile(residuals, q) for q in RESIDUAL_QUANTILES],
            "loso_errors": loso, "in_sample_errors": inside}


def refit(result: dict, path: Path | str) -> InStepFit:
    """The fit on every row of `path` (crossval's `fit`) as the terms its rows are priced at: in-sample."""
    return InStepFit(result["fit"], tuple(sorted(result["in_sample_errors"])),
                     f"refitted on every row of {path} (in-sample)")


def fit_used(fit: InStepFit | None = None, rows_file: Path | str | None = None, path: Path = FIT_FILE) -> dict:
    """The fit a validation priced its rows at, for its output: the committed one (`fit` None: the
    file `path`, its clocks, the file and rows it was fitted on) or a refit on `rows_file` (in-sample)."""
    if fit is not None:
        return {"fit": "refit", "in_sample": True, "file": None, "clock": fit.clock, "rows_file": str(rows_file),
                "fitted_on": len(fit.fitted_on), "source": fit.source}
    data = json.loads(path.read_text()) if path.is_file() else {}
    return {"fit": "committed", "in_sample": False, "file": _shown(path) if data else None,
            "clock": data.get("clock", {}), "rows_file": data.get("rows_file"),
            "fitted_on": len(data.get("fitted_on", ())), "source": data.get("source", f"no {path.name}: no in-step clock fitted")}


def fit_line(used: dict) -> str:
    """fit_used in one line: which fit, its clocks and fit set."""
    clocks = ", ".join(f"{k} {v:g}" for k, v in used["clock"].items()) or "none"
    if used["in_sample"]:
        return (f"IN-SAMPLE: in-step clock refitted on every row of {used['rows_file']} ({clocks}; {used['fitted_on']} "
                "rows): not a held-out error (without --refit: the committed fit)")
    if used["file"] is None:
        return f"in-step clock: none ({used['source']})"
    return (f"in-step clock: the committed fit {used['file']} ({clocks}; fitted on {used['fitted_on']} rows of "
            f"{used['rows_file'] or 'its rows file'}), not refitted here")


def _shown(path: Path) -> str:
    """A path relative to the checkout where it is inside it."""
    try:
        return str(path.resolve().relative_to(FIT_FILE.parents[1]))
    except ValueError:
        return str(path)


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of sorted `xs`, linear between order statistics."""
    i = q * (len(xs) - 1)
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def write_fit(result: dict, rows_file: Path | str, path: Path = FIT_FILE) -> Path:
    """The committed fit: the in-step clocks fitted on every row of `rows_file`, the rows, the
    residual quantiles and the LOSO figures they come with (devicerates.committed_fit reads it)."""
    shown = _shown(Path(rows_file))
    data = {"clock": result["fit"], "fitted_on": sorted(result["in_sample_errors"]), "rows_file": shown,
            "source": (f"echobench validate published: the in-step clock per GPU family minimising mean |log error| over "
                       f"{result['rows']} published rows of {result['sources']} sources ({shown}); "
                       f"leave-one-source-out mean |error| {result['loso']['mean_abs_error']:.1%}, max "
                       f"{result['loso']['max_abs_error']:.1%}"),
            "residual_quantiles": result["residual_quantiles"], "quantiles": list(RESIDUAL_QUANTILES),
            "loso": result["loso"], "in_sample": result["in_sample"]}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
