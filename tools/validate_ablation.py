"""What each of the model's choices moves on the published rows (reports/predict-published-2026-12-03.md):
`validate published`'s error over validation/published-runs.yaml with

  - no fitted term (the physical rates alone: InStepFit() is no in-step clock),
  - the in-step clock fitted on every row (in-sample),
  - the same, each row priced at its own values rather than the middle of its assumed range,
  - leave-one-source-out (the cross-validated figure),

per source and overall (mean / max |error|, mean signed).

    python tools/validate_ablation.py [validation/published-runs.yaml]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from echobench.hardware.devicerates import InStepFit  # noqa: E402  (after the path: run as a script)
from echobench.predict.crossval import crossval  # noqa: E402
from echobench.predict.validate import error_summary, load_rows, validate  # noqa: E402


def line(name: str, errors: dict[str, float], sources: dict[str, str]) -> str:
    cells = []
    for s in [*dict.fromkeys(sources.values()), None]:
        e = error_summary([v for k, v in errors.items() if s is None or sources[k] == s])
        cells.append(f"{e['mean_abs_error']:.1%} / {e['max_abs_error']:.1%} ({e['mean_error']:+.1%})")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    rows = load_rows(sys.argv[1] if len(sys.argv) > 1 else "validation/published-runs.yaml")
    sources = {r["id"]: r["source"]["name"] for r in rows}
    cv = crossval(rows)
    fit = InStepFit(cv["fit"], (), "every row")
    lines = [("physical rates alone, no fitted term", validate(rows, terms=InStepFit())),
             (f"+ the in-step clock fitted on every row {cv['fit']} (in-sample)", validate(rows, terms=fit)),
             ("  the same, each row at its own values (not the middle of its assumed range)",
              validate(rows, terms=fit, with_range=False))]
    names = list(dict.fromkeys(sources.values()))
    print("| model | " + " | ".join(names) + " | all |")
    print("| --- |" + " --- |" * (len(names) + 1))
    for name, results in lines:
        print(line(name, {r.id: r.error for r in results if r.error is not None}, sources))
    print(line("leave-one-source-out (the clock fitted without the row's source)", cv["loso_errors"], sources))


if __name__ == "__main__":
    main()
