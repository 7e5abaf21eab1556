"""Is the device's wheel set closed? The lent H200 has no network: whatever the device check imports
must be on its image or carried (tools/device/packages.txt), and every carried wheel's own
requirements must be met by the image plus the carried set (they install with --no-deps).

  python3 -m tools.device.stack imports              # the import check (no wheels needed)
  python3 -m tools.device.stack wheels DIR           # the requirements of the wheels in DIR
  python3 -m tools.device.stack all DIR              # both; exit 1 with one line per problem

The import check reads the code, it does not run it: every third-party module imported by the
echobench modules that the device check's commands reach (from echobench.cli, echobench.train.bench,
echobench.train.torchrun and the device kit's modules, following echobench's and the kit's own imports), by every test module
at module level (pytest imports them all to collect `-m gpu`) and inside `gpu`-marked tests.
An import inside `try: ... except ImportError` is optional and not counted; a string naming an
echobench module (for importlib.import_module) counts as an import of it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import zipfile
from email.parser import Parser
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ROOT / "tools" / "device" / "packages.txt"
ENTRY_MODULES = ("echobench.cli", "echobench.__main__", "echobench.train.bench", "echobench.train.torchrun")
ENTRY_SCRIPTS = ("tools/device/check.py", "tools/device/summary.py", "tools/device/bare_step.py",
                 "tools/device/stack.py")
# Import names whose distribution is not installed here to ask (importlib.metadata answers the rest).
KNOWN_DISTS = {"yaml": "pyyaml", "megatron": "megatron-core", "transformer_engine": "transformer-engine",
               "PIL": "pillow", "google": "protobuf"}
OWN = ("echobench", "tools")  # this checkout's packages: followed into, not looked up
ECHOBENCH_NAME = re.compile(r"^echobench(\.\w+)+$")
# The device's interpreter and platform, for requirement markers.
MARKER_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Stack:
    image: dict[str, str | None] = field(default_factory=dict)  # name -> version (None: not read)
    carried: dict[str, str] = field(default_factory=dict)
    source: str = "tools/device/packages.txt"

    def has(self, dist: str) -> bool:
        return norm(dist) in self.image or norm(dist) in self.carried

    def version(self, dist: str) -> str | None:
        return self.carried.get(norm(dist)) or self.image.get(norm(dist))


def read_stack(path: Path = PACKAGES) -> Stack:
    stack = Stack(source=str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path))
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        kind, _, spec = line.partition(" ")
        name, _, version = spec.strip().partition("==")
        if kind == "image":
            stack.image[norm(name)] = version or None
        elif kind == "carried" and version:
            stack.carried[norm(name)] = version
        else:
            raise ValueError(f"{path}:{n}: expected 'image NAME[==VERSION]' or 'carried NAME==VERSION', got {line!r}")
    return stack


# ---- the import check ----

def _guarded(node: ast.AST, parents: dict) -> bool:
    """Inside a try whose handlers catch ImportError (or ModuleNotFoundError, or everything)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.Try) and child in node.body:
            for h in node.handlers:
                names = {getattr(t, "id", getattr(t, "attr", None)) for t in
                         (h.type.elts if isinstance(h.type, ast.Tuple) else [h.type])} if h.type else {None}
                if names & {"ImportError", "ModuleNotFoundError", "Exception", None}:
                    return True
    return False


def _is_gpu_marked(node: ast.AST) -> bool:
    return any("gpu" in ast.unparse(d) for d in getattr(node, "decorator_list", ()))


