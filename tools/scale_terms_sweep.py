"""What the scale terms would do to `validate published` on a rows file if the shipped GPU profiles
carried them: a straggler jitter (cv), a network step latency, a shared spine. Each setting is
cross-validated leaving one source out (the in-step clock refitted without the source, as
`validate published` does), and printed with its scaling series and how many one-node rows it moves
against the baseline (none may get worse). A what-if: no shipped profile carries these terms.

    PYTHONPATH=. python3 tools/scale_terms_sweep.py [validation/published-runs.yaml]
"""

from __future__ import annotations

import sys

from echobench.hardware.profile import StepJitter, find_profile, load_profile
from echobench.predict.crossval import crossval, refit
from echobench.predict.validate import load_rows, scaling_series, validate

SETTINGS = {
    "baseline (the shipped profiles)": {},
    "jitter cv 0.005": {"jitter": 0.005},
    "jitter cv 0.01": {"jitter": 0.01},
    "jitter cv 0.02": {"jitter": 0.02},
    "network step 20 us": {"net_step_latency_s": 20e-6},
    "spine 2:1 past 16 nodes": {"nodes_per_leaf": 16, "oversubscription": 2.0},
}


def profiles_with(rows, setting: dict) -> dict:
    out = {}
    for name in {r["hardware"]["profile"] for r in rows}:
        prof = load_profile(find_profile(name))
        if "jitter" in setting:
            prof = prof.model_copy(update={"jitter": StepJitter(cv=setting["jitter"], source="what-if")})
        topo = {k: v for k, v in setting.items() if k != "jitter"}
        if topo and prof.topology is not None:
            prof = prof.model_copy(update={"topology": prof.topology.model_copy(update=topo)})
        out[name] = prof
    return out


def main(path: str = "validation/published-runs.yaml") -> None:
    rows = load_rows(path)
    one_node = {r["id"] for r in rows if r["hardware"]["gpus"] <= r["hardware"]["gpus_per_node"]}
    base_errors = None
    for label, setting in SETTINGS.items():
        profiles = profiles_with(rows, setting)
        cv = crossval(rows, profiles)
        results = validate(rows, terms=refit(cv, path), profiles=profiles)
        errors = {r.id: r.error for r in results if r.error is not None}
        base_errors = base_errors or errors
        worse = [i for i in one_node if i in errors and abs(errors[i]) > abs(base_errors[i]) + 1e-9]
        series = scaling_series(rows, results, cv["loso_errors"])
        loso = cv["loso"]
        print(f"{label}: leave-one-source-out mean {loso['mean_abs_error']:.2%}, max {loso['max_abs_error']:.1%}; "
              f"clock {cv['fit']}; one-node rows worse than the baseline: {len(worse)} of {len(one_node)}; series "
              + ", ".join(f"{s.ids[-1]} {s.loso_change * 100:+.1f}" for s in series))


if __name__ == "__main__":
    main(*sys.argv[1:])
