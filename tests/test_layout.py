"""The Layout object: a `parallelism` setting parsed once, and the properties the code asks of it.

Run as a script (`python tests/test_layout.py [ROOT]`) it prints the modules of ROOT/echobench that
name each layout, the measure the last test holds."""

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from echobench.backends import BACKENDS
from echobench.records.config import RunConfig, check_value
from echobench.records.layout import CARD_LAYOUTS, KINDS, Layout


def test_every_setting_text_parses_to_its_layout_and_back():
    for name in ("single", "ddp", "fsdp2", "hsdp", "tp1", "tp4", "tp12"):
        assert Layout.parse(name).name == name == str(Layout.parse(name))
    assert Layout.parse("tp4") == Layout("tpN", 4) and Layout.parse("ddp") == Layout("ddp")


@pytest.mark.parametrize("bad", ["fsdp", "tp0", "tp", "tpN", "tp02", "TP2", "DDP", "", None, 2])
def test_a_bad_layout_is_one_line_naming_the_valid_ones(bad):
    with pytest.raises(ValueError) as err:
        Layout.parse(bad)
    text = str(err.value)
    assert "\n" not in text and f"parallelism={bad!r}" in text
    assert "single, ddp, fsdp2, hsdp (torchtitan); tpN with N >= 1 (megatron)" in text
    if bad is None:  # a setting of null is the wrong type (check_value's own line)
        return
    # A run's setting is refused with the same list (check_value: flag, --config file and matrix alike).
    with pytest.raises(ValueError, match="single, ddp, fsdp2, hsdp \\(torchtitan\\); tpN with N >= 1"):
        check_value("parallelism", bad)


def test_a_layout_of_a_tensor_width_other_than_tpn_cannot_be_built():
    with pytest.raises(ValueError, match="no layout 'ddp' with tp 2"):
        Layout("ddp", 2)
    with pytest.raises(ValueError, match="no layout 'zero'"):
        Layout("zero")


def test_what_each_layout_splits():
    rows = {name: (lay.single, lay.replicates, lay.shards_parameters, lay.hybrid, lay.data_parallel,
                   lay.tensor_parallel)
            for name in ("single", "ddp", "fsdp2", "hsdp", "tp2") for lay in [Layout.parse(name)]}
    assert rows == {"single": (True, False, False, False, False, False),
                    "ddp": (False, True, False, False, True, False),
                    "fsdp2": (False, False, True, False, True, False),
                    "hsdp": (False, False, True, True, True, False),
                    "tp2": (False, False, False, False, False, True)}
    assert Layout.parse("hsdp").within_node == Layout.parse("fsdp2")
    assert Layout.parse("ddp").within_node == Layout.parse("ddp")


def test_world_factors_of_each_layout():
    # 2 nodes of 4: fsdp2 shards over all 8, hsdp over a node's 4, the rest do not shard.
    assert {n: Layout.parse(n).shard_ranks(2, 4) for n in ("single", "ddp", "fsdp2", "hsdp", "tp4")} == \
        {"single": 1, "ddp": 1, "fsdp2": 8, "hsdp": 4, "tp4": 1}
    assert Layout.parse("tp4").dp(8) == 2 and Layout.parse("fsdp2").dp(8) == 8
    cfg = RunConfig(framework="megatron", parallelism="tp2", nodes=2, gpus_per_node=4)
    assert (cfg.layout, cfg.tp, cfg.dp) == (Layout("tpN", 2), 2, 4)


def test_each_layout_is_run_by_the_backend_that_lists_it():
    assert {Layout.parse(n).framework for n in ("single", "ddp", "fsdp2", "hsdp")} == {"torchtitan"}
    assert Layout.parse("tp8").framework == "megatron"
    # Every kind has one backend, and every backend's layouts are kinds.
    assert sorted(k for b in BACKENDS.values() for k in b.layouts) == sorted(KINDS)