def imports_of(path: Path, module_level_only: bool = False) -> list[tuple[str, int]]:
    """(module name, line) of every unguarded absolute import in a file; with module_level_only, only
    those run when the file is imported (and those inside gpu-marked tests or classes)."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    module_gpu = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                     and "gpu" in ast.unparse(n.value) for n in tree.body)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ECHOBENCH_NAME.match(node.value):
            names = [node.value]  # a module named for importlib.import_module (the backends' table)
        else:
            continue
        if _guarded(node, parents):
            continue
        if module_level_only and not module_gpu:
            scope, up = node, node
            while up in parents:
                up = parents[up]
                if isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    scope = up
            if scope is not node and not _is_gpu_marked(scope):
                continue
        found.extend((name, node.lineno) for name in names)
    return found


def module_file(name: str) -> Path | None:
    if not name:
        return None
    rel = Path(*name.split("."))
    for cand in (ROOT / rel / "__init__.py", ROOT / rel.with_suffix(".py")):
        if cand.exists():
            return cand
    return None


def third_party_imports() -> dict[str, list[str]]:
    """Top-level third-party module -> where it is imported ('file:line')."""
    seen: set[Path] = set()
    todo = [p for p in (module_file(m) for m in ENTRY_MODULES) if p] + [ROOT / s for s in ENTRY_SCRIPTS]
    where: dict[str, list[str]] = {}

    def note(name: str, path: Path, line: int) -> None:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            return
        if (ROOT / "tests" / f"{top}.py").exists():
            return  # a test importing a sibling test module
        where.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{line}")

    def follow(name: str) -> None:
        # "from echobench.x import y" may name a module (x.y) or an object in x; tools.device likewise.
        todo.extend(p for p in (module_file(name), module_file(name.rpartition(".")[0])) if p)

    for path in sorted((ROOT / "tests").glob("*.py")):  # what collecting the tests imports
        for name, line in imports_of(path, module_level_only=True):
            follow(name) if name.split(".")[0] in OWN else note(name, path, line)
    while todo:  # everything in echobench (and the scripts) that the commands and the tests reach
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        for name, line in imports_of(path):
            follow(name) if name.split(".")[0] in OWN else note(name, path, line)
    return where


def dist_of(module: str) -> str:
    found = metadata.packages_distributions().get(module)
    return norm(found[0]) if found else norm(KNOWN_DISTS.get(module, module))


def import_problems(stack: Stack) -> list[str]:
    problems = []
    for module, places in sorted(third_party_imports().items()):
        dist = dist_of(module)
        if not stack.has(dist):
            problems.append(f"{module} ({dist}) is imported by {places[0]}"
                            + (f" and {len(places) - 1} more" if len(places) > 1 else "")
                            + f", but it is neither on the device image nor carried: add 'carried {dist}==VERSION' "
                            f"to {stack.source} (or guard the import)")
    return problems


# ---- the carried wheels' requirements ----

def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(name, version, Requires-Dist lines) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    head = Parser().parsestr(text, headersonly=True)
    return head["Name"], head["Version"], head.get_all("Requires-Dist") or []


def wheel_problems(stack: Stack, wheels: Path) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.version import Version

    files = sorted(wheels.glob("*.whl"))
    have = {norm(wheel_metadata(f)[0]): wheel_metadata(f)[1] for f in files}
    problems = [f"carried {name}=={version} has no wheel in {wheels} (tools/device/wheels.sh downloads them)"
                for name, version in sorted(stack.carried.items()) if have.get(name) != version]
    for f in files:
        name, version, requires = wheel_metadata(f)
        if norm(name) not in stack.carried:
            problems.append(f"{f.name} is in {wheels} but not carried in {stack.source}")
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(MARKER_ENV):
                continue  # an extra, or another platform's
            dep = norm(req.name)
            if dep in stack.carried:
                got = have.get(dep)
            elif dep in stack.image:
                got = stack.image[dep]
            else:
                problems.append(f"{name} {version} requires {req}, which is neither on the device image nor carried")
                continue
            if got is None:
                if dep in stack.carried:
                    problems.append(f"{name} {version} requires {req}: its wheel is missing from {wheels}")
                continue  # on the image, version not read: assumed to fit
            if req.specifier and Version(got) not in req.specifier:
                problems.append(f"{name} {version} requires {req}, but the device would have {req.name} {got}")
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("imports", "wheels", "all"))
    p.add_argument("wheels", nargs="?", type=Path, default=ROOT / ".whl")
    p.add_argument("--packages", type=Path, default=PACKAGES)
    args = p.parse_args(argv)
    stack = read_stack(args.packages)
    problems = []
    if args.what in ("imports", "all"):
        problems += import_problems(stack)
    if args.what in ("wheels", "all"):
        problems += wheel_problems(stack, args.wheels)
    for line in problems:
        print(f"device stack: {line}", file=sys.stderr)
    if not problems:
        print(f"device stack: closed ({len(stack.image)} image packages, {len(stack.carried)} carried)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
