"""What each of the model's terms does to a matrix's predictions: the runs predicted with every term
undone (the fitted in-step clock, the kernel gap, the profile's topology, NCCL's tuner, the host cost
per op, the GEMM shape model, attention points, achievable memory bandwidth; eager where `--eager`
names runs), then with the terms put back one at a time. Prints a markdown table of MFU (%) per run.

    python tools/predict_ablation.py matrices/gh200-published.yaml --profile gh200-quad-slingshot \\
        --compare gh200-quad-ib --nodes 1,4,16,64 --eager 800M,3B-tp2,8B

Each step is echobench.predict.predict on the same runs with a copy of the profile
(HardwareProfile.model_copy) that undoes the terms not yet put back, and the in-step clock of the
committed fit or none (devicerates.InStepFit()).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from echobench.hardware.devicerates import InStepFit
from echobench.hardware.profile import find_profile, load_profile
from echobench.sweep.matrix import expand, load_matrix
from echobench.predict import at_nodes, parse_nodes, predict

# In the order they are put back (they interact: an order is needed).
UNDO = {
    "achievable memory": lambda p: {"memory": [m for m in p.memory if m.op == "datasheet"] or p.memory},
    "attention by kernel": lambda p: {"attention": []},
    "GEMM tile/wave": lambda p: {"sm_count": None},
    "host_op": lambda p: {"host_op": None},
    "NCCL tuner latency": lambda p: {"backend": "gloo"},  # fits priced as fitted: alpha + bytes / bandwidth
    "topology": lambda p: {"topology": None},
    "kernel gap": lambda p: {"kernel_gap": None},
    "in-step clock": None,  # the committed fit's (undone: no in-step clock)
}


def label(cfg) -> str:
    layout = cfg.parallelism if cfg.framework == "torchtitan" else f"tp{cfg.tp}"
    return f"{cfg.scale} {layout} n{cfg.nodes}"


def eager_run(cfg, eager: list[str]) -> bool:
    key = cfg.scale if cfg.framework == "torchtitan" or cfg.scale == "8B" else f"{cfg.scale}-tp{cfg.tp}"
    return cfg.scale in eager or key in eager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("matrix")
    ap.add_argument("--profile", required=True)
    ap.add_argument("--compare", help="a second profile: its full model's MFU as the last column")
    ap.add_argument("--nodes", default="1,4,16")
    ap.add_argument("--eager", default="", help="runs the baseline predicts eager (scale or scale-tpN, comma-separated)")
    args = ap.parse_args()
    runs = at_nodes([r.cfg for r in expand(load_matrix(args.matrix)).runs], parse_nodes(args.nodes))
    runs = sorted(runs, key=lambda c: (c.scale, label(c).split()[1], c.nodes))
    profile = load_profile(find_profile(args.profile))
    eager = [e for e in args.eager.split(",") if e]

    def undone(kept: int):
        update, terms = {}, None
        for name, fn in list(UNDO.items())[kept:]:
            if fn is None:
                terms = InStepFit()
            else:
                update.update(fn(profile))
        return profile.model_copy(update=update), terms

    columns = [("all undone", undone(0), True), ("+ compile as the matrix says", undone(0), False)]
    columns += [(f"+ {name}", undone(i + 1), False) for i, name in enumerate(UNDO)]
    if args.compare:
        columns.append((f"now, {args.compare}", (load_profile(find_profile(args.compare)), None), False))
    print("| run | " + " | ".join(name for name, _, _ in columns) + " |")
    print("| --- |" + " --- |" * len(columns))
    for cfg in runs:
        cells = []
        for _, (prof, terms), base in columns:
            run = replace(cfg, compile=False) if base and eager_run(cfg, eager) else cfg
            cells.append(f"{predict(run, prof, terms=terms).mfu * 100:.1f}")
        print(f"| {label(cfg)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