def test_a_cards_layout_names_translate_both_ways():
    assert Layout.of_card("megatron", 4, 8) == Layout.parse("tp4")
    assert Layout.of_card("fsdp", 1, 8) == Layout.parse("fsdp2")
    assert Layout.of_card("fsdp", 1, 1) == Layout.of_card("ddp", 1, 1) == Layout.parse("single")
    assert Layout.of_card("hsdp", 1, 1) == Layout.parse("hsdp")  # refused by the run's check, not renamed
    assert {n: Layout.parse(n).card_layout for n in ("single", "ddp", "fsdp2", "hsdp", "tp2")} == \
        {"single": "ddp", "ddp": "ddp", "fsdp2": "fsdp", "hsdp": "hsdp", "tp2": "megatron"}
    for card_name in CARD_LAYOUTS:
        assert Layout.of_card(card_name, 2 if card_name == "megatron" else 1, 8).card_layout == card_name


# Where a layout may be named: the Layout module, the backends that run them (and a recipe named
# after FSDP2), the setting's default, the pricing of a layout's host work (predict's tables, the
# profile's host points, calibrate's measured layouts); a model card's own names (fsdp, hsdp) in the
# card modules that read, tune and reproduce cards, and validate's text of a published layout (tp4 pp2).
# Anywhere else the code asks a Layout (cfg.layout) what it splits.
LAYOUT_NAMES = ("single", "ddp", "fsdp2", "hsdp", "tpN", "fsdp")
LAYOUT_MODULE, BACKEND, PRICING = ("echobench/records/layout.py",), ("echobench/backends/__init__.py",), (
    "echobench/predict/work.py", "echobench/predict/pricing.py", "echobench/hardware/profile.py",
    "echobench/calibrate/commbench.py")
CARDS = ("echobench/predict/cards/card.py", "echobench/predict/cards/work.py", "echobench/sweep/reproduce.py",
         "echobench/tune/cards.py")
ALLOWED = {"single": {*LAYOUT_MODULE, *BACKEND, *PRICING, "echobench/records/config.py"},
           "ddp": {*LAYOUT_MODULE, *BACKEND, *PRICING, *CARDS},
           "fsdp2": {*LAYOUT_MODULE, *BACKEND, *PRICING, "echobench/backends/master.py", "echobench/records/config.py"},
           "hsdp": {*LAYOUT_MODULE, *BACKEND, *CARDS},
           "tpN": {*LAYOUT_MODULE, *BACKEND, "echobench/predict/validate.py"},
           "fsdp": {*LAYOUT_MODULE, *CARDS}}


def layout_names(tree: ast.AST) -> set[str]:
    """The layouts a module names: string constants equal to a layout's name (docstrings and longer
    text aside), and an f-string that builds a tpN name (f"tp{...}") as tpN."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and node.value in LAYOUT_NAMES and id(node) not in docs:
            out.add(node.value)
        if (isinstance(node, ast.JoinedStr) and len(node.values) == 2 and isinstance(node.values[0], ast.Constant)
                and node.values[0].value == "tp" and isinstance(node.values[1], ast.FormattedValue)):
            out.add("tpN")
    return out


def modules_naming_layouts(root: Path) -> dict[str, set[str]]:
    """Layout name -> the modules of root/echobench that name it."""
    found = defaultdict(set)
    for path in sorted((root / "echobench").rglob("*.py")):
        for name in layout_names(ast.parse(path.read_text())):
            found[name].add(path.relative_to(root).as_posix())
    return {name: found[name] for name in LAYOUT_NAMES}


def test_the_scan_finds_a_layout_named_in_code_not_in_a_docstring():
    tree = ast.parse('"""hsdp shards."""\ndef f(p, t):\n    """ddp"""\n    return p == "fsdp2" or p == f"tp{t}"\n')
    assert layout_names(tree) == {"fsdp2", "tpN"}


def test_layouts_are_named_only_where_they_are_defined_run_or_priced():
    root = Path(__file__).resolve().parents[1]
    stray = {name: sorted(modules - ALLOWED[name]) for name, modules in modules_naming_layouts(root).items()
             if modules - ALLOWED[name]}
    assert not stray, f"ask cfg.layout (echobench.records.layout.Layout) instead of naming a layout: {stray}"


if __name__ == "__main__":
    for name, modules in modules_naming_layouts(Path(sys.argv[1] if len(sys.argv) > 1 else ".")).items():
        print(f"{name}: {len(modules)} modules: {', '.join(sorted(modules))}")
