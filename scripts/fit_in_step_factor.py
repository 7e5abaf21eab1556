"""Fits the shipped GPU profiles' `in_step` factor to published runs, and checks it on the others.

A GPU's kernels run slower inside a training step than the profiles' isolated rates (MAMF's best
GEMM shape, FlashAttention's benchmark loops, a copy kernel) say: the clocks under a whole step's
power draw, NCCL's kernels taking SMs, gaps between kernels. The published runs give one number for
all of it: the factor k that scales a step's GEMM, attention and element-wise time. It is FITTED,
so the rows are split: k minimises mean |error| over the FIT rows (llm-foundry's single-node rows,
validation/published-runs.yaml) and is then held against every other row priced (multi-node
llm-foundry, Megatron-LM), which it never saw.

    python scripts/fit_in_step_factor.py            # the fit, both sets' errors
    python scripts/fit_in_step_factor.py --write    # and writes k into profiles/{h100,h200,gh200}*.yaml

The H200 and GH200 profiles get the H100's k (assumed to carry over: same SM architecture and
software; their own runs would refit it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from echobench.hwprofile import InStepFactor, find_profile, load_profile
from echobench.predict.validate import load_rows, validate_row

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "validation" / "published-runs.yaml"
PROFILE = "h100-hgx-ib"  # every published row's
CARRY_TO = ("h200-hgx-ib", "gh200-quad-slingshot", "gh200-quad-ib")
GRID = [1 + i / 200 for i in range(201)]  # 1.000 .. 2.000


def fit_set(row: dict) -> bool:
    """The rows k is fitted on: llm-foundry's single-node runs (no inter-node collective in them)."""
    return row["source"]["repo"] == "mosaicml/llm-foundry" and row["hardware"]["gpus"] <= row["hardware"]["gpus_per_node"]


def errors(rows: list[dict], k: float) -> dict[str, float]:
    profile = load_profile(find_profile(PROFILE))
    profile = profile.model_copy(update={"in_step": InStepFactor(factor=k, source="trial")})
    out = {}
    for row in rows:
        r = validate_row(row, {PROFILE: profile})
        if r.error is not None:
            out[r.id] = r.error
    return out


def summary(errs: list[float]) -> str:
    mean = sum(map(abs, errs)) / len(errs)
    return f"{len(errs)} rows: mean |error| {mean:.1%}, max {max(map(abs, errs)):.1%}, mean signed {sum(errs) / len(errs):+.1%}"


def in_step_block(k: float, fit_ids: list[str], held: str, fitted: str, carried: bool) -> str:
    source = (f"FITTED, not measured: scripts/fit_in_step_factor.py, k minimising mean |error| of echobench predict "
              f"--validate over the {len(fit_ids)} single-node llm-foundry H100 rows of validation/published-runs.yaml "
              f"({fitted}); held against the rows it was not fitted to: {held}")
    if carried:
        source += "; this device: the H100 fit, assumed to carry over (no published run of it fitted)"
    return yaml.safe_dump({"in_step": {"factor": round(k, 3), "fitted_on": fit_ids, "source": source}},
                          sort_keys=False, width=120)


def write(name: str, block: str) -> None:
    """Replaces (or inserts before `links:`) the top-level in_step block of a shipped profile, the rest
    of the file as it is."""
    path = find_profile(name)
    text = path.read_text()
    text = re.sub(r"^in_step:\n(?:[ -].*\n)*", "", text, flags=re.M)
    head, sep, tail = text.partition("\nlinks:\n")
    if not sep:
        sys.exit(f"{path}: no top-level `links:` to put in_step before")
    path.write_text(head + "\n" + block + "links:\n" + tail)
    load_profile(path)  # still a profile


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write k into the shipped GPU profiles")
    args = ap.parse_args()
    rows = load_rows(ROWS)
    fit_rows = [r for r in rows if fit_set(r)]
    best = min(GRID, key=lambda k: sum(map(abs, errors(fit_rows, k).values())))
    fit_errs = errors(fit_rows, best)
    others = {i: e for i, e in errors(rows, best).items() if i not in fit_errs}
    fitted, held = summary(list(fit_errs.values())), summary(list(others.values()))
    print(f"k = 1, no factor: all {summary(list(errors(rows, 1.0).values()))}")
    print(f"k = {best:.3f} (fitted on {fitted})\nheld out: {held}")
    for i, e in {**fit_errs, **others}.items():
        print(f"  {'fit ' if i in fit_errs else 'held'}  {i:<24} {e:+.1%}")
    if args.write:
        for name in (PROFILE, *CARRY_TO):
            try:
                find_profile(name)
            except ValueError:
                continue
            write(name, in_step_block(best, sorted(fit_errs), held, fitted, name != PROFILE))
            print(f"wrote in_step {best:.3f} into profiles/{name}.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
