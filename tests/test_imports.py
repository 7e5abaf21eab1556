"""The module graph of echobench has no cycle, and its packages import only the layers below them
(echobench.LAYERS). The module graph has no cycle: a fact lives in one module and the arrows between
modules point one way. Every import counts, a lazy one inside a function included (it is still
an arrow); a package's own __init__ choosing among its submodules (make_executor) is the one
exception, since the package is their common home."""

import ast
from pathlib import Path

from conftest import ROOT, cli_env

PACKAGE = ROOT / "echobench"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the echobench modules it imports (anywhere in its file)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package `level` steps up
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                found = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in found:
                # importing a.b.c runs a and a.b first: an arrow to each package on the way
                parts = target.split(".")
                targets |= {".".join(parts[:k]) for k in range(2, len(parts) + 1)} & set(files)
        own = {t for t in targets if is_package and t.startswith(name + ".")}  # a package's own members
        graph[name] = targets - own - {name, "echobench"}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (first node repeated at the end), or None."""
    state: dict[str, str] = {}  # visiting | done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "visiting"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "visiting":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_lazy_import_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_echobench_has_no_import_cycle():
    graph = import_graph()
    # the graph is the real one: the known arrows are in it (a lazy one among them)
    assert "echobench.records.results" in graph["echobench.sweep.executors"] and "echobench.hardware.device" in graph["echobench.predict.profiles"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def layer_violations(graph: dict[str, set[str]], layers) -> list[str]:
    """The arrows between echobench's packages that do not point to a lower layer (siblings of one
    layer must not import each other either)."""
    level = {package: i for i, line in enumerate(layers) for package in line}

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and not parts[1].startswith("__") else None

    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if (a := package(module)) and (b := package(target)) and a != b and level[a] >= level[b])


def test_the_layer_check_finds_an_upward_and_a_sideways_arrow():
    layers = (("top",), ("left", "right"), ("bottom",))
    graph = {"echobench.top.x": {"echobench.bottom.y"}, "echobench.bottom.y": {"echobench.left.z"},
             "echobench.left.z": {"echobench.right.w", "echobench.bottom.y"}}
    assert layer_violations(graph, layers) == ["echobench.bottom.y -> echobench.left.z",
                                               "echobench.left.z -> echobench.right.w"]


def test_packages_import_only_the_layers_below_them():
    from echobench import LAYERS

    entries = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    # every package has its layer, and nothing but packages sits at the top beside __init__ / __main__
    assert packages == {p for line in LAYERS for p in line}
    assert entries - packages == {"__init__.py", "__main__.py"}
    assert layer_violations(import_graph(), LAYERS) == []


def test_the_readme_and_the_docs_draw_the_layers_of_echobench_init():
    """The Layout block of README and of docs/development/layout.md is the package docstring's map,
    line for line (one place says it; the two pages are held to it)."""
    import echobench

    drawn = [line[4:] for line in echobench.__doc__.splitlines() if line.startswith("    ")]
    for page, heading in ((ROOT / "README.md", "## Layout"), (ROOT / "docs" / "development" / "layout.md", "# Layout")):
        block = page.read_text().split(heading, 1)[1].split("```\n", 2)[1]
        assert block.splitlines() == drawn, page
    assert [line.split()[0] for line in drawn] == [p for layer in echobench.LAYERS for p in layer]


def test_the_commands_that_read_records_import_no_torch(tmp_path):
    """report and results read records and price them: arithmetic, so neither pays torch's import
    (seconds of CPU a call); nor do plan and predict of a CPU matrix of single runs. (validate measured
    imports torch where it counts a step's element-wise bytes the cache lacks.) All four in one fresh
    process, which then holds no torch."""
    import json
    import shutil
    import subprocess
    import sys

    run = tmp_path / "sweep" / "run-1"
    run.mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "fixtures" / "record-v2.json", run / "result.json")
    matrix = tmp_path / "m.yaml"
    matrix.write_text("name: m\nexecutor: local\ndefaults: {scale: tiny, device: cpu}\naxes: {parallelism: [single]}\n")
    sweep = str(tmp_path / "sweep")
    commands = [["report", sweep, "--out", str(tmp_path / "html")], ["results", sweep], ["plan", str(matrix)],
                ["predict", str(matrix), "--profile", "h100-hgx-ib"]]
    code = ("import json, sys\nfrom echobench.cli import main\nfor args in json.loads(sys.argv[1]):\n"
            "    sys.argv = ['echobench', *args]\n    try:\n        main()\n    except SystemExit as e:\n"
            "        assert not e.code, (args, e.code)\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(commands)], capture_output=True, text=True, cwd=tmp_path,
                         env=cli_env(tmp_path), timeout=600)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "no torch", (out.stdout[-800:], out.stderr[-800:])
