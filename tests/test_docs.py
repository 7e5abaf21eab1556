"""The docs: README.md is a short front door, docs/ the MkDocs site (mkdocs.yml). Its generated pages
are current, it builds with --strict, and every relative link of README.md and docs/ reaches a file of
this repository."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 250


def docs_reference():
    """tools/docs_reference.py as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "tools" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_pages_are_current():
    tool = docs_reference()
    for rel, make in tool.PAGES.items():
        path = ROOT / rel
        assert path.is_file() and path.read_text() == make(), \
            f"{rel} is stale: regenerate it with `{tool.COMMAND}`"


def test_the_cli_page_has_every_command_and_option():
    """Each command of the typer app, sub-commands included, and each of its options is on the page."""
    import typer

    from echobench.cli import app

    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    group = typer.main.get_command(app)
    ctx = group.context_class(group, info_name="echobench")
    stack = [(group, ["echobench"], ctx)]
    seen = 0
    while stack:
        cmd, path, parent = stack.pop()
        for name in cmd.list_commands(parent):
            sub = cmd.get_command(parent, name)
            sub_ctx = sub.context_class(sub, info_name=name, parent=parent)
            assert f"## `{' '.join(path + [name])}`" in page
            # hidden ones (run's fail_* testing switches) are out of --help and the page alike
            for param in (p for p in sub.get_params(sub_ctx) if p.name != "help" and not getattr(p, "hidden", False)):
                for opt in getattr(param, "opts", []) if param.param_type_name == "option" else []:
                    assert f"`{opt}" in page or f", {opt}" in page or f"/ {opt}" in page, (name, opt)
            seen += 1
            if hasattr(sub, "list_commands"):
                stack.append((sub, path + [name], sub_ctx))
    assert seen >= 15


def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, a missing anchor or a page left out of the nav fails.
    mkdocs and the material theme are in the dev extra (scripts/setup.sh installs it)."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        message = "mkdocs / mkdocs-material are not installed: pip install -e '.[dev]' (scripts/setup.sh does)"
        if os.environ.get("ECHOBENCH_REQUIRE_DOCS") == "1":  # CI: required, not skipped
            pytest.fail(message)
        pytest.skip(message)  # e.g. tools/device/twin.sh --suite, on the device's own packages
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_the_readme_is_a_short_front_door():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md is {lines} lines: move the detail into docs/ (at most {README_MAX_LINES})"
    text = (ROOT / "README.md").read_text()
    # CI and the developers' guide run these two commands as they are written
    assert "bash scripts/quickstart.sh\n" in text and "bash scripts/test.sh\n" in text


def _links(text: str) -> list[str]:
    """The targets of markdown links and images, outside fenced blocks and code spans."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


def test_every_relative_link_reaches_a_file_of_the_repository():
    problems = []
    for page in PAGES:
        for target in _links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page (mkdocs --strict checks anchors)
            path = (page.parent / target.split("#", 1)[0]).resolve()
            if not path.is_relative_to(ROOT):
                problems.append(f"{page.relative_to(ROOT)}: {target} leaves the repository")
            elif not path.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target} does not exist")
    assert not problems, "\n".join(problems)
    assert _links("[a](b.md) `[c](d.md)` ![e](f.png)\n```\n[g](h.md)\n```\n") == ["b.md", "f.png"]


def test_no_page_sends_the_reader_outside_the_repository():
    for page in PAGES:
        assert "../shared" not in page.read_text(), page


def test_user_pages_hold_no_project_internal_words():
    """The README and docs/ speak to a user: no project issue numbers, no "the seed's" cluster, no
    lent machine, no path into the project's shared notes."""
    import re

    internal = re.compile(r"\bissue #?\d+\b|\blent (gpu|machine|device)\b|\bthe seed's\b|\.\./shared", re.I)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in pages for m in internal.finditer(p.read_text())]
    assert not found, found
