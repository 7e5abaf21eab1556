"""tools/suite_timeline.py --files: the test files that cost the suite the most CPU, which
scripts/test.sh prints after every run."""

import json
import subprocess
import sys

from conftest import ROOT


def timeline(tmp_path, rows) -> str:
    path = tmp_path / "timeline.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def row(test: str, cpu: float, wall: float, worker: str = "gw0") -> dict:
    return {"worker": worker, "test": test, "start": 100.0, "end": 100.0 + wall, "cpu_s": cpu}


def test_files_are_ranked_by_their_tests_summed_cpu(tmp_path):
    rows = [row("tests/test_a.py::one", 5.0, 9.0), row("tests/test_a.py::two[x]", 6.0, 1.0),
            row("tests/test_b.py::one", 10.0, 20.0, "gw1"), row("tests/test_c.py::one", 1.0, 1.0)]
    out = subprocess.run([sys.executable, ROOT / "tools/suite_timeline.py", timeline(tmp_path, rows), "--files", "2"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "the 2 test files that cost the most CPU (of 3; 22 CPU s in all):"
    assert [line.split() for line in out[2:]] == [["11", "10", "2", "tests/test_a.py"],
                                                  ["10", "20", "1", "tests/test_b.py"]]


def test_an_empty_timeline_says_so(tmp_path):
    proc = subprocess.run([sys.executable, ROOT / "tools/suite_timeline.py", timeline(tmp_path, []), "--files", "20"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("no test in the timeline")
