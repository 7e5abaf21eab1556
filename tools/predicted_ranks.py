"""How a matrix's layouts rank per node count on one or more profiles, PREDICTED, with each run's
interval (the cross-validated model error, predict.intervals, beside the calibration's spread) and
how far the ranking could move within it: a run whose interval overlaps a better-ranked run's could
trade places with it. Prints a markdown table.

    python tools/predicted_ranks.py matrices/gh200-published.yaml --profile gh200-quad-ib \\
        --profile gh200-quad-slingshot --nodes 1,4,16,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from echobench.hardware.profile import find_profile, load_profile  # noqa: E402  (after the path: run as a script)
from echobench.sweep.matrix import expand, load_matrix  # noqa: E402
from echobench.predict import at_nodes, parse_nodes, predict  # noqa: E402


def label(cfg) -> str:
    layout = {"single": "single", "ddp": "DDP", "fsdp2": "FSDP2", "hsdp": "HSDP"}.get(cfg.parallelism, cfg.parallelism)
    return f"{cfg.scale} {cfg.framework} " + (f"TP={cfg.tp}" if cfg.framework == "megatron" else layout)


def ranked(preds) -> list:
    return sorted(preds, key=lambda p: -p.mfu)


def moves(preds) -> dict[str, tuple[int, int]]:
    """Per run, the best and worst rank it could take within the intervals: runs whose MFU
    interval lies wholly above its (below its) always rank ahead (behind)."""
    out = {}
    for p in preds:
        lo, hi = p.mfu * p.step_time_s / p.step_time_high_s, p.mfu * p.step_time_s / p.step_time_low_s
        ahead = sum(1 for q in preds if q is not p and q.mfu * q.step_time_s / q.step_time_high_s > hi)
        behind = sum(1 for q in preds if q is not p and q.mfu * q.step_time_s / q.step_time_low_s < lo)
        out[p.run_id] = (ahead + 1, len(preds) - behind)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("matrix")
    ap.add_argument("--profile", action="append", required=True)
    ap.add_argument("--nodes", default="1,4,16,64")
    args = ap.parse_args()
    cfgs = at_nodes([r.cfg for r in expand(load_matrix(args.matrix)).runs], parse_nodes(args.nodes))
    profiles = [load_profile(find_profile(name)) for name in args.profile]
    print("| nodes | profile | rank | run | MFU | MFU interval | rank within the intervals | exposed comm |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in sorted({c.nodes for c in cfgs}):
        for prof in profiles:
            preds = ranked([predict(c, prof) for c in cfgs if c.nodes == n])
            span = moves(preds)
            for i, p in enumerate(preds, 1):
                lo, hi = p.mfu * p.step_time_s / p.step_time_high_s, p.mfu * p.step_time_s / p.step_time_low_s
                best, worst = span[p.run_id]
                print(f"| {n} | {prof.name} | {i} | {label(p.cfg)} | {p.mfu:.1%} | {lo:.1%}-{hi:.1%} | "
                      f"{best}-{worst} | {p.exposed_communication_s / p.step_time_s:.0%} |")


if __name__ == "__main__":
    main()
