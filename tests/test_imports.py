"""The module graph of echobench has no cycle: a fact lives in one module and the arrows between
modules point one way. Every import counts, a lazy one inside a function included (it is still
an arrow); a package's own __init__ choosing among its submodules (make_executor) is the one
exception, since the package is their common home."""

import ast
from pathlib import Path

from conftest import ROOT

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
    assert "echobench.results" in graph["echobench.executors"] and "echobench.hardware" in graph["echobench.results"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
