"""A hardware profile deliberately made wrong, to show what `echobench tune` does with a model that
misjudges the machine (reports/tune-cpu-2026-12-02.md): its collectives' bus bandwidth divided by
--bandwidth-divisor (every link and kind of group; --op: one collective's only), and/or an in_step compute factor set. The copy is
named SKEWED and says so in its note: never a profile to predict with.

    python tools/skewed_profile.py PROFILE --bandwidth-divisor 1000 --op all_reduce --out skewed.yaml
    python tools/skewed_profile.py PROFILE --in-step 0.5 --out fast.yaml
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from echobench.hardware.profile import InStepFactor, find_profile, load_profile, save_profile  # noqa: E402


def skewed(profile, divisor: float, in_step: float | None, only_op: str | None = None):
    def slow(op, fit):
        return fit.model_copy(update={"bus_gbps": fit.bus_gbps / divisor}) if only_op in (None, op) else fit

    links = {link: {op: slow(op, fit) for op, fit in ops.items()} for link, ops in profile.links.items()}
    kinds = {link: {op: [slow(op, f) for f in fits] for op, fits in ops.items()}
             for link, ops in profile.link_kinds.items()}
    what = [f"{only_op or 'bus'} bandwidth / {divisor:g}"] if divisor != 1 else []
    update = {"links": links, "link_kinds": kinds}
    if in_step is not None:
        what.append(f"in_step {in_step:g}")
        update["in_step"] = InStepFactor(factor=in_step, source="SKEWED on purpose (tools/skewed_profile.py)")
    return profile.model_copy(update={**update, "name": f"{profile.name} SKEWED ({', '.join(what)})",
                                      "note": f"SKEWED on purpose by tools/skewed_profile.py ({', '.join(what)}): "
                                              "a demonstration of a wrong model, not a profile to predict with"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile", help="a shipped profile's name or a profile file")
    parser.add_argument("--bandwidth-divisor", type=float, default=1.0)
    parser.add_argument("--op", default=None, help="only this collective (all_reduce, all_gather, ...)")
    parser.add_argument("--in-step", type=float, default=None)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    save_profile(skewed(load_profile(find_profile(args.profile)), args.bandwidth_divisor, args.in_step, args.op), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
