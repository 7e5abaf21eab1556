"""Each pass of tools/predict_cpu_sweep.sh (PASSES=N): its runs' step-time errors, its mean and max
|error|, the load it ran at, and the median pass, from the passes' `validate measured --json` files.
--reprice prices each pass's runs again on its own profile with this checkout's model first (a pass
folder: its profile.yaml and runs/; the measurements stay, the model changes).

    python3 tools/predict_cpu_passes.py OUT/pass-*/against.json
    python3 tools/predict_cpu_passes.py --reprice reports/predict-cpu-2026-12-04/pass-*
"""

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def reprice(passes: list[str], out: Path) -> list[str]:
    """`echobench validate measured PASS/runs --profile PASS/profile.yaml --json` of each pass, into
    out/NAME/against.json beside a copy of its pass.log; the files' paths."""
    paths = []
    for folder in map(Path, passes):
        target = out / folder.name
        target.mkdir(parents=True)
        priced = subprocess.run([sys.executable, "-m", "echobench", "validate", "measured", str(folder / "runs"),
                                 "--profile", str(folder / "profile.yaml"), "--json"],
                                capture_output=True, text=True, check=True)
        (target / "against.json").write_text(priced.stdout)
        if (folder / "pass.log").exists():
            (target / "pass.log").write_text((folder / "pass.log").read_text())
        paths.append(str(target / "against.json"))
    return paths


def loads(log: Path) -> str:
    """The 1-minute load average at calibrate and at sweep, as the pass logged them ('-': no log)."""
    if not log.exists():
        return "-"
    found = {line.rsplit(": ", 1)[-1]: line.split(" load ")[1].split()[0] for line in log.read_text().splitlines()
             if " load " in line}
    return f"{found.get('calibrate --comm', '?')} / {found.get('sweep', '?')}"


def main(paths: list[str]) -> None:
    passes, measured = [], []
    for path in paths:
        rows = json.loads(Path(path).read_text())
        errors = {r["run_id"].split("-mb")[0]: r["error"] for r in rows}
        measured.append({r["run_id"].split("-mb")[0]: r.get("measured_step_time_s") for r in rows})
        absolute = [abs(e) for e in errors.values()]
        passes.append((Path(path).parent.name, errors, sum(absolute) / len(absolute), max(absolute),
                       loads(Path(path).parent / "pass.log")))
    runs = sorted({run for _, errors, _, _, _ in passes for run in errors})
    print("| pass | load at calibrate / sweep | " + " | ".join(runs) + " | mean \\|error\\| | max \\|error\\| |")
    print("| --- | --- |" + " ---: |" * (len(runs) + 2))
    for name, errors, mean, top, load in passes:
        cells = [f"{errors[r]:+.1%}" if r in errors else "-" for r in runs]
        print(f"| {name} | {load} | " + " | ".join(cells) + f" | {mean:.1%} | {top:.1%} |")
    means, tops = [p[2] for p in passes], [p[3] for p in passes]
    print(f"\n{len(passes)} passes: median mean |error| {statistics.median(means):.1%} (range {min(means):.1%}-"
          f"{max(means):.1%}), median max |error| {statistics.median(tops):.1%} (range {min(tops):.1%}-{max(tops):.1%})")
    for run in runs:
        values = [errors[run] for _, errors, _, _, _ in passes if run in errors]
        steps = [s for s in (measured[k].get(run) for k in range(len(passes))) if s]
        print(f"{run}: median error {statistics.median(values):+.1%} over {len(values)} passes "
              f"({min(values):+.1%} .. {max(values):+.1%})"
              + (f"; measured {min(steps):.3f} .. {max(steps):.3f} s a step" if steps else ""))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--reprice"]:
        with tempfile.TemporaryDirectory() as tmp:
            main(reprice(sys.argv[2:], Path(tmp)))
    else:
        main(sys.argv[1:])
