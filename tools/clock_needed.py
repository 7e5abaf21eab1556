"""Where the in-step clock fails a source: per row of a rows file, the clock at which its predicted
step is its published one (crossval.RowFit.clock_needed) beside what might explain the spread: its
recompute policy, tokens per micro-batch, the share of the predicted step that attention and the
data-parallel collectives overlapped with compute take. Then, with `--dp-contention S`, a what-if:
every overlapped data-parallel collective's seconds x S added to the step (compute slowed while
NCCL's kernels share the SMs and HBM with it), cross-validated leaving one source out as
`validate published` does. No shipped term does this; it is a probe, not a model.

    PYTHONPATH=. python3 tools/clock_needed.py [validation/published-runs.yaml] [--dp-contention 0.3]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from echobench.hardware.devicerates import run_fit
from echobench.predict.cards.card import model_card, run_layout
from echobench.predict.cards.model import predict_card
from echobench.predict.crossval import crossval, row_fits
from echobench.predict.pricing import Rates
from echobench.predict.validate import _profile, load_rows

VALIDATE = sys.modules["echobench.predict.validate"]  # the package exports a function of the same name


def overlapped_dp_s(p) -> float:
    """The seconds of the step's data-parallel collectives that run beside compute."""
    return sum(c.seconds for c in p.collectives if c.group.startswith("dp") and c.overlaps != "none")


def table(rows: list[dict]) -> None:
    needed = {f.id: f.clock_needed() for f in row_fits(rows, {})}
    profiles: dict = {}
    print("| row | source | family | ac | tokens / micro-batch | attention / step | overlapped DP / step "
          "| clock needed |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        card, lay = model_card(r["model"]), run_layout(r["run"], r["hardware"])
        prof = _profile(r["hardware"]["profile"], profiles)
        p = predict_card(card, lay, prof, rates=Rates(prof, "mid", terms=run_fit(lay.gpus, None)))
        c = needed.get(r["id"])
        print(f"| {r['id']} | {r['source']['name']} | {prof.device} | {lay.ac} | {lay.micro_batch * lay.seq} | "
              f"{p.parts['attention'] / p.step_time_s:.2f} | {overlapped_dp_s(p) / p.step_time_s:.2f} | "
              f"{'-' if c is None else f'{c:.3f}'} |")


def contention(rows: list[dict], share: float) -> None:
    def slowed(*args, **kwargs):
        p = predict_card(*args, **kwargs)
        return replace(p, step_time_s=p.step_time_s + share * overlapped_dp_s(p))

    VALIDATE.predict_card = slowed
    try:
        cv = crossval(rows)
    finally:
        VALIDATE.predict_card = predict_card
    lo = cv["loso"]
    worst = sorted(cv["loso_errors"].items(), key=lambda kv: -abs(kv[1]))[:5]
    print(f"dp contention {share}: leave-one-source-out mean {lo['mean_abs_error']:.2%}, "
          f"max {lo['max_abs_error']:.1%}; "
          f"clock {cv['fit']}; largest " + ", ".join(f"{k} {v:+.1%}" for k, v in worst))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="?", default="validation/published-runs.yaml")
    ap.add_argument("--dp-contention", type=float, action="append", default=[])
    args = ap.parse_args()
    rows = load_rows(args.rows)
    if not args.dp_contention:
        table(rows)
    for s in args.dp_contention:
        contention(rows, s)


if __name__ == "__main__":
    main()
