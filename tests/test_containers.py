"""The container recipes in containers/: each is well-formed for its runtime and installs what
pyproject.toml names; the docs include them (not copies); every container a doc or a shipped matrix
names passes the matrix loader (echobench.sweep.cluster.ContainerSettings)."""

import re
import shlex
import tomllib

import pytest
import yaml
from packaging.markers import default_environment
from packaging.requirements import Requirement

from conftest import ROOT
from echobench.sweep.cluster import ContainerSettings
from echobench.sweep.matrix import expand, load_matrix, parse_matrix

RECIPES = ROOT / "containers"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Dockerfile reference: every instruction there is
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
                "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
# Apptainer definition files: the sections there are (the %app* ones for SCIF apps)
SECTIONS = {"setup", "files", "environment", "post", "runscript", "startscript", "test", "labels", "help",
            "arguments"}
# CSCS Container Engine: the keys of an environment definition file
EDF_KEYS = {"image", "base_environment", "workdir", "entrypoint", "writable", "mounts", "env", "annotations",
            "devices"}
IMAGE_PYTHON = "3.12"  # NVIDIA's pytorch:25.01-py3: the megatron extra's marker is read for it
BASE_IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"


def instructions(text: str) -> list[tuple[str, str]]:
    """A Dockerfile as (INSTRUCTION, arguments): comments and blank lines out, continued lines joined."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the last instruction ends with a line continuation"
    return [(ln.split(None, 1)[0], ln.split(None, 1)[1] if len(ln.split(None, 1)) > 1 else "") for ln in logical]


def pip_installs(shell: str) -> tuple[list[str], dict[str, Requirement]]:
    """The `pip install` commands of a shell text: (what installs with --no-deps, the requirements of
    the other installs by name)."""
    no_deps, requirements = [], {}
    for command in re.split(r"&&|;|\n", shell):
        words = shlex.split(command)
        if words[:2] != ["pip", "install"]:
            continue
        targets = [w for w in words[2:] if not w.startswith("-")]
        if "--no-deps" in words:
            no_deps += targets
        else:
            requirements.update({Requirement(t).name: Requirement(t) for t in targets})
    return no_deps, requirements


def expected_requirements() -> dict[str, str]:
    """pyproject.toml's dependencies but torch (the image's own), plus the megatron extra as it reads
    on the image's Python: name -> specifier."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = {**default_environment(), "python_version": IMAGE_PYTHON, "python_full_version": IMAGE_PYTHON + ".0"}
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [r for r in map(Requirement, project["optional-dependencies"]["megatron"])
               if r.marker is None or r.marker.evaluate(env)]
    return {r.name: str(r.specifier) for r in wanted if r.name != "torch"}


def test_the_dockerfile_parses_and_installs_pyprojects_dependencies():
    steps = instructions((RECIPES / "Dockerfile").read_text())
    assert {kind for kind, _ in steps} <= INSTRUCTIONS, {kind for kind, _ in steps} - INSTRUCTIONS
    assert all(kind == kind.upper() for kind, _ in steps)
    assert steps[0] == ("FROM", BASE_IMAGE)
    copied = set()
    for kind, args in steps:
        if kind in ("COPY", "ADD"):
            *sources, dest = shlex.split(args)
            for src in sources:  # the build context is the checkout's root
                assert (ROOT / src).exists(), f"COPY {src}: not in the checkout"
                copied.add(dest.rstrip("/") + ("" if (ROOT / src).is_dir() else "/" + src))
    no_deps, requirements = pip_installs("\n".join(a for k, a in steps if k == "RUN"))
    assert no_deps == ["/opt/echobench"] and {"/opt/echobench/pyproject.toml", "/opt/echobench/echobench"} <= copied
    assert {n: str(r.specifier) for n, r in requirements.items()} == expected_requirements()


def test_the_apptainer_definition_has_its_header_files_and_post():
    text = (RECIPES / "echobench.def").read_text()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert lines[0] == "Bootstrap: docker" and lines[1] == f"From: {BASE_IMAGE}"  # Bootstrap first, as required
    sections: dict[str, list[str]] = {}
    current = None
    for line in lines[2:]:
        if line.startswith("%"):
            current = line[1:].split()[0]
            assert current in SECTIONS or current.startswith("app"), f"unknown section %{current}"
            sections[current] = []
        elif current is not None:
            sections[current].append(line.strip())
        else:
            assert line.startswith("#"), f"header line after From: {line!r}"
    assert {"files", "post"} <= set(sections)
    for entry in sections["files"]:
        src, dest = entry.split()
        assert (ROOT / src).exists() and dest.startswith("/opt/echobench")
    post = "\n".join(ln for ln in sections["post"] if not ln.startswith("#")).replace("\\\n", " ")
    no_deps, requirements = pip_installs(post)
    assert no_deps == ["/opt/echobench"]
    assert {n: str(r.specifier) for n, r in requirements.items()} == expected_requirements()


