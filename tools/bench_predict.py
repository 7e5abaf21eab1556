"""How fast `echobench predict` is: every run of every shipped matrix (matrices/*.yaml), at its own
node counts and at 1, 2, 4, ... 1024 nodes, on the shipped profile of its device (CPU matrices: the
calibrated profile given, else the GH200 one as a stand-in for the arithmetic). Prints the import
time, then the seconds per hundred runs, cold (first pass: every shape priced once) and warm.

    .venv/bin/python tools/bench_predict.py [--profile CPU_PROFILE.yaml] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile for the CPU matrices (default: gh200-quad-slingshot)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    t0 = time.perf_counter()
    from echobench.hardware import traffic  # noqa: F401 - what predict imports to derive a step's collectives
    from echobench import predict as pr
    from echobench.sweep.matrix import expand, load_matrix

    imported = time.perf_counter() - t0
    cpu = pr.load_profiles([args.profile or "gh200-quad-slingshot"])[0]
    work = []
    for path in sorted((ROOT / "matrices").glob("*.yaml")):
        matrix = load_matrix(path)
        profile = pr.profile_for_device(matrix.spec.hardware.device) or cpu
        cfgs = [r.cfg for r in expand(matrix, "slurm").runs]
        for cfg in cfgs + pr.at_nodes(cfgs, [2 ** k for k in range(11)]):
            work.append((cfg, profile))
    figures = {"runs": len(work), "import_s": imported}
    for label in ("cold", "warm"):
        start = time.perf_counter()
        items = [pr.predict_runs([cfg], [profile])[0] for cfg, profile in work]
        spent = time.perf_counter() - start
        failed = [str(p) for p in items if isinstance(p, pr.PredictError)]
        figures[f"{label}_s"] = spent
        figures[f"{label}_s_per_100_runs"] = spent / len(work) * 100
        figures["not_predicted"] = len(failed)
    print(f"{figures['runs']} runs of {len(list((ROOT / 'matrices').glob('*.yaml')))} matrices; import "
          f"{figures['import_s']:.2f} s; cold {figures['cold_s']:.2f} s ({figures['cold_s_per_100_runs']:.3f} s per "
          f"100 runs), warm {figures['warm_s']:.2f} s ({figures['warm_s_per_100_runs']:.3f} s per 100 runs); "
          f"{figures['not_predicted']} not predicted")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
