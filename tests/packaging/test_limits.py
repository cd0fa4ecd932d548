"""The code stays readable: every function of the package at most 60 lines, every file at most 450, and
layers free of family names."""

from __future__ import annotations

import ast
from pathlib import Path

import timm_layerscale
import timm_ls

ROOTS = (Path(timm_layerscale.__file__).parent, Path(timm_ls.__file__).parent)
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 450


def sources() -> list[Path]:
    return [path for root in ROOTS for path in sorted(root.rglob("*.py"))]


def test_every_file_is_at_most_450_lines():
    long = {str(p): n for p in sources() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert long == {}


def test_every_function_is_at_most_60_lines():
    long = {
        f"{path}:{node.lineno} {node.name}": node.end_lineno - node.lineno + 1
        for path in sources()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno >= MAX_FUNCTION_LINES
    }
    assert long == {}


def test_the_checks_see_a_long_function(tmp_path):
    source = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    (node,) = ast.parse(source).body
    assert node.end_lineno - node.lineno + 1 == MAX_FUNCTION_LINES + 1


def test_layers_name_no_family():
    """A layer says what it computes, never whose model it serves: families are the config's and the
    formats' business, so a layer does not change when a family is added."""
    layers = Path(timm_layerscale.__file__).parent / "layers"
    families = ("dinov3", "sapiens", "lingbot", "eupe")
    named = {
        f"{path.name}:{number}": family
        for path in sorted(layers.glob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for family in families
        if family in line.lower()
    }
    assert named == {}
