"""Which processes the suite starts and what each costs: a census of every Python process of a venv.

    python3 tools/suite_census.py install .venv /tmp/census   # every process of .venv logs itself
    ECHOBENCH_TEST_TIMELINE=/tmp/timeline.jsonl bash scripts/test.sh
    python3 tools/suite_census.py summary /tmp/census [--files 30]
    python3 tools/suite_census.py remove .venv

`install` puts a .pth file into the venv's site-packages: at its exit (atexit, or os._exit, which the
ranks of a run with a process group end with) each process of that interpreter appends one JSON line
to DIR/PID.jsonl: its command line, the test that started it (PYTEST_CURRENT_TEST, inherited by
subprocesses and SLURM jobs), its own CPU seconds (not its children's) and whether it imported torch
and transformers. `summary` groups them by kind (a rank of a run, torchrun's launcher, a node check,
each `echobench` command) and by test file. The suite's timeline (tests/conftest.py) has each test's
CPU with its children; this says which children.
"""
import argparse
import collections
import glob
import json
import sys
from pathlib import Path

HOOK = '''# echobench suite census (tools/suite_census.py): one JSON line per process at its exit
import atexit, json, os, resource, sys, time
_DIR, _T0 = {dir!r}, time.time()
def _done():
    try:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        line = {{"pid": os.getpid(), "argv": sys.argv[:6], "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                 "cpu": ru.ru_utime + ru.ru_stime, "wall": time.time() - _T0, "torch": "torch" in sys.modules,
                 "transformers": "transformers" in sys.modules}}
        with open(os.path.join(_DIR, f"{{os.getpid()}}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\\n")
    except Exception:
        pass
atexit.register(_done)
_exit = os._exit
def _logged_exit(code):
    _done()
    _exit(code)
os._exit = _logged_exit
'''


def site_packages(venv: Path) -> Path:
    (found,) = glob.glob(str(venv / "lib" / "python3*" / "site-packages"))
    return Path(found)


def install(venv: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sp = site_packages(venv)
    (sp / "echobench_census.py").write_text(HOOK.format(dir=str(out.resolve())))
    (sp / "zz_echobench_census.pth").write_text("import echobench_census\n")
    print(f"every process of {venv} now logs itself into {out}; `remove {venv}` undoes it")


def remove(venv: Path) -> None:
    sp = site_packages(venv)
    for name in ("echobench_census.py", "zz_echobench_census.pth"):
        (sp / name).unlink(missing_ok=True)


def kind(row: dict) -> str:
    """What a process was, from its command line."""
    argv = row["argv"]
    line = " ".join(argv)
    if argv and argv[0].endswith("echobench/__main__.py"):
        command = argv[1] if len(argv) > 1 else "?"
        if command == "run" and row["torch"]:  # a rank, or a single-process run
            return "echobench run: a rank, Echo built" if row["transformers"] else "echobench run: a rank, a card's decoder"
        return f"echobench {command}" + (" (a launched run's parent)" if command == "run" else "")
    for module, name in (("train/torchrun.py", "torchrun's launcher (echobench.train.torchrun)"),
                         ("torch/distributed/run.py", "torchrun's launcher (torch.distributed.run)"),
                         ("train/nodecheck.py", "node check")):
        if module in line:
            return name + (f" {argv[1]}" if name == "node check" and len(argv) > 1 else "")
    if argv == ["-c"]:
        return "python -c (pytest-xdist worker, a spawned child)" + (" with torch" if row["torch"] else "")
    if "pip" in line:
        return "pip (setup)"
    return line[:60]


def table(groups: dict, top: int, title: str) -> None:
    total = sum(cpu for _, cpu in groups.values())
    print(f"\n{title} ({total:.0f} CPU s in all)\n\n| processes | CPU s | CPU s each | {title.split(' by ')[-1]} |\n"
          "| ---: | ---: | ---: | --- |")
    for name, (n, cpu) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {n} | {cpu:.0f} | {cpu / n:.1f} | {name or '(outside a test)'} |")


def summary(out: Path, top: int) -> None:
    rows = [json.loads(line) for path in sorted(out.glob("*.jsonl")) for line in path.read_text().splitlines() if line]
    by_kind, by_file = collections.defaultdict(lambda: [0, 0.0]), collections.defaultdict(lambda: [0, 0.0])
    for r in rows:
        for groups, key in ((by_kind, kind(r)), (by_file, r["test"].split("::")[0])):
            groups[key][0] += 1
            groups[key][1] += r["cpu"]
    print(f"{len(rows)} processes")
    table(by_kind, top, "processes by kind")
    table(by_file, top, "processes (the test's own process aside) by test file")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install")
    p.add_argument("venv", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("remove")
    p.add_argument("venv", type=Path)
    p = sub.add_parser("summary")
    p.add_argument("out", type=Path)
    p.add_argument("--files", type=int, default=30, help="rows of each table")
    args = ap.parse_args()
    if args.command == "install":
        install(args.venv, args.out)
    elif args.command == "remove":
        remove(args.venv)
    else:
        summary(args.out, args.files)


if __name__ == "__main__":
    sys.exit(main())