def test_the_edf_is_toml_with_the_container_engines_keys():
    edf = tomllib.loads((RECIPES / "echobench.toml").read_text())
    assert set(edf) <= EDF_KEYS, set(edf) - EDF_KEYS
    assert edf["image"].endswith(".sqsh") and edf["workdir"].startswith("/")
    for mount in edf["mounts"]:
        src, dst, *flags = mount.split(":")
        assert src.startswith("/") and dst.startswith("/") and len(flags) <= 1, mount
    assert edf["workdir"] in {m.split(":")[1] for m in edf["mounts"]}  # the checkout, mounted, is where ranks start
    hook = edf["annotations"]["com"]["hooks"]["aws_ofi_nccl"]
    assert hook == {"enabled": "true", "variant": "cuda12"}


def test_the_docs_include_the_recipes_not_copies():
    guide = (ROOT / "docs" / "guides" / "containers.md").read_text()
    for name in ("Dockerfile", "echobench.def", "echobench.toml"):
        assert f'--8<-- "containers/{name}"' in guide
    config = (ROOT / "mkdocs.yml").read_text()
    assert "pymdownx.snippets" in config and "check_paths: true" in config  # a missing file fails the build
    for page in DOCS:  # no page keeps its own copy of a recipe's install line or EDF
        text = page.read_text()
        assert "FROM nvcr.io" not in text and "com.hooks.aws_ofi_nccl.variant" not in text, page


def yaml_blocks(text: str) -> list[str]:
    return [re.sub(r"^ {0,4}", "", b, flags=re.M) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]


def flow_mappings(text: str, key: str = "container") -> list[str]:
    """Each `KEY: {...}` flow mapping of a text, to its matching brace (quoted braces aside)."""
    found = []
    for m in re.finditer(rf"\b{key}: \{{", text):
        depth, quote = 0, None
        for end in range(m.end() - 1, len(text)):
            ch = text[end]
            if quote:
                quote = None if ch == quote else quote
            elif ch in "\"'":
                quote = ch
            elif ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    found.append(text[m.end() - 1:end + 1])
                    break
    return found


def containers_named() -> list[tuple[str, object]]:
    """(where, what) for each container in the docs and the shipped matrices: whole matrices (a
    yaml block with a name), and `container: {...}` mappings in a line of text or a comment."""
    found = []
    for page in DOCS:
        text = page.read_text()
        for k, block in enumerate(yaml_blocks(text)):
            if "container:" in block and re.search(r"^name:", block, re.M):
                found.append((f"{page.name} block {k}", block))
        for mapping in flow_mappings(text):
            found.append((f"{page.name}: container: {mapping}", yaml.safe_load(mapping)))
    for matrix in sorted((ROOT / "matrices").glob("*.yaml")):
        comments = "\n".join(ln for ln in matrix.read_text().splitlines() if ln.lstrip().startswith("#"))
        for mapping in flow_mappings(comments):
            found.append((f"{matrix.name} (a comment): container: {mapping}", yaml.safe_load(mapping)))
    return found


@pytest.mark.parametrize("what", [pytest.param(what, id=where) for where, what in containers_named()])
def test_every_container_named_passes_the_matrix_loader(what):
    if isinstance(what, str):
        matrix = parse_matrix(what, "a matrix of the docs")
        assert matrix.spec.slurm.container is not None
        assert expand(matrix, "slurm").runs
    else:
        ContainerSettings.model_validate(what)


def test_the_shipped_matrices_with_a_container_load():
    named = [p for p in (ROOT / "matrices").glob("*.yaml") if re.search(r"^\s+container:", p.read_text(), re.M)]
    assert named, "no shipped matrix names a container"
    for path in named:
        assert load_matrix(path).spec.slurm.container is not None
    assert len(containers_named()) >= 6  # the guide's three matrices, route 2 and 3, the published matrix's comment
